"""Offline compare on several processes, with the serial verdict bit for bit.

A comparison walks the keys in the reference's order, and some verdicts depend on earlier ones
(:class:`~ttrace_megatron.step_bounds.StepBounds` learns from main grads, the clip coefficient and
the previous iteration's moments; :class:`~ttrace_megatron.compare.Cancellation` from each
microbatch's partial weight grads). What a key of one microbatch (forward, backward, a
microbatch's weight grad, the loss) is judged by depends on nothing judged before it: those keys,
most of a trace's bytes, are judged by a pool of worker processes. So are the main grads'
measurements (their shard sums, the reference's norm, a bias's token terms), whose verdict the
parent then decides in order from its own state. The parent walks the keys in order as the serial
comparison does: it takes each microbatch key's verdict from the pool (or judges the key), in
order, and tells its own :class:`Cancellation` the partial-sum magnitude the worker measured (the
sums then add up in the serial order). It judges the optimizer's scalars itself; the step's
optimizer states and updated values (with their element-wise Adam check) go to the pool with the
rest: the worker decides whether a state is re-clipped from its iteration's clip coefficients, as
the serial comparison does (:func:`reclipped_here`), and the verdicts are decided in order from
the parent's state, as a main grad's. No iteration waits for the parent to reach it: on 16 cores,
sending each iteration's step when the parent got there left most workers idle behind its largest
parameter's Adam check, three times (BENCHMARKS.md, issue #35). While the pool's processes start,
the parent judges the first chunks of keys itself (:func:`_shared_with_pool`). Every float a
verdict holds is computed by the same code on the same inputs in either mode.

Before any tensor is loaded, every data file's checksum is checked once, on threads (hashing and
reads release the GIL), and the workers are told which files are verified. A damaged file is the
same named :class:`~ttrace_megatron.errors.TraceError` as in a serial comparison.

Memory: each worker judges one key at a time, as the serial comparison does, and reads it a chunk
at a time where it can (``streaming``): the bound is per worker, and the parent's own while it
judges its share (BENCHMARKS.md, issue #35).
Knows nothing about megatron.
"""

from __future__ import annotations

import math
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterator, List, Optional, Set, Tuple

import torch

from . import keys
from .allocator import keep_freed_memory
from .fork_server import COMPARE_PRELOAD, MIN_PARALLEL_BYTES, available_cores, forkserver_context, main_importable
from .keys import TensorKey, TensorKind
from .trace_store import verify_files

# the judge and its verdicts are compare's (``_TraceJudge``, ``TensorResult``): compare imports this
# module, not the other way round; a worker is handed compare's ``open_judge`` to build its own

Dirs = Tuple[str, str, Optional[str]]  # reference, candidate, perturbation run (or None)

_JUDGE = None  # a worker process's own judge (compare._TraceJudge)


def per_microbatch(key: TensorKey) -> bool:
    """Judged by what it is alone: no verdict of an earlier key enters its bound."""
    return key.microbatch >= 0


def measured_in_pool(key: TensorKey) -> bool:
    """A key whose tensors a worker reads and measures: a microbatch's, judged there whole, or a main
    grad, whose measurements the parent turns into a verdict in order (its cancellation factor
    depends on the microbatches before it; its verdict feeds the step's bounds)."""
    return per_microbatch(key) or key.kind is TensorKind.MAIN_GRAD


def of_the_step(key: TensorKey) -> bool:
    """An optimizer state or an updated value: measured by a worker, which decides itself whether
    its states are re-clipped (:func:`reclipped_here`), and decided by the parent in order."""
    return key.kind is TensorKind.OPTIMIZER_STATE or keys.is_updated_value(key)


def _candidate_bytes(judge, keys: List[TensorKey]) -> int:
    total = 0
    for key in keys:
        for _, rec in judge.cand_groups[key]:
            itemsize = getattr(torch, rec.dtype, torch.float32).itemsize  # record dtypes are torch's names
            total += itemsize * math.prod(int(s) for s in rec.shape)  # (a damaged manifest's may not fit int64)
    return total


