"""The one place where megatron-core is taught to run without CUDA.

megatron-core 0.16.1 assumes a GPU in a handful of places even on its "CPU initialization" path:
allocations on ``torch.cuda.current_device()``, ``device="cuda"`` literals in the schedules,
optimizers and grad clipping, ``Tensor.cuda()`` on the tied output weight, CUDA RNG states for the
model-parallel RNG tracker, and optimizers that accept parameters only when ``param.type()`` names
a ``torch.cuda.*Tensor``. This module maps all of those to the CPU, for the whole process, so that
the real megatron-core code paths (not re-implementations of them) run under gloo in tests and in
the CPU demo.

Nothing here is used on a machine with a GPU: :func:`install` is called only by the CPU launcher.
Every shim is listed in :data:`SHIMS` so a reader can audit exactly what was changed.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

SHIMS = (
    "torch.cuda.current_device() -> 'cpu'",
    "device='cuda' / 'cuda:N' in tensor factories and .to() -> cpu",
    "Tensor.cuda() -> no-op",
    "Tensor.type() (no arguments) -> 'torch.cuda.<T>Tensor' string, for optimizer type checks",
    "torch.cuda.Stream / Event / stream / current_stream / default_stream / synchronize -> no-ops",
    "model-parallel RNG tracker keeps CPU generator states",
    "megatron.core.transformer.moe.moe_utils.te_general_gemm -> None when TransformerEngine is absent "
    "(the router's gating GEMM then falls back to torch, as megatron intends)",
    "moe_utils.maybe_move_tensor_to_cpu(as_numpy=True) converts CPU tensors too (megatron converts only "
    "CUDA ones; gloo's all_to_all_single takes split sizes as sequences, not tensors)",
    "torch.distributed.all_gather with pieces of different sizes on gloo (NCCL takes them; megatron's "
    "expert-TP token gathers send them): every piece padded to the largest, gathered, trimmed",
    "activation recomputation (tensor_parallel.random's CheckpointFunction and "
    "CheckpointWithoutOutputFunction) runs its backward, where the forward runs again, under the CUDA-to-CPU "
    "rewrite too: the autograd engine does not carry torch function modes into backward",
    "ttrace's own host-side work inside hooks (judging, staging) runs outside the rewrite (suspended())",
    "WrappedTorchNorm accepts sequence_parallel (as apex's FusedLayerNorm does) and tags its "
    "params sequence_parallel=True so finalize_model_grads all-reduces their grads over TP",
)

# what Megatron-LM's training package (megatron/training, not megatron-core) assumes of a GPU, for
# ``ttrace run --megatron-lm`` on CPU (install_megatron_lm); nothing of megatron-core beyond SHIMS
MEGATRON_LM_SHIMS = (
    "megatron.training.initialize.initialize_megatron(allow_no_cuda=True): it asserts CUDA otherwise",
    "torch.cuda.device_count() -> 1 and torch.cuda.set_device -> no-op, so that initialize runs the "
    "model-parallel setup and the model-parallel seeding it skips without devices",
    "megatron.training's get_device_arch_version() -> 0 (it reads the CUDA device's compute capability "
    "when TP > 1)",
    "megatron.legacy.fused_kernels.load -> no-op (it runs nvcc -V; absent from 0.17 on)",
)

_installed = False


def _map_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in every torch call made while the mode is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            first = args[1]
            if isinstance(first, (str, torch.device)) or isinstance(first, int):
                args = (args[0], _map_device(first)) + tuple(args[2:])
        return func(*args, **kwargs)


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullEvent()

    def synchronize(self):
        pass


class _NullEvent(_NullStream):
    def record(self, *args, **kwargs):
        pass

    def query(self):
        return True


def _install_rng_tracker():
    """Make megatron's model-parallel RNG tracker keep CPU generator states."""
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None


def _install_sequence_parallel_norm():
    """Let the torch norm of the local spec run under sequence parallelism.

    Without apex (a CUDA extension) the local spec falls back to ``WrappedTorchNorm``, which
    refuses ``sequence_parallel``. A norm is per-token, so it is correct on a sequence shard; what
    SP needs in addition is that its weight grads, partial sums over the local tokens, are summed
    over TP. megatron does that for params tagged ``sequence_parallel`` (as FusedLayerNorm tags
    them), so this builds the torch norm as usual and adds the tag.
    """
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__
    if getattr(original_new, "_ttrace_shim", False):
        return

    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new._ttrace_shim = True
    torch_norm.WrappedTorchNorm.__new__ = new


