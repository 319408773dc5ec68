"""Start the ranks of a run: gloo processes on CPU, one process per GPU on CUDA.

On CPU the workers come from a fork server that imported torch and megatron-core once, which
cuts a rank's start-up from ~5 s to under 1 s on a 2-core machine. Forking the caller itself
would be faster still but is unsafe: once the caller has run torch ops, its OpenMP thread pool
state is inherited and a child can deadlock in its first parallel region (seen here: a rank hung
in a futex after the test process had compared traces). A failing rank stops the whole run and
its traceback is raised in the parent with the rank named.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import tempfile
import time
import traceback
from typing import Dict, List, Optional

import torch
import torch.multiprocessing as mp

from ...errors import BuiltOtherwise, RecipeError, RunFailed
from ...fork_server import forkserver_context
from .runner import Probes, RunSpec, run_rank
from .server import PRELOAD

__all__ = ["RunFailed", "free_port", "launch", "launch_beside"]


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
    from ...trace_store import last_listed_key  # (torch: the CLI imports this module before it starts its server)

    where = "its trace holds no whole iteration"
    try:
        last = last_listed_key(os.path.join(trace_dir, f"rank-{rank:05d}")) if trace_dir else None
        if last is not None:
            where = (f"its trace reached iteration {last.iteration} (the last whole one; its last tensor "
                     f"{last.module} [{last.phase}] {last.tensor})")
    except Exception:  # (best effort: a report of a failure does not fail on a damaged trace)
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


LAUNCH_TIMEOUT_S = 1800.0  # a run's limit, its ranks' stacks dumped and stopped past it


def launch(spec: RunSpec, timeout_s: Optional[float] = LAUNCH_TIMEOUT_S, probes: Probes = Probes()) -> None:
    """Run every rank of ``spec`` and wait for all of them (``probes``: what tests and benchmarks
    measure beside the trace)."""
    if spec.megatron:
        from .side import launch_on_tree

        return launch_on_tree(spec, timeout_s, probes)
    _prepare(spec)
    with tempfile.TemporaryDirectory(prefix="ttrace-errors-") as error_dir:
        _wait([_Ranks(spec, probes, error_dir)], timeout_s)


def launch_beside(first: RunSpec, *readers: RunSpec, timeout_s: Optional[float] = None,
                  probes: Probes = Probes()) -> Dict[str, float]:
    """A reference written one iteration at a time (``first``: ``trace_store.Turns``) and the runs
    that read it as it comes (``readers``: its candidate, and a perturbation run where the check
    has one; each one's ``await_reference`` names the reference's trace), taking turns: their ranks
    start once the reference holds its first iteration whole, then judge each iteration as the
    reference lets them have it, while it waits for them all to let it go. A rank that fails on any
    side stops every side; the error is that side's. Returns the seconds from the start to each
    side's end, by side (``RunSpec.side``). (CPU ranks only: on GPUs a reader's rank 0 would run on
    the device the reference trains on.)

    The readers' start-up never runs beside the reference's training: started with it, the
    candidate's took the cores from that training and cost the check 0.3-1.8 s at the 50M rung on
    the 2-core development VM (BENCHMARKS.md, issue #35), and its processes' start alone ~0.3 s of
    a toy check. (Afterwards the sides overlap only where the reference records its next
    iteration's kept tensors while its readers judge the one before.)

    ``timeout_s``: for all of them together; by default :func:`launch`'s for each run, added up
    (the runs it would make one after the other held whole)."""
    specs = (first,) + readers
    if timeout_s is None:
        timeout_s = LAUNCH_TIMEOUT_S * len(specs)
    for spec in specs:
        if spec.megatron:
            raise ValueError("launch_beside runs the installed megatron-core's ranks only")
        _prepare(spec)
    if not all(spec.cpu for spec in specs):
        raise ValueError("launch_beside runs CPU ranks only")
    from ...errors import TraceError
    from ...trace_store import wait_for_iteration

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with contextlib.ExitStack() as stack:
        error_dirs = [stack.enter_context(tempfile.TemporaryDirectory(prefix="ttrace-errors-")) for _ in specs]
        sides = [_Ranks(first, probes, error_dirs[0])]
        reference = sides[0]

        def gone() -> bool:  # the reference ended (or failed) before its first iteration was whole
            return not reference.poll() or reference.failed is not None or (
                deadline is not None and time.monotonic() > deadline)
        try:
            whole = wait_for_iteration(first.trace.dir, 1, give_up=gone)
        except TraceError as e:  # its trace stopped being recorded: the readers would wait forever
            reference.stop(dump=False)
            raise RunFailed(f"the {first.side} run's trace cannot be streamed: {e}") from None
        if whole:
            taken = {first.master_port}
            for spec, error_dir in zip(readers, error_dirs[1:]):
                # its rendezvous port taken now, not at the start: a port free then may since have
                # become one end of the reference's own connections
                spec.master_port = free_port()
                while spec.master_port in taken:
                    spec.master_port = free_port()
                taken.add(spec.master_port)
                sides.append(_Ranks(spec, probes, error_dir))
        _wait(sides, None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not whole:  # (a reference that ended well has its trace whole: never here)
            raise RunFailed(f"the {first.side} run ended before its first iteration was whole")
        return {side.spec.side: side.ended - reference.started for side in sides}


def cpu_ranks(cpu: bool) -> bool:
    """Whether a run's ranks are CPU processes: asked for (``--cpu``), or no GPU here."""
    return cpu or not torch.cuda.is_available()


def _prepare(spec: RunSpec) -> None:
    spec.cpu = cpu_ranks(spec.cpu)
    if not spec.cpu and torch.cuda.device_count() < spec.world_size:
        raise RunFailed(f"{spec.world_size} ranks need {spec.world_size} GPUs, {torch.cuda.device_count()} visible")
    spec.master_port = spec.master_port or free_port()


class _Ranks:
    """One side's rank processes, started; :func:`_wait` polls them and raises what they left."""

    def __init__(self, spec: RunSpec, probes: Probes, error_dir: str):
        self.spec, self.error_dir = spec, error_dir
        ctx = _context(spec.cpu)
        self.started = time.monotonic()
        self.ended: Optional[float] = None
        self.procs = [ctx.Process(target=_worker, args=(r, spec, probes, error_dir), daemon=False)
                      for r in range(spec.world_size)]
        for p in self.procs:
            p.start()
        self.failed: Optional[int] = None  # the first rank seen to exit with an error
        self.stopped: List[int] = []  # ranks this launcher ended, not a fault of their own

    def poll(self) -> bool:
        """Whether a rank is still running (noting the first that failed, and when the side ended)."""
        alive = False
        for r, p in enumerate(self.procs):
            if p.is_alive():
                alive = True
            elif p.exitcode not in (0, None) and self.failed is None:
                self.failed = r
        if not alive and self.ended is None:
            self.ended = time.monotonic()
        return alive

    def stop(self, dump: bool) -> List[int]:
        """End every rank still running (``dump``: their stacks first, through SIGUSR1); the hung ones."""
        hung = [r for r, p in enumerate(self.procs) if p.is_alive()] if dump else []
        self.stopped = [r for r, p in enumerate(self.procs) if p.is_alive()]
        for r in hung:
            os.kill(self.procs[r].pid, signal.SIGUSR1)
        if hung:
            time.sleep(1.0)  # the dumps are written by each rank's own signal handler
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()
        if self.ended is None:
            self.ended = time.monotonic()
        return hung

    def raise_outcome(self, hung: List[int], timeout_s: Optional[float], timed_out: bool, beside: str = "") -> None:
        """The side's refusal, finding or failure as launch raises it; nothing where every rank ended well."""
        spec, procs, error_dir = self.spec, self.procs, self.error_dir
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
        for r in sorted(range(len(procs)), key=lambda r: r != self.failed):  # the rank that failed first
            path = os.path.join(error_dir, f"rank{r}.txt")
            if os.path.exists(path):
                with open(path) as f:
                    errors.append(f"--- {spec.side} rank {r} ---\n{f.read()}")
            elif procs[r].exitcode not in (0, None) and r not in self.stopped:
                errors.append(rank_ended(spec.side, r, procs[r].exitcode, getattr(spec.trace, "dir", None)))
        if errors and self.stopped:
            errors.append(f"(ranks {', '.join(map(str, self.stopped))} were stopped by ttrace once rank {self.failed} "
                          f"had failed)")
        if errors and beside:
            errors.append(beside)
        if timed_out and hung:
            raise RunFailed(f"the {spec.side} run did not finish within {timeout_s:.0f} s; where its ranks were:\n"
                            + "\n".join(_stack_tail(error_dir, r, spec.side) for r in hung))
        if errors:
            raise RunFailed(f"the {spec.side} run failed:\n" + "\n".join(errors))


def _wait(sides: List[_Ranks], timeout_s: Optional[float]) -> None:
    """Until every side's ranks ended; a rank that fails stops every side (its error is raised), and
    so does the deadline (where each side's hung ranks were is raised)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        running = [side.poll() for side in sides]
        failing = next((side for side in sides if side.failed is not None), None)
        timed_out = deadline is not None and time.monotonic() > deadline
        if failing is not None or timed_out or not any(running):
            break
        time.sleep(0.05)
    hung = {id(side): side.stop(dump=failing is None and timed_out) for side in sides}
    if failing is not None:
        others = [s.spec.side for s in sides if s is not failing and s.stopped]
        failing.raise_outcome([], timeout_s, False, beside=f"(the {' and '.join(others)} run"
                              f"{'s' if len(others) > 1 else ''}, started beside it, "
                              f"{'were' if len(others) > 1 else 'was'} stopped)" if others else "")
    for side in sides:
        side.raise_outcome(hung[id(side)], timeout_s, timed_out)
