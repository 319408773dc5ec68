"""What a check will write, before it writes it: ``ttrace plan`` and ``ttrace run``'s disk check.

The adapter describes each side of a check as groups of recorded tensors: the logical elements of
one record, its bytes per element, how many records an iteration writes, and its placements over
the mesh axes. This module turns that into bytes with the placement vocabulary
(:func:`placement.stored_copies`): a Shard splits a tensor's elements over its axis, a Replicate or
Partial stores them on every rank of it. Nothing here knows megatron.

Why a prediction rather than a probe run: a user checking a layout of a wide model on GPUs wants
to know whether the traces fit, and for how many iterations, before a GPU is held. The prediction
ignores padding of uneven shards and the few scalars per iteration (grad norm, lr); the
per-microbatch routing of MoE tokens is taken as even over the experts (the total is exact: every
token goes to ``topk`` experts). ``benchmarks/plan_check.py`` measures it against real traces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .placement import Placement, stored_copies

# tensor kinds, as the plan's table lists them
ACTIVATIONS = "activations and their grads"
WEIGHT_GRADS = "per-microbatch weight grads"
MAIN_GRADS = "main grads"
OPTIMIZER = "optimizer (params, moments)"
LOSS = "loss and masks"
ROUTING = "routing"
KINDS = (ACTIVATIONS, WEIGHT_GRADS, MAIN_GRADS, OPTIMIZER, LOSS, ROUTING)
COLUMN = {ACTIVATIONS: "activations", WEIGHT_GRADS: "wgrad/mb", MAIN_GRADS: "main grads", OPTIMIZER: "optimizer",
          LOSS: "loss", ROUTING: "routing"}  # the plan table's column headers

# each record's entry in its iteration file's safetensors header and in its rank's record log (its
# key, layout and checksum): 700-1100 bytes measured on the shipped recipes; it matters at toy sizes only
HEADER_BYTES_PER_RECORD = 900
# a side judged online (the default check's candidate and perturbation run) writes one verdict-sums
# entry per record and rank (``online.json``, compact JSON), no tensor: 366-379 bytes measured (moe_tp2_sp_ep2)
ONLINE_BYTES_PER_RECORD = 370
SEED_CHECKPOINT = "seed checkpoint"


@dataclasses.dataclass(frozen=True)
class TensorGroup:
    """Records of one shape, written ``records`` times an iteration (microbatches × modules)."""

    kind: str
    elements: int  # of one logical record
    itemsize: int
    records: int
    placements: Tuple[Placement, ...] = ()
    # a reference streamed one iteration at a time (``--reference-in stream``) writes the next
    # iteration's records of this group over this one's: a matrix's per-microbatch grads, optimizer
    # states and updated value (``online.overwritable``, the rule its writer follows)
    overwritable: bool = False

    def bytes(self, sizes: Mapping[str, int]) -> int:
        """Bytes over every rank of the side, one iteration."""
        return self.elements * self.itemsize * self.records * stored_copies(self.placements, sizes)

    def record_count(self, sizes: Mapping[str, int]) -> int:
        """Records over every rank: a sharded record is one file entry on each rank too."""
        return self.records * math.prod(sizes.get(p.axis, 1) for p in self.placements)


@dataclasses.dataclass
class SidePlan:
    """One trace directory: the reference, the candidate, the perturbation run, a twin's sides."""

    name: str
    ranks: int
    sizes: Dict[str, int]  # mesh axis -> size, for the placements
    iterations: int
    groups: List[TensorGroup]
    online: bool = False  # judged against the reference as it runs: verdict sums, no tensors
    judged: bool = True  # judged against a reference (False: a reference)

    def bytes_per_iteration(self) -> Dict[str, int]:
        out = {k: 0 for k in KINDS}
        for g in self.groups:
            out[g.kind] += (ONLINE_BYTES_PER_RECORD * g.record_count(self.sizes) if self.online else
                            g.bytes(self.sizes) + HEADER_BYTES_PER_RECORD * g.record_count(self.sizes))
        return out

    def total(self) -> int:
        return sum(self.bytes_per_iteration().values()) * self.iterations

    def streamed_peak(self) -> int:
        """The most this side holds written one iteration at a time (``--reference-in stream``): what
        it keeps of every iteration, and one iteration of its overwritable records, which each next
        iteration writes over. (Each record's entry in the header and manifest is counted kept: the
        manifest keeps every record listed.)"""
        if self.online:
            return self.total()
        again = sum(g.bytes(self.sizes) for g in self.groups if g.overwritable)
        return self.total() - max(self.iterations - 1, 0) * again


