"""The training-loop API: what Megatron-LM's ``pretrain_gpt.py`` / ``training.py`` call.

Two ways in, both no-ops unless ``--ttrace`` is given:

* **the patch** (``patches/``, fewer than 10 lines)::

      extra_args_provider=ttrace.extra_args_provider(<existing provider or None>)   # pretrain_gpt.py
      ttrace.attach(model, optimizer, config)       # pretrain(), after setup_model_and_optimizer
      ttrace.begin_iteration(iteration + 1)         # train(), before train_step
      ttrace.end_iteration(iteration + 1, loss_dict, grad_norm, skipped_iter)   # after train_step
      ttrace.flush()                                # end of train() (atexit covers sys.exit)

* **zero edits to training.py**: ``ttrace.install()`` once in ``pretrain_gpt.py`` before
  ``pretrain(...)``. It wraps ``megatron.training.training.setup_model_and_optimizer`` and
  ``train_step``, which ``pretrain``/``train`` look up by name at call time.

Iterations are numbered from 1, as Megatron-LM logs them (``iteration + 1`` inside ``train()``).
``attach`` takes the objects ``pretrain`` holds: a list of model chunks (``DDP(Float16Module(
GPTModel))``) and the optimizer from ``get_megatron_optimizer`` (a ``ChainedOptimizer``).
It writes nothing to the run: hooks copy tensors, the optimizer wrapper calls the original
``step`` and records around it, and no hook issues a collective.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..errors import RecipeError
from ..trace_store import CANDIDATE, REFERENCE, REPLAY


def parse_int_ranges(text: str) -> List[int]:
    """``"1,3-5"`` → ``[1, 3, 4, 5]`` (non-negative integers)."""
    out: List[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            if "-" in part:
                lo, hi = part.split("-", 1)
                out.extend(range(int(lo), int(hi) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers and ranges like 1,3-5, got {text!r}") from None
    return out


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
    perturb: int = 0  # > 0: the perturbation-estimate run, round-off-sized noise seeded by this (adapter.perturb)
    lockstep: Optional[str] = None  # after each step, take this reference trace's parameters and state (adapter.lockstep)

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
        )

    @property
    def write_tensors(self) -> bool:
        return self.reference is None or self.keep_tensors


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    if "--ttrace" in parser._option_string_actions:  # added already (a patched script run by --megatron-lm)
        return parser
    group = parser.add_argument_group("ttrace", "differential testing against a single-device reference")
    group.add_argument("--ttrace", action="store_true", help="record tensors for ttrace (off: ttrace does nothing)")
    group.add_argument("--ttrace-dir", default="ttrace", help="trace directory (default: ./ttrace)")
    group.add_argument("--ttrace-iters", type=parse_int_ranges, help="record only these iterations (1-based), e.g. 1,3-5")
    group.add_argument("--ttrace-modules", action="append", metavar="PATTERN",
                       help="record only modules matching this fnmatch pattern (repeatable), e.g. 'decoder.layers.1.*'")
    group.add_argument("--ttrace-ranks", type=parse_int_ranges, help="record only on these global ranks")
    group.add_argument("--ttrace-microbatches", type=parse_int_ranges, help="record only these global microbatch ids")
    group.add_argument("--ttrace-reference", metavar="DIR",
                       help="online compare: judge each rank's shards against this reference trace during the run "
                            "and write verdicts only")
    group.add_argument("--ttrace-keep-tensors", action="store_true",
                       help="with --ttrace-reference, also write the candidate's tensors")
    group.add_argument("--ttrace-seed-checkpoint", metavar="FILE",
                       help="start from the same logical weights: the reference writes FILE (if absent), every "
                            "other run loads its shard of each weight from it, whatever its parallel layout")
    group.add_argument("--ttrace-replay", metavar="DIR",
                       help="localization replay: every recorded module runs on this reference trace's inputs and "
                            "output-grads, so each is judged on its own (then: ttrace localize REF DIR)")
    group.add_argument("--ttrace-perturb", type=int, default=0, metavar="SEED",
                       help="the perturbation estimate: run the reference again with round-off-sized noise in every "
                            "recorded module (seeded by SEED > 0), into its own --ttrace-dir; ttrace compare "
                            "--perturbed DIR then bounds each tensor by what this noise moves it")
    group.add_argument("--ttrace-lockstep", metavar="DIR",
                       help="lock-step: after each optimizer step, take this reference trace's parameters and "
                            "optimizer state, so every iteration is judged given identical weights and state "
                            "(the reference must record every iteration)")
    group.add_argument("--ttrace-role", choices=("auto", REFERENCE, CANDIDATE), default="auto",
                       help="label of this run (auto: reference when TP=PP=CP=EP=DP=1)")
    return parser


def extra_args_provider(existing: Optional[Callable] = None):
    """An ``extra_args_provider`` for ``pretrain(...)`` that adds ``--ttrace*`` after ``existing``.

    Megatron-LM accepts one provider, so the existing one (modelopt's, or None) is chained. Given a
    parser instead of a provider, adds the arguments to it and returns it.
    """
    if isinstance(existing, argparse.ArgumentParser):
        return add_arguments(existing)

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if existing is not None:
            parser = existing(parser)
        return add_arguments(parser)

    return provider


# ------------------------------------------------------------------------------------------------
# the session


@dataclasses.dataclass
class Session:
    options: TraceOptions
    dispatcher: Any  # adapter.hooks.Dispatcher: the clock and every feature (record, replay, perturb)
    recorder: Any  # adapter.recorder.Recorder
    optimizer: Any
    rank: int


_SESSION: Optional[Session] = None


def _megatron_args():
    """Megatron-LM's parsed arguments, or None outside Megatron-LM (megatron.training absent)."""
    try:
        from megatron.training import get_args
    except ImportError:
        return None
    try:
        return get_args()
    except (AssertionError, AttributeError):
        return None  # megatron.training present, arguments not parsed (a megatron-core-only loop)


def _parallel_sizes() -> Dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "etp": ps.get_expert_tensor_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}