def judged_in_order(judge, dirs: Dirs, workers: int, open_judge: Callable, peaks: Optional[list] = None) -> Iterator:
    """Each of ``judge.common``'s verdicts, in order (``open_judge``: how a worker builds its own judge).
    ``peaks`` gets, for each key a worker measured, that worker's high-water mark so far over its
    memory once its judge was open (:func:`_high_water`; None where it cannot be read)."""
    peaks = [] if peaks is None else peaks
    readers = [r for r in (judge.ref, judge.cand, judge.pert) if r is not None]
    parallel = [k for k in judge.common if measured_in_pool(k)]
    small = not parallel or _candidate_bytes(judge, parallel) < MIN_PARALLEL_BYTES
    pooled = workers > 1 and not small and main_importable()
    # the fork server's imports (~1 s: torch) run while the files are verified
    ctx = forkserver_context(COMPARE_PRELOAD) if pooled else None
    verified = verify_files(readers, threads=max(1, workers))
    if not pooled:
        for key in judge.common:
            yield judge.tensor(key)
        return
    chunks = _chunks(judge, workers)
    claims = ctx.Array("b", len(chunks))  # who judges each chunk: FREE, WORKER or PARENT
    started = ctx.Value("b", 0)  # set by the first worker to start
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker,
                               initargs=(open_judge, dirs, judge.tol_config, verified, claims, started))
    try:
        yield from _shared_with_pool(judge, pool, chunks, claims, started, peaks)
    finally:
        # what no worker has started is the parent's now (the workers skip it): no future is
        # cancelled, which a pool that breaks meanwhile would not survive (:func:`claimed`)
        with claims.get_lock():
            for i in range(len(chunks)):
                claims[i] = claims[i] or PARENT
        pool.shutdown(wait=True)


FREE, WORKER, PARENT = 0, 1, 2  # a chunk's claim: nobody's yet, a worker's, the parent's