# compare's peak over its baseline where tensors are small: 70-77 MiB measured on a toy trace whose
# largest tensor is 8 MiB (the records of both traces, the results, the allocator's heap); with
# tensors of 64 MiB (the 50M rung) 23-50 MiB, 0.35-0.78× the largest (BENCHMARKS.md, issue #35)
COMPARE_FIXED_BYTES = 80 * 10 ** 6


@dataclasses.dataclass
class Plan:
    recipe: str
    sides: List[SidePlan]
    seed_checkpoint_bytes: int
    peak_sides: Tuple[Tuple[str, ...], ...]  # the sides on disk together at the peak, e.g. the pair, then a twin
    notes: List[str] = dataclasses.field(default_factory=list)
    # sides written to memory (:data:`MEMORY_ROOT`), not the disk: each pair's reference where it fits
    # (``--reference-in``); each is removed once its pair is judged, so they are not held together
    # (but for the moments a pair's is freed in the background while its twin's reference starts)
    in_memory: Tuple[str, ...] = ()
    # of those, the ones streamed to their candidate one iteration at a time (``--reference-in stream``)
    streamed: Tuple[str, ...] = ()

    def side(self, name: str) -> SidePlan:
        return next(s for s in self.sides if s.name == name)

    def disk_needed(self) -> int:
        """The peak: the largest set of sides on disk together, and the seed checkpoint."""
        return self.seed_checkpoint_bytes + max(sum(self.side(n).total() for n in names if n not in self.in_memory)
                                                for names in self.peak_sides)

    def memory_needed(self) -> int:
        """The most the sides written to memory hold at once: the largest of them (one at a time), a
        streamed one at its peak."""
        return max((self.held(n) for n in self.in_memory), default=0)

    def held(self, name: str) -> int:
        """The most side ``name`` holds at once: all it writes, or streamed its peak."""
        side = self.side(name)
        return side.streamed_peak() if name in self.streamed else side.total()

    def memory_written(self) -> int:
        """What the check writes to memory in all: each side held there (a pair's reference, and a
        twin's), written one after the other."""
        return sum(self.side(n).total() for n in self.in_memory)

    def all_bytes(self) -> int:
        """What the check leaves on the disk with every side kept (``--out``): the sides in memory are not."""
        return self.seed_checkpoint_bytes + sum(s.total() for s in self.sides if s.name not in self.in_memory)

    def largest_tensor(self) -> int:
        """The largest logical tensor any side records (bytes): what bounds compare's peak."""
        return max((g.elements * g.itemsize for s in self.sides for g in s.groups), default=0)

    def host_memory(self) -> Dict[str, int]:
        """What the check takes of the host's memory beside the training itself: the reference held
        in memory; each recording rank's staging buffers (``stream_writer``, whatever the trace's
        size); compare's peak a process, twice the largest tensor or its fixed part, whichever is
        larger (:data:`COMPARE_FIXED_BYTES`)."""
        from .stream_writer import STAGING_BUFFERS, STAGING_BYTES

        return {"reference_in_memory": self.memory_needed(), "staging_per_rank": STAGING_BUFFERS * STAGING_BYTES,
                "compare_per_process": max(2 * self.largest_tensor(), COMPARE_FIXED_BYTES)}

    def to_json(self) -> dict:
        return {"recipe": self.recipe, "disk_needed": self.disk_needed(), "all_bytes": self.all_bytes(),
                "in_memory": list(self.in_memory), "streamed": list(self.streamed),
                "memory_needed": self.memory_needed(),
                "memory_written": self.memory_written(),
                "host_memory": self.host_memory(),
                "seed_checkpoint_bytes": self.seed_checkpoint_bytes, "notes": self.notes,
                "sides": [{"name": s.name, "ranks": s.ranks, "iterations": s.iterations, "online": s.online,
                           "total": s.total(), "streamed_peak": s.streamed_peak(),
                           "per_iteration": s.bytes_per_iteration(),
                           "per_rank_per_iteration": sum(s.bytes_per_iteration().values()) // s.ranks}
                          for s in self.sides]}


def human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def parse_bytes(text: str) -> int:
    """``200GB``, ``1.5TB``, ``500MB`` or a plain number of bytes (decimal units, as ``df -H``)."""
    t = text.strip().upper().replace(" ", "").removesuffix("B")
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
    try:
        if t and t[-1] in scale:
            return int(float(t[:-1]) * scale[t[-1]])
        return int(float(t))
    except ValueError:
        raise ValueError(f"{text!r} is not a size (examples: 200GB, 1.5TB, 500MB)") from None


# the share of the free space a check may plan to fill: the plan leaves out a failing check's replay
# and is within ~1 % of real traces at scale (5 % at toy sizes, where headers weigh)
DISK_HEADROOM = 0.95


def fits(need: int, free: int) -> bool:
    """The disk check's one rule: a check may plan to fill ``DISK_HEADROOM`` of the free space."""
    return need <= DISK_HEADROOM * free


def existing_parent(path: str) -> str:
    """``path`` or its nearest existing parent: where a directory about to be made will live."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return probe


def free_bytes(path: str) -> int:
    """Free space of the filesystem that will hold ``path``."""
    return shutil.disk_usage(existing_parent(path)).free


# Linux's shared-memory tmpfs: a reference written there never reaches a disk (on the 50M rung's
# check its recording took 11.3-11.8 s through this VM's disk and 5.8-6.3 s there, against 3.2 s of
# training it). Without shmem huge pages it is read back at ~5 GB/s, slower than a file in the page
# cache (BENCHMARKS.md, issue #35): what it saves is the disk's bytes, and a slow disk's time.
MEMORY_ROOT = "/dev/shm"
# the share of the memory available as a check starts that its in-memory reference may take: the
# rest is the runs' own (the candidate's ranks on a CPU; on a GPU machine the host's is mostly free)
MEMORY_SHARE = 0.5
# ``--reference-in``: where a pair's reference is written (stream: in memory, one iteration at a time)
AUTO, MEMORY, DISK, STREAM = "auto", "memory", "disk", "stream"
REFERENCE_IN = (AUTO, MEMORY, DISK, STREAM)
# from this size held whole on, ``auto`` streams a reference that may stream, even where it would fit
# held: streamed, it writes each iteration's overwritable bytes into the last one's pages and holds
# about half as much. On the 2-core development VM (issue #35, benchmarks/stream_or_hold.py: gpt_tp2_sp
# fp32, 3 alternated rounds a size, two runs) a streamed check took 0.73-0.82× the held one's time at
# the 50M rung (4.04 GB held whole) where fresh memory was dear (f95fe25) and 0.90-1.04× where it was
# not (14b6181); 0.89-1.13× at 1.63 GB, 0.92-1.11× at 0.54 GB, 0.66-1.23× at 14.5 MB. Below it,
# holding also spares a failing check the reference run again for its replay (at the rung, 19.4 s
# streamed against 17.4 held at 14b6181).
STREAM_FROM_BYTES = 1 << 30


def memory_available() -> Optional[int]:
    """The kernel's estimate of the memory that can be taken without swapping (``MemAvailable`` in
    /proc/meminfo), or None where there is none to read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_room(root: str = MEMORY_ROOT, limit: Optional[int] = None) -> Optional[int]:
    """What an in-memory reference may take now: :data:`MEMORY_SHARE` of the available memory (or
    ``limit``, ``--reference-memory``, within all of it), within what the tmpfs at ``root`` has free
    (a container's /dev/shm is often 64 MB); None where there is no writable tmpfs or no memory
    figure (then a reference goes to the disk)."""
    available = memory_available()
    if available is None or not os.path.isdir(root) or not os.access(root, os.W_OK):
        return None
    share = MEMORY_SHARE * available if limit is None else min(limit, available)
    return int(min(share, DISK_HEADROOM * shutil.disk_usage(root).free))


