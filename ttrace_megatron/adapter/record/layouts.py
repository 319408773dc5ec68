"""Placement inference for megatron-core modules, parameters and activations.

Every rule that maps a megatron-core tensor to the placement vocabulary of
:mod:`ttrace_megatron.placement` lives here, for parameters (seed checkpoint, grads, main_grads,
updated params) and activations (module inputs, outputs and their grads) alike.
:meth:`KeyLayouts.of` gives the layout of every recorded key; the recorder, the replayer, the
perturbation run and the seed checkpoint all ask it, so a key has one layout wherever it is used.

The rules come from the module types and their partition sizes, and are cross-checked against
the partition attributes megatron tags on parameters (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``). Those tags are set only when ``perform_initialization``
is on, so they are never trusted alone: a disagreement between the two is an error.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Optional, Sequence, Tuple

import torch

from ...keys import BACKWARD, GRAD_OUTPUT, INPUT, LOSS_MODULE, MAIN_GRAD, WEIGHT, TensorKey, TensorKind
from ...placement import Layout, Partial, Placement, RangeShard, Replicate, Shard
from ..recipe.heterogeneous import is_gathered_linear
from ..recipe.naming import OUTPUT_LAYER

TP = "tp"
DP = "dp"
PP = "pp"
ETP = "etp"  # expert tensor parallel: how MoE experts' linears are split
EDP = "edp"  # expert data parallel: the replicas of an expert's parameters

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")


class LayoutInferenceError(RuntimeError):
    """megatron's partition attributes disagree with the module's partition sizes."""


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What placement inference needs to know about the model, beyond each module."""

    num_layers: int
    vocab_size: int  # the tokenizer's vocabulary, before megatron pads it (what token ids index)
    sequence_parallel: bool
    gated_linear_unit: bool
    tp_size: int
    hidden_size: int = 0
    tokens_per_microbatch: int = 0  # micro_batch_size × seq_length
    tokens_per_iteration: int = 0  # global_batch_size × seq_length
    pp_size: int = 1
    mtp_layers: int = 0  # multi-token prediction depths after the decoder (mtp_num_layers)
    # the tokens an expert sees on one rank are not one microbatch's tokens (EXPERT_TOKENS_MIXED,
    # EXPERT_TOKENS_SPLIT): its per-microbatch tensors have no counterpart in the reference, only its
    # main grads and values do
    experts_mix_microbatches: bool = False
    # calculate_per_token_loss: megatron does not scale a microbatch's loss by 1/num_microbatches
    # (finalize_model_grads divides the grads by the batch's tokens instead), so backward tensors
    # carry no DP-dependent scale
    per_token_loss: bool = False
    seq_length: int = 0  # tokens of one sequence: attention's softmax and P·V sum over its keys (0: unknown)


