"""Start the ranks of a run: gloo processes on CPU, one process per GPU on CUDA.

On CPU the workers come from a fork server that imported torch and megatron-core once, which
cuts a rank's start-up from ~5 s to under 1 s on a 2-core machine. Forking the caller itself
would be faster still but is unsafe: once the caller has run torch ops, its OpenMP thread pool
state is inherited and a child can deadlock in its first parallel region (seen here: a rank hung
in a futex after the test process had compared traces). A failing rank stops the whole run and
its traceback is raised in the parent with the rank named.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import tempfile
import time
import traceback
from typing import Optional

import torch
import torch.multiprocessing as mp

from ...errors import BuiltOtherwise, RecipeError, RunFailed
from ...fork_server import forkserver_context
from .runner import Probes, RunSpec, run_rank
from .server import PRELOAD

__all__ = ["RunFailed", "free_port", "launch"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, spec: RunSpec, probes: Probes, error_dir: str) -> None:
    from . import worker_env

    worker_env.quiet_warnings()
    worker_env.whole_lines()
    # where each thread is, on SIGUSR1: what launch reports of a rank that outlived its timeout
    stacks = open(os.path.join(error_dir, f"rank{rank}.stack"), "w")
    # which process a rank is, and whose trace it writes, for whoever watches the run
    stacks.write(f"pid {os.getpid()} trace {getattr(spec.trace, 'dir', '')}\n")
    stacks.flush()
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        if spec.cpu:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        run_rank(rank, spec, probes)
    except RecipeError as e:  # a refusal (megatron's own build-time checks): no traceback
        with open(os.path.join(error_dir, f"rank{rank}.refused"), "w") as f:
            f.write(str(e))
        os._exit(1)
    except BuiltOtherwise as e:  # a valid recipe built as another model: a finding, not an error
        with open(os.path.join(error_dir, f"rank{rank}.built"), "w") as f:
            json.dump(e.problems, f)
        os._exit(1)
    except BaseException as e:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as f:
            f.write(_where(e) + traceback.format_exc())
        os._exit(1)


def rank_ended(role: str, rank: int, exitcode: int, trace_dir: Optional[str]) -> str:
    """A rank that ended with no Python error of its own: its side, rank, exit status or signal,
    and how far its trace got (the last whole iteration its manifest lists, and its last tensor)."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        how = f"was killed by {name}"
        if name == "SIGKILL":
            how += " (the kernel's OOM killer sends SIGKILL too: see dmesg)"
    else:
        how = f"exited with status {exitcode}"
    where = "its trace holds no whole iteration"
    manifest = os.path.join(trace_dir, f"rank-{rank:05d}", "manifest.json") if trace_dir else None
    try:
        with open(manifest) as f:
            records = json.load(f).get("records") or []
        if records:
            last = records[-1]["key"]
            where = (f"its trace reached iteration {last['iteration']} (the last whole one; its last tensor "
                     f"{last['module']} [{last['phase']}] {last['tensor']})")
    except (OSError, TypeError, ValueError, KeyError):
        pass
    return f"--- {role} rank {rank} {how}; {where} ---"


def _stack_tail(error_dir: str, rank: int, role: str, frames: int = 12) -> str:
    """The innermost ``frames`` frames of each thread of a rank that was stopped at its timeout."""
    try:
        with open(os.path.join(error_dir, f"rank{rank}.stack")) as f:
            text = f.read()
    except OSError:
        text = ""
    if text.startswith("pid "):
        text = text.split("\n", 1)[1] if "\n" in text else ""
    if not text.strip():
        return f"--- {role} rank {rank}: no stack (it did not answer SIGUSR1) ---"
    threads = [t for t in text.split("\n\n") if t.strip()]
    shown = ["\n".join(t.splitlines()[:frames + 1]) for t in threads]
    return f"--- {role} rank {rank}, innermost frame first ---\n" + "\n".join(shown)


def _where(error: BaseException) -> str:
    """A first line that says whether a rank failed inside megatron-core or torch (a configuration
    megatron accepts and then cannot run: name its file and line) or in ttrace's own code."""
    frames = traceback.extract_tb(error.__traceback__)
    for f in reversed(frames):
        path = f.filename.replace("\\", "/")
        if path.endswith("/ttrace_megatron/adapter/cpu/cuda_shim.py"):
            continue  # the CPU shim passes every torch call through
        if "/ttrace_megatron/" in path:
            return ""
        if "/megatron/core/" in path:
            return (f"megatron-core fails on this configuration at {path[path.rfind('/megatron/core/') + 1:]}:"
                    f"{f.lineno} ({type(error).__name__}: {error}); not a ttrace error: change the recipe's "
                    f"fields that reach this line\n")
    return ""