def check_reference_in(mode: str, online: bool) -> None:
    """``--reference-in``'s value, and its one contradiction: ``memory`` (and ``stream``) removes the
    reference once judged, ``--keep-traces`` (not ``online``) keeps every trace (ValueError, before anything runs)."""
    if mode not in REFERENCE_IN:
        raise ValueError(f"--reference-in {mode!r}: one of {', '.join(REFERENCE_IN)}")
    if mode in (MEMORY, STREAM) and not online:
        raise ValueError(f"--reference-in {mode} removes the reference once its pair is judged, and --keep-traces keeps "
                         "both sides' traces under --out for `ttrace compare` to read again: give one of them")


def reference_placement(mode: str, held: int, streamed: int, room: Optional[int], online: bool,
                        stream_refused: str = "", perturbed: bool = False) -> str:
    """Where a pair writes its reference (:data:`MEMORY`, :data:`STREAM` or :data:`DISK`; a bf16
    recipe's pair and its fp32 twin are placed apart, each by its own bytes and perturbation run): as asked
    (``memory`` and ``stream`` are refused at the run where they do not fit); ``auto``: streamed to
    the candidate one iteration at a time where nothing refuses it (``stream_refused``: why not), its
    peak (``streamed``) fits ``room``, held whole it would take :data:`STREAM_FROM_BYTES` or more
    (``held``) and no perturbation run would read it beside the candidate (``perturbed``); else held
    whole in memory where that fits; else streamed where its peak fits and nothing refuses it; else
    the disk. Always the disk where the check keeps its traces (not ``online``: with
    ``--keep-traces`` both sides stay there, for ``ttrace compare`` to read again).

    Why a small reference is held even where it could stream: below :data:`STREAM_FROM_BYTES` the
    two ways took as long, and a failing streamed check runs its reference again for the replay.
    Why one with a perturbation run: the reference, the candidate's ranks and the perturbation run
    then share the cores at once (the 50M rung in bf16 on the 2-core development VM: its pair took
    24.2 s streamed and 19.3 held at f95fe25, 21.6 and 18.3 at 14b6181; stream_or_hold.py)."""
    check_reference_in(mode, online)
    if mode != AUTO:
        return mode
    if not online or room is None:
        return DISK
    can_stream = not stream_refused and streamed <= room
    if can_stream and held >= STREAM_FROM_BYTES and not perturbed:
        return STREAM
    if held <= room:
        return MEMORY
    return STREAM if can_stream else DISK


