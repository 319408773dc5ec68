"""The ranks' fork server: what it imports once, and starting it before ``ttrace run`` imports torch.

On CPU every rank of a check, and the disk check's plan, is forked from one server
(``fork_server.forkserver_context``) that has imported torch and megatron-core once: a rank starts
in hundredths of a second, not the ~5 s of those imports. The server's own imports still take
~4 s; started as ``ttrace run`` begins, they run beside the command's (validating a recipe imports
megatron-core too). Started after the command had imported torch to ask whether it has a GPU, the
demo's first rank began 1.3 s later on the development VM. Importing this module loads no torch.
"""

from __future__ import annotations

import glob
import os

from ...fork_server import forkserver_context

# what the server imports once; the layer specs and the run's plan are what a rank or the disk check's
# plan imported after its fork (0.1 s of the plan's 0.16 s in its process, on the development VM)
PRELOAD = ["ttrace_megatron.adapter.run.worker_env", "torch", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.distributed", "megatron.core.pipeline_parallel", "megatron.core.models.gpt.gpt_layer_specs",
           "ttrace_megatron.adapter.run.runner", "ttrace_megatron.adapter.record.recorder",
           "ttrace_megatron.adapter.run.plan"]

GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd")  # NVIDIA's GPUs, AMD's compute driver


def gpu_device_visible() -> bool:
    """Whether this process may see a GPU, asked without torch: a device node is there and
    CUDA_VISIBLE_DEVICES does not hide every one. Only where it is not does :func:`prestart_early`
    start the server; the ranks' context is still chosen by torch (``launch._context``)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(glob.glob(pattern) for pattern in GPU_DEVICE_NODES)


def prestart(cpu: bool) -> None:
    """On CPU, start the ranks' fork server now (no-op where it runs already): its imports run
    while the calling process does its own work, instead of before the first rank."""
    if cpu:
        forkserver_context(PRELOAD)


def prestart_early(cpu: bool) -> bool:
    """:func:`prestart` before this process imports torch, where the run will be on CPU: ``cpu``
    (``--cpu``) or no GPU device here. True where it started (or found) the server."""
    if cpu or not gpu_device_visible():
        prestart(True)
        return True
    return False


__all__ = ["PRELOAD", "gpu_device_visible", "prestart", "prestart_early"]
