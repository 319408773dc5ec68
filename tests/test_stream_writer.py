"""Trace data files written in the background: byte-exact safetensors, xxh3 checksums of header and data,
header parts, O_DIRECT and its fallbacks, and a disk that fills up mid-write."""

import json
import os
import subprocess
import sys
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from ttrace_megatron import stream_writer
from ttrace_megatron.errors import TraceError
from ttrace_megatron.placement import Layout, Replicate
from ttrace_megatron.trace_store import TensorKey, TraceReader, TraceWriter, write_run_info

from trace_files import read_manifest, write_manifest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 1000, generator=g), torch.randn(40, 1024, generator=g),
            torch.arange(7, dtype=torch.int64), torch.randn(0, 3, generator=g),
            torch.randn(100, 100, generator=g).t(),  # not contiguous
            torch.randn(4, 4, generator=g).bfloat16(), torch.tensor([True, False, True]),
            torch.randn(5, 7, generator=g).to(torch.float8_e4m3fn)]


def _record(path, tensors, **writer_kw):
    write_run_info(str(path), {"role": "candidate", "world_size": 1, "num_layers": 1})
    writer = TraceWriter(str(path), 0, {"tp": (0, 1)}, **writer_kw)
    for i, t in enumerate(tensors):
        writer.add(TensorKey(1, 0, f"m{i}", "forward", "output"), t, Layout((Replicate("tp"),), tuple(t.shape)))
    writer.flush(1)
    writer.close()
    return writer


def _check_round_trip(path, tensors):
    reader = TraceReader(str(path))  # verifies every listed file's size and checksum on first load
    seen = 0
    for rank_trace, rec in reader.records():
        assert torch.equal(reader.load(rank_trace, rec), tensors[int(rec.key.module[1:])])
        seen += 1
    assert seen == len(tensors)
    files = sorted((path / "rank-00000").glob("*.safetensors"))
    for f in files:  # the safetensors library reads them too
        entry = reader.ranks[0].files[f.name]
        head_bytes = entry[stream_writer.CHECKSUM]["head_bytes"]
        assert stream_writer.checksum_entry(f.read_bytes(), head_bytes) == {stream_writer.CHECKSUM: entry[
            stream_writer.CHECKSUM]}
        with safe_open(str(f), "pt") as st_file:
            for name in st_file.keys():
                rec = next(r for r in reader.ranks[0].records if r.name == name)
                assert torch.equal(st_file.get_tensor(name), tensors[int(rec.key.module[1:])])
    return files


def test_round_trip_through_small_buffers_and_header_parts(tmp_path, monkeypatch):
    """Tensors span staging buffers, and a header region that fills up starts a new file part."""
    monkeypatch.setattr(stream_writer, "STAGING_BYTES", 3 * stream_writer.ALIGN)
    monkeypatch.setattr(stream_writer, "STAGING_BUFFERS", 2)
    monkeypatch.setattr(stream_writer, "HEADER_REGION", stream_writer.ALIGN)  # ~60 tensors per part
    tensors = _tensors() * 15
    _record(tmp_path, tensors)
    files = _check_round_trip(tmp_path, tensors)
    assert len(files) > 1 and files[-1].name == "iter-000001.safetensors"
    assert [f.name for f in files[:-1]] == [f"iter-000001-{k:03d}.safetensors" for k in range(1, len(files))]


def test_an_iteration_is_written_into_two_files_at_once_and_reads_back_in_order(tmp_path, monkeypatch):
    """Past LANE_OPENS_AT bytes, each tensor goes to the lane given the fewest bytes: two files of
    the iteration written by two threads, each byte-exact, and the records read back in the order
    they were recorded, whichever file became whole first."""
    from ttrace_megatron import trace_store

    monkeypatch.setattr(stream_writer, "STAGING_BYTES", 3 * stream_writer.ALIGN)
    monkeypatch.setattr(stream_writer, "STAGING_BUFFERS", 2)  # one a lane: each holds the one it fills
    monkeypatch.setattr(trace_store, "LANE_OPENS_AT", 20_000)  # m0 (12 kB) and m1 (164 kB) in the first file
    tensors = _tensors() * 5
    _record(tmp_path, tensors)
    files = _check_round_trip(tmp_path, tensors)
    reader = TraceReader(str(tmp_path))
    records = reader.ranks[0].records
    assert [int(r.key.module[1:]) for r in records] == list(range(len(tensors)))
    per_file = {}
    for rec in records:
        t = tensors[int(rec.key.module[1:])]
        per_file.setdefault(rec.file, []).append(t.numel() * t.element_size())
    assert [f.name for f in files] == ["iter-000001-001.safetensors", "iter-000001.safetensors"]
    assert records[0].file == records[1].file == "iter-000001.safetensors" and records[2].file != records[0].file
    first, second = (sum(per_file[f.name]) for f in files)
    assert abs(first - second) <= 40 * 1024 * 4  # balanced to within the largest tensor


