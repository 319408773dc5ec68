"""On-disk traces: per-rank safetensors files plus JSON manifests. Never pickle.

Layout of a trace directory::

    run.json                         what ran: role, world size, configs, library versions
    rank-00003/manifest.json         this rank's coordinates, its data files, and how far its record log is whole
    rank-00003/records.jsonl         one line per recorded tensor, appended as each data file is whole
    rank-00003/iter-000001.safetensors  the tensors of one iteration (with iter-000001-001... : a file
                                        a writer lane, and parts past a size)

Data files are written in the background while the run goes on (:mod:`.stream_writer`). A rank's
manifest is rewritten atomically (write, fsync, rename) once each data file is whole, and says
``"complete": true`` only once the rank has closed its writer. Each data file's size and checksum
are in the manifest, so a rank killed mid-write, a truncated file or flipped bits are detected
and reported with the file, the rank and the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import re
import struct
import threading
import time
import zlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import xxhash

from .errors import TraceError
from .keys import PHASES, TensorKey  # noqa: F401  (re-exported: the key of every record)
from .placement import Layout, shape_from_json
from .stream_writer import CHECKSUM, SAFETENSORS_DTYPES, BackgroundWriter, StreamingFile

# 4: a rank's records are in an append-only log beside its manifest, which names how far it is whole
#    and its xxh3-64 (3 and before: the records inline in the manifest)
# 3: a data file's checksum is xxh3-64 of its header region and of its data (2 and 1: CRC32 of the file)
# 2: a per-rank value scale is part of the layout (1 kept it in the record as ``scale``)
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
INLINE_RECORDS = (1, 2, 3)  # the versions whose manifests hold their records inline
RUN_FILE = "run.json"
MANIFEST_FILE = "manifest.json"
# Why a log. The manifest is rewritten after every data file, and a trace read while it is written
# (a streamed reference) is read again at every iteration: with the records inline, each rewrite
# serialized and each read parsed every record so far, a cost that grew with the square of a check's
# iterations (at 48 iterations of the shipped toy, each candidate rank spent half its time parsing
# the reference's manifest, benchmarks/stream_iterations.py). The log is appended to and never
# rewritten; the manifest says how many of its bytes and records are whole (``RECORD_LOG``), so a
# reader reads the bytes appended since its last read only, and checks the digest of all of them.
RECORD_LOG_FILE = "records.jsonl"
RECORD_LOG = "record_log"  # the manifest's entry: {"file", "bytes", "records", "xxh3_64"}
# run.json "role": what a trace is
REFERENCE = "reference"  # the single-device run the others are judged against
CANDIDATE = "candidate"  # the distributed run under test
REPLAY = "replay"  # the candidate again, every hooked module on the reference's inputs (localization)

# a strided read (:meth:`TraceReader.load_view`) reads row by row from rows of this size on: shorter
# rows cost more in calls than reading the span between them (page cache: ~9 GB/s here)
RUN_BYTES = 64 << 10
# a rank writes its iteration's tensors into this many files at once (its lanes), one writer thread
# each, a tensor to the lane given the fewest bytes: tmpfs holds a file's lock through a whole write,
# so one thread's writes into fresh pages bounded the reference's recording (2.5 GB/s on the 2-core
# development VM; 4.4-5.1 GB/s for two threads into two files, 2.3-2.8 into one). The second lane
# opens once the iteration has recorded LANE_OPENS_AT bytes: a small iteration stays in one file (a
# file's header region is 128 KiB, most of a toy iteration's bytes)
WRITE_LANES = 2
LANE_OPENS_AT = 32 << 20
_DATA_FILE_RE = re.compile(r"^iter-\d{6}(-\d{3})?\.safetensors$")
_RANK_DIR = "rank-{:05d}"
# a trace read one iteration at a time (:class:`Turns`): each reader's mark of the last iteration it
# let go, in this directory of the trace
TURNS_DIR = "turns"
_READER_MARK = "reader-{:05d}"
# beside a streamed trace's manifest, written right after it: how far it is whole, and whether it is
# complete or failed, in a few bytes (a waiting reader parsed the manifest, 0.75 MB at the 50M rung,
# at each of its rewrites: ~7 % of a candidate rank's samples)
TURN_FILE = "turn.json"
WAIT_POLL_S = 0.02  # how often a side waiting for the other looks; a manifest is parsed only when it changed


@dataclasses.dataclass
class Turns:
    """A trace written one iteration at a time for ``readers`` processes that read each iteration
    as it is whole (``ttrace run --reference-in stream``: the reference, for its candidate's ranks).

    Why. Held whole in memory, a check's reference writes every byte into pages the machine has not
    given it yet: on the 2-core development VM that was 1.4-1.5 s of the 50M rung's 2.3 s of
    recording, against 0.4-0.6 s for the same bytes written into pages already held
    (BENCHMARKS.md, issue #35). Here the writer publishes each iteration once its files are listed
    (the manifest's ``whole_through``), and at the next iteration's first record that
    ``overwritable`` picks waits for every reader to let it go (:func:`release_iteration`); those
    records go to files of their own, which are then renamed to the new iteration's names and
    written over in place (the records before it, kept, go to new files meanwhile). Their records
    stay in the record log (their keys and layouts: what a comparison orders and groups by), their
    files in its ``released``: reading one is a TraceError that says so. The records kept are the
    ones a comparison of the readers' results still reads once the run is over."""

    readers: int
    overwritable: Callable[[TensorKey, Layout], bool]
    poll_s: float = WAIT_POLL_S


@dataclasses.dataclass
class Record:
    """One recorded tensor on one rank."""

    key: TensorKey
    layout: Layout
    dtype: str
    shape: Tuple[int, ...]
    seq: int  # order of recording on this rank: execution order
    file: str
    name: str  # tensor name inside the file
    depth: int = 0  # layer depth, 1-based; 0 for the embedding, num_layers + 1 for the output side
    compute_dtype: str = ""  # dtype the producing op computed in (for tolerances)
    reduction: int = 0  # reduction length K of the GEMM that produced it (0 if not a GEMM output)
    # computed from values a localization replay does not substitute (the grad of a bias that a
    # linear hands to its caller to add): judged like what arrives at a module, never as a
    # module's own output
    arrival: bool = False
    # a statistic of another tensor of the same module, phase and microbatch (an FP8 GEMM's amax of
    # its input): it moves with that tensor, so it is judged with that tensor's tolerance too
    statistic_of: str = ""
    # the value's own round-off, measured by the run against an fp64 twin of the same computation
    # (absolute; 0: not measured): the grad norm's (adapter ``_GradNormTwin``)
    roundoff: float = 0.0

    def to_json(self) -> dict:
        obj = {"key": self.key.to_json(), "layout": self.layout.to_json(), "dtype": self.dtype,
               "shape": list(self.shape), "seq": self.seq, "file": self.file, "name": self.name,
               "depth": self.depth, "compute_dtype": self.compute_dtype, "reduction": self.reduction}
        if self.arrival:
            obj["arrival"] = True
        if self.statistic_of:
            obj["statistic_of"] = self.statistic_of
        if self.roundoff:
            obj["roundoff"] = self.roundoff
        return obj

    @staticmethod
    def from_json(obj: dict) -> "Record":
        layout = Layout.from_json(obj["layout"])
        if "scale" in obj:  # format 1 kept the value scale in the record
            layout = dataclasses.replace(layout, scale=float(obj["scale"]))
        return Record(TensorKey.from_json(obj["key"]), layout, str(obj["dtype"]),
                      shape_from_json(obj["shape"]), int(obj["seq"]), str(obj["file"]),
                      str(obj["name"]), int(obj.get("depth", 0)), str(obj.get("compute_dtype", "")),
                      int(obj.get("reduction", 0)), bool(obj.get("arrival", False)),
                      str(obj.get("statistic_of", "")), float(obj.get("roundoff", 0.0)))


class RecordLog:
    """A rank's record log as its writer appends to it (:data:`RECORD_LOG_FILE`): a line of compact
    JSON a record, in the order their data files became whole, and the running xxh3-64 of every byte
    so far, which the manifest lists with the byte and record counts (:meth:`entry`). Created empty
    (a log left in the directory by an earlier run is cut). Each append writes at the end of what is
    counted, not at the end of the file: what a failed append left there (a full disk's short write)
    is written over by the next, and a reader reads only the bytes the manifest counts."""

    def __init__(self, path: str, sync: bool):
        self.path, self.sync = path, sync
        self.bytes = 0
        self.count = 0
        self._digest = xxhash.xxh3_64()
        with open(path, "wb"):
            pass

    def append(self, records: Sequence["Record"]) -> None:
        if not records:
            return
        text = "".join(json.dumps(r.to_json(), separators=(",", ":")) + "\n" for r in records).encode()
        fd = os.open(self.path, os.O_WRONLY)
        try:
            view, at = memoryview(text), self.bytes
            while view:
                written = os.pwrite(fd, view, at)
                view, at = view[written:], at + written
            if self.sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        self._digest.update(text)
        self.bytes += len(text)
        self.count += len(records)

    def entry(self) -> dict:
        return {"file": RECORD_LOG_FILE, "bytes": self.bytes, "records": self.count,
                CHECKSUM: self._digest.hexdigest()}

    @staticmethod
    def empty_entry() -> dict:
        return {"file": RECORD_LOG_FILE, "bytes": 0, "records": 0, CHECKSUM: xxhash.xxh3_64().hexdigest()}


@dataclasses.dataclass
class _LogRead:
    """How far a reader of a trace still being written has read a rank's record log: its bytes and
    their digest so far, and the Records parsed from them (a reload reads what was appended since)."""

    bytes: int
    digest: "xxhash.xxh3_64"
    records: List["Record"]


def read_record_log(rank_dir: str, rank: int, listed, before: Optional[_LogRead] = None) -> _LogRead:
    """The records a manifest's :data:`RECORD_LOG` entry (``listed``) says are whole, read from the
    rank's log: from ``before`` on where given (a reload), all of it where the bytes before it are
    not what the manifest's digest now covers (the log rewritten: Records parsed anew). Raises a
    named :class:`TraceError` for a log that is missing, shorter than listed, damaged, or holds
    another number of records."""
    path = os.path.join(rank_dir, RECORD_LOG_FILE)
    if not isinstance(listed, dict) or listed.get("file") != RECORD_LOG_FILE:
        raise TraceError(f"bad record log entry {listed!r}", path=os.path.join(rank_dir, MANIFEST_FILE), rank=rank)
    size, count, digest = listed.get("bytes"), listed.get("records"), listed.get(CHECKSUM)
    if not (isinstance(size, int) and isinstance(count, int) and size >= 0 and count >= 0
            and isinstance(digest, str)) or isinstance(size, bool) or isinstance(count, bool):
        raise TraceError(f"bad record log entry {listed!r}", path=os.path.join(rank_dir, MANIFEST_FILE), rank=rank)
    if before is not None and before.bytes <= size:
        read = _read_log(path, rank, before.bytes, size, before.digest.copy())
        if read[1].hexdigest() == digest:
            return _log_records(path, rank, read, before, count)
    read = _read_log(path, rank, 0, size, xxhash.xxh3_64())
    if read[1].hexdigest() != digest:
        raise TraceError("record log is corrupt (xxh3 mismatch)", path=path, rank=rank)
    return _log_records(path, rank, read, None, count)


def _read_log(path: str, rank: int, start: int, end: int, digest) -> Tuple[bytes, "xxhash.xxh3_64"]:
    """Bytes ``start`` to ``end`` of a record log, and ``digest`` updated with them."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < end:  # (named before a read sized by the manifest allocates it)
                raise TraceError(f"record log has {size} bytes, the manifest says {end} (truncated?)", path=path,
                                 rank=rank)
            f.seek(start)
            text = f.read(end - start)
    except FileNotFoundError:
        raise TraceError("record log not found", path=path, rank=rank) from None
    except OSError as e:
        raise TraceError(f"cannot read record log ({e.strerror})", path=path, rank=rank) from None
    if len(text) != end - start:
        raise TraceError(f"record log has {start + len(text)} bytes, the manifest says {end} (truncated?)",
                         path=path, rank=rank)
    digest.update(text)
    return text, digest


def _log_records(path: str, rank: int, read, before: Optional[_LogRead], count: int) -> _LogRead:
    text, digest = read
    kept = list(before.records) if before is not None else []
    try:  # one parse for all the new lines (compact JSON holds no raw newline)
        entries = json.loads("[" + text.decode().rstrip("\n").replace("\n", ",") + "]") if text else []
        records = kept + [Record.from_json(e) for e in entries]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError, AttributeError,
            OverflowError) as e:
        raise TraceError(f"malformed record log ({type(e).__name__}: {e})", path=path, rank=rank) from None
    if len(records) != count:
        raise TraceError(f"record log holds {len(records)} records, the manifest says {count}", path=path, rank=rank)
    return _LogRead((before.bytes if before is not None else 0) + len(text), digest, records)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def atomic_write_json(path: str, obj: dict, *, compact: bool = False) -> None:
    """Write, fsync, rename. ``compact``: no indentation, which lets json use its C encoder
    (a manifest is rewritten after every data file, from the writer thread)."""
    atomic_write_text(path, json.dumps(obj, indent=None if compact else 1,
                                       separators=(",", ":") if compact else None))


def atomic_write_text(path: str, text: str) -> None:
    """Write, fsync, rename."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_run_info(trace_dir: str, info: dict) -> None:
    os.makedirs(trace_dir, exist_ok=True)
    atomic_write_json(os.path.join(trace_dir, RUN_FILE), dict(info, format_version=FORMAT_VERSION))


class TraceWriter:
    """Writes one rank's trace: an iteration's tensors in :data:`WRITE_LANES` safetensors files (or
    more parts), written at once.

    Tensors are copied into staging buffers as they are recorded and written by background threads,
    one a lane, while training goes on (:mod:`.stream_writer`); a data file is listed in the manifest
    once it is whole (and fsync'd where the trace syncs), its records appended to the rank's record
    log (:class:`RecordLog`) just before, in the order each file became whole (a reader orders them
    by ``seq``). :meth:`close` waits for the writes and marks the trace complete.

    A failure to write (a full or unwritable disk) never stops training: recording stops, a
    warning is printed once, and the manifest says why the trace is incomplete.
    """

    def __init__(self, trace_dir: str, rank: int, coords: Dict[str, Tuple[int, int]], *, direct_io: bool = True,
                 page_cache: bool = False, turns: Optional[Turns] = None):
        self.rank = rank
        self.trace_dir = trace_dir
        self.dir = os.path.join(trace_dir, _RANK_DIR.format(rank))
        # ``turns``: written one iteration at a time for readers beside it (:class:`Turns`)
        self.turns = turns
        self.whole_through = 0  # with turns: the last iteration whose files are all listed
        self.released: Dict[str, int] = {}  # with turns: file name -> the iteration whose files overwrote it
        self._overwritable_files: Dict[int, List[str]] = {}  # iteration -> its overwritable files, in order
        self._overwrite_next: List[str] = []  # the last iteration's, for this iteration's files to overwrite
        self._pending = 0  # files finished, not yet listed (or failed); guarded by _lock
        self._to_publish = 0  # with turns: the last iteration flushed, published once its files are listed
        self._overwriting = 0  # with turns: the iteration whose overwritable records are being written
        self.coords = {k: [int(v[0]), int(v[1])] for k, v in coords.items()}
        # ``page_cache``: a trace read right after on this machine (a check's reference, which the
        # candidate reads while it runs): written through the page cache and not fsync'd, so that
        # neither the writes nor the reads wait for the disk; its files' checksums, which every
        # read verifies, still catch what a crash would leave half-written. (Through the page cache
        # and fsync'd, it cost a 50M-parameter check's reference 5 s more than O_DIRECT on the
        # 2-core development VM, and the candidate's reads as much less.)
        self.direct_io = direct_io and not page_cache
        self.sync = not page_cache
        self.records: List[Record] = []  # of the files written whole; guarded by _lock
        self._log: Optional[RecordLog] = None  # opened with the rank's directory
        self.files: Dict[str, dict] = {}
        self._lock = threading.RLock()  # the writer threads list files and may fail too
        self._settled = threading.Condition(self._lock)  # notified as each finished file is listed or fails
        self._writer: Optional[BackgroundWriter] = None  # started by the first tensor recorded
        self._open: List[Optional[_OpenFile]] = [None] * WRITE_LANES  # the file each lane writes now
        self._lane_bytes = [0] * WRITE_LANES  # bytes handed to each lane this iteration
        self._lanes_iteration = -1
        self._seq = 0
        self._file_index: Dict[int, int] = {}
        self.failed: Optional[str] = None
        try:
            os.makedirs(self.dir, exist_ok=True)
            self._write_manifest(complete=False)  # (listing no records) before a log left here is cut
            self._log = RecordLog(os.path.join(self.dir, RECORD_LOG_FILE), self.sync)
        except OSError as e:
            self._fail(e)

    @property
    def active(self) -> bool:
        return self.failed is None

    def add(self, key: TensorKey, tensor: torch.Tensor, layout: Layout, *, depth: int = 0,
            compute_dtype: Optional[torch.dtype] = None, reduction: int = 0,
            arrival: bool = False, statistic_of: str = "", roundoff: float = 0.0) -> None:
        """Copy ``tensor`` into the file of its iteration now; it is written in the background."""
        if not self.active:
            self._drop_files()
            return
        name = f"t{self._seq:07d}"
        try:
            for k, open_file in enumerate(self._open):  # a new iteration: the last one's files are whole
                if open_file is not None and open_file.iteration != key.iteration:
                    self._finish_file(k)
            if key.iteration != self._lanes_iteration:
                self._lanes_iteration, self._lane_bytes = key.iteration, [0] * WRITE_LANES
            lane = self._lane() if self.turns is None else int(self.turns.overwritable(key, layout))
            if self.turns is not None and lane == 1 and key.iteration != self._overwriting:
                if self._overwriting:
                    self._take_turn(self._overwriting)
                self._overwriting = key.iteration
            if self._open[lane] is None:
                self._open_file(key.iteration, lane)
            if not self._open[lane].file.append(name, tensor):  # its header region or its part is full: a new part
                self._finish_file(lane)
                self._open_file(key.iteration, lane)
                self._open[lane].file.append(name, tensor)
        except OSError as e:
            self._fail(e)
            return
        self._lane_bytes[lane] += tensor.numel() * tensor.element_size()
        self._open[lane].records.append(Record(
            key, layout, dtype_name(tensor.dtype), tuple(tensor.shape), self._seq, self._open[lane].name, name, depth,
            dtype_name(compute_dtype or tensor.dtype), reduction, arrival, statistic_of, roundoff))
        self._seq += 1

    def flush(self, iteration: int) -> None:
        """The iteration is over: its files are finished in the background (not waited for; with
        turns, the iteration is published whole once they are listed: :meth:`_publish`)."""
        if not self.active:
            self._drop_files()
            return
        for lane, open_file in enumerate(self._open):
            if open_file is not None:
                self._finish_file(lane)
        if self.turns is not None and iteration > self.whole_through:
            with self._lock:
                self._to_publish = iteration
                if self._publish():
                    try:
                        self._write_manifest(complete=False)
                    except OSError as e:
                        self._fail(e)

    def _publish(self) -> bool:
        """With turns, under the lock (the recording thread's flush, or a writer thread listing a
        file): once every file finished so far is listed, the manifest says the iteration flushed
        last is whole, and its readers start on it. The recording goes on meanwhile: what the next
        iteration records that no reader reads again is written into new files, and the rest waits
        for the readers (:meth:`_take_turn`). True where it did (the caller writes the manifest)."""
        if self._to_publish > self.whole_through and not self._pending and self.active:
            self.whole_through = self._to_publish
            return True
        return False

    def _take_turn(self, last: int) -> None:
        """With turns, at this iteration's first overwritable record: wait for every reader to let
        ``last`` go (its overwritable files are then this iteration's to write over), once it is
        published (its files listed: a reader lets go only what it read, but its mark may be ahead)."""
        with self._lock:
            while self.whole_through < last and self.active:
                self._settled.wait()
            if not self.active:
                return
        marks = [os.path.join(self.trace_dir, TURNS_DIR, _READER_MARK.format(i)) for i in range(self.turns.readers)]
        while not all(_released_through(m) >= last for m in marks):
            time.sleep(self.turns.poll_s)
        self._overwrite_next = self._overwritable_files.pop(last, [])

    def close(self) -> None:
        """Wait for every write, then mark the trace complete (if nothing failed)."""
        self.flush(-1)
        if self._writer is not None:
            self._writer.stop()
            self._writer = None
        with self._lock:
            if self.active:
                try:
                    self._write_manifest(complete=True)
                except OSError as e:
                    self._fail(e)

    def abandon(self, reason: str) -> None:
        """The run stopped mid-iteration: drop the unfinished file, leave the trace marked incomplete."""
        self._drop_files()
        if self._writer is not None:
            self._writer.stop()  # earlier iterations' files are still listed
            self._writer = None
        with self._lock:
            if self.failed is None:
                self.failed = reason
                try:
                    self._write_manifest(complete=False)
                except OSError:
                    pass

    def _lane(self) -> int:
        """The lane given the fewest bytes this iteration (lane 0 until it holds LANE_OPENS_AT)."""
        if sum(self._lane_bytes) < LANE_OPENS_AT:
            return 0
        return min(range(WRITE_LANES), key=self._lane_bytes.__getitem__)

    def _open_file(self, iteration: int, lane: int) -> None:
        part = self._file_index.get(iteration, 0)
        fname = f"iter-{iteration:06d}.safetensors" if part == 0 else f"iter-{iteration:06d}-{part:03d}.safetensors"
        if self._writer is None:
            self._writer = BackgroundWriter(f"ttrace-writer-rank{self.rank}", lanes=WRITE_LANES)
        overwrite = False
        if self.turns is not None and lane == 1:
            self._overwritable_files.setdefault(iteration, []).append(fname)
            if self._overwrite_next:  # the last iteration's file of this place, its readers done with it
                last = self._overwrite_next.pop(0)
                os.rename(os.path.join(self.dir, last), os.path.join(self.dir, fname))
                with self._lock:
                    del self.files[last]
                    self.released[last] = iteration
                overwrite = True
        self._open[lane] = _OpenFile(StreamingFile(self._writer, os.path.join(self.dir, fname), self.direct_io,
                                                   self.sync, lane=lane, overwrite=overwrite), fname, iteration)
        self._file_index[iteration] = part + 1

    def _finish_file(self, lane: int) -> None:
        open_file, self._open[lane] = self._open[lane], None
        fname, records = open_file.name, open_file.records
        with self._lock:
            self._pending += 1
        open_file.file.finish(lambda _, size, checksum: self._listed(fname, records, size, checksum),
                              lambda _, error: self._fail(error, settled=True))

    def _drop_files(self) -> None:
        for lane, open_file in enumerate(self._open):
            if open_file is not None:
                open_file.file.abandon()
                self._open[lane] = None

    def _listed(self, fname: str, records: List[Record], size: int, checksum: dict) -> None:
        """On a writer thread: a data file is whole (and fsync'd where the trace syncs); the manifest
        now lists it. Also after a write on another lane failed: the file is whole, and the manifest
        still says the trace is incomplete, and why."""
        with self._lock:
            try:
                self._log.append(records)  # before the manifest that lists them
            except OSError as e:
                self._fail(e, settled=True)
                return
            self.records.extend(records)
            self.files[fname] = {"bytes": size, CHECKSUM: checksum}
            self._pending -= 1
            self._publish()
            self._settled.notify_all()
            try:
                self._write_manifest(complete=False)
            except OSError as e:
                self._fail(e)

    def _fail(self, error: OSError, settled: bool = False) -> None:
        with self._lock:
            if settled:  # a finished file's write failed: it will not be listed
                self._pending -= 1
            self._settled.notify_all()  # (a turn waiting for a publication that will not come)
            if self.failed is None:
                self.failed = f"{type(error).__name__}: {error}"
                print(f"[ttrace] rank {self.rank}: recording stopped, the trace will be marked incomplete: "
                      f"{self.failed}", flush=True)
                try:
                    self._write_manifest(complete=False)
                except OSError:
                    pass

    def _write_manifest(self, complete: bool) -> None:
        """The manifest anew, after every data file: compact JSON of the rank's files and of how far
        its record log is whole (never the records themselves: :data:`RECORD_LOG_FILE`)."""
        fields = {"format_version": FORMAT_VERSION, "rank": self.rank, "coords": self.coords,
                  "complete": complete, "failure": self.failed, "files": self.files,
                  RECORD_LOG: self._log.entry() if self._log is not None else RecordLog.empty_entry()}
        if self.turns is not None:
            fields.update(whole_through=self.whole_through, released=self.released)
        atomic_write_text(os.path.join(self.dir, MANIFEST_FILE), json.dumps(fields, separators=(",", ":")))
        if self.turns is not None:  # after the manifest: what it says is there once this says so
            atomic_write_json(os.path.join(self.dir, TURN_FILE), {
                "whole_through": self.whole_through, "complete": complete, "failure": self.failed}, compact=True)


@dataclasses.dataclass
class _OpenFile:
    """A data file a :class:`TraceWriter` is writing now, on one of its writer lanes."""

    file: StreamingFile
    name: str
    iteration: int
    records: List[Record] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RankTrace:
    rank: int
    coords: Dict[str, Tuple[int, int]]
    records: List[Record]
    files: Dict[str, dict]
    dir: str
    # files of a trace written one iteration at a time (:class:`Turns`) that a later iteration
    # overwrote: name -> that iteration. Their records are listed, their bytes gone
    released: Dict[str, int] = dataclasses.field(default_factory=dict)


class TraceReader:
    """Reads and validates a whole trace directory (all ranks).

    ``mapped``: read the data through a private memory map of each file, views of the page cache
    instead of copies of it. What is read so is shared by every read of the same bytes in this
    process: writing into it (copy-on-write: no file changes) would change what later reads see, so
    a caller copies before it writes (``streaming.BufferPool`` hands out a piece that lies contiguous in a map
    as such a view, :meth:`shared_view`, and never takes one back). Only for a trace
    written whole before it is read and written by no one while it is: a file that shrinks under a map
    kills the reader with SIGBUS where a read names the file (:class:`TraceError`). ``ttrace run``'s
    candidate maps its own in-memory reference (``TraceOptions.map_reference``): an online rank's
    reads of it were 1.2-1.5 s of its ~8 s of judging at the 50M rung, copies of memory already there."""

    def __init__(self, trace_dir: str, *, allow_incomplete: bool = False, mapped: bool = False):
        self.dir = trace_dir
        self.mapped = mapped
        run_path = os.path.join(trace_dir, RUN_FILE)
        self.run = read_json(run_path, rank=None)
        if not isinstance(self.run, dict) or "world_size" not in self.run:
            raise TraceError("run description lacks 'world_size'", path=run_path)
        if self.run.get("format_version") not in READABLE_VERSIONS:
            raise TraceError(f"trace format {self.run.get('format_version')!r} is not one of {READABLE_VERSIONS}",
                             path=run_path)
        world = self.run["world_size"]
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise TraceError(f"bad world_size {world!r}", path=run_path)
        layers = self.run.get("num_layers", 0)
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 0:
            raise TraceError(f"bad num_layers {layers!r}", path=run_path)
        if not isinstance(self.run.get("model_config", {}), dict):
            raise TraceError("model_config must be a mapping", path=run_path)
        # rank -> how far its record log was read: a reload reads only what was appended since. Kept
        # by a reader of a trace still being written only (a whole trace's is read once)
        self._logs: Dict[int, _LogRead] = {}
        self._keeps_logs = allow_incomplete
        self.ranks: List[RankTrace] = []
        for rank in range(world):
            self.ranks.append(self._read_rank(rank, allow_incomplete))
        self._cache: Dict[Tuple[int, str], object] = {}
        self._maps: Dict[Tuple[int, str], mmap.mmap] = {}  # (rank, file) -> its map, where ``mapped``
        # (path, bytes, mtime_ns) of files already checked against their checksum (:func:`verify_files`)
        self.verified: Set[Tuple[str, int, int]] = set()

    def prefetch(self) -> None:
        """Ask the kernel to read every data file into the page cache, in the background (a thread
        that gives ``POSIX_FADV_WILLNEED`` file by file, in iteration order): a run that reads this
        trace while it trains (a candidate judging online, or in lock-step) then finds it in memory
        by the time it reads, the disk's reads overlapping its start and its first iterations.
        Nothing is read into this process; a file that cannot be opened is left to the read that
        names it."""
        if not hasattr(os, "posix_fadvise"):
            return
        paths = [os.path.join(rt.dir, f) for rt in self.ranks for f in sorted(rt.files)]

        def advise():
            for path in paths:
                try:
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                    finally:
                        os.close(fd)
                except OSError:
                    pass

        threading.Thread(target=advise, name="ttrace-prefetch", daemon=True).start()

    def share_verification(self, index: int, count: int, files: Optional[Sequence[Tuple[RankTrace, str]]] = None
                           ) -> List[Tuple[RankTrace, str]]:
        """Split the checking of this trace's data files against their checksums over ``count``
        readers of it that run together (the ranks of a candidate judging it online), so that each
        byte is hashed once, not once a reader: files are dealt largest first to the least loaded
        reader, the same way in every one. Marks the others' files as verified here (a file
        changed since is checked again where it is opened) and returns this reader's (``index``),
        which it must verify with :meth:`verify` even where it reads none of them: a damaged file
        then fails the check on the reader that owns it, as a reader that opened it would have.
        ``files``: those to split (default: every listed file)."""
        files = sorted(((rt, f) for rt in self.ranks for f in rt.files) if files is None else files,
                       key=lambda item: (-int(item[0].files[item[1]]["bytes"]), item[0].rank, item[1]))
        loads, mine = [0] * max(1, count), []
        for rt, fname in files:
            owner = min(range(len(loads)), key=lambda i: (loads[i], i))
            loads[owner] += int(rt.files[fname]["bytes"])
            if owner == index:
                mine.append((rt, fname))
                continue
            path = os.path.join(rt.dir, fname)
            try:
                self.verified.add(_fingerprint(path, os.stat(path)))
            except OSError:
                pass  # left to the read that names it
        return mine

    def verify(self, files: Sequence[Tuple[RankTrace, str]]) -> None:
        """Check each of ``files`` (rank trace, file name) against its checksum, unless already
        checked; the first damaged one raises its named :class:`TraceError`."""
        for rt, fname in files:
            self._open_file(rt, fname)

    def fingerprints(self, files: Sequence[Tuple[RankTrace, str]]) -> List[Tuple[str, int, int]]:
        """What :attr:`verified` holds of ``files`` (rank trace, file name) that were verified here:
        (path, bytes, mtime in ns) as it was then, for another reader of the same files to trust
        (a file changed since no longer matches, and is checked again where it is opened)."""
        out = []
        for rt, fname in files:
            path = os.path.join(rt.dir, fname)
            try:
                fingerprint = _fingerprint(path, os.stat(path))
            except OSError:
                continue
            if fingerprint in self.verified:
                out.append(fingerprint)
        return out

    def _read_rank(self, rank: int, allow_incomplete: bool) -> RankTrace:
        rank_dir = os.path.join(self.dir, _RANK_DIR.format(rank))
        path = os.path.join(rank_dir, MANIFEST_FILE)
        if not os.path.exists(path):
            raise TraceError(f"rank {rank} of {self.run['world_size']} has no manifest (missing rank)",
                             path=path, rank=rank)
        m = read_json(path, rank)
        try:
            if m.get("rank") != rank:
                raise TraceError(f"manifest says rank {m.get('rank')!r}", path=path, rank=rank)
            if not m.get("complete") and not allow_incomplete:
                why = m.get("failure") or "the writer did not close (the rank stopped or was killed mid-run)"
                raise TraceError(f"incomplete trace: {why}", path=path, rank=rank)
            files = m["files"]
            for fname, info in files.items():
                if not isinstance(fname, str) or not _DATA_FILE_RE.match(fname):
                    raise TraceError(f"data file name {fname!r} is not allowed", path=path, rank=rank)
                if not isinstance(info.get("bytes"), int) or not _checksum_listed(info):
                    raise TraceError(f"bad file entry for {fname!r}", path=path, rank=rank)
            released = {str(f): int(i) for f, i in (m.get("released") or {}).items()}
            # in recording order: a writer's lanes list their files as each is whole, not in order
            if RECORD_LOG in m or self.run.get("format_version") not in INLINE_RECORDS:
                log = read_record_log(rank_dir, rank, m.get(RECORD_LOG), self._logs.get(rank))
                if self._keeps_logs:
                    self._logs[rank] = log
                records = sorted(log.records, key=lambda r: r.seq)
            else:  # (no writer of this version writes them: a reload of one parses them all again)
                records = sorted((Record.from_json(entry) for entry in m["records"]), key=lambda r: r.seq)
            coords = {str(k): (int(v[0]), int(v[1])) for k, v in m["coords"].items()}
        except TraceError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise TraceError(f"malformed manifest ({type(e).__name__}: {e})", path=path, rank=rank) from None
        world = int(self.run["world_size"])
        for axis, (position, size) in coords.items():
            # every axis groups some of the trace's ranks: a size beyond the world is a bad manifest
            # (and would make merge allocate a tensor that many times larger)
            if not 1 <= size <= world or not 0 <= position < size:
                raise TraceError(f"rank coordinates {axis}={position} of {size} do not fit a world of {world}",
                                 path=path, rank=rank)
        for rec in records:
            if rec.file not in files and rec.file not in released:
                raise TraceError(f"record points at unlisted file {rec.file!r}", path=path, rank=rank,
                                 tensor=str(rec.key))
        return RankTrace(rank, coords, records, files, rank_dir, released)

    def reload(self) -> Optional[List[Tuple[RankTrace, "Record"]]]:
        """Read every rank's manifest again (a trace written one iteration at a time, read while it
        is written: :class:`Turns`), each :class:`RankTrace` updated in place (groups of records
        made before stay valid). What was opened of files no longer listed is let go. Returns the
        records listed since the last read, in :meth:`records`' order, where every record listed
        then is still listed as it was (a streamed reference's are: their files move to
        ``released``, the records stay); else None (then regroup them all)."""
        appended: Optional[List[Tuple[RankTrace, Record]]] = []
        # every rank read before any is updated: a read that fails leaves them all as they were
        fresh = [self._read_rank(rt.rank, allow_incomplete=True) for rt in self.ranks]
        for rt, new in zip(self.ranks, fresh):
            before = {id(rec) for rec in rt.records}
            if appended is not None and before <= {id(rec) for rec in new.records}:
                appended += [(rt, rec) for rec in new.records if id(rec) not in before]
            else:
                appended = None
            rt.records, rt.files, rt.released = new.records, new.files, new.released
        self.forget([(rt, f) for rt in self.ranks for (rank, f) in list(self._cache) + list(self._maps)
                     if rank == rt.rank and f not in rt.files])
        return appended

    def iteration_files(self, iteration: int) -> List[Tuple[RankTrace, str]]:
        """The data files that hold records of ``iteration``, as listed now."""
        return sorted({(rt.rank, rec.file): (rt, rec.file) for rt, rec in self.records()
                       if rec.key.iteration == iteration and rec.file in rt.files}.values(),
                      key=lambda item: (item[0].rank, item[1]))

    def forget(self, files: Sequence[Tuple[RankTrace, str]]) -> None:
        """Let go of what this reader opened of ``files``: their indexes and maps (a map stays
        mapped while a tensor read from it is alive; no read here goes through it again)."""
        for rt, fname in files:
            self._cache.pop((rt.rank, fname), None)
            self._maps.pop((rt.rank, fname), None)

    def records(self) -> Iterator[Tuple[RankTrace, Record]]:
        for rt in self.ranks:
            for rec in rt.records:
                yield rt, rec

    def load(self, rank_trace: RankTrace, rec: Record) -> torch.Tensor:
        """Read one tensor: only its bytes, at its offset (no whole-file buffer); where the reader is
        ``mapped``, a view of its file's map, which no one may write into (see ``mapped``)."""
        path, dtype, shape, start, nbytes = self._locate(rank_trace, rec)
        mapped = self._mapped_elements(rank_trace, rec, dtype, start, nbytes)
        if mapped is not None:
            return mapped.view(shape)
        raw = torch.empty(nbytes, dtype=torch.uint8)  # not zero-filled, as a bytearray would be
        self._read_into(path, rank_trace.rank, rec, [(start, raw.numpy())])
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return raw.view(dtype).reshape(shape)

    def load_view(self, rank_trace: RankTrace, rec: Record, shape: Sequence[int], stride: Sequence[int],
                  offset: int) -> torch.Tensor:
        """Read only the elements of one tensor that a strided view of it covers (``shape``,
        ``stride`` and ``offset`` in elements, as ``torch.as_strided`` takes them, with strides
        >= 0), into a new contiguous tensor of ``shape`` (mapped: the map's own view where that is
        contiguous): what one rank's slice of a logical tensor needs (``compare.reference_piece``).
        Rows of at least :data:`RUN_BYTES` each are read one by one; shorter ones as the span from
        the first element to the last, in one read."""
        path, dtype, whole, start, nbytes = self._locate(rank_trace, rec)
        shape, stride = tuple(int(n) for n in shape), tuple(int(n) for n in stride)
        out = torch.empty(shape, dtype=dtype)
        if out.numel() == 0:
            return out
        item = dtype.itemsize
        last = _fitting_view(path, rank_trace.rank, rec, whole, nbytes // item, shape, stride, offset)
        mapped = self._mapped_elements(rank_trace, rec, dtype, start, nbytes)
        if mapped is not None:  # the view of the map itself where it is contiguous, else one copy of it
            return mapped.as_strided(shape, stride, offset).contiguous()
        # rows: the innermost dims the view holds as one contiguous run (stride 1, then each outer dim
        # whose stride is the size of what it holds)
        inner, run = len(shape), 1
        while inner > 0 and (shape[inner - 1] == 1 or stride[inner - 1] == run):
            run *= shape[inner - 1]
            inner -= 1
        if run * item >= RUN_BYTES:
            firsts = torch.zeros((), dtype=torch.int64) + offset
            for n, st in zip(shape[:inner], stride[:inner]):
                firsts = firsts.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
            rows = out.view(-1, run).view(torch.uint8).numpy()
            self._read_into(path, rank_trace.rank, rec,
                            [(start + int(f) * item, rows[i]) for i, f in enumerate(firsts.reshape(-1).tolist())])
            return out
        span = torch.empty((last + 1 - offset) * item, dtype=torch.uint8)
        self._read_into(path, rank_trace.rank, rec, [(start + offset * item, span.numpy())])
        out.copy_(span.view(dtype).as_strided(shape, stride))
        return out

    def shared_view(self, rank_trace: RankTrace, rec: Record, shape: Sequence[int], stride: Sequence[int],
                    offset: int) -> Optional[torch.Tensor]:
        """The elements of a strided view of one tensor (as :meth:`load_view` takes it) as a view of
        the file's map, no copy: where the reader is ``mapped`` and they lie contiguous in the file.
        None otherwise (:meth:`load_view` then reads or copies them); a view that does not fit the
        record is named as :meth:`load_view` names it. Shared with every other read of those bytes in
        this process: never to be written into."""
        if not self.mapped:
            return None
        path, dtype, whole, start, nbytes = self._locate(rank_trace, rec)
        shape, stride = tuple(int(n) for n in shape), tuple(int(n) for n in stride)
        if not math.prod(shape):
            return None
        _fitting_view(path, rank_trace.rank, rec, whole, nbytes // dtype.itemsize, shape, stride, offset)
        mapped = self._mapped_elements(rank_trace, rec, dtype, start, nbytes)
        if mapped is None:
            return None
        view = mapped.as_strided(shape, stride, offset)
        return view if view.is_contiguous() else None

    def _mapped_elements(self, rank_trace: RankTrace, rec: Record, dtype: torch.dtype, start: int,
                         nbytes: int) -> Optional[torch.Tensor]:
        """A record's elements as a flat view of its file's map (None where the reader is not
        ``mapped``, the record is empty, or its offset is not a multiple of its element size)."""
        if not self.mapped or not nbytes or start % dtype.itemsize:
            return None
        key = (rank_trace.rank, rec.file)
        mapping = self._maps.get(key)
        if mapping is None:
            path = os.path.join(rank_trace.dir, rec.file)
            try:
                with open(path, "rb") as f:
                    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as e:
                raise TraceError(f"cannot map data file ({e})", path=path, rank=rank_trace.rank,
                                 tensor=str(rec.key)) from None
            if len(mapping) != rank_trace.files[rec.file]["bytes"]:  # changed since it was verified
                raise TraceError(f"data file has {len(mapping)} bytes, the manifest says "
                                 f"{rank_trace.files[rec.file]['bytes']} (changed since it was verified?)",
                                 path=path, rank=rank_trace.rank, tensor=str(rec.key))
            self._maps[key] = mapping
        return torch.frombuffer(mapping, dtype=dtype, count=nbytes // dtype.itemsize, offset=start)

    def _read_into(self, path: str, rank: int, rec: Record, parts) -> None:
        """Fill each buffer of ``parts`` ((absolute file offset, writable buffer), ...) from the file."""
        try:
            with open(path, "rb") as f:
                for at, buffer in parts:
                    want = len(buffer)
                    got = os.preadv(f.fileno(), [buffer], at) if want else 0
                    if got != want:
                        raise TraceError(f"read {got} of {want} bytes (file changed since it was verified?)",
                                         path=path, rank=rank, tensor=str(rec.key))
        except OSError as e:
            raise TraceError(f"cannot read tensor ({e.strerror})", path=path, rank=rank, tensor=str(rec.key)) from None

    def _locate(self, rank_trace: RankTrace, rec: Record) -> Tuple[str, torch.dtype, Tuple[int, ...], int, int]:
        """Where one record's bytes are: its file (verified and indexed on first use), dtype,
        shape, absolute offset and byte count, checked against the manifest."""
        if rec.file in rank_trace.released:
            raise TraceError(f"its file {rec.file} was overwritten by iteration {rank_trace.released[rec.file]}'s (a "
                             f"trace written one iteration at a time keeps only what its comparison reads after "
                             f"the run: run it with --reference-in memory or disk to keep every tensor)",
                             path=os.path.join(rank_trace.dir, rec.file), rank=rank_trace.rank, tensor=str(rec.key))
        cache_key = (rank_trace.rank, rec.file)
        index = self._cache.get(cache_key)
        if index is None:
            if len(self._cache) >= 64:
                self._cache.clear()
                self._maps.clear()  # (each map is unmapped once no tensor read from it is left)
            index = self._open_file(rank_trace, rec.file)
            self._cache[cache_key] = index
        path = os.path.join(rank_trace.dir, rec.file)
        entry = index.get(rec.name)
        if entry is None:
            raise TraceError(f"tensor {rec.name!r} is not in the file", path=path, rank=rank_trace.rank,
                             tensor=str(rec.key))
        dtype, shape, start, nbytes = entry
        if tuple(shape) != rec.shape or dtype_name(dtype) != rec.dtype:
            raise TraceError(f"file holds {dtype_name(dtype)}{list(shape)}, manifest says {rec.dtype}{list(rec.shape)}",
                             path=path, rank=rank_trace.rank, tensor=str(rec.key))
        return path, dtype, shape, start, nbytes

    def _open_file(self, rank_trace: RankTrace, fname: str) -> Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]]:
        """Verify a data file's size and checksum (streamed through one reused buffer, or hashed
        from its map where the reader is ``mapped``), then index its safetensors header: name ->
        (dtype, shape, absolute offset, byte count)."""
        path = os.path.join(rank_trace.dir, fname)
        info = rank_trace.files[fname]
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                fingerprint, mapping = _fingerprint(path, st), None
                if fingerprint in self.verified:
                    size, intact = info["bytes"], True
                elif self.mapped and st.st_size:
                    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                    size, intact = _verify_view(memoryview(mapping), info)
                else:
                    size, intact = _verify(f, info)
                f.seek(0)
                head = f.read(8)
                header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 <= header_len <= min(size - 8, 100 << 20):
                    header = None
                else:
                    header = f.read(header_len)
        except OSError as e:
            raise TraceError(f"cannot read data file ({e.strerror})", path=path, rank=rank_trace.rank) from None
        if size != info["bytes"]:
            raise TraceError(f"data file has {size} bytes, the manifest says {info['bytes']} (truncated?)",
                             path=path, rank=rank_trace.rank)
        if not intact:
            what = "xxh3" if CHECKSUM in info else "CRC32"
            raise TraceError(f"data file is corrupt ({what} mismatch)", path=path, rank=rank_trace.rank)
        if header is None:
            raise TraceError("data file is not valid safetensors (bad header length)", path=path, rank=rank_trace.rank)
        index = _index_header(header, 8 + header_len, size, path, rank_trace.rank)
        self.verified.add(fingerprint)  # hashed once: a file opened again (its index let go) is not hashed again
        if mapping is not None:  # what is read of it reads the map it was hashed from
            self._maps[(rank_trace.rank, fname)] = mapping
        return index


def _fingerprint(path: str, st: os.stat_result) -> Tuple[str, int, int]:
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


def verify_files(readers: Sequence["TraceReader"], threads: int) -> Set[Tuple[str, int, int]]:
    """Check every data file of ``readers`` against its checksum, ``threads`` at a time (the reads
    and the hashing release the GIL), and mark them verified in each reader: what a file is loaded
    through later is not hashed again. Returns the fingerprints (path, bytes, mtime_ns), which
    other processes' readers of the same traces can take (a file changed since has another). The
    first damaged file raises its named :class:`TraceError`."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(reader, rt, fname) for reader in readers for rt in reader.ranks for fname in rt.files]

    def check(job):
        reader, rt, fname = job
        path = os.path.join(rt.dir, fname)
        reader._open_file(rt, fname)  # raises the named error
        return _fingerprint(path, os.stat(path))

    with ThreadPoolExecutor(max(1, threads)) as pool:
        done = set(pool.map(check, jobs))
    for reader in readers:
        reader.verified |= done
    return done


def _checksum_listed(info: dict) -> bool:
    """A manifest's file entry carries a checksum this reader can check."""
    entry = info.get(CHECKSUM)
    if entry is None:
        return isinstance(info.get("crc32"), int)  # formats 1 and 2
    return (isinstance(entry, dict) and isinstance(entry.get("head_bytes"), int) and entry["head_bytes"] >= 0
            and all(isinstance(entry.get(k), str) for k in ("head", "data")))


def _verify(f, info: dict) -> Tuple[int, bool]:
    """Read a data file once: its size, and whether its bytes match the manifest's checksum."""
    chunk = bytearray(1 << 20)  # 1 MiB: as fast as larger reads, and no large peak
    view = memoryview(chunk)
    size = 0
    entry = info.get(CHECKSUM)
    if entry is None:
        crc = 0
        while True:
            n = f.readinto(chunk)
            if not n:
                return size, crc == info["crc32"]
            crc = zlib.crc32(view[:n], crc)
            size += n
    head, data = xxhash.xxh3_64(), xxhash.xxh3_64()
    while True:
        n = f.readinto(chunk)
        if not n:
            return size, head.hexdigest() == entry["head"] and data.hexdigest() == entry["data"]
        cut = min(max(entry["head_bytes"] - size, 0), n)
        if cut:
            head.update(view[:cut])
        if n > cut:
            data.update(view[cut:n])
        size += n


def _verify_view(view: memoryview, info: dict) -> Tuple[int, bool]:
    """:func:`_verify` of a whole file's bytes already in memory (a map of it): no copy."""
    entry = info.get(CHECKSUM)
    if entry is None:
        return len(view), zlib.crc32(view) == info["crc32"]
    cut = min(entry["head_bytes"], len(view))
    return len(view), (xxhash.xxh3_64_hexdigest(view[:cut]) == entry["head"]
                       and xxhash.xxh3_64_hexdigest(view[cut:]) == entry["data"])


_DTYPES_BY_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def _fitting_view(path: str, rank: int, rec: Record, whole: Sequence[int], numel: int, shape: Tuple[int, ...],
                  stride: Tuple[int, ...], offset: int) -> int:
    """The last element a strided view of a record's ``numel`` elements covers (not empty, as
    ``torch.as_strided`` takes it), or a :class:`TraceError` naming the file, rank and tensor where
    it does not lie within them (a negative stride or offset, or past the end)."""
    last = offset + sum((n - 1) * st for n, st in zip(shape, stride))
    if min(stride, default=0) < 0 or offset < 0 or last >= numel:
        raise TraceError(f"a view of {list(shape)} at {offset} does not fit the tensor's {list(whole)}",
                         path=path, rank=rank, tensor=str(rec.key))
    return last


def _index_header(header: bytes, data_start: int, file_size: int, path: str, rank: int):
    """Parse and check a safetensors header (JSON only; offsets must lie inside the file)."""
    try:
        obj = json.loads(header.decode("utf-8"))
        if not isinstance(obj, dict):
            raise ValueError("header is not a JSON object")
        index = {}
        for name, e in obj.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES_BY_NAME[e["dtype"]]
            shape = tuple(int(d) for d in e["shape"])
            begin, end = (int(x) for x in e["data_offsets"])
            numel = 1
            for d in shape:
                if d < 0:
                    raise ValueError(f"negative dim in {name!r}")
                numel *= d
            if not 0 <= begin <= end <= file_size - data_start or end - begin != numel * dtype.itemsize:
                raise ValueError(f"offsets {begin}..{end} of {name!r} do not fit its shape or the file")
            index[str(name)] = (dtype, shape, data_start + begin, end - begin)
        return index
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError,
            OverflowError) as e:
        raise TraceError(f"data file is not valid safetensors ({type(e).__name__}: {e})", path=path, rank=rank) from None


def read_json(path: str, rank: Optional[int]):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise TraceError("file not found", path=path, rank=rank) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"not readable JSON ({e})", path=path, rank=rank) from None


def last_listed_key(rank_dir: str) -> Optional[TensorKey]:
    """The key of the last record a rank's manifest lists (in the order its data files became
    whole), None where it lists none: how far a rank that stopped got. Raises :class:`TraceError`
    where the manifest or its record log cannot be read."""
    path = os.path.join(rank_dir, MANIFEST_FILE)
    m = read_json(path, None)
    if not isinstance(m, dict):
        raise TraceError("malformed manifest", path=path)
    rank = m.get("rank") if isinstance(m.get("rank"), int) else None
    try:
        if RECORD_LOG in m:
            records = read_record_log(rank_dir, rank, m[RECORD_LOG]).records
            return records[-1].key if records else None
        entries = m.get("records") or []
        return TensorKey.from_json(entries[-1]["key"]) if entries else None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise TraceError(f"malformed manifest ({type(e).__name__}: {e})", path=path, rank=rank) from None


def _released_through(mark: str) -> int:
    """The last iteration a reader's mark (:func:`release_iteration`) lets go; 0 before its first."""
    try:
        with open(mark) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def release_iteration(trace_dir: str, reader: int, iteration: int) -> None:
    """Reader ``reader`` of a trace written one iteration at a time (:class:`Turns`) is done with
    ``iteration`` and every one before: the writer may overwrite their files."""
    os.makedirs(os.path.join(trace_dir, TURNS_DIR), exist_ok=True)
    atomic_write_text(os.path.join(trace_dir, TURNS_DIR, _READER_MARK.format(reader)), str(iteration))


def wait_for_iteration(trace_dir: str, iteration: Optional[int] = None, poll_s: float = WAIT_POLL_S,
                       give_up: Optional[Callable[[], bool]] = None) -> bool:
    """Return True once every rank of the trace being written at ``trace_dir`` has it whole through
    ``iteration`` (its manifest's ``whole_through``, :class:`Turns`) or, where ``iteration`` is None
    or a rank writes no turns, closed it complete; False once ``give_up()`` says so (asked between
    looks). Raises TraceError, naming the rank and why, where a rank stopped recording (its
    manifest's ``failure``): that iteration will never be whole. Without ``give_up``, whoever started
    both runs stops this one where the writing run dies without a word (the waiting has no deadline
    of its own); it sleeps between looks."""
    run_path = os.path.join(trace_dir, RUN_FILE)
    seen: Dict[int, Tuple[int, int]] = {}  # rank -> (inode, mtime in ns) of the file last parsed
    done: Set[int] = set()
    world = None
    while True:
        if world is None and os.path.exists(run_path):
            run = read_json(run_path, rank=None)
            world = run.get("world_size") if isinstance(run, dict) else None
            if not isinstance(world, int) or world < 1:
                raise TraceError("run description lacks 'world_size'", path=run_path)
        for rank in range(world or 0):
            if rank in done:
                continue
            rank_dir = os.path.join(trace_dir, _RANK_DIR.format(rank))
            path = os.path.join(rank_dir, TURN_FILE)  # a streamed trace's; else its manifest
            try:
                st = os.stat(path)
            except FileNotFoundError:
                path = os.path.join(rank_dir, MANIFEST_FILE)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
            if seen.get(rank) == (st.st_ino, st.st_mtime_ns):
                continue
            seen[rank] = (st.st_ino, st.st_mtime_ns)
            manifest = read_json(path, rank)  # written by an atomic rename: whole, old or new
            if not isinstance(manifest, dict):
                raise TraceError("malformed manifest", path=path, rank=rank)
            if manifest.get("failure"):
                raise TraceError(f"the trace stopped being recorded: {manifest['failure']}", path=path, rank=rank)
            whole = manifest.get("whole_through")
            if manifest.get("complete") or (iteration is not None and isinstance(whole, int) and whole >= iteration):
                done.add(rank)
        if world is not None and len(done) == world:
            return True
        if give_up is not None and give_up():
            return False
        time.sleep(poll_s)
