"""One rank's tracing session: what ``attach`` starts, whichever training loop drives the model.

Megatron-LM's loop reaches it through :mod:`..megatron_lm.api` (``ttrace.attach`` and the
``--ttrace*`` flags); ttrace's own loop (:mod:`.runner`) calls :func:`start` with the options,
model facts and signature it built from the recipe. A session hooks the model chunks (one
dispatcher: the clock and every feature: record, replay, perturbation), wraps the optimizer,
writes ``run.json`` on rank 0 and shares the seed checkpoint. It writes nothing to the run: hooks
copy tensors, the optimizer wrapper calls the original ``step`` and records around it, and no hook
issues a collective.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import uuid
from typing import Any, Dict, List, Optional, Sequence

import torch

from ...about import __version__
from ...errors import RecipeError
from ...recipe import SEED_INIT_MEGATRON
from ...trace_store import CANDIDATE, REFERENCE, REPLAY


@dataclasses.dataclass
class TraceOptions:
    """What to record and where; built from ``--ttrace*`` arguments or given directly."""

    enabled: bool = False
    dir: str = "ttrace"
    iterations: Optional[List[int]] = None  # 1-based; None = every iteration
    modules: Sequence[str] = ("*",)  # fnmatch patterns of canonical module names
    ranks: Optional[List[int]] = None
    microbatches: Optional[List[int]] = None  # global microbatch ids
    reference: Optional[str] = None  # online compare against this reference trace
    keep_tensors: bool = False  # with ``reference``: also write the tensors
    replay: Optional[str] = None  # localization replay: run every module on this reference's inputs
    role: str = "auto"  # reference | candidate | auto (reference when nothing is parallel)
    seed_checkpoint: Optional[str] = None  # logical initial weights: the reference writes, candidates load
    perturb: int = 0  # > 0: the perturbation-estimate run, round-off-sized noise seeded by this (run.perturb)
    lockstep: Optional[str] = None  # after each step, take this reference trace's parameters and state (run.lockstep)
    seed_init: str = SEED_INIT_MEGATRON  # what the reference writes to the seed checkpoint (run.sensitize)
    # write through the page cache, not O_DIRECT, and without fsync: a check on this machine reads
    # this trace right after (lock-step, online), from memory instead of the disk (TraceWriter)
    page_cache: bool = False
    # with ``reference``: it is this check's own, written whole before this run started and by no one
    # while it runs (``ttrace run``'s reference in memory): read through memory maps of its files,
    # not copies (TraceReader's ``mapped``)
    map_reference: bool = False
    # with ``reference``: the verdicts per iteration as scalars (live_scalars), through ttrace's own
    # SummaryWriter in this directory, and/or through Megatron-LM's TensorBoard and W&B writers
    tensorboard: Optional[str] = None
    megatron_writers: bool = False
    # a reference written one iteration at a time for this many online candidate ranks beside it,
    # each iteration overwriting what they never read again (trace_store.Turns; ``ttrace run
    # --reference-in stream``); 0: written whole
    stream_readers: int = 0
    # with ``reference``: it is streamed so (read an iteration at a time, each let go at its flush)
    streamed_reference: bool = False
    # streamed: the reader number of this run's rank 0 among the reference's readers (a perturbation
    # run streamed beside the candidate reads after the candidate's ranks)
    stream_reader: int = 0
    # train no further than this iteration (None: the recipe's every one): a streamed reference run
    # again for a failing check's replay, which reads nothing of the iterations after the failing one
    until: Optional[int] = None

    @staticmethod
    def from_args(args: Any) -> "TraceOptions":
        return TraceOptions(
            enabled=bool(getattr(args, "ttrace", False)),
            dir=getattr(args, "ttrace_dir", None) or "ttrace",
            iterations=getattr(args, "ttrace_iters", None),
            modules=tuple(getattr(args, "ttrace_modules", None) or ("*",)),
            ranks=getattr(args, "ttrace_ranks", None),
            microbatches=getattr(args, "ttrace_microbatches", None),
            reference=getattr(args, "ttrace_reference", None),
            keep_tensors=bool(getattr(args, "ttrace_keep_tensors", False)),
            replay=getattr(args, "ttrace_replay", None),
            role=getattr(args, "ttrace_role", None) or "auto",
            seed_checkpoint=getattr(args, "ttrace_seed_checkpoint", None),
            perturb=int(getattr(args, "ttrace_perturb", 0) or 0),
            lockstep=getattr(args, "ttrace_lockstep", None),
            seed_init=getattr(args, "ttrace_seed_init", None) or SEED_INIT_MEGATRON,
            page_cache=bool(getattr(args, "ttrace_page_cache", False)),
            map_reference=bool(getattr(args, "ttrace_map_reference", False)),
            # Megatron-LM makes its writers on the last rank from these; every rank holds the arguments
            megatron_writers=bool(getattr(args, "tensorboard_dir", None) or getattr(args, "wandb_project", None)),
        )

    @property
    def write_tensors(self) -> bool:
        return self.reference is None or self.keep_tensors


@dataclasses.dataclass
class Session:
    options: TraceOptions
    dispatcher: Any  # record.hooks.Dispatcher: the clock and every feature (record, replay, perturb)
    recorder: Any  # record.recorder.Recorder
    optimizer: Any
    rank: int
    live: Any = None  # live_scalars.LiveScalars of an online check with writers


_SESSION: Optional[Session] = None


def as_chunks(model) -> List:
    """A model chunk or a list of chunks (virtual pipeline stages) as a list."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def parallel_sizes() -> Dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "etp": ps.get_expert_tensor_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}