def model_facts(chunks, config, *, vocab_size: int, tokens_per_microbatch: int,
                tokens_per_iteration: int, seq_length: int = 0) -> ModelFacts:
    """The one way to build :class:`ModelFacts`, from the built model's config and megatron's
    parallel state (``ttrace run`` and ``--ttrace`` alike). ``vocab_size`` is the tokenizer's
    vocabulary: the rows past it are megatron's padding."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    return ModelFacts(num_layers=config.num_layers, vocab_size=int(vocab_size),
                      sequence_parallel=config.sequence_parallel, gated_linear_unit=config.gated_linear_unit,
                      tp_size=tp, hidden_size=config.hidden_size,
                      tokens_per_microbatch=int(tokens_per_microbatch), tokens_per_iteration=int(tokens_per_iteration),
                      pp_size=ps.get_pipeline_model_parallel_world_size(),
                      experts_mix_microbatches=expert_tokens_unmatched(
                          ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size(), tp,
                          config.sequence_parallel, getattr(config, "moe_token_dispatcher_type", None)) is not None,
                      per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
                      seq_length=int(seq_length), mtp_layers=int(getattr(config, "mtp_num_layers", None) or 0))


EXPERT_TOKENS_MIXED = ("expert parallelism over data-parallel ranks (EP × expert-TP > TP): an expert's tokens come "
                       "from several microbatches, so only its main grads and parameters are compared")
EXPERT_TOKENS_SPLIT = ("experts split over fewer ranks than TP with sequence parallelism (EP × expert-TP < TP): "
                       "each rank sends its own sequence shard's tokens to a whole expert, a routing-dependent "
                       "piece of the microbatch, so only the experts' main grads and parameters are compared")


EXPERT_TOKENS_INTERLEAVED = (
    "the alltoall dispatcher with expert parallelism and expert-TP both over sequence-parallel ranks (EP > 1 and "
    "expert-TP > 1, EP × expert-TP = TP): an expert's tokens arrive grouped by expert-TP rank, then by EP rank, "
    "not in the sequence's order, so only its main grads and parameters are compared")
ALLTOALL = "alltoall"  # megatron-core's moe_token_dispatcher_type (its default: allgather)


def expert_tokens_unmatched(ep: int, etp: int, tp: int, sequence_parallel: bool,
                            dispatcher: Optional[str]) -> Optional[str]:
    """Why an expert's per-microbatch tensors on one rank are not a placement of the reference's, or
    None when they are.

    With EP × expert-TP = TP under sequence parallelism an expert sees every token of the microbatch
    routed to it; the allgather dispatcher gathers them over TP in the sequence's order. The alltoall
    dispatcher exchanges them over EP, then gathers over expert-TP: its source ranks come expert-TP
    rank first, then EP rank (ranks 0, 2, 1, 3 at EP 2 × expert-TP 2, the expert-TP ranks innermost),
    a permutation of the sequence's shards no placement describes. Found by the configuration sweep
    (sweep0025 of seed 0: TP 4, EP 2, expert-TP 2; the MoE layer's output and the loss agreed, the
    experts' inputs did not)."""
    if ep * etp > tp:
        return EXPERT_TOKENS_MIXED
    if ep * etp < tp and sequence_parallel:
        return EXPERT_TOKENS_SPLIT
    if dispatcher == ALLTOALL and ep > 1 and etp > 1 and sequence_parallel:
        return EXPERT_TOKENS_INTERLEAVED
    return None


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a tensor is recorded: a module under its canonical name, and one of its parameters."""

    module_name: str
    module: Optional[torch.nn.Module] = None
    param_name: str = ""
    param: Optional[torch.Tensor] = None


# the distributed optimizer's ownership: param -> (flat range bounds of every DP rank, this rank)
OwnedRanges = Dict[torch.nn.Parameter, Tuple[Tuple[int, ...], int]]


class KeyLayouts:
    """The layout of every recorded key, given the model and this run's DP size.

    One function for every kind of tensor (:meth:`of`), so the recorder, the replayer and the seed
    checkpoint can never disagree about a key: activations and their grads from the module
    (:func:`activation_layout`), parameter values, per-microbatch grads and main grads from the
    parameter (:func:`param_layout`), the loss and the optimizer's scalars as replicas. Backward
    tensors carry the loss scale 1/num_microbatches of this run, ``dp`` times that of a DP=1 run
    (megatron scales each microbatch's loss by 1/num_microbatches of its DP rank, and DDP divides
    by dp again when it reduces): the layout's ``scale``, which merge and slice apply. With
    ``calculate_per_token_loss`` there is no such scale (the grads are divided by the batch's tokens
    in ``finalize_model_grads``, after the per-microbatch tensors are recorded).

    Under fp16 every grad also carries megatron's loss scale (the grad scaler's scale when the
    backward ran; the optimizer unscales the main grads when it steps): ``loss_scale``, set by the
    recorder from the optimizer before each iteration's backward, multiplies the scale of backward
    tensors and main grads, so their logical values are the unscaled grads, the same whatever scale
    each run trains at, and the optimizer's states and updates are judged against them.
    """

    def __init__(self, facts: ModelFacts, dp_size: int = 1, owned_ranges: Optional[OwnedRanges] = None,
                 params_gathered_late: bool = False):
        self.facts = facts
        self.dp_size = dp_size
        self.owned_ranges = owned_ranges or {}
        self.loss_scale = 1.0
        # overlap_param_gather: after the step each DP rank holds its owned range of a parameter up
        # to date and the rest stale until the next forward gathers it; the updated parameter is
        # each rank's owned range (what it is at that point), like the optimizer's state
        self.params_gathered_late = params_gathered_late

    def of(self, key: TensorKey, site: Site, shape: Sequence[int]) -> Layout:
        kind = key.kind
        facts = self.facts
        if kind in (TensorKind.INPUT, TensorKind.OUTPUT, TensorKind.GRAD_INPUT, TensorKind.GRAD_OUTPUT):
            layout = activation_layout(kind, site.module_name, site.module, facts, shape)
        elif kind in (TensorKind.SELECTION_SCORES, TensorKind.SELECTION):
            # [tokens, experts], the tokens the router sees: laid out like its probs
            layout = activation_layout(TensorKind.OUTPUT, site.module_name, site.module, facts, shape)
        elif kind is TensorKind.PARAM_GRAD:
            layout = param_layout(site, facts, microbatch_grad=True)
        elif kind in (TensorKind.MAIN_GRAD, TensorKind.OPTIMIZER_STATE):
            # the optimizer's state lives where the main grads are reduced: each rank's owned range
            # under the distributed optimizer, a replica over DP otherwise
            bounds, _ = self.owned_ranges.get(site.param, (None, 0))
            layout = param_layout(site, facts, dp_ranges=bounds)
        elif kind in (TensorKind.OPTIMIZER_SCALAR, TensorKind.STEP_SETTING):
            layout = stage_replicated_layout(shape, facts)
        elif kind is TensorKind.PARAM and self.params_gathered_late and site.param in self.owned_ranges:
            layout = param_layout(site, facts, dp_ranges=self.owned_ranges[site.param][0])
        elif kind is TensorKind.PARAM:
            layout = param_layout(site, facts)
        elif kind is TensorKind.LOSS:
            layout = replicated_layout(shape)
        elif kind is TensorKind.AUX_LOSS:
            layout = router_loss_layout(activation_layout(TensorKind.INPUT, site.module_name, site.module, facts,
                                                          (1, 1, 1)))
        elif kind is TensorKind.AMAX:
            layout = replicated_layout(shape, (tensor_parallel_axis(site.module, facts)[0],))
        else:
            raise ValueError(f"no layout rule for {kind} ({key})")
        scale = float(self.dp_size) if key.phase == BACKWARD and not facts.per_token_loss else 1.0
        if key.phase in (BACKWARD, MAIN_GRAD):
            scale *= self.loss_scale
        return dataclasses.replace(layout, scale=scale) if scale != 1.0 else layout

    def param_value(self, site: Site) -> Layout:
        """A parameter's value (the seed checkpoint, the updated parameter)."""
        return param_layout(site, self.facts)