def _install_moe_without_te():
    """megatron-core 0.16.1 imports ``te_general_gemm`` from TE inside a try block and leaves the
    name undefined when TE is missing; the router's gating then raises NameError instead of taking
    its torch path (``if te_general_gemm is not None``)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    from megatron.core.transformer.moe import token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _install_uneven_all_gather():
    """gloo's all_gather requires every rank's piece to have one size; NCCL's does not, and
    megatron-core's token gathers over expert-TP ranks (``gather_from_sequence_parallel_region``
    with ``output_split_sizes``) send pieces of different sizes. Pad each piece to the largest,
    gather, and copy each piece's own elements out: the same values arrive, by another route."""
    import torch.distributed as dist

    original = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if len({t.numel() for t in tensor_list}) <= 1 or dist.get_backend(group) != "gloo":
            return original(tensor_list, tensor, group=group, async_op=async_op)
        width = max(t.numel() for t in tensor_list)
        padded = tensor.new_zeros(width)
        padded[:tensor.numel()] = tensor.reshape(-1)
        gathered = [tensor.new_empty(width) for _ in tensor_list]
        original(gathered, padded, group=group)
        for out, got in zip(tensor_list, gathered):
            out.copy_(got[:out.numel()].view(out.shape))
        return _DoneWork() if async_op else None

    all_gather._ttrace_shim = True
    dist.all_gather = all_gather


class _DoneWork:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _install_recompute_under_mode() -> None:
    """The forward a recomputation runs again inside backward allocates tensors too (megatron's
    default causal mask on ``device="cuda"``); the autograd engine runs backward without the torch
    function modes of the caller, so each checkpoint function's backward enters the mode itself."""
    from megatron.core.tensor_parallel import random as tp_random

    for name in ("CheckpointFunction", "CheckpointWithoutOutputFunction"):
        function = getattr(tp_random, name, None)
        if function is None or getattr(function.backward, "_ttrace_cpu", False):
            continue
        original = function.backward

        def backward(ctx, *grads, _original=original):
            with _CudaToCpuMode():
                return _original(ctx, *grads)

        backward._ttrace_cpu = True
        function.backward = staticmethod(backward)


def install() -> None:
    """Apply every shim to this process. Idempotent."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cuda_shim.install() is for CPU-only processes; this machine has CUDA")
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    _install_rng_tracker()
    _install_sequence_parallel_norm()
    _install_moe_without_te()
    _install_uneven_all_gather()
    _install_recompute_under_mode()
    _CudaToCpuMode().__enter__()
    _installed = True


def suspended():
    """A context in which torch calls skip the CUDA-to-CPU rewrite: for ttrace's own host-side work
    inside a hook (an online rank judging its shards, a recording rank staging its tensors), which
    names no CUDA device. Every torch call under the mode goes through a Python
    ``__torch_function__`` (~2 µs); an online rank judging the scale ladder's 50M rung made 235,000
    of them. Where the rewrite is not installed, or another mode is above it, nothing changes."""
    stack = torch.overrides._get_current_function_mode_stack() if _installed else []
    if not stack or not isinstance(stack[-1], _CudaToCpuMode):
        return contextlib.nullcontext()
    return torch.overrides._pop_mode_temporarily()


def install_megatron_lm() -> None:
    """Apply :data:`MEGATRON_LM_SHIMS` (after :func:`install`), before Megatron-LM's
    ``pretrain_gpt.py`` runs. Each is applied where the name exists in the checkout's release."""
    import importlib

    from megatron.training import initialize

    original = initialize.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    for module_name in ("megatron.training.initialize", "megatron.training.training", "megatron.training"):
        module = importlib.import_module(module_name)  # the callers that bound the name at import
        if getattr(module, "initialize_megatron", None) is original:
            module.initialize_megatron = initialize_megatron
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    for module_name in ("megatron.training.arguments", "megatron.training.utils",
                        "megatron.training.utils.common_utils"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, "get_device_arch_version"):
            module.get_device_arch_version = lambda: 0
    try:
        from megatron.legacy import fused_kernels
    except ImportError:
        return
    fused_kernels.load = lambda args: None
