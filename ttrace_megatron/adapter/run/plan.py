"""A check's trace bytes from its recipe, before anything runs (``ttrace plan``, the disk check).

The model is built as the reference builds it, on the ``meta`` device (no memory, no weights, a
few seconds even at a 70B model's width), and its parameters and recorded modules are read off
it. Each recorded tensor then becomes a :class:`plan.TensorGroup` with the placements the recorder
gives it on each side (``adapter.record.layouts``): for the reference every axis has size 1; for
the candidate the recipe's layout sizes them. The core turns groups into bytes.

What each recorded module writes per microbatch follows the recorder (``record.recorder``):
linears and the embedding their input and output and both grads, the router its scores and
choices, the MoE layer its input and output; every parameter its per-microbatch grad, its main
grad once, and the optimizer's state (Adam: the parameter, fp32 master where the parameter is not,
both moments). An expert sees ``topk`` / experts of the microbatch's tokens on average.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ... import keys
from ... import plan as core
from ...errors import RecipeError
from ...placement import Partial, RangeShard, Replicate, Shard
from ...recipe import FP32_TWIN, Recipe, fp32_twin
from ...trace_store import CANDIDATE, REFERENCE
from ..record.layouts import DP, EDP, ETP, POSITION_EMBEDDINGS, PP, TP, expert_tokens_unmatched, is_expert
from ..recipe import config as cfg
from ..recipe.naming import OUTPUT_LAYER, TIED_EMBEDDING

EP = "ep"
TIED_COPIES = "tied"  # the word embeddings' copies: the first stage's, and the last stage's output layer
PERTURBED = "reference-perturbed"  # cli's directory of the perturbation run
TWIN = FP32_TWIN + "/"

_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # activations and model grads (FP8 GEMMs keep bf16 I/O)
FP32, FP64, INT64 = 4, 8, 8


@dataclasses.dataclass(frozen=True)
class ParamShape:
    """One parameter of the logical (one-rank) model: its size and how megatron splits it."""

    module: str  # canonical module name
    name: str  # full canonical parameter name
    numel: int
    tp_sharded: bool
    expert: bool
    trainable: bool
    matrix: bool  # two dims or more (not a bias's or a norm's vector): streamed, its records are written over


@dataclasses.dataclass(frozen=True)
class SiteShape:
    """One module whose tensors are recorded per microbatch, with its features on one rank."""

    module: str
    kind: str  # one of the SITE_* below
    in_features: int
    out_features: int
    tp_sharded: bool  # the weight is split over TP (or expert-TP)
    expert: bool


WORD_EMBEDDINGS = TIED_EMBEDDING + ".weight"
SITE_COLUMN, SITE_ROW, SITE_EMBEDDING, SITE_ROUTER, SITE_MOE = "column", "row", "embedding", "router", "moe"


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the plan needs of the model: read once off the meta-device build, reused for every side."""

    params: Tuple[ParamShape, ...]
    sites: Tuple[SiteShape, ...]
    tied_embeddings: bool = False  # the output layer uses the word embeddings' weight