def rank_coordinates() -> Dict[str, Tuple[int, int]]:
    """This rank's (rank, size) along every axis a placement may name, from megatron's groups."""
    from megatron.core import parallel_state as ps

    return {TP: (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
            DP: (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
            PP: (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
            ETP: (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()),
            EDP: (ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size())}


def layer_depth(canonical_name: str, num_layers: int) -> int:
    """1-based global layer of a module; 0 for the embedding, num_layers + 1 after the decoder.

    Multi-token prediction depth k (``mtp.layers.{k-1}``) runs after the decoder: its layer is
    num_layers + k (megatron's ``layer_number`` of its transformer layer), what its output layer
    and loss compute from it one further."""
    m = _LAYER_RE.match(canonical_name + ".")
    if m:
        return int(m.group(1)) + 1
    m = _MTP_LAYER_RE.match(canonical_name)
    if m:
        layer = num_layers + int(m.group(1)) + 1
        return layer + 1 if is_logits_or_loss(m.group(2)) else layer
    if canonical_name.startswith("embedding"):
        return 0
    return num_layers + 1


def _column_stride(module_name: str, facts: ModelFacts) -> int:
    return 2 if facts.gated_linear_unit and module_name.endswith("linear_fc1") else 1


def _check_attr(param: torch.Tensor, name: str, expect_parallel: bool, dim: int, stride: int) -> None:
    if not getattr(param, "tensor_model_parallel", False):
        return  # untagged (e.g. --no-initialization) or replicated: the sizes decide, checked by caller
    if not expect_parallel:
        raise LayoutInferenceError(f"{name}: tagged tensor_model_parallel, but its module replicates it")
    if getattr(param, "partition_dim", dim) != dim:
        raise LayoutInferenceError(f"{name}: tagged partition_dim={param.partition_dim}, module splits dim {dim}")
    if getattr(param, "partition_stride", stride) != stride:
        raise LayoutInferenceError(f"{name}: tagged partition_stride={param.partition_stride}, "
                                   f"module layout needs stride {stride}")


def param_layout(site: Site, facts: ModelFacts, *, microbatch_grad: bool = False,
                 dp_ranges: Optional[Tuple[int, ...]] = None) -> Layout:
    """Layout of a parameter (or of its grad / main_grad: same shape, same split); use
    :meth:`KeyLayouts.of`, which chooses the variant from the key.

    ``microbatch_grad``: the layout of a per-microbatch grad, before ``finalize_model_grads``. The
    grads of replicated parameters that see only this rank's sequence shard are then partial sums
    over TP, and those of tied embeddings partial sums over the pipeline stages. Each DP rank's
    per-microbatch grads are of other microbatches (other keys): no DP placement.
    Otherwise (values, main grads) the parameter is a replica over DP, or, with ``dp_ranges``,
    each DP rank holds a flat range of it (the distributed optimizer's main grads, see
    :func:`distributed_optimizer_ranges`).
    """
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding)

    module_name, param_name, module, param = site.module_name, site.param_name, site.module, site.param
    full_name = f"{module_name}.{param_name}" if module_name else param_name
    tp_axis, tp, dp_axis = tensor_parallel_axis(module, facts)
    local = tuple(param.shape)
    logical = list(local)
    placements: Tuple[Placement, ...]
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) or (
            isinstance(module, RowParallelLinear) and param_name == "weight"):
        if isinstance(module, RowParallelLinear):
            dim, stride = 1, 1
            expect_local = module.input_size_per_partition
        elif isinstance(module, ColumnParallelLinear):
            dim, stride = 0, _column_stride(module_name, facts)
            expect_local = module.output_size_per_partition
        else:
            dim, stride = 0, 1
            expect_local = module.num_embeddings_per_partition
        if local[dim] != expect_local:
            raise LayoutInferenceError(f"{full_name}: local shape {local} does not match the module's "
                                       f"partition size {expect_local} on dim {dim}")
        _check_attr(param, full_name, True, dim, stride)
        # a vocabulary's padding rows (megatron pads it to a multiple of make_vocab_size_divisible_by ×
        # TP) are real parameters: in the softmax, the grad norm and the weight decay. Both sides pad
        # alike (the model signature holds the padded size), so they are compared like any other row
        logical[dim] = local[dim] * tp
        placements = (Shard(dim, tp_axis, stride),)
    elif is_head_sharded(module, param_name):
        # a learnable softmax offset (attention sinks): one per attention head, each TP rank holding
        # its heads', though megatron does not tag it tensor_model_parallel
        if local[0] != module.num_attention_heads_per_partition:
            raise LayoutInferenceError(f"{full_name}: local shape {local} is not one per head of this rank's "
                                       f"{module.num_attention_heads_per_partition}")
        logical[0] = local[0] * tp
        placements = (Shard(0, tp_axis),)
    else:
        _check_attr(param, full_name, False, -1, 1)
        sp_partial = microbatch_grad and facts.sequence_parallel and sees_sequence_shard(module, param_name)
        head_partial = microbatch_grad and sees_head_shard(module_name)
        placements = (Partial(tp_axis) if sp_partial or head_partial else Replicate(tp_axis),)
    if dp_ranges is not None:
        placements = placements + (RangeShard(dp_axis, dp_ranges, local),)
    elif not microbatch_grad:
        placements = (Replicate(dp_axis),) + placements
    if is_tied_across_stages(param, facts) or is_copied_for_mtp(module_name, facts):
        # the first stage's embedding and the last stage's output layer hold one parameter: its
        # per-microbatch grads are each stage's share of the sum, its main grad and value replicas
        placements = ((Partial(PP) if microbatch_grad else Replicate(PP)),) + placements
    return Layout(placements, tuple(logical))


def is_head_sharded(module: Optional[torch.nn.Module], param_name: str) -> bool:
    """A parameter with one entry per attention head of this rank: DotProductAttention's learnable
    softmax offset (``softmax_type: learnable``)."""
    return param_name == "softmax_offset" and hasattr(module, "num_attention_heads_per_partition")


def is_expert(module: Optional[torch.nn.Module]) -> bool:
    """A linear inside an MoE expert (megatron's ``is_expert``): split over the expert TP group."""
    return bool(getattr(module, "is_expert", False))


def tensor_parallel_axis(module: Optional[torch.nn.Module], facts: ModelFacts) -> Tuple[str, int, str]:
    """(TP axis, its size, DP axis) for a module: experts use the expert TP and expert DP groups."""
    if is_expert(module):
        return ETP, module.tp_group.size(), EDP
    return TP, facts.tp_size, DP


POSITION_EMBEDDINGS = "embedding.position_embeddings"


def is_copied_for_mtp(module_name: str, facts: ModelFacts) -> bool:
    """Learned absolute position embeddings with multi-token prediction and PP > 1: the MTP stage
    builds an embedding of its own for the MTP depths' tokens, position embeddings included, a copy
    of the first stage's one parameter. Its per-microbatch grads are each stage's share of the
    sum; its main grad and value must be replicas (megatron-core syncs the word embeddings' copies
    over its embedding group, and the position embeddings' over a group of the first stage alone)."""
    return facts.pp_size > 1 and facts.mtp_layers > 0 and module_name == POSITION_EMBEDDINGS


def is_tied_across_stages(param: torch.Tensor, facts: ModelFacts) -> bool:
    """Tied word embeddings with PP > 1: megatron tags both stages' copies ``shared_embedding``."""
    return facts.pp_size > 1 and bool(getattr(param, "shared_embedding", False))


def distributed_optimizer_ranges(chunks, optimizer) -> Dict[torch.nn.Parameter, Tuple[Tuple[int, ...], int]]:
    """Under the distributed optimizer: for each parameter, the flat ranges of it that each rank of
    its DP group owns, and this rank's position in that group.

    After the reduce-scatter only the owned range of ``param.main_grad`` holds the reduced grad.
    megatron splits every bucket of the grad buffer into DP-size equal chunks, ignoring parameter
    boundaries (``DistributedOptimizer._build_model_gbuf_range``); every rank's range follows from
    the buffer's ``param_index_map`` and bucket offsets, so all ranks record the same placement.
    Expert parameters live in buffers over the expert DP group. This rank's range is
    cross-checked against the optimizer's own map. Empty without the distributed optimizer.
    """
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    dist_opts = [o for o in inner if hasattr(o, "_get_model_param_range_map")]
    if not dist_opts:
        return {}
    ranges: Dict[torch.nn.Parameter, Tuple[Tuple[int, ...], int]] = {}
    for chunk in chunks:
        buffers = list(getattr(chunk, "buffers", None) or []) + list(getattr(chunk, "expert_parallel_buffers", None) or [])
        for buffer in buffers:
            if not hasattr(buffer, "param_index_map"):
                continue
            n, me = buffer.data_parallel_group.size(), buffer.data_parallel_group.rank()
            for param, (start, end, bucket_id) in buffer.param_index_map.items():
                bucket = buffer.buckets[bucket_id]
                bucket_size = bucket.grad_data.numel()
                per_rank = bucket_size // n
                bounds = [0]
                for r in range(n):
                    rank_end = bucket.offset + min(bucket_size, (r + 1) * per_rank)
                    bounds.append(min(max(rank_end - start, 0), end - start))
                ranges[param] = (tuple(bounds), me)
    for opt in dist_opts:
        for param, (bounds, me) in ranges.items():
            try:
                own = opt._get_model_param_range_map(param)["param"]
                mine = (own.start, own.end)
            except KeyError:
                mine = None  # this rank owns none of it, or the param belongs to another sub-optimizer
            if mine is not None and mine != (bounds[me], bounds[me + 1]):
                raise LayoutInferenceError(f"distributed optimizer range {mine} of a {tuple(param.shape)} parameter "
                                           f"differs from the grad buffer's {bounds} at DP rank {me}")
    return ranges


def recorded_module_types() -> Tuple[type, ...]:
    """The modules whose inputs, outputs and grads are recorded (and substituted in a replay)."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding)
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import Router

    return (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, Router, MoELayer)


def grad_computed_outside(module: torch.nn.Module, param_name: str) -> bool:
    """A parameter whose per-microbatch grad is not computed by a recorded module from the values
    a localization replay substitutes (its input and output-grad).

    That is every parameter of a module ttrace does not hook (norms, position embeddings: their
    inputs are the run's own activations), and the bias of a linear built with ``skip_bias_add``,
    which the linear returns for its caller to add (megatron's bias-dropout-add), so its grad
    comes from the grad of that sum. Such grads are judged like arrivals in a replay.
    """
    if not isinstance(module, recorded_module_types()):
        return True
    return param_name == "bias" and bool(getattr(module, "skip_bias_add", False))


QK_NORMS = ("q_layernorm", "k_layernorm")


def sees_head_shard(module_name: str) -> bool:
    """A norm attention applies to each query/key head (``qk_layernorm``): a replicated weight
    applied to this rank's heads only, so, with or without SP, its per-microbatch grad is a partial
    sum over TP that ``finalize_model_grads`` must sum (megatron does, by these names)."""
    return module_name.rpartition(".")[2] in QK_NORMS


def sees_sequence_shard(module: torch.nn.Module, param_name: str) -> bool:
    """Under SP, is this replicated parameter applied to the rank's sequence shard only?

    Then its per-microbatch grad is a partial sum over TP that ``finalize_model_grads`` must sum.
    This is decided from the module's structure (norms outside TP regions, the bias a
    RowParallelLinear adds after its reduce-scatter), not from megatron's ``sequence_parallel``
    tag: a missing tag is exactly the bug that leaves those grads unsummed.
    """
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    if isinstance(module, RowParallelLinear):
        return param_name == "bias" and module.sequence_parallel
    if isinstance(module, SharedExpertMLP):  # its gate is a replicated GEMV on the MoE layer's input
        return param_name == "gate_weight"
    return (isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or "Norm" in type(module).__name__
            or is_router(module))


KEY_NORM_BIAS_ZERO = ("its gradient is zero by construction: without rotary embeddings a key-norm bias "
                      "shifts every key of a head by the same vector, which moves each query's scores by one "
                      "constant, and softmax ignores constants; both sides hold round-off only, and Adam turns "
                      "round-off into updates of either sign")


def zero_gradient_params(chunks, facts: ModelFacts) -> Dict[str, str]:
    """{parameter: why} for parameters whose exact gradient is zero whatever the data, so that
    reference and candidate each hold their own round-off there (a relative error against a zero
    is meaningless): listed as not judged (``run.json`` ``unjudged_params``), never silently."""
    from ..recipe.naming import all_parameters, full_param_name, unwrap

    out = {}
    rotary = any(getattr(unwrap(c), "position_embedding_type", "") in ("rope", "mrope", "yarn") for c in chunks)
    if rotary:
        return out
    for mname, pname, _, _ in all_parameters(chunks):
        if mname.endswith(".self_attention.k_layernorm") and pname == "bias":
            out[full_param_name(mname, pname)] = KEY_NORM_BIAS_ZERO
    return out


def is_moe_layer(module: Optional[torch.nn.Module]) -> bool:
    """The whole MoE block (router, token dispatcher, experts, combine): recorded so that a fault in
    the dispatcher, which has no module of its own, is localized to the MoE layer."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return isinstance(module, MoELayer)


def is_router(module: Optional[torch.nn.Module]) -> bool:
    """The MoE router: a replicated gating weight applied to this rank's tokens (a sequence shard
    under SP), returning per-token expert probabilities."""
    from megatron.core.transformer.moe.router import Router

    return isinstance(module, Router)


def _scaled_logical(local: Sequence[int], placements: Sequence[Placement], sizes: Dict[str, int]) -> Tuple[int, ...]:
    shape = list(local)
    for p in placements:
        if isinstance(p, Shard):
            shape[p.dim % len(shape)] *= sizes[p.axis]
    return tuple(shape)


def router_loss_layout(router_input_layout: Layout) -> Layout:
    """A router's aux-loss value (load balancing, z-loss) as megatron attaches it to the graph: a sum
    over this rank's tokens, so a partial sum over the axes that shard the tokens (TP under SP,
    which megatron requires for MoE with TP), a replica over the others."""
    sharded = {p.axis for p in router_input_layout.placements if isinstance(p, Shard)}
    return Layout(tuple(Partial(p.axis) if p.axis in sharded else Replicate(p.axis)
                        for p in router_input_layout.placements), (1,))


def activation_layout(kind: TensorKind, module_name: str, module: torch.nn.Module, facts: ModelFacts,
                      shape: Sequence[int]) -> Layout:
    """Layout of a recorded module's first input or first output, or of the grad w.r.t. either
    (``kind``), for a tensor of ``shape`` as this rank holds it."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding)

    tp_axis, tp, _ = tensor_parallel_axis(module, facts)
    sizes = {tp_axis: tp}
    out_permute = None
    seq_sharded = (Shard(0, tp_axis),)
    replicated = (Replicate(tp_axis),)
    if is_expert(module):
        # an expert sees the tokens routed to it, the same on every expert-TP rank; its fc2 returns
        # partial sums that the token dispatcher reduces
        if isinstance(module, ColumnParallelLinear):
            in_pl, out_pl = replicated, (Shard(-1, tp_axis, _column_stride(module_name, facts)),)
        else:
            in_pl, out_pl = (Shard(-1, tp_axis),), (Partial(tp_axis),)
    elif isinstance(module, ColumnParallelLinear):
        in_pl = seq_sharded if module.sequence_parallel else replicated
        if is_gathered_linear(module):  # a heterogeneous layer's linear: its TP output gathered, or under SP
            out_pl = seq_sharded if module.sequence_parallel else replicated  # reduce-scattered over the sequence
        else:
            out_pl = replicated if module.gather_output else (Shard(-1, TP, _column_stride(module_name, facts)),)
    elif isinstance(module, RowParallelLinear):
        in_pl = (Shard(-1, TP),)
        out_pl = seq_sharded if module.sequence_parallel else replicated
    elif is_router(module) or is_moe_layer(module):
        # router: input [s, b, h], probs [s·b, experts]; MoE layer: [s, b, h] in and out (routing,
        # dispatch, experts and combine as one module): all split on tokens under SP
        in_pl = out_pl = seq_sharded if facts.sequence_parallel else replicated
    elif isinstance(module, VocabParallelEmbedding):
        in_pl = replicated
        if module.reduce_scatter_embeddings:  # stored [s/tp, b, h]: already megatron's [s, b, h] order
            out_pl = seq_sharded
        else:  # stored [b, s, h]: logical order is [s, b, h] like every other activation
            out_pl, out_permute = replicated, (1, 0, 2)
    else:
        in_pl = out_pl = replicated
    if kind in (TensorKind.INPUT, TensorKind.GRAD_INPUT):
        layout = Layout(in_pl, _scaled_logical(shape, in_pl, sizes))
    else:
        stored = _scaled_logical(shape, out_pl, sizes)
        logical = tuple(stored[d] for d in out_permute) if out_permute else stored
        layout = Layout(out_pl, logical, out_permute)
    return _grad_layout(layout, module) if kind in (TensorKind.GRAD_INPUT, TensorKind.GRAD_OUTPUT) else layout


def _grad_layout(layout: Layout, module: Optional[torch.nn.Module]) -> Layout:
    """The layout of the grad of an activation recorded with ``layout``.

    The same, except around experts: their linears leave the expert-TP reductions to the token
    dispatcher (``explicit_expert_comm``), so the grad w.r.t. an fc1 input that every expert-TP
    rank holds whole is a partial sum, and the grad of fc2's partial output is whole on every rank.
    """
    if not is_expert(module):
        return layout
    swapped = tuple(Partial(p.axis) if isinstance(p, Replicate) and p.axis == ETP else
                    Replicate(p.axis) if isinstance(p, Partial) and p.axis == ETP else p
                    for p in layout.placements)
    return dataclasses.replace(layout, placements=swapped)


def gemm_operand_placements(module_name: str, module: torch.nn.Module, facts: ModelFacts
                            ) -> Dict[str, Tuple[Placement, ...]]:
    """Placements of a linear's GEMM operands as its ``_forward_impl`` sees them: the input before
    the sequence-parallel all-gather, the weight, and the grad of the GEMM's own output (before a
    row-parallel reduction, where the output is a partial sum and its grad is whole on every rank).
    An FP8 GEMM reduces each operand's amax over the axes that shard it (``fp8_emulation``)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    tp_axis, _, _ = tensor_parallel_axis(module, facts)
    in_layout = activation_layout(TensorKind.INPUT, module_name, module, facts, (1, 1, 1))
    weight = param_layout(Site(module_name, module, WEIGHT, module.weight), facts)
    if isinstance(module, ColumnParallelLinear):
        grad_output = (Shard(-1, tp_axis, _column_stride(module_name, facts)),)
    else:
        grad_output = (Replicate(tp_axis),)
    return {INPUT: in_layout.placements, WEIGHT: weight.placements, GRAD_OUTPUT: grad_output}


def grad_norm_term_layout(main_grad: Layout, counted_over: Sequence[str]) -> Layout:
    """The layout of a parameter's term of the grad norm (``keys.grad_norm_term``: the sum of the
    squares of its main grad that this rank counted), from its main grad's layout and the axes the
    norm's call reduced over (``counted_over``: those whose whole group lies in the call's
    grad-stats group).

    Over a counted axis the ranks' terms add up: a shard's squares, or a replica counted on one
    rank and 0 on the others (megatron counts a TP-replicated parameter on TP rank 0 only, the
    last stage's copy of a tied embedding not at all): Partial. Over an axis the norm does not
    reduce over, every rank computes the same norm (DP replicas without the distributed optimizer):
    Replicate, so a rank that counts otherwise is a replica that differs. The grads are unscaled
    when the norm is taken: the term carries no scale."""
    placements = tuple(Partial(p.axis) if p.axis in counted_over else Replicate(p.axis)
                       for p in main_grad.placements)
    return Layout(placements, (1,))


def sharded_axes(placements: Sequence[Placement]) -> Tuple[str, ...]:
    """The axes over which a tensor with these placements is split (not replicated, not partial)."""
    return tuple(p.axis for p in placements if isinstance(p, (Shard, RangeShard)))


def axis_group(axis: str):
    """megatron's process group of a placement axis."""
    from megatron.core import parallel_state as ps

    groups = {TP: ps.get_tensor_model_parallel_group, DP: ps.get_data_parallel_group,
              PP: ps.get_pipeline_model_parallel_group, ETP: ps.get_expert_tensor_parallel_group,
              EDP: ps.get_expert_data_parallel_group}
    return groups[axis]()


def counted_axes(group) -> Tuple[str, ...]:
    """The placement axes whose whole group lies in ``group`` (a grad-norm call's grad-stats group;
    None: every rank): the axes a sum over ``group`` adds up over."""
    import torch.distributed as dist

    members = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    return tuple(axis for axis in (TP, DP, PP, ETP, EDP)
                 if set(dist.get_process_group_ranks(axis_group(axis))) <= members)


# the linears around core attention (the local spec's SelfAttention): what arrives at the output
# projection, and the grad that arrives at the fused QKV projection, come out of the attention's sums
ATTENTION_OUTPUT_PROJECTION = "self_attention.linear_proj"
ATTENTION_INPUT_PROJECTION = "self_attention.linear_qkv"


def reduction_length(module_name: str, module: Optional[torch.nn.Module], kind: TensorKind,
                     facts: ModelFacts) -> int:
    """K: the length of the reduction that produced a recorded tensor of ``kind``, for its tolerance
    (for an amax, the kind of the operand it summarizes: ``keys.operand_kind``).

    Linear outputs reduce over input features (fprop) and input grads over output features
    (dgrad); weight grads reduce over the microbatch's tokens (wgrad), main grads, updated
    parameters and the optimizer's scalars over the iteration's tokens, router aux losses over the
    microbatch's tokens; a position embedding's row over the sequences that hold its position. A
    weight grad's K is never less than its operands' (the hidden size; with the sequence around
    attention): the round-off of what it sums is in it too, which matters where a microbatch has
    fewer tokens than the model is wide.
    Tensors produced by ops we do not hook get the longest reduction among those ops: the hidden
    size for norms and activations, and for core attention's output (linear_proj's input) and
    the grad it sends back (linear_qkv's output-grad) also the sequence, over whose keys its
    softmax, P·V and their backward sum. The loss, the output layer's input and their grads get
    the vocabulary (log-sum-exp), or the hidden size where it is larger (the logits' reduction).
    (The optimizer's scalars get their bounds from the run's own
    measurements: ``step_bounds``; K is the fallback for traces without them.)
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    linear = isinstance(module, (ColumnParallelLinear, RowParallelLinear))
    if kind is TensorKind.OUTPUT and linear:
        return int(module.input_size)
    if kind is TensorKind.GRAD_INPUT and linear:
        return int(module.output_size)
    attention = module_name.endswith((ATTENTION_OUTPUT_PROJECTION, ATTENTION_INPUT_PROJECTION))
    # what a weight grad sums carries the round-off of the reductions that made its operands (the
    # module's input, the grad arriving at its output): never less than theirs
    operands = max(facts.hidden_size, facts.seq_length if attention else 0)
    per_position = facts.seq_length > 0 and module_name.endswith("position_embeddings")
    if kind is TensorKind.PARAM_GRAD:
        tokens = facts.tokens_per_microbatch // facts.seq_length if per_position else facts.tokens_per_microbatch
        return max(tokens, operands)
    if kind in (TensorKind.MAIN_GRAD, TensorKind.PARAM, TensorKind.OPTIMIZER_SCALAR, TensorKind.OPTIMIZER_STATE,
                TensorKind.GRAD_NORM_TERM):
        tokens = facts.tokens_per_iteration // facts.seq_length if per_position else facts.tokens_per_iteration
        return max(tokens, operands)
    if (kind is TensorKind.INPUT and module_name.endswith(ATTENTION_OUTPUT_PROJECTION)) or (
            kind is TensorKind.GRAD_OUTPUT and module_name.endswith(ATTENTION_INPUT_PROJECTION)):
        return max(facts.hidden_size, facts.seq_length)
    if kind is TensorKind.STEP_SETTING:
        return 1  # set, not reduced: two correct runs agree to the last bit

    if kind is TensorKind.AUX_LOSS and is_router(module):
        return facts.tokens_per_microbatch
    if is_logits_or_loss(module_name):
        return max(facts.vocab_size, facts.hidden_size)  # log-sum-exp over V, of logits reduced over h
    return facts.hidden_size


def is_logits_or_loss(module_name: str) -> bool:
    """The output layer and the loss, the decoder's or a multi-token prediction depth's
    (``mtp.layers.0.output_layer``, ``mtp.layers.0.loss``)."""
    return module_name in (LOSS_MODULE, OUTPUT_LAYER) or module_name.endswith(
        ("." + LOSS_MODULE, "." + OUTPUT_LAYER))


def stage_replicated_layout(shape: Sequence[int], facts: ModelFacts) -> Layout:
    """A value every rank computes, the same on all of them (the grad norm)."""
    return replicated_layout(shape, (PP, DP, TP) if facts.pp_size > 1 else (DP, TP))


def replicated_layout(shape: Sequence[int], axes: Sequence[str] = (TP,)) -> Layout:
    return Layout(tuple(Replicate(a) for a in axes), tuple(shape))
