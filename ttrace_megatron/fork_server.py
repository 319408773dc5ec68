"""The fork server a check's CPU processes come from: its ranks (``ttrace run``), the disk check's
plan, compare's workers. Importing this module loads nothing but the standard library, so that a
``ttrace`` command can start the server before it imports torch itself: the server's imports
(torch and megatron-core, ~4 s on the development VM) then run beside the command's own.

Knows nothing about megatron: what the server preloads is its callers' list.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import List, Optional

# compare's workers: below this many candidate bytes in microbatch keys, starting processes costs more
# than it saves (``compare_workers``; ``prestart_compare`` counts the candidate's bytes on the disk instead)
MIN_PARALLEL_BYTES = 256 << 20
COMPARE_PRELOAD = ["ttrace_megatron.compare"]  # what compare's workers need, when compare starts the server


def forkserver_context(preload: List[str]):
    """The fork-server context this process's CPU work is forked from (a ``ttrace run``'s ranks, a
    compare's workers), its server started now if it is not running: with ``preload`` imported
    once, and every GPU hidden from it and so from every process forked from it. A CPU rank on a
    machine with GPUs runs through a shim that refuses a process seeing CUDA (``ttrace run --cpu``
    there); a compare worker needs no GPU. This process's own view is left as it was. (Whoever
    starts the server first chooses its preload: the other's imports then happen in each child.)"""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(server_preload(preload))
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    return ctx


EXIT_MODULE = "ttrace_megatron.fork_server_exit"  # first: the server's exit skips the interpreter's teardown
ENTRY_MODULE = "ttrace_megatron.cli"  # what the ``ttrace`` console script imports (setup.py's entry point)


def server_preload(preload: List[str]) -> List[str]:
    """What the fork server imports once: :data:`EXIT_MODULE` (``fork_server_exit``), ``preload``,
    and :data:`ENTRY_MODULE`. Each process forked from the server first runs the parent's
    ``__main__`` again (multiprocessing's spawn preparation; Python 3.11's fork server does not pass
    it the main path to preload), and the ``ttrace`` script's one import, the CLI with rich, took
    each rank, plan and compare worker 0.30-0.41 s on the development VM before its target started,
    against 0.02-0.04 s preloaded. A ``ttrace run`` starts at least three such processes one after
    the other."""
    return [EXIT_MODULE] + [m for m in preload if m not in (EXIT_MODULE, ENTRY_MODULE)] + [ENTRY_MODULE]


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def main_importable() -> bool:
    """A new process re-imports the parent's ``__main__`` from its file: not possible for a script
    read from stdin (or ``-c``); such a caller compares in its own process."""
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return path is None or getattr(main, "__spec__", None) is not None or os.path.exists(path)


def prestart_compare(candidate_dir: str, workers: Optional[int]) -> bool:
    """Start the server ``ttrace compare`` will fork its workers from now, before the command
    imports torch, where it will want them: more than one worker, a candidate of at least
    :data:`MIN_PARALLEL_BYTES` on the disk (an online candidate's verdict sums are far less) and
    a ``__main__`` a worker can import. Started once compare had imported torch, the server's own
    imports were still running when the pool's first worker was due: on a 16-core Xeon host the
    first began 4 s into a compare of 8 s (BENCHMARKS.md, issue #35). True where it started it."""
    if (workers or available_cores()) <= 1 or not main_importable():
        return False
    # the bytes on the disk, as plan.measured_bytes counts them, without importing plan (torch)
    total = 0
    for parent, _, names in os.walk(candidate_dir):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(parent, name))
            except OSError:  # gone meanwhile
                pass
    if total < MIN_PARALLEL_BYTES:
        return False
    forkserver_context(COMPARE_PRELOAD)
    return True


__all__ = ["COMPARE_PRELOAD", "ENTRY_MODULE", "EXIT_MODULE", "MIN_PARALLEL_BYTES", "available_cores",
           "forkserver_context", "main_importable", "prestart_compare", "server_preload"]