def _refuse_unsupported(config, sizes: Dict[str, int], chunks: List, options: TraceOptions) -> None:
    """Modes whose placements are not inferred yet: refuse before training starts, not mid-run."""
    problems = [f"{k.upper()}={v}" for k, v in sizes.items() if k in ("cp",) and v > 1]
    if getattr(config, "fp8", None):
        problems.append("FP8")
    if getattr(config, "recompute_granularity", None) == "full":
        problems.append("full activation recompute (module forwards run again during backward)")
    te = sorted({type(m).__name__ for c in chunks for m in c.modules() if type(m).__name__.startswith("TE")})
    if te:
        problems.append(f"TransformerEngine layers ({', '.join(te[:3])}; use --transformer-impl local)")
    if options.replay and options.reference:
        problems.append("--ttrace-replay with --ttrace-reference (replay writes a trace to compare locally)")
    if options.perturb and (options.replay or options.reference):
        problems.append("--ttrace-perturb with --ttrace-replay or --ttrace-reference (the perturbation run is a "
                        "second reference run that writes its own trace)")
    if problems:
        raise RecipeError("ttrace cannot trace this run yet: " + ", ".join(problems)
                          + ". Supported: TP, SP, PP (with virtual stages), DP, the distributed optimizer and MoE "
                          "(EP, expert TP), with the local layer spec.")


def model_facts(chunks: List, config, args: Any = None, *, logical_vocab_size: Optional[int] = None,
                tokens_per_microbatch: Optional[int] = None, tokens_per_iteration: Optional[int] = None):
    """:class:`.layouts.ModelFacts` of a Megatron-LM run (its arguments give the batch sizes), or of
    a megatron-core loop that passes them."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from .layouts import model_facts as build_facts
    from .naming import unwrap

    if logical_vocab_size is None and args is not None and hasattr(args, "padded_vocab_size"):
        logical_vocab_size = _tokenizer_vocab_size()  # Megatron-LM pads its tokenizer's vocabulary
    if logical_vocab_size is None:
        # the padded vocabulary: from the embedding (first stage) or the output layer (last stage)
        logical_vocab_size = 0
        for chunk in chunks:
            model = unwrap(chunk)
            embedding = next((m for m in model.modules() if isinstance(m, VocabParallelEmbedding)), None)
            output_layer = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
            if embedding is not None:
                logical_vocab_size = int(embedding.num_embeddings)
            elif output_layer is not None:
                logical_vocab_size = int(output_layer.output_size)
    if tokens_per_microbatch is None or tokens_per_iteration is None:
        if args is None or not hasattr(args, "seq_length"):
            raise RecipeError("ttrace.attach needs tokens_per_microbatch and tokens_per_iteration outside Megatron-LM")
        tokens_per_microbatch = args.micro_batch_size * args.seq_length
        tokens_per_iteration = args.global_batch_size * args.seq_length
    seq_length = int(getattr(args, "seq_length", 0) or 0) if args is not None else 0
    return build_facts(chunks, config, vocab_size=logical_vocab_size, tokens_per_microbatch=tokens_per_microbatch,
                       tokens_per_iteration=tokens_per_iteration, seq_length=seq_length)


def _tokenizer_vocab_size() -> Optional[int]:
    """The vocabulary of Megatron-LM's tokenizer (its ``get_tokenizer()``), before the padding to a
    multiple of ``--make-vocab-size-divisible-by`` × TP; None where there is none."""
    try:
        from megatron.training import get_tokenizer

        return int(get_tokenizer().vocab_size)
    except Exception:  # no Megatron-LM training package, or no tokenizer built
        return None


def training_signature(args: Any) -> Dict[str, Any]:
    """What Megatron-LM's arguments say about the data and the loop (see :func:`.build.model_signature`)."""
    if args is None:
        return {}
    names = {"seed": "seed", "seq_length": "seq_length", "micro_batch_size": "micro_batch_size",
             "global_batch_size": "global_batch_size", "iterations": "train_iters", "lr_decay_style": "lr_decay_style",
             "lr_warmup_iters": "lr_warmup_iters", "lr_decay_iters": "lr_decay_iters"}
    out = {k: getattr(args, a, None) for k, a in names.items()}
    # the tokens: Megatron-LM's mock dataset (which ttrace's runner can build too, data.source
    # megatron_mock) or a dataset of the user's, named by its paths
    out["data_source"] = "megatron_mock" if getattr(args, "mock_data", False) else \
        "megatron_data:" + ",".join(map(str, getattr(args, "data_path", None) or []))
    return out


