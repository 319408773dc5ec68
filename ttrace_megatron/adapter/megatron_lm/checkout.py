"""``ttrace run RECIPE --megatron-lm PATH``: both sides through Megatron-LM's own ``pretrain_gpt.py``.

The recipe becomes Megatron-LM's flags (:func:`training_args`: the model, the parallel layout, the
optimizer, mock data, dropout 0, the local layers), and each rank runs the checkout's unmodified
``pretrain_gpt.py`` as ``torchrun`` would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the
environment) with ttrace added the zero-edit way: ``install()`` wraps ``setup_model_and_optimizer``
and ``train_step`` by name, and the ``--ttrace*`` flags are chained onto megatron's argument parser
(:func:`_chain_ttrace_arguments`), which is what the patch's ``extra_args_provider`` line does. On
CPU the rank first applies ``cuda_shim.install_megatron_lm()`` (its ``MEGATRON_LM_SHIMS`` list).

Run a rank directly: ``python -m ttrace_megatron.adapter.megatron_lm.checkout CHECKOUT -- FLAGS...``.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from ...about import SOURCE_ROOT
from ...errors import RecipeError
from ...recipe import MEGATRON_INDEXED, MEGATRON_MOCK, SEED_INIT_MEGATRON, SYNTHETIC, Recipe
from ..recipe.data import indexed_path, write_documents
from ..recipe import compat, heterogeneous
from ..run.session import TraceOptions

SCRIPT = "pretrain_gpt.py"
# the patch of each supported Megatron-LM release (patches/), by the megatron-core release its
# checkout holds (the core_v0.19.0 tag's megatron/core says 0.19.1)
PATCHES = {"0.16": "megatron_lm_core_v0.16.1.patch", "0.19": "megatron_lm_core_v0.19.0.patch"}
PATCH_DIR = os.path.join(SOURCE_ROOT, "patches")

# recipe model fields -> Megatron-LM flags (value flags); booleans are below
_VALUE_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "ffn_hidden_size": "--ffn-hidden-size", "kv_channels": "--kv-channels",
    "normalization": "--normalization", "position_embedding_type": "--position-embedding-type",
    "init_method_std": "--init-method-std", "layernorm_epsilon": "--norm-epsilon", "rotary_base": "--rotary-base",
    "rotary_percent": "--rotary-percent",
    # MoE (SequentialMLP experts: Megatron-LM builds them with the local spec unless --moe-grouped-gemm)
    "num_moe_experts": "--num-experts", "moe_router_topk": "--moe-router-topk",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size", "moe_token_dispatcher_type": "--moe-token-dispatcher-type",
    "moe_router_load_balancing_type": "--moe-router-load-balancing-type", "moe_aux_loss_coeff": "--moe-aux-loss-coeff",
    "moe_z_loss_coeff": "--moe-z-loss-coeff", "moe_router_score_function": "--moe-router-score-function",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_router_topk_scaling_factor": "--moe-router-topk-scaling-factor", "moe_router_dtype": "--moe-router-dtype",
    "moe_router_bias_update_rate": "--moe-router-bias-update-rate",
    # multi-token prediction
    "mtp_num_layers": "--mtp-num-layers", "mtp_loss_scaling_factor": "--mtp-loss-scaling-factor",
}
# boolean model fields -> the Megatron-LM flag that turns them on (their default is off)
_SWITCH_FLAGS = {
    "qk_layernorm": "--qk-layernorm", "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
}
_PARALLEL_FLAGS = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "expert_tensor_parallel_size": "--expert-tensor-parallel-size",
}
# everything else a recipe may set is refused for --megatron-lm until it is translated and verified


# the modules Megatron-LM's training code imports beyond megatron-core's requirements (found by
# importing pretrain_gpt.py at core_v0.16.1 and core_v0.19.0 in a venv that followed the README, and
# by training: megatron.training compiles megatron-core's dataset helpers with pybind11); setup.py's
# ``megatron-lm`` extra installs them
TRAINING_IMPORTS = ("six", "regex", "pydantic", "triton", "pybind11")


def check_checkout(path: str) -> str:
    """The checkout's absolute path, or RecipeError naming what is missing: a file of the checkout,
    or a module its training code imports that this interpreter lacks (all of them at once, before
    any rank starts)."""
    import importlib.util

    path = os.path.abspath(path)
    for need in (SCRIPT, os.path.join("megatron", "training", "training.py"), os.path.join("megatron", "core")):
        if not os.path.exists(os.path.join(path, need)):
            raise RecipeError(f"--megatron-lm {path}: not a Megatron-LM checkout (no {need})")
    missing = [m for m in TRAINING_IMPORTS if importlib.util.find_spec(m) is None]
    if missing:
        raise RecipeError(f"--megatron-lm {path}: Megatron-LM's training code imports {', '.join(missing)}, not "
                          f"installed in {sys.executable}: pip install -e '.[megatron-lm]' in ttrace's checkout "
                          f"(or pip install {' '.join(missing)})")
    return path


def release_of(checkout: str) -> str:
    """The megatron-core release of a checkout (its ``megatron/core/package_info.py``), read as
    text: the checkout is not imported here."""
    path = os.path.join(checkout, "megatron", "core", "package_info.py")
    try:
        with open(path) as f:
            text = f.read()
        parts = [re.search(rf"^{name}\s*=\s*(\d+)", text, re.M).group(1) for name in ("MAJOR", "MINOR", "PATCH")]
    except (OSError, AttributeError):
        raise RecipeError(f"{path}: cannot read the checkout's megatron-core release") from None
    return ".".join(parts)


def patch_for(checkout: str) -> str:
    """The path of the patch for the checkout's release (RecipeError for a release without one)."""
    minor = ".".join(release_of(checkout).split(".")[:2])
    if minor not in PATCHES:
        raise RecipeError(f"{checkout}: no ttrace patch for megatron-core {minor} (patches exist for "
                          f"{', '.join(sorted(PATCHES))}); use ttrace.install() instead")
    return os.path.join(PATCH_DIR, PATCHES[minor])


