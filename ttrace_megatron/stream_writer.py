"""Safetensors files written while training runs: a few reused staging buffers, a writer thread and a
checksum thread.

Why not buffer an iteration and write it at the end: that costs a copy of every recorded byte into
host memory no one has touched yet (a page fault per page), then a write into page-cache pages no
one has touched yet, then an fsync, all inside the step. On the 2-core development VM that made a
recorded iteration 5-8× the time its bytes take to write (BENCHMARKS.md, "Costs"). Here

* each recorded tensor is copied into one of a few fixed staging buffers (warm after their first
  use), as it is recorded. A host tensor is copied by one plain ``memcpy`` (numpy's, which releases
  the GIL), not by ``Tensor.copy_``: torch splits a copy that size over its intra-op threads, and
  the writer thread, busy beside them in the kernel, left one of them waiting for a core while
  the other waited for it at the end of the copy. On the 2-core development VM an 8 MiB copy ran
  at 6 GB/s so beside a writing thread, against 22 GB/s for the plain one; in one profiled
  reference of the 50M rung (py-spy, native frames, a slow phase of the VM) the copies were 3.5 s
  of its 12 s. In a fast phase the two took alike (ten alternated checks: 5.9 s against 6.1 s);
* a full buffer goes to two background threads at once: one (its file's lane's) writes it, with ``O_DIRECT`` where
  the filesystem allows (no page-cache pages to allocate, and the run's page cache is left
  alone), else through the page cache; the other adds it to the file's xxh3 checksum. Both
  release the GIL. Hashing and writing one after the other on one thread made a recorded iteration
  1.83× its write time on an H200 machine, zlib's CRC32 (3.1 GB/s) being 40 % of it (BENCHMARKS.md,
  "On a GPU at the real shapes"); xxh3 runs at 13.7 GB/s there;
* the safetensors header, whose size is only known at the end, goes into a region reserved at the
  start of the file: the header is padded with spaces to fill it (the format allows trailing
  whitespace in the header), so data offsets never move. A file whose header would outgrow the
  region, or whose data would pass :data:`PART_BYTES`, is finished, and the writer starts another part.

The header region is written last, so the file's checksum (trace format 3, :func:`checksum_entry`)
is two xxh3-64 digests, of the header region and of the data after it; the reader streams the
file once and checks both. Traces of formats 1 and 2 list a CRC32 of the whole file instead, and
still read.

Numerics: the thread reads only the staging buffers; the run's tensors are read once, by the copy,
on the recording thread. No collective is issued. Knows nothing about megatron.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import queue
import struct
import threading
from typing import Callable, List, Optional

import numpy as np
import torch
import xxhash

ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses are multiples of this
HEADER_REGION = 128 << 10  # 8-byte length + JSON header; ~1500 tensors per file part
# a part holds at most this many data bytes (or one larger tensor): the readers that check a trace's
# checksums share them out file by file (``TraceReader.share_verification``, ``verify_files``), and
# an iteration of 1.35 GB in one file left one of two online ranks hashing twice what the other did
PART_BYTES = 256 << 20
STAGING_BYTES = 8 << 20
# 64 MiB of host memory per rank, whatever the size of the trace; shared by the writer's lanes, each
# holding one it fills: with 4, the 50M rung's reference waited 0.7-0.8 s for a free one; with 8, 0.2-0.4
STAGING_BUFFERS = 8

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}


CHECKSUM = "xxh3_64"  # a data file's manifest entry holds {"head_bytes", "head", "data"} under this key


def checksum_entry(raw: bytes, head_bytes: int) -> dict:
    """The manifest's checksum of a whole file's bytes whose first ``head_bytes`` are its header
    region (what a writer would have listed; for tools and tests that write a file themselves)."""
    return {CHECKSUM: {"head_bytes": head_bytes, "head": xxhash.xxh3_64_hexdigest(raw[:head_bytes]),
                       "data": xxhash.xxh3_64_hexdigest(raw[head_bytes:])}}


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src``, both flat ``uint8`` of one length, ``dst`` in host memory: a host ``src`` by
    one memcpy on the calling thread (numpy's, the GIL released; the module's docstring says why
    not ``Tensor.copy_``), a device one by ``Tensor.copy_``, synchronously (into pinned memory: the
    run may free or overwrite it right after; not measured on a GPU yet)."""
    if src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