def attach(model, optimizer, config, *, options: Optional[TraceOptions] = None, args: Any = None,
           facts=None, signature: Optional[Dict[str, Any]] = None,
           run_info: Optional[Dict[str, Any]] = None) -> Optional[Session]:
    """Start recording ``model`` (a chunk or a list of chunks) and ``optimizer``.

    Options come from ``options`` or else from Megatron-LM's ``--ttrace*`` arguments; without
    ``--ttrace`` nothing happens and None is returned. Raises RecipeError before training starts
    for parallel modes that cannot be traced yet. ``signature``: the model signature
    (:func:`.build.model_signature`) of a caller that describes the model as it built it, before
    anything patched it (``ttrace run`` injects bugs); else it is read from the model, the optimizer
    and Megatron-LM's arguments now.
    """
    global _SESSION
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    from ..trace_store import TraceWriter, write_run_info
    from . import layouts
    from .build import model_signature
    from .hooks import Clock, Dispatcher
    from .recorder import Recorder, RecordFilter

    if args is None and options is None:
        args = _megatron_args()
    options = options or TraceOptions.from_args(args)
    if not options.enabled:
        return None
    if _SESSION is not None:
        raise RuntimeError("ttrace.attach was called twice without ttrace.flush in between")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    sizes = _parallel_sizes()
    _refuse_unsupported(config, sizes, chunks, options)
    facts = facts or model_facts(chunks, config, args)

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    coords = layouts.rank_coordinates()
    role = options.role if options.role != "auto" else (REFERENCE if world == 1 else CANDIDATE)
    if options.replay:
        role = REPLAY
    key_layouts = layouts.KeyLayouts(facts, sizes["dp"], layouts.distributed_optimizer_ranges(chunks, optimizer))

    if rank == 0:
        if signature is None:
            signature = model_signature(chunks, config, getattr(optimizer, "config", None), facts,
                                        training_signature(args))
        info = {"role": role, "world_size": world, "parallel": {k: v for k, v in sizes.items() if v > 1},
                "model_config": signature, "num_layers": facts.num_layers,
                "compute_dtype": str(config.params_dtype).replace("torch.", ""), "versions": library_versions(),
                "online_reference": os.path.abspath(options.reference) if options.reference else None,
                "replay_reference": os.path.abspath(options.replay) if options.replay else None,
                "perturbation_seed": options.perturb or None,
                "lockstep_reference": os.path.abspath(options.lockstep) if options.lockstep else None,
                "record_filter": {"iterations": options.iterations, "modules": list(options.modules),
                                  "microbatches": options.microbatches, "ranks": options.ranks}}
        opt_config = getattr(optimizer, "config", None)
        if opt_config is not None:
            from .optimizer_state import param_groups_by_name, update_rule

            info["update_rule"] = update_rule(opt_config)
            info["param_groups"] = param_groups_by_name(optimizer, chunks)
        from .routing import unobserved_routing

        unobserved = unobserved_routing(config)
        if unobserved:
            # the comparison lists this in the report; routing flips then go unexplained
            info["unjudged"] = [{"what": "MoE routers' top-k choices", "why": unobserved}]
            print(f"[ttrace] the MoE routers' top-k choices are not recorded, judged or followed: {unobserved}",
                  flush=True)
        unmatched = layouts.expert_tokens_unmatched(sizes["ep"] * sizes["etp"], sizes["tp"], config.sequence_parallel)
        if unmatched:
            info["not_recorded"] = [{"modules": "*.local_experts.*", "why": unmatched}]

        from .naming import all_parameters, full_param_name

        # coverage: the parameters this rank holds (the one-rank reference: all of them), and the
        # ones no comparison can judge, with why
        info["parameters"] = [{"param": full_param_name(m, n), "module": m, "name": n,
                               "module_type": type(module).__name__, "numel": int(p.numel()),
                               "requires_grad": bool(p.requires_grad)}
                              for m, n, module, p in all_parameters(chunks)]
        info["unjudged_params"] = [{"param": name, "why": why}
                                   for name, why in layouts.zero_gradient_params(chunks, facts).items()]
        by_why: Dict[str, List[str]] = {}
        for entry in info["unjudged_params"]:
            by_why.setdefault(entry["why"], []).append(entry["param"])
        for why, names in by_why.items():
            print(f"[ttrace] not judged: {len(names)} parameter(s) ({names[0]}{', …' if len(names) > 1 else ''}): "
                  f"{why}", flush=True)
        info.update(run_info or {})
        write_run_info(options.dir, info)

    if options.seed_checkpoint:
        from .seed_checkpoint import share_initial_weights

        share_initial_weights(options.seed_checkpoint, chunks, key_layouts, coords, rank, role, world, optimizer)

    sinks = []
    if options.write_tensors:
        sinks.append(TraceWriter(options.dir, rank, coords))
    if options.reference:
        from ..online import OnlineComparer

        sinks.append(OnlineComparer(options.reference, options.dir, rank, coords, lockstep=bool(options.lockstep)))
    clock = Clock(dp_rank=ps.get_data_parallel_rank(), dp_size=sizes["dp"])
    dispatcher = Dispatcher(chunks, clock)
    record_filter = RecordFilter(options.iterations, tuple(options.modules), options.microbatches, options.ranks)
    recorder = dispatcher.add(Recorder(sinks, chunks, key_layouts, clock, rank, coords, record_filter)).attach()
    recorder.wrap_optimizer(optimizer)
    if options.replay:
        from .replay import Replayer

        dispatcher.add(Replayer(options.replay, recorder))
    if options.perturb:
        from .perturb import Perturber

        dispatcher.add(Perturber(options.perturb))
    if options.lockstep:
        from .lockstep import LockStep

        LockStep(options.lockstep, recorder)
    _SESSION = Session(options, dispatcher.attach(), recorder, optimizer, rank)
    return _SESSION


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