def patched(checkout: str) -> Tuple[bool, bool]:
    """(``pretrain_gpt.py`` adds the ``--ttrace`` flags, ``training.py`` calls ttrace itself): a
    checkout with the patch applied, which the run must not instrument a second time."""
    def mentions(relative: str, text: str) -> bool:
        with open(os.path.join(checkout, relative)) as f:
            return text in f.read()

    return (mentions(SCRIPT, "ttrace.extra_args_provider("),
            mentions(os.path.join("megatron", "training", "training.py"), "ttrace.attach("))


def write_indexed_dataset(prefix: str, *, vocab_size: int, documents: int, seed: int,
                          min_length: int = 8, max_length: int = 96) -> str:
    """A small token dataset in megatron's indexed format (``PREFIX.bin``/``.idx``, written with
    megatron-core's IndexedDatasetBuilder, :func:`..recipe.data.write_documents`): ``documents``
    documents of random lengths and tokens below ``vocab_size``. Returns the prefix for
    ``--megatron-lm-data``."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def document():
        length = int(torch.randint(min_length, max_length + 1, (1,), generator=generator))
        return torch.randint(0, vocab_size, (length,), generator=generator, dtype=torch.int32)

    return write_documents(prefix, (document() for _ in range(documents)))


def training_args(recipe: Recipe, role: str, parallel: Dict, *, release: str,
                  data_path: Optional[str] = None) -> List[str]:
    """Megatron-LM's flags for one side of ``recipe`` on a checkout of megatron-core ``release``
    (``parallel``: the candidate's settings, or {} for the one-rank reference; ``data_path``: an
    indexed dataset for Megatron-LM's GPTDataset instead of its mock data). Raises RecipeError
    naming a recipe field with no translation."""
    argv = _model_flags(recipe) + _parallel_flags(recipe, parallel) + _optimizer_flags(recipe)
    _refuse_untranslated_data(recipe, data_path)
    if recipe.data.source == MEGATRON_INDEXED:  # the recipe's own indexed dataset
        data_path = indexed_path(recipe)
    argv += _loop_flags(recipe, release, data_path)
    # megatron-core's TransformerConfig computes attention softmax in fp32 by default; Megatron-LM's
    # flag defaults to off: the recipe's (TransformerConfig's) value is passed on
    if recipe.model.get("attention_softmax_in_fp32", True):
        argv += ["--attention-softmax-in-fp32"]
    if recipe.dtype == "bf16":
        argv += ["--bf16"]
    elif recipe.dtype != "fp32":
        raise RecipeError(f"{recipe.source}: --megatron-lm: dtype {recipe.dtype} has no translation in ttrace yet")
    return argv + ["--ttrace-role", role]


def _model_flags(recipe: Recipe) -> List[str]:
    """The recipe's model fields as Megatron-LM's flags; a field with no translation is refused."""
    model = dict(recipe.model)
    argv: List[str] = []
    for key, value in model.items():
        if key in _VALUE_FLAGS:
            argv += [_VALUE_FLAGS[key], str(value)]
        elif key == "num_query_groups":
            argv += ["--group-query-attention", "--num-query-groups", str(value)]
        elif key == "add_bias_linear":
            argv += [] if value else ["--disable-bias-linear"]
        elif key == "gated_linear_unit":
            if value and model.get("activation_func") != "silu":
                raise RecipeError(f"{recipe.source}: --megatron-lm: gated_linear_unit translates to --swiglu only "
                                  f"(activation_func: silu)")
            argv += ["--swiglu"] if value else []
        elif key == "activation_func":
            if value not in ("gelu", "silu") or (value == "silu" and not model.get("gated_linear_unit")):
                raise RecipeError(f"{recipe.source}: --megatron-lm: activation_func {value!r} has no translation yet")
        elif key == "share_embeddings_and_output_weights":
            argv += [] if value else ["--untie-embeddings-and-output-weights"]
        elif key == "attention_softmax_in_fp32":
            pass  # training_args
        elif key in _SWITCH_FLAGS:
            argv += [_SWITCH_FLAGS[key]] if value else []
        elif key == heterogeneous.JSON_KEY:
            raise RecipeError(f"{recipe.source}: --megatron-lm: model: '{key}' has no Megatron-LM flag translation in "
                              f"ttrace yet: Megatron-LM takes the blocks only inside a Hugging Face Llama-Nemotron "
                              f"config.json and checks the model flags against it (megatron/training/arguments.py:125, "
                              f"validate_model_config_args_from_heterogeneous_config at core_v0.16.1: SwiGLU, RMSNorm, "
                              f"RoPE with Llama 3.1's scaling, one n_heads_in_group for every layer); run it with "
                              f"ttrace's own loop (no --megatron-lm)")
        elif key == "moe_layer_freq":  # an int, or a list Megatron-LM parses from its Python form
            argv += ["--moe-layer-freq", str(value) if isinstance(value, int) else "[" + ",".join(map(str, value)) + "]"]
        else:
            raise RecipeError(f"{recipe.source}: --megatron-lm: model: '{key}' has no Megatron-LM flag translation "
                              f"in ttrace yet")
    if "share_embeddings_and_output_weights" not in model:  # GPT_MODEL_KEYS: ttrace's default is untied
        argv += ["--untie-embeddings-and-output-weights"]
    return argv


def _parallel_flags(recipe: Recipe, parallel: Dict) -> List[str]:
    argv: List[str] = []
    for key, value in parallel.items():
        if key == "sequence_parallel":
            argv += ["--sequence-parallel"] if value else []
        elif key in _PARALLEL_FLAGS:
            argv += [_PARALLEL_FLAGS[key], str(value)]
        else:
            raise RecipeError(f"{recipe.source}: --megatron-lm: parallel: '{key}' has no translation in ttrace yet")
    return argv


def _optimizer_flags(recipe: Recipe) -> List[str]:
    """The distributed optimizer's flag (the optimizer and lr are loop flags); any other optimizer
    or ddp field is refused."""
    for key in recipe.optimizer:
        if key not in ("optimizer", "lr", "use_distributed_optimizer"):
            raise RecipeError(f"{recipe.source}: --megatron-lm: optimizer: '{key}' has no translation in ttrace yet")
    if recipe.ddp:
        raise RecipeError(f"{recipe.source}: --megatron-lm: ddp: fields have no translation in ttrace yet")
    return ["--use-distributed-optimizer"] if recipe.optimizer.get("use_distributed_optimizer") else []


def _refuse_untranslated_data(recipe: Recipe, data_path: Optional[str]) -> None:
    d, t = recipe.data, recipe.train
    if data_path and d.source == MEGATRON_INDEXED:
        raise RecipeError(f"{recipe.source}: --megatron-lm-data: data: source '{MEGATRON_INDEXED}' names its own "
                          f"dataset (path); give one of them")
    if data_path and d.source == MEGATRON_MOCK:
        raise RecipeError(f"{recipe.source}: --megatron-lm-data: data: source '{MEGATRON_MOCK}' asks for the mock "
                          f"dataset; leave 'source' out to train on {data_path}")
    if d.source == SYNTHETIC:
        raise RecipeError(f"{recipe.source}: --megatron-lm: data: source 'synthetic' is ttrace's own data; "
                          f"Megatron-LM's pretrain_gpt.py trains on its mock dataset ('{MEGATRON_MOCK}', the "
                          f"default with --megatron-lm) or on --megatron-lm-data")
    if d.masked_share or d.document_length or d.padded_share or d.distinct_tokens:
        raise RecipeError(f"{recipe.source}: --megatron-lm: data: 'masked_share', 'document_length', "
                          f"'padded_share' and 'distinct_tokens' shape ttrace's synthetic data; Megatron-LM's loop "
                          f"trains on its own dataset's documents and masks (pretrain_gpt.py hands the model no "
                          f"padding mask)")
    if t.frozen or t.start_weight_decay is not None or t.end_weight_decay is not None:
        raise RecipeError(f"{recipe.source}: --megatron-lm: train: frozen parameters and weight-decay schedules "
                          f"have no translation in ttrace yet")


def _loop_flags(recipe: Recipe, release: str, data_path: Optional[str]) -> List[str]:
    """The optimizer's schedule, the data, the tokenizer, and what keeps the run deterministic and
    on megatron's local layers (no dropout, no fusions, no evaluation)."""
    opt, d, t = recipe.optimizer, recipe.data, recipe.train
    return [
        "--optimizer", opt.get("optimizer", "adam"), "--lr", str(opt.get("lr", 1e-3)), "--min-lr", "0",
        "--lr-decay-style", t.lr_decay_style, "--lr-warmup-iters", str(t.lr_warmup_iters),
        "--lr-decay-iters", str(t.lr_decay_iters or t.iterations),
        "--seed", str(d.seed), "--seq-length", str(d.seq_length), "--max-position-embeddings", str(d.seq_length),
        "--micro-batch-size", str(d.micro_batch_size), "--global-batch-size", str(d.global_batch_size),
        "--train-iters", str(t.iterations),
        *(["--data-path", data_path, "--split", "100,0,0", "--dataloader-type", "single"] if data_path
          else ["--mock-data"]),
        *(["--eod-mask-loss"] if d.eod_mask_loss else []),
        *(["--reset-position-ids"] if d.reset_position_ids else []),
        *(["--reset-attention-mask"] if d.reset_attention_mask else []),
        # the recipe's vocabulary (the logical one, before padding), NullTokenizer's EOD token included
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(compat.null_tokenizer_vocab_flag(d.vocab_size, release)),
        "--make-vocab-size-divisible-by", str(recipe.model.get("make_vocab_size_divisible_by", 128)),
        "--transformer-impl", "local", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
        "--eval-iters", "0", "--eval-interval", str(10 ** 6), "--log-interval", "1",
        "--use-cpu-initialization",
    ]


def trace_args(trace: TraceOptions, recipe: Optional[Recipe] = None) -> List[str]:
    """The ``--ttrace*`` flags of one side; the recipe's ``train.seed_init`` goes with the seed
    checkpoint (the reference draws it so)."""
    argv = ["--ttrace", "--ttrace-dir", trace.dir]
    if trace.seed_checkpoint:
        argv += ["--ttrace-seed-checkpoint", trace.seed_checkpoint]
        seed_init = recipe.train.seed_init if recipe is not None else trace.seed_init
        if seed_init != SEED_INIT_MEGATRON:
            argv += ["--ttrace-seed-init", seed_init]
    if trace.lockstep:
        argv += ["--ttrace-lockstep", trace.lockstep]
    if trace.page_cache:
        argv += ["--ttrace-page-cache"]
    if trace.reference:  # online compare; its verdicts go out through Megatron-LM's own TensorBoard writer
        argv += ["--ttrace-reference", trace.reference] + (["--ttrace-keep-tensors"] if trace.keep_tensors else [])
        if trace.map_reference:
            argv += ["--ttrace-map-reference"]
        if trace.tensorboard:
            argv += ["--tensorboard-dir", trace.tensorboard]
    if trace.replay:
        argv += ["--ttrace-replay", trace.replay]
        if trace.iterations:  # a replay records one failing iteration: Megatron-LM's loop stops after it
            argv += ["--exit-interval", str(max(trace.iterations))]
    if trace.perturb:  # the perturbation estimate: the reference again, with round-off-sized noise
        argv += ["--ttrace-perturb", str(trace.perturb)]
    if trace.iterations:
        argv += ["--ttrace-iters", ",".join(map(str, trace.iterations))]
    if trace.microbatches:
        argv += ["--ttrace-microbatches", ",".join(map(str, trace.microbatches))]
    for pattern in trace.modules if tuple(trace.modules) != ("*",) else ():
        argv += ["--ttrace-modules", pattern]
    return argv


INJECT_ENV = "TTRACE_MEGATRON_LM_INJECT"  # ";"-separated bug specs (adapter.zoo.bugs), injected after setup


def run(checkout: str, recipe: Recipe, role: str, trace: TraceOptions, *, inject=(), cpu: bool = True,
        log_dir: Optional[str] = None, timeout_s: int = 900, data_path: Optional[str] = None) -> None:
    """One side of a ``ttrace run --megatron-lm``: the reference on one rank, the candidate on the
    recipe's ranks and layout, ``inject``: bugs for the candidate (adapter.zoo.bugs)."""
    import torch

    from ...trace_store import CANDIDATE

    parallel = recipe.parallel if role == CANDIDATE else {}
    world = recipe.world_size if role == CANDIDATE else 1
    cpu = cpu or not torch.cuda.is_available()
    argv = training_args(recipe, role, parallel, release=release_of(checkout), data_path=data_path)
    argv += ["--distributed-backend", "gloo" if cpu else "nccl"]
    argv += trace_args(trace, recipe)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    launch(checkout, argv, world, cpu=cpu, timeout_s=timeout_s, log_dir=log_dir,
           env={INJECT_ENV: ";".join(inject)}, name=os.path.basename(os.path.normpath(trace.dir)))


def launch(checkout: str, argv: List[str], world_size: int, *, cpu: bool = True, timeout_s: int = 600,
           log_dir: Optional[str] = None, env: Optional[Dict[str, str]] = None, name: str = "run") -> None:
    """Run ``world_size`` ranks of the checkout's ``pretrain_gpt.py`` with ``argv``, as torchrun
    would; raise RunFailed with each failing rank's output tail."""
    from ...errors import RunFailed
    from ..run.launch import free_port

    env = dict(os.environ, **(env or {}), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world_size), TTRACE_MEGATRON_LM_CPU="1" if cpu else "0", CUDA_DEVICE_MAX_CONNECTIONS="1",
               # the checkout's .python-version names another interpreter for pyenv; its dataset
               # helpers are compiled with this one
               PYENV_VERSION=".".join(map(str, sys.version_info[:3])))
    env["PYTHONPATH"] = os.pathsep.join([checkout] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    procs = []
    logs = []
    try:
        for rank in range(world_size):
            logs.append(open(os.path.join(log_dir, f"megatron-lm-{name}-rank{rank}.log"), "w+") if log_dir
                        else tempfile.TemporaryFile("w+"))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "ttrace_megatron.adapter.megatron_lm.checkout", checkout, "--", *argv],
                env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), cwd=checkout, stdout=logs[-1],
                stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        failed = []
        for rank, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                rc = "timeout"
            if rc != 0:
                failed.append((rank, rc))
        if failed:
            tails = []
            for rank, rc in failed[:2]:
                logs[rank].seek(0)
                tails.append(f"--- rank {rank} (exit {rc}) ---\n" + logs[rank].read()[-3000:])
            raise RunFailed(f"Megatron-LM's {SCRIPT} failed:\n" + "\n".join(tails))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()