def check_traceable(config, chunks: List, options: TraceOptions) -> None:
    """Refuse before training starts, not mid-run: a second session, and the modes whose placements
    are not inferred yet."""
    if _SESSION is not None:
        raise RuntimeError("ttrace.attach was called twice without ttrace.flush in between")
    _refuse_unsupported(config, parallel_sizes(), chunks, options)


def _refuse_unsupported(config, sizes: Dict[str, int], chunks: List, options: TraceOptions) -> None:
    """Modes whose placements are not inferred yet: refuse before training starts, not mid-run."""
    problems = [f"{k.upper()}={v}" for k, v in sizes.items() if k in ("cp",) and v > 1]
    if getattr(config, "fp8", None):
        problems.append("FP8")
    if getattr(config, "recompute_granularity", None) and options.perturb:
        problems.append("--ttrace-perturb with activation recomputation (the noise of a module's recomputed "
                        "forward would not be its first run's)")
    from ..recipe.config import recompute_refused

    recompute = recompute_refused(getattr(config, "recompute_granularity", None),
                                  getattr(config, "recompute_modules", None), getattr(config, "add_bias_linear", True))
    if recompute:
        problems.append(recompute)
    tf32 = tf32_refusal(config, _parameter_device_type(chunks))
    if tf32:
        problems.append(tf32)
    te = sorted({type(m).__name__ for c in chunks for m in c.modules() if type(m).__name__.startswith("TE")})
    if te:
        problems.append(f"TransformerEngine layers ({', '.join(te[:3])}; use --transformer-impl local)")
    if options.replay and options.reference:
        problems.append("--ttrace-replay with --ttrace-reference (replay writes a trace to compare locally)")
    if options.perturb and options.replay:
        problems.append("--ttrace-perturb with --ttrace-replay (the perturbation run is a second reference run, "
                        "the replay a candidate's)")
    if problems:
        raise RecipeError("ttrace cannot trace this run yet: " + ", ".join(problems)
                          + ". Supported: TP, SP, PP (with virtual stages), DP, the distributed optimizer and MoE "
                          "(EP, expert TP), with the local layer spec.")


def _parameter_device_type(chunks: List) -> str:
    for chunk in chunks:
        for p in chunk.parameters():
            return p.device.type
    return "cpu"


def tf32_matmul_enabled(environ=None) -> bool:
    """Whether cuBLAS runs this process's fp32 GEMMs with TF32 inputs (10 mantissa bits).

    torch's flag (``torch.backends.cuda.matmul.allow_tf32``, or ``fp32_precision == "tf32"`` in the
    newer API) already counts ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``, which NGC's PyTorch containers
    set; ``NVIDIA_TF32_OVERRIDE=0`` turns TF32 off inside cuBLAS whatever torch asks for."""
    env = os.environ if environ is None else environ
    if env.get("NVIDIA_TF32_OVERRIDE") == "0":
        return False
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    return bool(matmul.allow_tf32) or precision == "tf32"