def flush() -> None:
    """Close the trace: manifests are marked complete, hooks removed, the optimizer unwrapped."""
    global _SESSION
    session, _SESSION = _SESSION, None
    if session is None:
        return
    from .recorder import Recorder

    session.dispatcher.close()  # the hooks, then every feature: the recorder finishes its trace
    Recorder.unwrap_optimizer(session.optimizer)


atexit.register(flush)


def library_versions() -> Dict[str, str]:
    import torch

    import megatron.core

    out = {"torch": torch.__version__, "megatron.core": getattr(megatron.core, "__version__", "?"),
           # which tree: an installed release, a checkout, a patched copy (--candidate-megatron)
           "megatron.core.path": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
               megatron.core.__file__))))}
    try:
        from ttrace_megatron import __version__
        out["ttrace_megatron"] = __version__
    except ImportError:
        pass
    try:
        import transformer_engine  # noqa: F401
        out["transformer_engine"] = transformer_engine.__version__
    except Exception:
        pass
    return out


# ------------------------------------------------------------------------------------------------
# zero-edit install


def install(training_module=None) -> None:
    """Wrap Megatron-LM's ``setup_model_and_optimizer`` and ``train_step`` by name.

    ``pretrain`` and ``train`` look both up as module globals of ``megatron.training.training`` at
    call time, so replacing them there is enough. Arguments are parsed inside ``pretrain``, so the
    wrappers decide at call time whether ``--ttrace`` is on.
    """
    if training_module is None:
        import megatron.training.training as training_module
    if getattr(training_module, "_ttrace_installed", False):
        return
    setup = training_module.setup_model_and_optimizer
    train_step = training_module.train_step

    def setup_model_and_optimizer(*args, **kwargs):
        result = setup(*args, **kwargs)
        model, optimizer = result[0], result[1]
        from megatron.core.utils import get_model_config

        attach(model, optimizer, get_model_config(model[0] if isinstance(model, (list, tuple)) else model))
        return result

    def traced_train_step(*args, **kwargs):
        iteration = kwargs.get("iteration")
        if iteration is None:
            margs = _megatron_args()
            iteration = getattr(margs, "curr_iteration", 0) if margs is not None else 0
        begin_iteration(iteration + 1)
        result = train_step(*args, **kwargs)
        end_iteration(iteration + 1)
        return result

    training_module.setup_model_and_optimizer = setup_model_and_optimizer
    training_module.train_step = traced_train_step
    training_module._ttrace_installed = True