class _Countdown:
    """Runs ``then`` once ``count`` calls of :meth:`done` have been made, from any threads."""

    def __init__(self, count: int, then: Callable[[], None]):
        self._count, self._then, self._lock = count, then, threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._then()


class _Staging:
    """One page-aligned host buffer (pinned when CUDA is there, so device copies can use DMA)."""

    def __init__(self, nbytes: int):
        if torch.cuda.is_available():
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._mmap = None
        else:
            self._mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.view = memoryview(self.tensor.numpy())
        self.aligned = self.tensor.data_ptr() % ALIGN == 0


class StreamingFile:
    """One safetensors file being written. Its methods run on the recording thread; the writes
    they queue run on the :class:`BackgroundWriter`'s thread."""

    def __init__(self, writer: "BackgroundWriter", path: str, direct_io: bool, sync: bool = True, lane: int = 0,
                 overwrite: bool = False):
        """``overwrite``: ``path`` holds an earlier file whose pages this one is written into, in
        place (not truncated first: cut to this file's size once whole, as every file is)."""
        self.writer = writer
        self.lane = lane  # the writer thread that writes this file, in order
        self.sync = sync  # fsync the file once whole (else its checksum alone vouches for it after a crash)
        self.error: Optional[OSError] = None  # set by the writer thread
        self._data_hash = xxhash.xxh3_64()  # of the data region, kept by the checksum thread
        self._hashed = threading.Event()  # set by the checksum thread once the last data is in
        self._entries: List[str] = []
        self._header_bytes = 2  # "{}"
        self.data_bytes = 0  # data region bytes appended so far
        self._staged: Optional[_Staging] = None
        self._fill = 0
        self._written = 0  # data bytes handed to the writer thread
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if overwrite else os.O_TRUNC), 0o644)
        self.direct_fd = -1
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
                self.direct_fd = -1

    def append(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy ``tensor``'s bytes into staging buffers now; they are written in the background.
        False (and nothing appended) when the header region has no room left for it, or the part
        holds data already and would grow past :data:`PART_BYTES`."""
        start = self.data_bytes
        entry = json.dumps(name) + ":" + json.dumps(
            {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
             "data_offsets": [start, start + tensor.numel() * tensor.element_size()]}, separators=(",", ":"))
        if self._header_bytes + len(entry) + 1 > HEADER_REGION - 8 or (
                self._entries and start + tensor.numel() * tensor.element_size() > PART_BYTES):
            return False
        self._entries.append(entry)
        self._header_bytes += len(entry) + (1 if len(self._entries) > 1 else 0)
        src = tensor.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        flat = src.reshape(-1).view(torch.uint8)
        pos, total = 0, flat.numel()
        while pos < total:
            if self._staged is None:
                self._staged, self._fill = self.writer.acquire(), 0
            take = min(total - pos, STAGING_BYTES - self._fill)
            copy_bytes(self._staged.tensor[self._fill:self._fill + take], flat[pos:pos + take])
            self._fill += take
            pos += take
            if self._fill == STAGING_BYTES:
                self._submit()
        self.data_bytes += total
        return True

    def _submit(self) -> None:
        staged, nbytes = self._staged, self._fill
        both = _Countdown(2, lambda: self.writer.release(staged))
        self.writer.submit_checksum(self._hash_job(staged, nbytes, both))
        self.writer.submit(self._write_job(staged, self._written, nbytes, both), self.lane)
        self._written += self._fill
        self._staged, self._fill = None, 0

    def finish(self, on_done: Callable[["StreamingFile", int, dict], None],
               on_error: Callable[["StreamingFile", OSError], None]) -> None:
        """Queue the last data, the header, truncation and fsync. Then, on the writer thread,
        ``on_done(file, bytes, checksum)`` runs (checksum: the manifest entry's :data:`CHECKSUM`
        part), or ``on_error(file, error)`` if any write failed."""
        if self._staged is not None:
            self._submit()
        self.writer.submit_checksum(self._hashed.set)
        header = ("{" + ",".join(self._entries) + "}").encode()
        header += b" " * (HEADER_REGION - 8 - len(header))
        head = struct.pack("<Q", len(header)) + header
        self.writer.submit(lambda: self._finish(head, on_done, on_error), self.lane)

    def abandon(self) -> None:
        """Stop writing this file: what is staged is dropped, queued writes are skipped."""
        if self._staged is not None:
            self.writer.release(self._staged)
            self._staged = None
        self.error = self.error or OSError(errno.ECANCELED, "abandoned")
        self.writer.submit(self._close_fds, self.lane)

    # ---- writer thread
    def _write_job(self, staged: _Staging, offset: int, nbytes: int, both: _Countdown):
        def job():
            try:
                if self.error is None:
                    self._pwrite(staged, nbytes, HEADER_REGION + offset)
            except OSError as e:
                self.error = e
            finally:
                both.done()
        return job

    # ---- checksum thread
    def _hash_job(self, staged: _Staging, nbytes: int, both: _Countdown):
        def job():
            try:
                self._data_hash.update(staged.view[:nbytes])
            finally:
                both.done()
        return job

    def _pwrite(self, staged: _Staging, nbytes: int, offset: int) -> None:
        if self.direct_fd >= 0 and staged.aligned:
            padded = -(-nbytes // ALIGN) * ALIGN  # the tail is cut off by ftruncate at the end
            try:
                self._pwrite_all(self.direct_fd, staged.view[:padded], offset)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                os.close(self.direct_fd)  # the filesystem accepted the flag but not the write
                self.direct_fd = -1
        self._pwrite_all(self.fd, staged.view[:nbytes], offset)

    @staticmethod
    def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
        while len(data):
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n

    def _finish(self, head: bytes, on_done, on_error) -> None:
        size = HEADER_REGION + self.data_bytes
        self._hashed.wait()  # the checksum thread never waits on this one
        try:
            if self.error is None:
                self._pwrite_all(self.fd, memoryview(head), 0)
                os.ftruncate(self.fd, size)
                if self.sync:
                    os.fsync(self.fd)
        except OSError as e:
            self.error = e
        self._close_fds()
        if self.error is None:
            on_done(self, size, {"head_bytes": len(head), "head": xxhash.xxh3_64_hexdigest(head),
                                 "data": self._data_hash.hexdigest()})
        else:
            on_error(self, self.error)

    def _close_fds(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.direct_fd = -1


class BackgroundWriter:
    """A writer thread a lane (:data:`WRITE_LANES`), each running its lane's queued writes in order,
    one thread for the checksums, and the pool of staging buffers they share: a buffer goes back to
    the pool once its write and its checksum are done.

    The pool bounds memory: when the disk is slower than the run records, :meth:`acquire` waits
    for a buffer to be written (the run slows down rather than grow without limit).
    """

    def __init__(self, name: str, lanes: int = 1):
        if STAGING_BUFFERS < lanes:  # each lane holds the buffer it fills: fewer would wait forever
            raise ValueError(f"{STAGING_BUFFERS} staging buffers cannot serve {lanes} writer lanes")
        self._jobs: "List[queue.Queue[Optional[Callable[[], None]]]]" = [queue.Queue() for _ in range(lanes)]
        self._checksum_jobs: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._free: "queue.Queue[_Staging]" = queue.Queue()
        self._allocated = 0
        queues = [(jobs, f"writer{k}") for k, jobs in enumerate(self._jobs)] + [(self._checksum_jobs, "checksum")]
        self._threads = [threading.Thread(target=self._run, args=(jobs, what), name=f"{name}-{what}", daemon=True)
                         for jobs, what in queues]
        for thread in self._threads:
            thread.start()

    def acquire(self) -> _Staging:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if self._allocated < STAGING_BUFFERS:
            self._allocated += 1
            return _Staging(STAGING_BYTES)
        return self._free.get()

    def release(self, staged: _Staging) -> None:
        self._free.put(staged)

    def submit(self, job: Callable[[], None], lane: int = 0) -> None:
        self._jobs[lane].put(job)

    def submit_checksum(self, job: Callable[[], None]) -> None:
        self._checksum_jobs.put(job)

    def stop(self) -> None:
        self._checksum_jobs.put(None)
        for jobs in self._jobs:
            jobs.put(None)
        for thread in self._threads:
            thread.join()

    @staticmethod
    def _run(jobs: "queue.Queue[Optional[Callable[[], None]]]", what: str) -> None:
        while True:
            job = jobs.get()
            try:
                if job is None:
                    return
                job()
            except Exception as e:  # a bug here must not hang the run in acquire() or stop()
                print(f"[ttrace] trace {what} thread: {type(e).__name__}: {e}", flush=True)
