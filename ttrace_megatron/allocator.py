"""Host memory a comparing process frees is kept for its next chunk, not handed back to the kernel.

Why. Compare reads and computes a chunk at a time (``streaming``): tensors of 1-2 MiB allocated and
freed tens of thousands of times per gigabyte judged. glibc's malloc serves an allocation above its
mmap threshold with fresh pages, and hands freed memory at the top of its heap back to the kernel
once more than its trim threshold is free there. Both thresholds move with the sizes it has seen
(128 KiB at the start), so a chunk's memory is often fresh: a page fault per 4 KiB, each page zeroed
by the kernel first, and slower still when the page cache fills memory and the kernel must reclaim
before it gives a page. Measured on the 50M rung's traces (8.1 GB, one thread, the traces in the
page cache): compare took 8.7-13.1 s, 3-7 s of it in the kernel, against 6.5-6.9 s with 1.5 s in the
kernel once freed memory was kept. It is the advice PyTorch's CPU performance guide gives with
another allocator (jemalloc, tcmalloc): reuse what was freed.

How. ``mallopt``: allocations up to :data:`MMAP_THRESHOLD` come from the heap, and up to
:data:`TRIM_THRESHOLD` of free memory at its top stays with the process. The bound: a process keeps
at most that much it is not using. Called by the processes that judge: compare's and its workers',
and an online candidate rank's (``online.OnlineComparer``), which judges a chunk at a time while it
trains. There it made a rank fault in 0.73 M pages instead of 1.1 M and cut its time by ~0.9 s of
12 (the 50M rung, profiled; training alone faults in 0.44 M). The training in that process is
served by the same settings: its numerics are untouched (where the bytes live, not what they
hold), and the ranks of a plain run, or a reference, never call it. Elsewhere than glibc it does
nothing.

Knows nothing about megatron.
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's own largest dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
TRIM_THRESHOLD = 256 << 20

_kept = False


def keep_freed_memory() -> bool:
    """Set this process's malloc to keep what it frees (see the module's docstring). True where it
    did (or had already), False where this is not glibc or ``mallopt`` refused."""
    global _kept
    if _kept:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept


__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]