def test_a_host_tensor_is_staged_by_one_memcpy_not_by_torchs_threads(tmp_path, monkeypatch):
    """A host tensor's bytes reach the staging buffers without ``Tensor.copy_``, whose copy torch
    splits over its intra-op threads (stream_writer's docstring: beside the writer thread it ran at a
    fraction of memory speed); the bytes are the tensor's, across staging buffers."""
    monkeypatch.setattr(stream_writer, "STAGING_BYTES", 3 * stream_writer.ALIGN)
    calls = []
    real_copy = torch.Tensor.copy_

    def counted(self, *a, **kw):
        calls.append(self.shape)
        return real_copy(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    tensors = _tensors()
    _record(tmp_path, tensors)
    assert calls == []
    monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
    _check_round_trip(tmp_path, tensors)


def test_a_part_holds_at_most_part_bytes_or_one_larger_tensor(tmp_path, monkeypatch):
    """A part whose data would pass PART_BYTES is finished and the next one started: every part
    but one holding a single larger tensor stays within it, and the trace reads back whole."""
    monkeypatch.setattr(stream_writer, "PART_BYTES", 50_000)  # the 40×1024 fp32 tensor is larger
    tensors = _tensors() * 3
    _record(tmp_path, tensors)
    files = _check_round_trip(tmp_path, tensors)
    reader = TraceReader(str(tmp_path))
    per_file = {}
    for rec in reader.ranks[0].records:
        t = tensors[int(rec.key.module[1:])]
        per_file.setdefault(rec.file, []).append(t.numel() * t.element_size())
    assert len(files) > 3
    assert all(sum(b) <= 50_000 or len(b) == 1 for b in per_file.values()), per_file


def test_direct_and_page_cache_writes_give_the_same_bytes(tmp_path):
    tensors = _tensors()
    _record(tmp_path / "direct", tensors)
    _record(tmp_path / "buffered", tensors, direct_io=False)
    name = "rank-00000/iter-000001.safetensors"
    assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "buffered" / name).read_bytes()
    _check_round_trip(tmp_path / "direct", tensors)


def test_a_trace_read_right_after_is_written_through_the_page_cache_unsynced(tmp_path, monkeypatch):
    """``page_cache``: the same bytes, written without O_DIRECT and without an fsync of its data
    files (only the manifest, written atomically, is synced); the checksums still catch damage."""
    tensors = _tensors()
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    _record(tmp_path / "direct", tensors)
    direct_synced, synced[:] = list(synced), []
    writer = _record(tmp_path / "cached", tensors, page_cache=True)
    assert not writer.direct_io
    name = "rank-00000/iter-000001.safetensors"
    assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "cached" / name).read_bytes()
    assert any(p.endswith(".safetensors") for p in direct_synced)
    assert synced and not any(p.endswith(".safetensors") for p in synced)
    _check_round_trip(tmp_path / "cached", tensors)
    data = tmp_path / "cached" / name
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(TraceError, match="corrupt"):
        _check_round_trip(tmp_path / "cached", tensors)