def memory_refusal_text(name: str, need: int, room: Optional[int], mode: str = MEMORY,
                        limited: bool = False) -> str:
    """Why ``ttrace run --reference-in memory`` (or ``stream``) refuses, with the numbers.
    ``limited``: ``room`` is what ``--reference-memory`` allows."""
    share = ("--reference-memory, within the memory available" if limited
             else f"{MEMORY_SHARE:.0%} of the memory available")
    where = (f"only {human(room)} may be taken there ({share}, within {MEMORY_ROOT}'s free space)"
             if room is not None else f"there is no writable {MEMORY_ROOT} with a memory figure on this machine")
    what = "the reference's trace takes" if mode == MEMORY else "the reference, streamed, holds at its peak"
    return (f"{name}: --reference-in {mode}: {what} about {human(need)} and {where}. "
            f"Record fewer iterations or modules, or write it to the disk (--reference-in disk or auto)")


def memory_scratch(root: str = MEMORY_ROOT) -> str:
    """A new directory under ``root`` for this process's in-memory references (removed by the
    check that made it), named ``ttrace-<pid namespace>-<pid>-…``. What a killed check left there
    (its process gone) is removed first: a tmpfs holds memory until its files are deleted. Only a
    directory of this PID namespace is judged by its pid: containers that share a ``/dev/shm``
    see other pids (a live check in another would look dead from here)."""
    import tempfile

    space = _pid_namespace()
    for name in os.listdir(root):
        parts = name.split("-")
        if (len(parts) >= 4 and parts[0] == "ttrace" and parts[1] == space and parts[2].isdigit()
                and not _alive(int(parts[2]))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"ttrace-{space}-{os.getpid()}-", dir=root)