def model_shape(recipe: Recipe) -> ModelShape:
    """The reference's model as megatron builds it, on the meta device, in this process.

    Needs a process of its own: it starts a 1-rank gloo group and megatron's parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import Router

    from ..cpu import cuda_shim
    from ..record.hooks import hooked_modules
    from ..recipe.build import gpt_chunks
    from ..recipe.naming import all_parameters, full_param_name

    cuda_shim.install()
    if not dist.is_initialized():  # a store of its own: under torchrun or SLURM the launcher's port is taken
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    with torch.device("meta"):
        chunks, _ = gpt_chunks(recipe, {}, cpu=True)
    params = tuple(ParamShape(module=mname, name=full_param_name(mname, pname), numel=p.numel(),
                              tp_sharded=bool(getattr(p, "tensor_model_parallel", False)),
                              expert=is_expert(module), trainable=p.requires_grad, matrix=p.dim() >= 2)
                   for mname, pname, module, p in all_parameters(chunks))
    sites, tied = [], False
    for site in hooked_modules(chunks):
        m = site.module
        weight = getattr(m, "weight", None)
        sharded = bool(getattr(weight, "tensor_model_parallel", False))
        expert = is_expert(m)
        if isinstance(m, ColumnParallelLinear) and weight is None:  # the output layer of tied embeddings
            kind, in_f, out_f, sharded = SITE_COLUMN, recipe.model["hidden_size"], cfg.padded_vocab_size(recipe), True
            tied = True
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            out_f, in_f = weight.shape
            kind = SITE_COLUMN if isinstance(m, ColumnParallelLinear) else SITE_ROW
        elif isinstance(m, VocabParallelEmbedding):
            kind, in_f, out_f = SITE_EMBEDDING, 1, weight.shape[1]
        elif isinstance(m, Router):
            kind, (out_f, in_f) = SITE_ROUTER, weight.shape
        elif isinstance(m, MoELayer):
            kind, in_f, out_f = SITE_MOE, recipe.model["hidden_size"], recipe.model["hidden_size"]
        else:
            continue
        sites.append(SiteShape(site.module_name, kind, int(in_f), int(out_f), sharded, expert))
    return ModelShape(params, tuple(sites), tied)


@dataclasses.dataclass(frozen=True)
class Selection:
    """``--iters``, ``--modules``, ``--microbatches`` of ``ttrace run``."""

    iterations: Optional[Sequence[int]] = None
    modules: Sequence[str] = ("*",)
    microbatches: Optional[Sequence[int]] = None

    def wants(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, p) for p in self.modules)


def side_sizes(recipe: Recipe, world_size: int) -> Dict[str, int]:
    """Mesh axis sizes of a side that runs ``recipe``'s layout on ``world_size`` ranks."""
    s = cfg.parallel_sizes(recipe.parallel)
    if s["cp"] > 1:  # as the run refuses it (session._refuse_unsupported)
        raise RecipeError(f"{recipe.source}: parallel: context_parallel_size {s['cp']}: ttrace cannot trace context "
                          f"parallelism yet, so there is no check to plan")
    dp = max(1, world_size // (s["tp"] * s["pp"]))
    edp = max(1, s["tp"] * dp // (s["ep"] * s["etp"]))
    return {TP: s["tp"], DP: dp, ETP: s["etp"], EDP: edp, EP: s["ep"], PP: s["pp"],
            TIED_COPIES: 2 if s["pp"] > 1 else 1}


def recomputed(recipe: Recipe, module: str) -> bool:
    """Whether the candidate recomputes this recorded module's forward in its backward (recorded
    again as ``keys.RECOMPUTED_OUTPUT``; the reference does not recompute). Full recomputation:
    every layer (``uniform``) or the first ``recompute_num_layers`` of each model chunk (``block``);
    selective: the modules ``recompute_modules`` names that hold recorded modules (core attention
    and the norms hold none)."""
    model = recipe.model
    granularity = model.get("recompute_granularity")
    layer = re.match(r"^(?:decoder|mtp)\.layers\.(\d+)\.(.*)$", module)
    if not granularity or layer is None:
        return False
    if granularity == "full":
        if model.get("recompute_method") != "block":
            return True
        s = cfg.parallel_sizes(recipe.parallel)
        per_chunk = max(1, model["num_layers"] // (s["pp"] * s["vpp"]))
        return module.startswith("decoder.") and int(layer.group(1)) % per_chunk < int(model.get("recompute_num_layers", 1))
    inner = layer.group(2)
    wanted = set(model.get("recompute_modules") or ("core_attn",))
    moe = bool(model.get("num_moe_experts"))
    return (("mlp" in wanted and not moe and inner.startswith("mlp"))
            or ("moe" in wanted and moe and inner.startswith("mlp"))
            or ("shared_experts" in wanted and ".shared_experts." in f".{inner}."))


def _copied_across_stages(name: str, shape: ModelShape, model: Dict[str, Any]) -> bool:
    """A parameter the last pipeline stage holds a copy of: the word embeddings when the output layer
    shares them or multi-token prediction embeds there; its learned position embeddings with MTP
    (``layouts.is_copied_for_mtp``)."""
    mtp = bool(model.get("mtp_num_layers"))
    return ((name == WORD_EMBEDDINGS and (shape.tied_embeddings or mtp))
            or (name == POSITION_EMBEDDINGS + ".weight" and mtp))


def _calls(model: Dict[str, Any], module: str) -> int:
    """How many times a recorded module runs on a microbatch's tokens (``naming.call_name``): with
    multi-token prediction the word embeddings, the output layer and the loss once more per depth,
    and a repeated MTP layer (``mtp_use_repeated_layer``) once per depth. (``mlp_chunks_for_training``
    runs an MLP once per chunk, on the chunk's tokens: the same bytes.)"""
    depths = int(model.get("mtp_num_layers") or 0)
    if module in (TIED_EMBEDDING, OUTPUT_LAYER, keys.LOSS_MODULE):
        return 1 + depths
    return depths if model.get("mtp_use_repeated_layer") and module.startswith("mtp.layers.0.") else 1


def side_groups(recipe: Recipe, shape: ModelShape, sizes: Dict[str, int], selection: Selection = Selection(),
                role: str = CANDIDATE) -> List[core.TensorGroup]:
    """The tensors one iteration of a side records, as groups with that side's placements."""
    data, model = recipe.data, recipe.model
    act = _ITEMSIZE[recipe.dtype]
    micro = data.global_batch_size // data.micro_batch_size
    if selection.microbatches is not None:
        micro = min(micro, len(selection.microbatches))
    tokens = data.micro_batch_size * data.seq_length
    sp = bool(recipe.parallel.get("sequence_parallel", False)) and sizes[TP] > 1
    topk = int(model.get("moe_router_topk", 2) or 2)
    experts = int(model.get("num_moe_experts") or 1)
    calls = _calls(model, keys.LOSS_MODULE)  # each MTP depth has a loss of its own
    out: List[core.TensorGroup] = []

    def add(kind, elements, itemsize, records, placements, overwritable=False):
        if elements and records:
            out.append(core.TensorGroup(kind, int(elements), itemsize, int(records), tuple(placements), overwritable))

    seq_split = (Shard(0, TP),) if sp else (Replicate(TP),)
    # the recorder's rule: where an expert's tokens on a rank are no placement of the reference's,
    # only its main grads and parameters are recorded
    experts_unrecorded = expert_tokens_unmatched(sizes[EP], sizes[ETP], sizes[TP], sp,
                                                 model.get("moe_token_dispatcher_type")) is not None
    for s in shape.sites:
        if not selection.wants(s.module) or (s.expert and experts_unrecorded):
            continue
        per_micro = micro * _calls(model, s.module)
        again = 1 if role == CANDIDATE and recomputed(recipe, s.module) else 0  # its output, recomputed
        if s.expert:  # a fraction of the tokens, over expert-TP
            t = tokens * topk / experts
            split = (Shard(-1, ETP),) if s.tp_sharded else (Replicate(ETP),)
            whole = (Replicate(ETP),) if s.kind == SITE_COLUMN else (Partial(ETP),)
            ins, outs = (whole, split) if s.kind == SITE_COLUMN else (split, whole)
            add(core.ACTIVATIONS, t * s.in_features, act, 2 * per_micro, ins)  # input, its grad
            add(core.ACTIVATIONS, t * s.out_features, act, (2 + again) * per_micro, outs)
        elif s.kind in (SITE_COLUMN, SITE_ROW):
            split = (Shard(-1, TP),) if s.tp_sharded else (Replicate(TP),)
            ins, outs = (seq_split, split) if s.kind == SITE_COLUMN else (split, seq_split)
            if not s.tp_sharded:  # a replicated linear (MLA's down projections): whole on every rank
                ins = outs = seq_split
            add(core.ACTIVATIONS, tokens * s.in_features, act, 2 * per_micro, ins)
            add(core.ACTIVATIONS, tokens * s.out_features, act, (2 + again) * per_micro, outs)
        elif s.kind == SITE_EMBEDDING:
            add(core.ACTIVATIONS, tokens, INT64, per_micro, (Replicate(TP),))  # token ids
            add(core.ACTIVATIONS, tokens * s.out_features, act, 2 * per_micro, seq_split)  # output, its grad
        elif s.kind == SITE_MOE:
            add(core.ACTIVATIONS, tokens * s.in_features, act, (4 + again) * per_micro, seq_split)  # in, out, grads
        elif s.kind == SITE_ROUTER:
            add(core.ACTIVATIONS, tokens * s.in_features, act, 2 * per_micro, seq_split)  # input, its grad
            balancing = model.get("moe_router_load_balancing_type", "aux_loss") not in ("none", None)
            routed = 4 + (2 if balancing else 0) + again  # output, its grad, top-k scores and choice (+ balancing's)
            add(core.ROUTING, tokens * s.out_features, FP32, routed * per_micro, seq_split)
    if selection.wants(keys.LOSS_MODULE):
        add(core.LOSS, tokens, FP32, 2 * micro * calls, (Replicate(TP),))  # per-token loss, loss mask (per depth)
    _param_groups(recipe, shape, sizes, selection, micro, experts_unrecorded, add)
    if selection.wants(keys.OPTIMIZER_MODULE):
        # the step's scalars on every rank: the grad norm and its fp64 twin, the clip coefficient, the
        # step count, and the lr and weight decay of the two param groups (a record, or an online entry, each)
        add(core.OPTIMIZER, 1, FP64, STEP_SCALARS, (Replicate(TP), Replicate(DP), Replicate(PP)))
    return out


def _param_groups(recipe: Recipe, shape: ModelShape, sizes: Dict[str, int], selection: Selection, micro: int,
                  experts_unrecorded: bool, add) -> None:
    """Each trainable parameter's records of an iteration (``side_groups``): its per-microbatch grads,
    main grad and grad-norm term, updated value and optimizer state."""
    act = _ITEMSIZE[recipe.dtype]
    distopt = bool(recipe.optimizer.get("use_distributed_optimizer", False))
    ddp = cfg.ddp_config(recipe)
    model = recipe.model
    main_grad = FP32 if ddp.grad_reduce_in_fp32 else act
    opt = recipe.optimizer.get("optimizer", "adam")
    states = 2 if opt == "adam" else (1 if float(recipe.optimizer.get("sgd_momentum", 0.9)) else 0)
    states += 1 if recipe.dtype != "fp32" else 0  # the fp32 master copy of a low-precision parameter
    for p in shape.params:
        if not selection.wants(p.module) or not p.trainable:
            continue
        tp_axis, dp_axis = (ETP, EDP) if p.expert else (TP, DP)
        split = (Shard(0, tp_axis),) if p.tp_sharded else (Replicate(tp_axis),)
        if _copied_across_stages(p.name, shape, model):  # with PP, the last stage's copy too
            split += (Replicate(TIED_COPIES),)
        if not (p.expert and experts_unrecorded):
            add(core.WEIGHT_GRADS, p.numel, act, micro, split, p.matrix)
        owned = (_even_ranges(dp_axis, p.numel, sizes[dp_axis]),) if distopt else (Replicate(dp_axis),)
        add(core.MAIN_GRADS, p.numel, main_grad, 1, split + owned)
        # its term of the grad norm, a scalar on every rank holding a piece of its main grad
        add(core.MAIN_GRADS, 1, FP64, 1, tuple(Replicate(q.axis) for q in split + owned))
        # the updated parameter: whole on every replica, or its owned range under overlap_param_gather
        updated = split + owned if distopt and ddp.overlap_param_gather else (Replicate(dp_axis),) + split
        add(core.OPTIMIZER, p.numel, act, 1, updated, p.matrix)
        add(core.OPTIMIZER, p.numel, FP32, states, split + owned, p.matrix)


STEP_SCALARS = 8  # the optimizer scalars recorded on each rank in an iteration (side_groups)


def _even_ranges(axis: str, numel: int, n: int) -> RangeShard:
    """The distributed optimizer's ownership of a parameter's flat range, taken as even (its buckets
    place the bounds elsewhere; the bytes summed over the ranks are the same)."""
    return RangeShard(axis, tuple(numel * i // n for i in range(n + 1)), (numel,))


def check_plan(recipe: Recipe, *, online: bool = False, perturb: Optional[bool] = None, twin: bool = True,
               keep: bool = True, selection: Selection = Selection(), reference_everything: bool = True,
               shape: Optional[ModelShape] = None, reference_in: str = core.DISK,
               twin_reference_in: Optional[str] = None) -> core.Plan:
    """What ``ttrace run`` of ``recipe`` writes with these options. ``online``: the candidate and the
    perturbation run judge their tensors as they run and write verdict sums (run's default; False:
    ``--keep-traces``). ``keep``: ``--out`` keeps every
    side's traces (else a pair's traces go before its twin runs). ``reference_everything``: in
    lock-step the reference records every iteration, module and microbatch whatever the selection
    (the candidate takes its weights after each step). ``reference_in``: where each pair's reference
    is written (``--reference-in``, decided: memory, the disk, or memory streamed one iteration at a
    time); ``twin_reference_in``: the fp32 twin's, where it is placed apart (``cli._plan_of``)."""
    shape = shape or model_shape(recipe)
    iterations = len(selection.iterations) if selection.iterations else recipe.train.iterations
    ref_selection = Selection() if reference_everything else selection
    ref_iterations = recipe.train.iterations if reference_everything else iterations
    sides, notes = [], []
    twin_recipe = fp32_twin(recipe) if twin else None
    for prefix, r in (("", recipe), (TWIN, twin_recipe)):
        if r is None:
            continue
        reference = dataclasses.replace(r, parallel={})
        ref_sizes = side_sizes(reference, 1)
        cand_sizes = side_sizes(r, r.world_size)
        sides.append(core.SidePlan(prefix + REFERENCE, 1, ref_sizes, ref_iterations,
                                   side_groups(reference, shape, ref_sizes, ref_selection, REFERENCE), judged=False))
        sides.append(core.SidePlan(prefix + CANDIDATE, r.world_size, cand_sizes, iterations,
                                   side_groups(r, shape, cand_sizes, selection, CANDIDATE), online=online))
        if bool(perturb) or r.tolerance.perturbation:
            # the reference again, recording what the candidate records (cli: the selection applies)
            sides.append(core.SidePlan(prefix + PERTURBED, 1, ref_sizes, iterations,
                                       side_groups(reference, shape, ref_sizes, selection, REFERENCE), online=online))
    pair = tuple(s.name for s in sides if not s.name.startswith(TWIN))
    twin_sides = tuple(s.name for s in sides if s.name.startswith(TWIN))
    peak = (pair + twin_sides,) if keep or not twin_sides else (pair, twin_sides)
    seed = sum(p.numel for p in shape.params) * _ITEMSIZE[recipe.dtype]  # the model's own dtype
    if any(p.expert for p in shape.params):
        notes.append("MoE: expert activations assume tokens spread evenly over the experts (their total is exact)")
    if recipe.dtype == "fp16":
        notes.append("fp16: a step the loss scaler skips records no optimizer moments, which the plan counts (an "
                     "upper bound: the first steps of a dynamic scaler usually skip)")
    notes.append("a failing check also writes a replay of the candidate's failing iteration (at most one "
                 "iteration of what the candidate records with --keep-traces)"
                 + ("; streamed, its reference again, up to the failing iteration, first (in memory where held whole "
                    "it fits there, else under --out)" if core.STREAM in (reference_in, twin_reference_in) else ""))
    placed = {ref: reference_in if not ref.startswith(TWIN) or twin_reference_in is None else twin_reference_in
              for ref in (s.name for s in sides if s.name.endswith(REFERENCE))}
    return core.Plan(recipe.name, sides, seed, peak, notes,
                     in_memory=tuple(ref for ref, where in placed.items() if where != core.DISK),
                     streamed=tuple(ref for ref, where in placed.items() if where == core.STREAM))