def _chunks(judge, workers: int) -> List[List[TensorKey]]:
    """The keys a worker measures, in order, in chunks: small, since the parent's last one runs
    beside the workers and a pool's last one alone."""
    sent = [k for k in judge.common if measured_in_pool(k) or of_the_step(k)]
    size = max(1, min(16, len(sent) // (8 * workers)))
    return [sent[i:i + size] for i in range(0, len(sent), size)]


def claimed(claims, i: int, who: int) -> bool:
    """Whether ``who`` (:data:`WORKER` or :data:`PARENT`) now holds chunk ``i``: the first to ask
    does, once. A shared array, not ``Future.cancel``: on Python 3.10-3.11 a pool that breaks with
    cancelled futures pending loses its manager thread, and the interpreter can hang at exit."""
    with claims.get_lock():
        if claims[i] != FREE:
            return False
        claims[i] = who
        return True


def _shared_with_pool(judge, pool: ProcessPoolExecutor, chunks: List[List[TensorKey]], claims, started,
                      peaks: list) -> Iterator:
    """The verdicts in order, the keys a worker measures shared between the pool and this process.

    The chunks go to the pool the last first. Until a worker has started (``started``), this process
    walks them from the first and judges itself each chunk no worker has claimed (:func:`claimed`;
    a worker skips it then): it judges while it waits for the pool's processes (the fork server's
    imports took 4 s on a 16-core host), and not beside them (on 2 cores, judging on until a worker
    had measured a chunk cost 0.35 s more than it saved). Each key is judged once, by the same code
    either way: the verdicts are the serial ones. The step's keys go with the rest: a worker
    decides their re-clip itself (:func:`reclipped_here`)."""
    where = {key: (i, j) for i, chunk in enumerate(chunks) for j, key in enumerate(chunk)}
    futures, broken = {}, False
    try:
        for i in reversed(range(len(chunks))):
            futures[i] = pool.submit(_in_worker, i, chunks[i])
    except BrokenProcessPool as e:
        broken = _stopped(e)
    taken = {}  # chunk -> its measurements from the pool, or None: judged here
    for key in judge.common:
        if key not in where:
            yield judge.tensor(key)
            continue
        i, j = where[key]
        if i not in taken and not broken:
            try:
                mine = not started.value and claimed(claims, i, PARENT)
                taken[i] = None if mine else futures[i].result()
            except BrokenProcessPool as e:
                broken = _stopped(e)
            futures.pop(i, None)
        measured = taken.get(i)
        if j == len(chunks[i]) - 1:
            taken.pop(i, None)
        if measured is None:
            yield judge.tensor(key)  # which tells its own Cancellation and StepBounds
            continue
        out, peak = measured[j]
        peaks.append(peak)
        yield _decided(judge, key, out)


def _stopped(e: BrokenProcessPool) -> bool:
    # a worker could not start (a __main__ a new process cannot import, such as a script read from
    # stdin) or died: the keys not yet measured are judged in this process, alike
    print(f"[ttrace] compare workers stopped ({e}); judging the rest in this process", flush=True)
    return True


def reclipped_here(worker, key: TensorKey, common: Set[TensorKey], clips: Set[TensorKey]) -> bool:
    """Whether the step's ``key`` is judged against a re-clipped reference, decided on ``worker``'s own
    judge as the serial comparison decides it (``StepBounds.reclipped``): by whether its iteration's
    clip coefficients differ, which is what judging that scalar there first (once, noted in
    ``clips``) tells it. It reads the two traces' coefficients alone, no earlier verdict, so a pool
    worker or a rank needs not wait for the parent to reach the step: no iteration is a barrier."""
    clip = TensorKey(key.iteration, -1, keys.OPTIMIZER_MODULE, keys.OPTIMIZER, keys.CLIP_COEFFICIENT)
    if clip in common and clip not in clips and worker.order[clip] < worker.order[key]:
        worker.tensor(clip)
        clips.add(clip)
    return worker.step_bounds.reclipped(key)


def _start_worker(open_judge: Callable, dirs: Dirs, tol_config, verified: Set[Tuple[str, int, int]],
                  claims, started) -> None:
    global _JUDGE, _BASELINE, _COMMON, _CLAIMS
    started.value = 1  # the parent stops taking chunks for itself
    torch.set_num_threads(1)  # the pool is the parallelism
    keep_freed_memory()
    _JUDGE = open_judge(*dirs, tol_config)
    _COMMON, _CLAIMS = set(_JUDGE.common), claims
    for reader in (_JUDGE.ref, _JUDGE.cand, _JUDGE.pert):
        if reader is not None:
            reader.verified |= verified
    _BASELINE = _reset_high_water()


_BASELINE: Optional[int] = None  # a worker's resident bytes once its judge is open (its high-water mark reset there)


def _status_bytes(field: str) -> Optional[int]:
    """A field of /proc/self/status in bytes (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), None)
    except (OSError, ValueError, IndexError):
        return None


def _reset_high_water() -> Optional[int]:
    """This process's resident bytes now, its high-water mark reset to them (Linux's clear_refs), or
    None where that cannot be done. A worker is the fork server's child: it starts with whatever the
    server holds, which is not the judging's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")


def _high_water() -> Optional[int]:
    """The most this worker has held over its baseline since its judge was opened (None: unknown)."""
    top = _status_bytes("VmHWM") if _BASELINE is not None else None
    return None if top is None else top - _BASELINE


_COMMON: Set[TensorKey] = set()  # a worker's judge's common keys
_CLIPS: Set[TensorKey] = set()  # the clip coefficients a worker has judged (reclipped_here)
_CLAIMS = None  # the pool's claims on its chunks (claimed)


def _in_worker(i: int, chunk: List[TensorKey]) -> Optional[list]:
    """Chunk ``i``'s measurements, each with this worker's high-water mark after it; None where the
    parent claimed the chunk first."""
    if not claimed(_CLAIMS, i, WORKER):
        return None
    out = []
    for key in chunk:
        reclipped = reclipped_here(_JUDGE, key, _COMMON, _CLIPS) if of_the_step(key) else None
        out.append((_measure(_JUDGE, key, reclipped), _high_water()))
    return out


def _measure(judge, key: TensorKey, reclipped: Optional[bool] = None):
    """What a worker (a process of the pool, or a rank) sends for a key: a microbatch key's verdict
    and its partial-sum magnitude, a main grad's or the step's key's :class:`compare.Measured`
    (None: the key is judged whole by whoever decides it)."""
    if of_the_step(key):
        return judge.step_measured(key, reclipped)
    if not per_microbatch(key):
        measured = judge.main_grad_measured(key)
        judge.partial_magnitudes.pop(key, None)
        return measured
    result = judge.tensor(key)
    return result, judge.partial_magnitudes.pop(key, None)


def _decided(judge, key: TensorKey, out):
    """A measured key's verdict, decided in order from ``judge``'s state (None: judged here whole)."""
    if out is None:
        return judge.tensor(key)
    if per_microbatch(key):
        result, magnitude = out
        if magnitude is not None:
            judge.cancellations.note_partial(key, magnitude)
        return result
    return judge.decided(key, out)


def judged_across_ranks(judge, dirs: Dirs, open_judge: Callable) -> Iterator:
    """Each of ``judge.common``'s verdicts in order, on rank 0 of torch.distributed's default group
    (``torchrun ... ttrace compare --distributed``, over several machines where a trace is larger than
    one): every rank measures every world-size-th measured key (microbatch keys, main grads, the
    step's keys) on a judge of its own, as a pool worker does, deciding a step's re-clip as the
    serial comparison would (its iteration's clip coefficient judged first there); rank 0 gathers
    the measurements (sums and verdicts, not tensors) and decides every verdict in order. The
    verdict is the serial one, bit for bit. Other ranks yield nothing."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    worker = open_judge(*dirs, judge.tol_config)  # its state is its own, as a pool worker's
    common, clips, mine = set(judge.common), set(), {}
    for key in [k for k in judge.common if measured_in_pool(k) or of_the_step(k)][rank::world]:
        mine[key] = _measure(worker, key, reclipped_here(worker, key, common, clips) if of_the_step(key) else None)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return
    measured = {k: v for part in gathered for k, v in part.items()}
    for key in judge.common:
        yield _decided(judge, key, measured[key]) if key in measured else judge.tensor(key)