def remove_tree(path: str, threads: int) -> None:
    """``shutil.rmtree(path, ignore_errors=True)``, its files unlinked ``threads`` at a time. Freeing
    a tmpfs's pages is the kernel's work, file by file: the 50M rung's in-memory reference (4.04 GB,
    16 files) took 0.54-0.58 s on one thread of the 2-core development VM and 0.28-0.29 s on two."""
    from concurrent.futures import ThreadPoolExecutor

    files = []
    for parent, _, names in os.walk(path):
        files.extend(os.path.join(parent, n) for n in names)
    if threads > 1 and len(files) > 1:
        def unlink(name: str) -> None:
            with contextlib.suppress(OSError):
                os.unlink(name)

        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ttrace-remove") as pool:
            list(pool.map(unlink, sorted(files, key=_size, reverse=True)))
    shutil.rmtree(path, ignore_errors=True)


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _pid_namespace() -> str:
    """This process's PID namespace (the inode of /proc/self/ns/pid), or "0" where none can be read."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def disk_refusal_text(name: str, need: int, free: int, out: str) -> str:
    """Why ``ttrace run`` refuses a check whose traces would not fit, with the numbers."""
    return (f"{name}: this check writes about {human(need)} under {os.path.abspath(out)}, and only {human(free)} "
            f"are free there (a check may plan to fill {DISK_HEADROOM:.0%} of it). Record fewer iterations (--iters), modules (--modules) or microbatches "
            f"(--microbatches), judge online (leave out --keep-traces), or point --out at a larger disk; `ttrace plan` shows "
            f"where the bytes go and `--budget` suggests a selection (--no-disk-check runs it anyway)")


def suggest(options: Sequence[Tuple[str, "Plan"]], budget: int) -> List[str]:
    """Each selective recording offered (flags, its plan) with the disk it needs, the ones within
    ``budget`` marked. What a selection leaves unjudged is the user's choice, so every option is
    named with its flags, never applied for them."""
    out = []
    for flags, p in options:
        need = p.disk_needed()
        out.append(f"{'fits' if need <= budget else 'over'}  {human(need):>9}  {flags}")
    return out


def measured_bytes(trace_dir: str) -> int:
    """What a trace directory holds on disk (for checking a plan against a run)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(trace_dir) for f in files)