def tf32_refusal(config, device_type: str, environ=None) -> str:
    """The refusal of an fp32 check whose GEMMs run in TF32 on the GPU, or "".

    ttrace judges an fp32 run's tensors with fp32 bounds. A TF32 GEMM rounds its inputs to 10
    mantissa bits, so inputs that differ by fp32 round-off round apart: measured on an H200, one TF32
    GEMM (K = 4096) turned an input difference of 1 ε₃₂ into 65 ε₃₂, and 10 ε₃₂ into 218 ε₃₂
    (BENCHMARKS.md, "On a GPU at the real shapes"). Nothing in the fp32 bound's per-layer growth
    (C = 1.03) covers that: a clean check would false-alarm. Turning TF32 off for the user would
    change the numerics of the run observed, so the check is refused and says how to run it."""
    if device_type != "cuda" or getattr(config, "bf16", False) or getattr(config, "fp16", False):
        return ""
    if not tf32_matmul_enabled(environ):
        return ""
    return ("an fp32 run whose GEMMs use TF32 (torch.backends.cuda.matmul.allow_tf32 is on; NGC containers set "
            "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1): fp32 bounds cannot judge TF32 round-off. Run both sides with "
            "NVIDIA_TF32_OVERRIDE=0, or with allow_tf32 off and TORCH_ALLOW_TF32_CUBLAS_OVERRIDE unset")


def start(model, optimizer, config, options: TraceOptions, facts, signature: Optional[Dict[str, Any]],
          run_info: Optional[Dict[str, Any]] = None) -> Optional[Session]:
    """Start recording ``model`` (a chunk or a list of chunks) and ``optimizer``.

    ``facts``: the model's :class:`..record.layouts.ModelFacts`; ``signature``: the model signature
    (:func:`..recipe.build.model_signature`) as the caller built the model, before anything patched
    it (``ttrace run`` injects bugs); rank 0 writes it to ``run.json`` with ``run_info``. Without
    ``options.enabled`` nothing happens and None is returned.
    """
    global _SESSION
    import torch.distributed as dist

    from ..record import layouts

    if not options.enabled:
        return None
    chunks = as_chunks(model)
    check_traceable(config, chunks, options)
    sizes = parallel_sizes()
    rank = global_rank()
    world = dist.get_world_size() if dist.is_initialized() else 1
    coords = layouts.rank_coordinates()
    role = REPLAY if options.replay else \
        options.role if options.role != "auto" else (REFERENCE if world == 1 else CANDIDATE)
    late = any(getattr(getattr(c, "ddp_config", None), "overlap_param_gather", False) for c in chunks)
    key_layouts = layouts.KeyLayouts(facts, sizes["dp"], layouts.distributed_optimizer_ranges(chunks, optimizer),
                                     params_gathered_late=late)
    if rank == 0:
        _write_run_info(options, chunks, optimizer, config, facts, sizes, role, world, signature, run_info)
    if options.seed_checkpoint:
        from .seed_checkpoint import share_initial_weights

        share_initial_weights(options.seed_checkpoint, chunks, key_layouts, coords, rank, role, world, optimizer,
                              init=options.seed_init)
    dispatcher, recorder = _hook(options, chunks, optimizer, key_layouts, sizes, rank, coords)
    _SESSION = Session(options, dispatcher.attach(), recorder, optimizer, rank, _live_scalars(options, recorder))
    return _SESSION


def _live_scalars(options: TraceOptions, recorder):
    """The online check's scalars per iteration, where it has writers (live_scalars)."""
    if not options.reference or not (options.tensorboard or options.megatron_writers):
        return None
    from ...online import OnlineComparer
    from .live_scalars import LiveScalars, OwnWriter, megatron_lm_writers

    comparer = next(s for s in recorder.sinks if isinstance(s, OnlineComparer))
    own = OwnWriter(options.tensorboard) if options.tensorboard else None
    if own is None:
        return LiveScalars(comparer, megatron_lm_writers)
    return LiveScalars(comparer, (lambda: own() + megatron_lm_writers()) if options.megatron_writers else own, own)