def _context(cpu: bool):
    """The ranks' process context: on CPU, forked from a fork server that imported ``PRELOAD`` once
    (a rank starts in well under a second, not the ~5 s of importing torch and megatron-core); on
    GPUs, spawned (CUDA cannot be forked into)."""
    if cpu:
        return forkserver_context(PRELOAD)
    return mp.get_context("spawn")


def run_function(target, args: tuple, timeout_s: float, cpu: bool = False) -> Optional[int]:
    """``target(*args)`` in a process of the ranks' kind (on CPU, ``cpu`` or no GPU here, forked from
    their fork server, its imports done): its exit code, or None when it did not end within
    ``timeout_s`` (then killed). ``ttrace run``'s disk check plans this way, in a process of its own
    that starts in no time. (On a machine with GPUs a ``--cpu`` check spawned it instead: a fresh
    interpreter importing torch and megatron-core.)"""
    p = _context(cpu=cpu or not torch.cuda.is_available()).Process(target=target, args=args, daemon=True)
    p.start()
    p.join(timeout_s)
    if p.is_alive():
        p.kill()
        p.join()
        return None
    return p.exitcode


def launch(spec: RunSpec, timeout_s: Optional[float] = 1800.0, probes: Probes = Probes()) -> None:
    """Run every rank of ``spec`` and wait for all of them (``probes``: what tests and benchmarks
    measure beside the trace)."""
    if spec.megatron:
        from .side import launch_on_tree

        return launch_on_tree(spec, timeout_s, probes)
    spec.cpu = spec.cpu or not torch.cuda.is_available()
    if not spec.cpu and torch.cuda.device_count() < spec.world_size:
        raise RunFailed(f"{spec.world_size} ranks need {spec.world_size} GPUs, {torch.cuda.device_count()} visible")
    spec.master_port = spec.master_port or free_port()
    ctx = _context(spec.cpu)
    with tempfile.TemporaryDirectory(prefix="ttrace-errors-") as error_dir:
        procs = [ctx.Process(target=_worker, args=(r, spec, probes, error_dir), daemon=False) for r in range(spec.world_size)]
        for p in procs:
            p.start()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed = None
        while any(p.is_alive() for p in procs):
            for r, p in enumerate(procs):
                if not p.is_alive() and p.exitcode not in (0, None) and failed is None:
                    failed = r
            if failed is not None or (deadline is not None and time.monotonic() > deadline):
                break
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.is_alive()] if failed is None else []
        stopped = [r for r, p in enumerate(procs) if p.is_alive()]  # ended by this function, not by a fault
        for r in hung:
            os.kill(procs[r].pid, signal.SIGUSR1)
        if hung:
            time.sleep(1.0)  # the dumps are written by each rank's own signal handler
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        refusals = []
        for r in range(len(procs)):
            path = os.path.join(error_dir, f"rank{r}.refused")
            if os.path.exists(path):
                with open(path) as f:
                    refusals.append(f.read())
        if refusals:
            raise RecipeError(refusals[0])
        for r in range(len(procs)):
            path = os.path.join(error_dir, f"rank{r}.built")
            if os.path.exists(path):
                with open(path) as f:
                    raise BuiltOtherwise(json.load(f), side=spec.role, rank=r)
        errors = []
        for r in sorted(range(len(procs)), key=lambda r: r != failed):  # the rank that failed first
            path = os.path.join(error_dir, f"rank{r}.txt")
            if os.path.exists(path):
                with open(path) as f:
                    errors.append(f"--- {spec.role} rank {r} ---\n{f.read()}")
            elif procs[r].exitcode not in (0, None) and r not in stopped:
                errors.append(rank_ended(spec.role, r, procs[r].exitcode, getattr(spec.trace, "dir", None)))
        if errors and stopped:
            errors.append(f"(ranks {', '.join(map(str, stopped))} were stopped by ttrace once rank {failed} had failed)")
        if failed is None and deadline is not None and time.monotonic() > deadline:
            raise RunFailed(f"the {spec.role} run did not finish within {timeout_s:.0f} s; where its ranks were:\n"
                            + "\n".join(_stack_tail(error_dir, r, spec.role) for r in hung))
        if errors:
            raise RunFailed(f"the {spec.role} run failed:\n" + "\n".join(errors))