def format_plan(plan: Plan, free: Optional[int] = None, budget: Optional[int] = None,
                write_bandwidth: Optional[float] = None, options: Sequence[Tuple[str, Plan]] = (),
                compare_rates: Optional[CompareRates] = None, workers: int = 1,
                memory_room: Optional[int] = None, memory_write: Optional[Tuple[float, int]] = None) -> List[str]:
    """The plan as plain lines (no colour: it goes into logs and CI output too). ``memory_write``:
    (bytes a second, bytes timed) of a write where the sides held in memory go
    (:func:`measure_memory_write`)."""
    lines = [f"{plan.recipe}: what this check writes (predicted)"]
    head = f"{'side':22} {'ranks':>5} {'iters':>5} " + " ".join(f"{COLUMN[k]:>11}" for k in KINDS) + \
        f" {'per iter':>10} {'total':>10}"
    lines.append(head)
    for s in plan.sides:
        per = s.bytes_per_iteration()
        lines.append(f"{s.name + (' (online)' if s.online else ''):22} {s.ranks:>5} {s.iterations:>5} "
                     + " ".join(f"{human(per[k]):>11}" for k in KINDS)
                     + f" {human(sum(per.values())):>10} {human(s.total()):>10}")
    lines.append(f"{SEED_CHECKPOINT:22} {'':>5} {'':>5} " + " " * (12 * len(KINDS))
                 + f"{'':>10} {human(plan.seed_checkpoint_bytes):>10}")
    lines.append(f"disk needed at the peak: {human(plan.disk_needed())}"
                 + (f" (all sides kept with --out: {human(plan.all_bytes())})" if plan.all_bytes() != plan.disk_needed()
                    else ""))
    if plan.in_memory:
        held = [n for n in plan.in_memory if n not in plan.streamed]
        kept = "; ".join(
            ([f"{', '.join(held)}: a failing check's moved under --out where it fits"] if held else [])
            + ([f"{', '.join(plan.streamed)}: a failing check's run again for its replay, up to the failing iteration: "
                "in memory where held whole it fits, then moved under --out where that fits, else under --out"]
               if plan.streamed else []))
        lines.append(f"held in memory ({MEMORY_ROOT}, each removed once its pair is judged; {kept}): "
                     f"{', '.join(plan.in_memory)}, at most {human(plan.memory_needed())}"
                     + ("" if memory_room is None else f" of the {human(memory_room)} it may take here"
                        + ("" if plan.memory_needed() <= memory_room else " — NOT ENOUGH (ttrace run refuses it)")))
    if plan.streamed:
        whole = max(plan.side(n).total() for n in plan.streamed)
        lines.append(f"streamed to its candidate one iteration at a time (--reference-in stream, or as auto places it): "
                     f"{', '.join(plan.streamed)}, its matrices' per-microbatch grads, optimizer states and updated "
                     f"values of each iteration written over the one before's (held whole: {human(whole)})")
    host = plan.host_memory()
    lines.append(f"host memory beside the training: {human(host['staging_per_rank'])} of staging buffers a recording "
                 f"rank, compare at most about {human(host['compare_per_process'])} a process (twice the largest tensor, "
                 f"{human(plan.largest_tensor())}, or its fixed part, whichever is larger)"
                 + (f", the reference held in memory {human(host['reference_in_memory'])}" if plan.in_memory else ""))
    busiest = max(plan.sides, key=lambda s: sum(s.bytes_per_iteration().values()) / s.ranks)
    lines.append(f"the most one rank writes in an iteration: {human(sum(busiest.bytes_per_iteration().values()) / busiest.ranks)}"
                 f" (a rank of {busiest.name}; a mean over its ranks)")
    if write_bandwidth:
        lines.append(f"writing it at this disk's measured {human(write_bandwidth)}/s: about "
                     f"{plan.all_bytes() / write_bandwidth:.0f} s")
    if memory_write and plan.in_memory:
        rate, timed = memory_write
        lines.append(f"writing what is held in memory ({', '.join(plan.in_memory)}: {human(plan.memory_written())} to "
                     f"{MEMORY_ROOT}) at the measured {human(rate)}/s ({human(timed)} timed alone): at least "
                     f"{plan.memory_written() / rate:.1f} s (memory the kernel has not given out lately can come "
                     "several times slower, on a VM most)")
    if compare_rates is not None:
        lines.append(f"compare's parts on one thread here: verifying {human(compare_rates.verify)}/s, reading "
                     f"{human(compare_rates.read)}/s, sums {human(compare_rates.sums)}/s, the element-wise Adam check "
                     f"{human(compare_rates.update)}/s, {compare_rates.record * 1e3:.2f} ms a record")
        for name, seconds in judging_seconds(plan, compare_rates, workers).items():
            online = plan.side(name).online
            lines.append(f"judging {name}" + (" as it runs, on each of its ranks" if online else
                                              f" after the run on {workers} process{'es' if workers > 1 else ''}")
                         + f": at least {seconds:.0f} s" + (" a rank" if online else "")
                         + " (its parts' cost; the keys' ordering, processes and scheduling come on top)")
    if free is not None:
        lines.append(f"free where the traces go: {human(free)}"
                     + ("" if fits(plan.disk_needed(), free) else
                        f" — NOT ENOUGH (ttrace run refuses above {DISK_HEADROOM:.0%} of it)"))
    if budget is not None:
        lines.append(f"within {human(budget)}:")
        lines += [f"  {s}" for s in suggest(options, budget)]
    lines += [f"note: {n}" for n in plan.notes]
    return lines