def _write_run_info(options: TraceOptions, chunks: List, optimizer, config, facts, sizes: Dict[str, int], role: str,
                    world: int, signature: Optional[Dict[str, Any]], run_info: Optional[Dict[str, Any]]) -> None:
    """Rank 0's ``run.json``: the run's role, layout, model signature and versions, what the trace
    records, the optimizer's update rule, and what no comparison can judge."""
    from ...trace_store import write_run_info

    info = {"role": role, "world_size": world, "parallel": {k: v for k, v in sizes.items() if v > 1},
            "model_config": signature, "num_layers": facts.num_layers + facts.mtp_layers,
            "compute_dtype": str(config.params_dtype).replace("torch.", ""), "versions": library_versions(),
            "online_reference": os.path.abspath(options.reference) if options.reference else None,
            "replay_reference": os.path.abspath(options.replay) if options.replay else None,
            "perturbation_seed": options.perturb or None,
            "lockstep_reference": os.path.abspath(options.lockstep) if options.lockstep else None,
            # identity by content, not by path: a moved or copied pair is still a lock-step pair
            "run_id": uuid.uuid4().hex,
            "lockstep_reference_id": run_id_of(options.lockstep) if options.lockstep else None,
            "online_reference_id": run_id_of(options.reference) if options.reference else None,
            "record_filter": {"iterations": options.iterations, "modules": list(options.modules),
                              "microbatches": options.microbatches, "ranks": options.ranks}}
    opt_config = getattr(optimizer, "config", None)
    if opt_config is not None:
        from ..record.optimizer_state import param_groups_by_name, update_rule

        info["update_rule"] = update_rule(opt_config)
        info["param_groups"] = param_groups_by_name(optimizer, chunks)
    info.update(_unobserved(chunks, config, facts, sizes))
    info.update(run_info or {})
    write_run_info(options.dir, info)


def run_id_of(trace_dir: str) -> Optional[str]:
    """The ``run_id`` a trace's ``run.json`` holds (None: a trace of a ttrace before run ids)."""
    from ...trace_store import RUN_FILE, read_json

    run = read_json(os.path.join(trace_dir, RUN_FILE), rank=None)
    return run.get("run_id") if isinstance(run, dict) else None


def _unused_params(chunks: List, config, sizes: Dict[str, int]) -> List[Dict[str, str]]:
    """Parameters some rank holds that are not the model's (rank 0 writes run.json, so they are
    found from the layout, not the rank's own chunks): with tied embeddings and multi-token
    prediction under PP, the last stage's output-layer weight (naming.UNUSED_OUTPUT_WEIGHT)."""
    from ..recipe.naming import UNUSED_OUTPUT_WEIGHT, unwrap

    model = unwrap(chunks[0])
    if (getattr(model, "share_embeddings_and_output_weights", False) and getattr(config, "mtp_num_layers", None)
            and sizes["pp"] > 1):
        print(f"[ttrace] not the model's, not judged: output_layer.weight of the last pipeline stage: "
              f"{UNUSED_OUTPUT_WEIGHT}", flush=True)
        return [{"param": "output_layer.weight", "where": "the last pipeline stage", "why": UNUSED_OUTPUT_WEIGHT}]
    return []


def _unobserved(chunks: List, config, facts, sizes: Dict[str, int]) -> Dict[str, Any]:
    """What this run cannot record or judge, with why (the report lists it; the parameters' part
    is printed now): MoE routing choices, expert tokens, parameters no gradient reaches. Coverage
    starts from the parameters this rank holds (the one-rank reference: all of them)."""
    from ..recipe.naming import all_parameters, full_param_name
    from ..record import layouts
    from ..record.routing import unobserved_routing

    info: Dict[str, Any] = {}
    unobserved = unobserved_routing(config)
    if unobserved:
        # the comparison lists this in the report; routing flips then go unexplained
        info["unjudged"] = [{"what": "MoE routers' top-k choices", "why": unobserved}]
        print(f"[ttrace] the MoE routers' top-k choices are not recorded, judged or followed: {unobserved}",
              flush=True)
    unmatched = layouts.expert_tokens_unmatched(sizes["ep"], sizes["etp"], sizes["tp"], config.sequence_parallel,
                                                getattr(config, "moe_token_dispatcher_type", None))
    if unmatched:
        info["not_recorded"] = [{"modules": "*.local_experts.*", "why": unmatched}]
    info["parameters"] = [{"param": full_param_name(m, n), "module": m, "name": n,
                           "module_type": type(module).__name__, "numel": int(p.numel()),
                           "requires_grad": bool(p.requires_grad)}
                          for m, n, module, p in all_parameters(chunks)]
    info["unused_params"] = _unused_params(chunks, config, sizes)
    info["unjudged_params"] = [{"param": name, "why": why}
                               for name, why in layouts.zero_gradient_params(chunks, facts).items()]
    by_why: Dict[str, List[str]] = {}
    for entry in info["unjudged_params"]:
        by_why.setdefault(entry["why"], []).append(entry["param"])
    for why, names in by_why.items():
        print(f"[ttrace] not judged: {len(names)} parameter(s) ({names[0]}{', …' if len(names) > 1 else ''}): "
              f"{why}", flush=True)
    return info