def _chain_ttrace_arguments() -> None:
    """Add the ``--ttrace*`` flags to megatron's parser, as the patch's ``extra_args_provider``
    line does: wrap ``megatron.training.arguments.parse_args`` wherever megatron calls it from
    (core_v0.16.1: ``initialize_megatron`` through its own import of the name; core_v0.18 on:
    ``parse_and_validate_args``, which ``pretrain_gpt.py`` calls itself, through the module's)."""
    import importlib

    from megatron.training import arguments

    from .arguments import extra_args_provider

    original = arguments.parse_args

    def parse_args(extra=None, *args, **kwargs):
        return original(extra_args_provider(extra), *args, **kwargs)

    for module_name in ("megatron.training.arguments", "megatron.training.initialize"):
        module = importlib.import_module(module_name)
        if getattr(module, "parse_args", None) is original:
            module.parse_args = parse_args


def _inject_after_setup(bugs: List[str]) -> None:
    """Inject ``bugs`` into the candidate's model once Megatron-LM has built it and ttrace has
    attached (and loaded the seed checkpoint), then refresh the optimizer's main copies of the
    weights, as ``ttrace run`` injects before its optimizer copies them. A bug in how megatron
    builds the model is injected now, before Megatron-LM builds it."""
    import megatron.training.training as training_module

    from ..zoo import bugs as bug_registry

    for bug in bugs:
        bug_registry.inject_before_build(bug)
    setup = training_module.setup_model_and_optimizer

    def setup_model_and_optimizer(*args, **kwargs):
        result = setup(*args, **kwargs)
        for bug in bugs:
            bug_registry.inject(result[0], bug)
        result[1].reload_model_params()
        return result

    training_module.setup_model_and_optimizer = setup_model_and_optimizer


def _python_311() -> None:
    """Megatron-LM's training package from core_v0.18 on declares Python >= 3.12 and imports
    ``typing.override`` (3.12); on 3.11 that is typing_extensions' (the same decorator, a no-op at
    run time). Nothing else of 3.12 is needed by the paths ttrace runs."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def main(argv: List[str]) -> None:
    checkout, _, flags = argv[0], argv[1], argv[2:]
    _python_311()
    sys.path.insert(0, checkout)
    if os.environ.get("TTRACE_MEGATRON_LM_CPU") == "1":
        from ..cpu import cuda_shim

        cuda_shim.install()
        cuda_shim.install_megatron_lm()
    from ..run import worker_env  # noqa: F401  (quiet library warnings)
    from .api import install

    args_patched, loop_patched = patched(checkout)  # a patched checkout instruments itself
    if not loop_patched:
        install()
    if not args_patched:
        _chain_ttrace_arguments()
    bugs = [b for b in os.environ.get(INJECT_ENV, "").split(";") if b]
    if bugs:
        _inject_after_setup(bugs)
    sys.argv = [os.path.join(checkout, SCRIPT), *flags]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