@dataclasses.dataclass(frozen=True)
class CompareRates:
    """Compare's parts on this machine, in bytes per second on one thread (a compare worker's
    setting): verifying a data file (xxh3), reading pieces a chunk at a time from the page cache, a
    piece's sums against the reference (both operands), the element-wise Adam check of an updated
    value (its six operands); and the seconds a record costs whatever its size (``record``: a small
    piece placed, read and summed)."""

    verify: float
    read: float
    sums: float
    update: float
    record: float


def measure_compare_rates(directory: str, elements: int = 1 << 22) -> CompareRates:
    """:class:`CompareRates` timed on ``elements`` fp32 elements (16 MiB) as compare runs each part,
    a trace written in ``directory`` to read back (removed after); best of three, about a second."""
    import tempfile
    import time

    import torch

    from . import streaming, trace_store
    from .compare import streamed_shard_sums
    from .placement import Layout
    from .tolerance import difference_sums
    from .trace_store import TensorKey, TraceReader, TraceWriter, write_run_info
    from .update_rules import AdamRule, judge_adam_chunks

    def best(fn) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(elements, generator=gen)
        b = a * (1 + 1e-7 * torch.randn(elements, generator=gen))
        chunks = list(streaming.chunks(elements))
        nbytes = 4 * elements
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory, prefix=".ttrace-plan-") as tmp:
            write_run_info(tmp, {"role": "reference", "world_size": 1, "num_layers": 1})
            w = TraceWriter(tmp, 0, {}, page_cache=True)
            key, small = TensorKey(1, -1, "m", "optimizer", "weight"), TensorKey(1, -1, "m", "optimizer", "bias")
            w.add(key, a, Layout((), (elements,)), depth=1)
            w.add(small, a[:64], Layout((), (64,)), depth=1)
            w.flush(1)
            w.close()
            reader = TraceReader(tmp)
            records = {rec.key: (rt, rec) for rt, rec in reader.records()}
            source, tiny = (streaming.RecordSource(reader, *records[k]) for k in (key, small))
            whole = source.meta()
            streaming.read_flat(source, whole, 0, 1)  # (verified once, as compare does)
            read = best(lambda: [streaming.read_flat(source, whole, lo, hi) for lo, hi in chunks])
            rt = records[key][0]
            fname, info = next(iter(rt.files.items()))

            def verify():
                with open(os.path.join(rt.dir, fname), "rb") as f:
                    trace_store._verify(f, info)

            verify_s = best(verify)
            record = best(lambda: [streamed_shard_sums(small, tiny, Layout((), (64,)), {}, tiny)
                                   for _ in range(100)]) / 100
            file_bytes = os.path.getsize(os.path.join(rt.dir, fname))
        sums = best(lambda: [difference_sums(a[lo:hi], b[lo:hi]) for lo, hi in chunks])
        m, v, rule = a.abs() * 1e-3, a * a * 1e-6, AdamRule(0.9, 0.95, 1e-8)
        update = best(lambda: judge_adam_chunks(rule, 1e-4, 2.0, "float32",
                                                ((lo, [a[lo:hi], b[lo:hi], m[lo:hi], v[lo:hi], m[lo:hi], v[lo:hi]])
                                                 for lo, hi in chunks)))
        return CompareRates(verify=file_bytes / verify_s, read=nbytes / read, sums=2 * nbytes / sums,
                            update=6 * nbytes / update, record=record)
    finally:
        torch.set_num_threads(threads)