def test_a_filesystem_that_refuses_direct_writes_falls_back(tmp_path, monkeypatch):
    """Some filesystems accept O_DIRECT at open and fail the write with EINVAL."""
    real_pwrite, direct_fds = os.pwrite, set()
    real_open = os.open

    def tracking_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & getattr(os, "O_DIRECT", 0):
            direct_fds.add(fd)
        return fd

    def refusing_pwrite(fd, data, offset):
        if fd in direct_fds:
            raise OSError(22, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(stream_writer.os, "open", tracking_open)
    monkeypatch.setattr(stream_writer.os, "pwrite", refusing_pwrite)
    tensors = _tensors()
    writer = _record(tmp_path, tensors)
    assert writer.active
    _check_round_trip(tmp_path, tensors)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_tmpfs_refuses_o_direct_at_open_and_is_written_through_the_page_cache(tmp_path):
    import tempfile

    tensors = _tensors()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        path = type(tmp_path)(shm)
        _record(path, tensors)
        _check_round_trip(path, tensors)


DISK_FULL = r"""
import os, resource, signal, sys, torch
from ttrace_megatron import trace_store
from ttrace_megatron.placement import Layout, Replicate
from ttrace_megatron.trace_store import TensorKey, TraceWriter
trace_store.LANE_OPENS_AT = int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
w = TraceWriter(sys.argv[1], 0, {"tp": (0, 1)})
layout = Layout((Replicate("tp"),), (1 << 18,))
for it in (1, 2, 3):
    for i in range(4):  # 1 MiB each; the first is flushed alone (a 1.1 MiB file), the next 3 overflow
        w.add(TensorKey(it, 0, f"m{i}", "forward", "output"), torch.full((1 << 18,), float(i)), layout)
        if it == 1 and i == 0:
            w.flush(1)
    w.flush(it)
w.close()
print("training went on")
"""


@pytest.mark.parametrize("lanes_at,listed", [
    (32 << 20, {"iter-000001.safetensors": 0.0}),  # one file an iteration: m1-m3 overflow it
    # two lanes from the start: m1 and m3 overflow the second lane's file, m2's on the first is whole,
    # and listed though it became whole after the other lane failed
    (0, {"iter-000001.safetensors": 0.0, "iter-000001-002.safetensors": 2.0})])
def test_a_disk_that_fills_up_mid_write_stops_recording_not_training(tmp_path, lanes_at, listed):
    out = subprocess.run([sys.executable, "-c", DISK_FULL, str(tmp_path), str(lanes_at)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "training went on" in out.stdout
    assert "recording stopped" in out.stdout and "File too large" in out.stdout
    manifest = json.loads((tmp_path / "rank-00000" / "manifest.json").read_text())
    assert manifest["complete"] is False and "File too large" in manifest["failure"]
    assert set(manifest["files"]) == set(listed)  # the whole files written before the limit
    write_run_info(str(tmp_path), {"role": "candidate", "world_size": 1, "num_layers": 1})
    reader = TraceReader(str(tmp_path), allow_incomplete=True)
    loaded = {rec.file: reader.load(rank_trace, rec) for rank_trace, rec in reader.records()}
    assert set(loaded) == set(listed)
    assert all(torch.equal(t, torch.full((1 << 18,), listed[f])) for f, t in loaded.items())


def test_format_2_traces_with_crc32_still_read_and_their_damage_is_named(tmp_path):
    """Traces written before format 3 list a CRC32 of the whole file: they still read, and a
    flipped byte in them is still a named error."""
    from ttrace_megatron.errors import TraceError

    tensors = _tensors()
    _record(tmp_path, tensors)
    run = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "run.json").write_text(json.dumps(dict(run, format_version=2)))
    m = read_manifest(tmp_path / "rank-00000")  # (format 2 kept the records inline)
    for name in m["files"]:
        raw = (tmp_path / "rank-00000" / name).read_bytes()
        m["files"][name] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}
    write_manifest(tmp_path / "rank-00000", dict(m, format_version=2), inline=True)
    files = _check_round_trip_v2(tmp_path, tensors)
    raw = bytearray(files[0].read_bytes())
    raw[-3] ^= 0x01
    files[0].write_bytes(bytes(raw))
    reader = TraceReader(str(tmp_path))
    with pytest.raises(TraceError, match="CRC32 mismatch") as e:
        for rank_trace, rec in reader.records():
            reader.load(rank_trace, rec)
    assert e.value.rank == 0


def _check_round_trip_v2(path, tensors):
    reader = TraceReader(str(path))
    for rank_trace, rec in reader.records():
        assert torch.equal(reader.load(rank_trace, rec), tensors[int(rec.key.module[1:])])
    return sorted((path / "rank-00000").glob("*.safetensors"))


@pytest.mark.parametrize("where", ["header region", "data"])
def test_a_flipped_bit_in_either_checksummed_part_is_named(tmp_path, where):
    from ttrace_megatron.errors import TraceError

    _record(tmp_path, _tensors())
    f = sorted((tmp_path / "rank-00000").glob("*.safetensors"))[0]
    raw = bytearray(f.read_bytes())
    at = stream_writer.HEADER_REGION - 2 if where == "header region" else len(raw) - 5  # header padding / data
    raw[at] ^= 0x10
    f.write_bytes(bytes(raw))
    reader = TraceReader(str(tmp_path))
    with pytest.raises(TraceError, match="xxh3 mismatch") as e:
        for rank_trace, rec in reader.records():
            reader.load(rank_trace, rec)
    assert e.value.rank == 0 and f.name in e.value.path