def _hook(options: TraceOptions, chunks: List, optimizer, key_layouts, sizes: Dict[str, int], rank: int, coords):
    """The dispatcher and its features in order (record, then replay, perturbation), the trace's
    sinks (the writer, the online comparer) and the optimizer wrapper; lock-step wraps last."""
    from megatron.core import parallel_state as ps

    from ...trace_store import TraceWriter
    from ..record.hooks import Clock, Dispatcher
    from ..cpu import cuda_shim
    from ..record.recorder import Recorder, RecordFilter

    sinks: List[Any] = []
    if options.write_tensors:
        turns = None
        if options.stream_readers:
            from ...online import overwritable
            from ...trace_store import Turns

            turns = Turns(options.stream_readers, overwritable)
        sinks.append(TraceWriter(options.dir, rank, coords, page_cache=options.page_cache, turns=turns))
    online = None
    if options.reference:
        from ...online import OnlineComparer

        online = OnlineComparer(options.reference, options.dir, rank, coords, lockstep=bool(options.lockstep),
                                world_size=torch.distributed.get_world_size(), mapped=options.map_reference,
                                streamed=options.streamed_reference, reader=options.stream_reader + rank)
        sinks.append(online)
    clock = Clock(dp_rank=ps.get_data_parallel_rank(), dp_size=sizes["dp"])
    dispatcher = Dispatcher(chunks, clock)
    record_filter = RecordFilter(options.iterations, tuple(options.modules), options.microbatches, options.ranks)
    recorder = dispatcher.add(Recorder(sinks, chunks, key_layouts, clock, rank, coords, record_filter)).attach()
    recorder.sink_context = cuda_shim.suspended  # a no-op where the shim is not installed (a GPU)
    recorder.wrap_optimizer(optimizer)
    if options.replay:
        from .replay import Replayer

        dispatcher.add(Replayer(options.replay, recorder))
    if options.perturb:
        from .perturb import Perturber

        dispatcher.add(Perturber(options.perturb))
    if options.lockstep:
        from .lockstep import LockStep

        # on the online comparer's trace: its reader (each file verified once in this process)
        same = online is not None and os.path.samefile(options.lockstep, options.reference)
        if options.streamed_reference and not same:
            raise RecipeError("a streamed reference (--reference-in stream) is lock-stepped with itself only")
        LockStep(options.lockstep, recorder, online.reference if same else None,
                 online._reference_groups if same else None, online.ensure if same and online.streamed else None)
    return dispatcher, recorder


def begin_iteration(iteration: int) -> None:
    """Start recording iteration ``iteration`` (1-based)."""
    if _SESSION is not None:
        _SESSION.dispatcher.begin_iteration(iteration)


def end_iteration(iteration: int, loss_dict=None, grad_norm=None, skipped_iter=None) -> None:
    """Finish iteration ``iteration``: its tensors are written (or judged) now.

    ``loss_dict``, ``grad_norm`` and ``skipped_iter`` are what ``train_step`` returns; the grad
    norm itself is recorded per rank inside the optimizer wrapper, before ``train_step`` reduces it.
    """
    if _SESSION is not None:
        _SESSION.dispatcher.end_iteration(iteration)
        if _SESSION.live is not None:
            _SESSION.live.end_iteration(iteration)


def flush() -> None:
    """Close the trace: manifests are marked complete, hooks removed, the optimizer unwrapped."""
    global _SESSION
    session, _SESSION = _SESSION, None
    if session is None:
        return
    from ..record.recorder import Recorder

    session.dispatcher.close()  # the hooks, then every feature: the recorder finishes its trace
    if session.live is not None:
        session.live.close()
    Recorder.unwrap_optimizer(session.optimizer)


atexit.register(flush)


def library_versions() -> Dict[str, str]:
    import torch

    import megatron.core

    out = {"torch": torch.__version__, "megatron.core": getattr(megatron.core, "__version__", "?"),
           # which tree: an installed release, a checkout, a patched copy (--candidate-megatron)
           "megatron.core.path": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
               megatron.core.__file__)))),
           "ttrace_megatron": __version__}
    try:
        import transformer_engine  # noqa: F401
        out["transformer_engine"] = transformer_engine.__version__
    except Exception:
        pass
    return out