def compare_seconds(side: SidePlan, rates: CompareRates, workers: int = 1, reference_bytes: Optional[int] = None,
                    mapped: bool = False) -> float:
    """Judging a side against its reference, its parts at ``rates``: every byte's sums taken with the
    reference's at its positions, each updated value checked element by element over both sides'
    values and moments (about twice the side's optimizer bytes), and each record's own cost; and
    what comes before them:

    * a recorded side, judged after the run on ``workers`` processes: both sides' files verified
      once, every byte read with the reference's, the moments read again for the update check;
    * an online side, judged as it runs, on all its ranks together (what it would record): its own
      tensors are in memory, neither read nor verified; the reference's files (``reference_bytes``)
      are verified once between its ranks, and the reference's pieces read, with its moments again,
      unless ``mapped`` (the reference held in memory: its pieces are views of the page cache)."""
    recorded = dataclasses.replace(side, online=False)
    total = recorded.total()
    optimizer = recorded.bytes_per_iteration()[OPTIMIZER] * side.iterations
    records = sum(g.record_count(side.sizes) for g in side.groups) * side.iterations
    judge = 2 * total / rates.sums + 2 * optimizer / rates.update + records * rates.record
    if side.online:
        reads = 0.0 if mapped else (total + optimizer) / rates.read
        return (total if reference_bytes is None else reference_bytes) / rates.verify + reads + judge
    return (2 * total / rates.verify + (2 * total + 2 * optimizer) / rates.read + judge) / max(workers, 1)


def reference_of(plan: Plan, side: SidePlan) -> Optional[SidePlan]:
    """The reference ``side`` is judged against: the plan's ``reference`` (a twin's side, its twin's)."""
    prefix = side.name.rpartition("/")[0]
    name = f"{prefix}/reference" if prefix else "reference"
    return next((s for s in plan.sides if s.name == name), None)


def judging_seconds(plan: Plan, rates: CompareRates, workers: int) -> Dict[str, float]:
    """:func:`compare_seconds` of each side judged against the reference: an online side's on each
    of its ranks (a rank judges its own shards, on its own thread; the reference mapped where the
    plan holds it in memory), a recorded one's after the run. A floor, not a forecast: at the 50M
    rung (``benchmarks/compare_at_scale.py``) the whole compare took 1.5× it on one process and
    2.4× on two of a 2-core machine, and an online candidate rank's judging 1.8-1.9× it on a 16-core
    Xeon host, where a rank's training ran on 8 threads and its judging on one (BENCHMARKS.md,
    issue #35: the cost table at f3ab4bd on the H200 machine's host)."""
    out = {}
    for s in plan.sides:
        if not s.judged:
            continue
        if not s.online:
            out[s.name] = compare_seconds(s, rates, workers)
            continue
        ref = reference_of(plan, s)
        out[s.name] = compare_seconds(s, rates, reference_bytes=ref.total() if ref else None,
                                      mapped=ref is not None and ref.name in plan.in_memory) / s.ranks
    return out


# the most ``ttrace plan --measure-disk`` writes to memory to time it: a write of 256 MiB is served by
# memory freed moments before, and overstated the rate for the 50M rung's 4 GB reference by 1.4-6×
# on the development VM (256 MiB at 1.8-2.4 GB/s, 4 GB at 0.36-1.55 GB/s); 1 GiB costs a second or two
MEMORY_SAMPLE_MAX = 1 << 30
MEMORY_SAMPLE_MIN = 1 << 28


def measure_memory_write(plan: Plan, root: str = MEMORY_ROOT) -> Optional[Tuple[float, int]]:
    """(bytes a second, bytes timed) of one write to ``root`` of what the plan holds in memory,
    between :data:`MEMORY_SAMPLE_MIN` and :data:`MEMORY_SAMPLE_MAX`, in whole MiB; None where it
    holds nothing there."""
    if not plan.in_memory:
        return None
    nbytes = min(max(plan.memory_written(), MEMORY_SAMPLE_MIN), MEMORY_SAMPLE_MAX) >> 20 << 20
    return measure_write_bandwidth(root, nbytes), nbytes


def measure_write_bandwidth(directory: str, nbytes: int = 1 << 28) -> float:
    """Bytes per second of one sequential write with fsync in ``directory`` (removed after)."""
    import tempfile
    import time

    os.makedirs(directory, exist_ok=True)
    block = os.urandom(1 << 20)
    fd, path = tempfile.mkstemp(dir=directory, prefix=".ttrace-plan-")
    try:
        start = time.monotonic()
        with os.fdopen(fd, "wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return nbytes / max(time.monotonic() - start, 1e-9)
    finally:
        os.remove(path)
