"""Traces: round trip, and bad input gets an error naming the file, the rank and the tensor."""

import io
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ttrace_megatron.compare import compare_traces
from ttrace_megatron.errors import ConfigMismatchError, TraceError
from ttrace_megatron.placement import Layout, RangeShard, Replicate, Shard, slice_logical
from ttrace_megatron.trace_store import TensorKey, TraceReader, TraceWriter, write_run_info
from test_placement import _all_coords, layouts
from trace_files import read_manifest, write_manifest

KEY = TensorKey(1, 0, "decoder.layers.0.mlp.linear_fc1", "forward", "output")


def single_device_reference(tmp, full, mapped: bool = False) -> TraceReader:
    """A reference trace holding ``full`` as KEY, whole on its one rank."""
    write_run_info(str(tmp), {"role": "reference", "world_size": 1, "num_layers": 2})
    w = TraceWriter(str(tmp), 0, {"tp": (0, 1)})
    w.add(KEY, full, Layout((), tuple(full.shape)), depth=1)
    w.flush(1)
    w.close()
    return TraceReader(str(tmp), mapped=mapped)


def rank_pieces(layout, sizes, stored):
    """(coords, the shape its rank stores) of every rank of a ``layouts()`` case."""
    local_shape = list(stored)
    for p in layout.placements:
        if isinstance(p, Shard):
            local_shape[p.dim] //= sizes[p.axis]
    last = layout.placements[-1]
    for coords in _all_coords(sizes):
        yield coords, ((lambda s, e: (e - s,))(*last.piece(coords[last.axis][0])) if isinstance(last, RangeShard)
                       else tuple(local_shape))


def make_trace(path, world=2, value=None, model_config=None, close=True, nan=False):
    write_run_info(str(path), {"role": "candidate", "world_size": world, "num_layers": 2,
                               "model_config": model_config or {"model": {"hidden_size": 8}}})
    full = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) / 7 if value is None else value
    if nan:
        full = full.clone()
        full[0, 0] = float("nan")
    layout = Layout((Shard(1, "tp"),), tuple(full.shape))
    for r in range(world):
        w = TraceWriter(str(path), r, {"tp": (r, world)})
        w.add(KEY, full.chunk(world, dim=1)[r].clone(), layout, depth=1)
        w.add(TensorKey(1, -1, "decoder.layers.0.mlp.linear_fc1", "main_grad", "bias.main_grad"),
              torch.ones(3), Layout((Replicate("tp"),), (3,)), depth=1)
        w.flush(1)
        if close:
            w.close()
    return full


def test_round_trip(tmp_path):
    make_trace(tmp_path)
    reader = TraceReader(str(tmp_path))
    assert len(reader.ranks) == 2
    c = compare_traces(str(tmp_path), str(tmp_path))
    assert c.verdict == "pass" and len(c.results) == 2


def test_missing_rank_is_named(tmp_path):
    make_trace(tmp_path)
    os.remove(tmp_path / "rank-00001" / "manifest.json")
    with pytest.raises(TraceError, match="rank 1 of 2 has no manifest") as e:
        TraceReader(str(tmp_path))
    assert e.value.rank == 1 and "rank-00001" in e.value.path


def test_killed_writer_leaves_an_incomplete_trace(tmp_path):
    make_trace(tmp_path, close=False)
    with pytest.raises(TraceError, match="incomplete trace") as e:
        TraceReader(str(tmp_path))
    assert e.value.rank == 0


def test_truncated_file_is_named(tmp_path):
    make_trace(tmp_path)
    data = tmp_path / "rank-00001" / "iter-000001.safetensors"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(TraceError, match="truncated") as e:
        compare_traces(str(tmp_path), str(tmp_path))
    assert e.value.path.endswith("rank-00001/iter-000001.safetensors") and e.value.rank == 1


def test_corrupt_file_is_named(tmp_path):
    make_trace(tmp_path)
    data = tmp_path / "rank-00000" / "iter-000001.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(TraceError, match="corrupt") as e:
        compare_traces(str(tmp_path), str(tmp_path))
    assert e.value.rank == 0


def test_records_are_logged_beside_the_manifest_and_older_traces_still_read(tmp_path):
    """Format 4 keeps a rank's records in an append-only log that the manifest lists by its byte
    count, record count and digest; a trace of format 3 (records inline) reads the same."""
    from ttrace_megatron.trace_store import RECORD_LOG, RECORD_LOG_FILE, last_listed_key

    make_trace(tmp_path / "a")
    m = json.loads((tmp_path / "a" / "rank-00000" / "manifest.json").read_text())
    assert "records" not in m and m[RECORD_LOG]["records"] == 2
    assert m[RECORD_LOG]["bytes"] == os.path.getsize(tmp_path / "a" / "rank-00000" / RECORD_LOG_FILE)
    assert last_listed_key(str(tmp_path / "a" / "rank-00000")).tensor == "bias.main_grad"
    make_trace(tmp_path / "b")
    run = json.loads((tmp_path / "b" / "run.json").read_text())
    (tmp_path / "b" / "run.json").write_text(json.dumps(dict(run, format_version=3)))
    for r in (0, 1):
        rank_dir = tmp_path / "b" / f"rank-0000{r}"
        write_manifest(rank_dir, read_manifest(rank_dir), inline=True)
        os.remove(rank_dir / RECORD_LOG_FILE)
    assert last_listed_key(str(tmp_path / "b" / "rank-00000")).tensor == "bias.main_grad"
    logged, inline = TraceReader(str(tmp_path / "a")), TraceReader(str(tmp_path / "b"))
    assert [(rt.rank, rec) for rt, rec in logged.records()] == [(rt.rank, rec) for rt, rec in inline.records()]
    assert compare_traces(str(tmp_path / "a"), str(tmp_path / "b")).verdict == "pass"


@pytest.mark.parametrize("damage, message", [("flip", "record log is corrupt"), ("cut", "truncated"),
                                             ("count", "holds 2 records, the manifest says 3"),
                                             ("gone", "record log not found"), ("name", "bad record log entry"),
                                             ("huge", "the manifest says 1000000000000000 \\(truncated")])
def test_a_damaged_record_log_is_named(tmp_path, damage, message):
    from ttrace_megatron.trace_store import RECORD_LOG, RECORD_LOG_FILE

    make_trace(tmp_path)
    log, manifest = tmp_path / "rank-00001" / RECORD_LOG_FILE, tmp_path / "rank-00001" / "manifest.json"
    raw, m = bytearray(log.read_bytes()), json.loads(manifest.read_text())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
        log.write_bytes(bytes(raw))
    elif damage == "cut":
        log.write_bytes(bytes(raw[:-5]))
    elif damage == "gone":
        os.remove(log)
    else:
        m[RECORD_LOG] = dict(m[RECORD_LOG], **{"count": {"records": 3}, "name": {"file": "../x"},
                                                "huge": {"bytes": 10 ** 15}}[damage])
        manifest.write_text(json.dumps(m))
    with pytest.raises(TraceError, match=message) as e:
        TraceReader(str(tmp_path))
    assert e.value.rank == 1 and "rank-00001" in e.value.path


def test_a_failed_log_append_is_written_over_and_a_reused_directory_starts_empty(tmp_path, monkeypatch):
    """An append that failed partway (a full disk's short write) leaves bytes the manifest does not
    count: the next append writes over them, and the log reads as its whole appends. A writer started
    in a directory that holds another trace lists no record of it."""
    from ttrace_megatron import trace_store
    from ttrace_megatron.trace_store import RecordLog, read_record_log

    make_trace(tmp_path)
    old = TraceReader(str(tmp_path))
    recs = [rec for _, rec in old.records()]
    log = RecordLog(str(tmp_path / "records.jsonl"), sync=True)
    log.append(recs[:1])
    pwrite = os.pwrite

    def short(fd, data, at):
        pwrite(fd, bytes(data[:7]), at)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trace_store.os, "pwrite", short)
    with pytest.raises(OSError):
        log.append(recs[1:2])
    monkeypatch.setattr(trace_store.os, "pwrite", pwrite)
    log.append(recs[2:3])
    read = read_record_log(str(tmp_path), 0, log.entry())
    assert [r.key for r in read.records] == [recs[0].key, recs[2].key] and log.count == 2
    TraceWriter(str(tmp_path), 0, {"tp": (0, 2)})  # rank 0 again, nothing recorded yet
    assert not TraceReader(str(tmp_path), allow_incomplete=True).ranks[0].records


def test_malformed_manifest_is_named(tmp_path):
    make_trace(tmp_path)
    (tmp_path / "rank-00000" / "manifest.json").write_text("{not json")
    with pytest.raises(TraceError, match="not readable JSON") as e:
        TraceReader(str(tmp_path))
    assert e.value.rank == 0


@pytest.mark.parametrize("field", ["shape", "logical_shape"])
def test_infinite_shape_in_manifest_is_named(tmp_path, field):
    """Found by hypothesis: int(inf) raised OverflowError instead of a named error."""
    make_trace(tmp_path)
    m = read_manifest(tmp_path / "rank-00000")
    target = m["records"][0] if field == "shape" else m["records"][0]["layout"]
    target[field] = [float("inf")]
    write_manifest(tmp_path / "rank-00000", m)
    with pytest.raises(TraceError, match="malformed record log") as e:
        TraceReader(str(tmp_path))
    assert e.value.rank == 0


def test_rank_coordinates_larger_than_the_world_are_named(tmp_path):
    """Found by hypothesis: a TP size of 2**32 in a manifest made merge allocate 256 GiB."""
    make_trace(tmp_path)
    path = tmp_path / "rank-00000" / "manifest.json"
    m = json.loads(path.read_text())
    m["coords"]["tp"][1] = 2 ** 32
    path.write_text(json.dumps(m))
    with pytest.raises(TraceError, match="do not fit a world of 2") as e:
        TraceReader(str(tmp_path))
    assert e.value.rank == 0 and e.value.path.endswith("rank-00000/manifest.json")


def test_manifest_cannot_escape_the_trace_directory(tmp_path):
    make_trace(tmp_path)
    path = tmp_path / "rank-00000" / "manifest.json"
    m = json.loads(path.read_text())
    m["files"] = {"../../etc/passwd": {"bytes": 1, "crc32": 0}}
    path.write_text(json.dumps(m))
    with pytest.raises(TraceError, match="not allowed"):
        TraceReader(str(tmp_path))


def test_config_mismatch_names_the_fields(tmp_path):
    make_trace(tmp_path / "a")
    make_trace(tmp_path / "b", model_config={"model": {"hidden_size": 16}})
    with pytest.raises(ConfigMismatchError, match=r"model\.hidden_size: reference=8 candidate=16"):
        compare_traces(str(tmp_path / "a"), str(tmp_path / "b"))


def test_nan_is_a_mismatch_even_when_identical(tmp_path):
    make_trace(tmp_path / "a", nan=True)
    make_trace(tmp_path / "b", nan=True)
    c = compare_traces(str(tmp_path / "a"), str(tmp_path / "b"))
    assert c.verdict == "fail"
    assert "same 1 NaN/Inf positions on both sides" in c.first_mismatch.reason


def test_tensor_on_one_side_only_is_listed(tmp_path):
    make_trace(tmp_path / "a")
    make_trace(tmp_path / "b")
    for r in (0, 1):
        m = read_manifest(tmp_path / "b" / f"rank-0000{r}")
        m["records"] = [x for x in m["records"] if x["key"]["phase"] != "main_grad"]
        write_manifest(tmp_path / "b" / f"rank-0000{r}", m)
    c = compare_traces(str(tmp_path / "a"), str(tmp_path / "b"))
    assert c.verdict == "fail" and [k.tensor for k in c.missing_in_candidate] == ["bias.main_grad"]


def test_unwritable_directory_stops_recording_not_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    w = TraceWriter(str(blocker), 0, {"tp": (0, 1)})  # a file where a directory should be
    w.add(KEY, torch.ones(2), Layout((Replicate("tp"),), (2,)))
    w.flush(1)
    w.close()
    assert not w.active and "recording stopped" in capsys.readouterr().out


def test_online_compare_judges_shards_and_warns_live(tmp_path, capsys):
    from ttrace_megatron.online import OnlineComparer, combine_online

    full = make_trace(tmp_path / "ref", world=1)
    write_run_info(str(tmp_path / "cand"), {"role": "candidate", "world_size": 2, "num_layers": 2,
                                            "model_config": {"model": {"hidden_size": 8}},
                                            "online_reference": str(tmp_path / "ref")})
    layout = Layout((Shard(1, "tp"),), tuple(full.shape))
    for r in range(2):
        comparer = OnlineComparer(str(tmp_path / "ref"), str(tmp_path / "cand"), r, {"tp": (r, 2)})
        shard = full.chunk(2, dim=1)[r].clone()
        if r == 1:
            shard *= 2  # a bug on rank 1's shard
        comparer.add(KEY, shard, layout, depth=1)
        comparer.add(TensorKey(1, -1, "decoder.layers.0.mlp.linear_fc1", "main_grad", "bias.main_grad"),
                     torch.ones(3), Layout((Replicate("tp"),), (3,)), depth=1)
        comparer.flush(1)
        comparer.close()
    out = capsys.readouterr().out
    assert "[ttrace] rank 1 iteration 1: 1 shard(s) above tolerance" in out and "rank 0" not in out
    assert not list((tmp_path / "cand").rglob("*.safetensors"))
    c = combine_online(str(tmp_path / "cand"))
    assert c.verdict == "fail" and c.first_mismatch.key == KEY
    assert [r.verdict for r in c.results if r.key != KEY] == ["pass"]


def test_describe_difference_names_simple_kinds():
    from ttrace_megatron.compare import describe_difference

    g = torch.Generator().manual_seed(0)
    r = torch.randn(64, 32, generator=g)
    assert "sign is flipped" in describe_difference(-r, r)
    assert "2× the reference" in describe_difference(2 * r, r)
    assert "1/2 of the reference" in describe_difference(r / 2, r)
    assert "permutation" in describe_difference(r.flip(0), r)
    a, b = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    assert "1/√2" in describe_difference(a, a + b)
    assert "cosine" in describe_difference(torch.randn(64, 32, generator=g), r)


def test_run_stopped_mid_iteration_leaves_an_incomplete_trace(tmp_path):
    """A recorder closed inside an iteration (an exception, then the atexit flush) must not mark
    its trace complete."""
    from ttrace_megatron.adapter.record.hooks import Clock
    from ttrace_megatron.adapter.record.recorder import Recorder

    writer = TraceWriter(str(tmp_path), 0, {"tp": (0, 1)})
    writer.add(KEY, torch.ones(2, 2), Layout((Replicate("tp"),), (2, 2)))
    recorder = Recorder.__new__(Recorder)  # only the sink bookkeeping is exercised
    recorder._handles, recorder.sinks, recorder.clock = [], [writer], Clock(iteration=3, in_iteration=True)
    recorder.close()
    m = read_manifest(tmp_path / "rank-00000")
    assert m["complete"] is False and "iteration 3" in m["failure"] and not m["records"]


def test_partial_sums_are_judged_by_the_same_rules(tmp_path):
    """A partial sum is merged and then judged by the one verdict pipeline: its replicas' mismatch
    is named like any other, and the scale of its layout is divided out."""
    from ttrace_megatron.placement import Partial

    key = TensorKey(1, 0, "decoder.layers.0.input_layernorm", "backward", "weight.grad")
    full = torch.arange(6, dtype=torch.float32) / 3
    for name, world, scale, bad in (("ref", 1, 1.0, False), ("cand", 4, 2.0, True)):
        write_run_info(str(tmp_path / name), {"role": name, "world_size": world, "num_layers": 2})
        for r in range(world):
            coords = {"pp": (r // 2, 2), "tp": (r % 2, 2)} if world > 1 else {"pp": (0, 1), "tp": (0, 1)}
            piece = full * scale / 2 if world > 1 else full
            if bad and r == 3:
                piece = piece + 1  # the replica over tp of the second stage differs
            w = TraceWriter(str(tmp_path / name), r, coords)
            layout = Layout((Partial("pp"), Replicate("tp")) if world > 1 else (Replicate("tp"),), (6,), scale=scale)
            w.add(key, piece.clone(), layout, depth=1)
            w.close()
    c = compare_traces(str(tmp_path / "ref"), str(tmp_path / "cand"))
    (result,) = c.results
    assert result.verdict == "fail" and "candidate replicas over tp differ (ranks [0, 1]" in result.reason
    assert result.error == 0.0  # the lowest ranks' copies sum to the logical value once the scale is out


def test_format_1_traces_keep_their_scale(tmp_path):
    """Traces written before the scale moved into the layout still read with it."""
    make_trace(tmp_path / "a")
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    (tmp_path / "a" / "run.json").write_text(json.dumps(dict(run, format_version=1)))
    for r in (0, 1):
        m = read_manifest(tmp_path / "a" / f"rank-0000{r}")
        for rec in m["records"]:
            rec["scale"] = 4.0
        write_manifest(tmp_path / "a" / f"rank-0000{r}", m, inline=True)
    reader = TraceReader(str(tmp_path / "a"))
    assert {rec.layout.scale for _, rec in reader.records()} == {4.0}


@settings(max_examples=150, deadline=None)
@given(layouts(), st.integers(0, 2**31 - 1), st.sampled_from([1.0, 0.5]), st.booleans(), st.booleans())
def test_reading_a_rank_piece_of_a_reference_reads_what_slicing_the_whole_gives(case, seed, scale, row_by_row, mapped):
    """compare.reference_piece reads only the bytes of a rank's piece from a single-device
    reference (row by row, or the span of short rows; or, mapped, views of the file's map):
    bitwise what slicing the whole tensor gives, for every layout of the placement vocabulary and
    every rank."""
    import dataclasses
    import tempfile

    from ttrace_megatron import trace_store
    from ttrace_megatron.compare import group_records, reference_piece

    layout, sizes, stored = case
    layout = dataclasses.replace(layout, scale=scale)
    full = torch.randn(layout.logical_shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        reader = single_device_reference(tmp, full, mapped)
        pieces = group_records(reader)[KEY]
        before = trace_store.RUN_BYTES
        trace_store.RUN_BYTES = 1 if row_by_row else before
        try:
            for coords, shape in rank_pieces(layout, sizes, stored):
                want = slice_logical(full, layout, coords, shape)
                got = reference_piece(reader, pieces, layout, coords, shape)
                assert got.dtype == want.dtype and torch.equal(got, want), (layout, coords)
                unscaled = reference_piece(reader, pieces, layout, coords, shape, scaled=False)
                assert torch.equal(unscaled, slice_logical(full, dataclasses.replace(layout, scale=1.0), coords, shape))
        finally:
            trace_store.RUN_BYTES = before


@pytest.mark.parametrize("placement, rows", [(Shard(0, "tp"), False), (Shard(1, "tp"), True), (Shard(1, "tp"), False)])
def test_a_rank_piece_reads_only_its_bytes(tmp_path, monkeypatch, placement, rows):
    """A row shard, and a column shard of long rows, read their half of the tensor, no more; a
    column shard of short rows reads the span from its first element to its last."""
    from ttrace_megatron import trace_store
    from ttrace_megatron.compare import group_records, reference_piece

    full = torch.randn(64, 32768 if rows else 64)  # half a row: 64 KiB (RUN_BYTES), or 128 bytes
    reader = single_device_reference(tmp_path, full)
    read = []
    real = TraceReader._read_into
    monkeypatch.setattr(TraceReader, "_read_into",
                        lambda self, path, rank, rec, parts: (read.extend(len(b) for _, b in parts),
                                                              real(self, path, rank, rec, parts)))
    layout = Layout((placement,), tuple(full.shape))
    shape = tuple(full.chunk(2, dim=placement.dim)[1].shape)
    got = reference_piece(reader, group_records(reader)[KEY], layout, {"tp": (1, 2)}, shape)
    assert torch.equal(got, full.chunk(2, dim=placement.dim)[1])
    half = full.numel() * 4 // 2
    if placement.dim == 0 or rows:
        assert sum(read) == half and len(read) == (1 if placement.dim == 0 else 64)
    else:
        assert sum(read) == 2 * half - 32 * 4 and len(read) == 1  # every row but the first's left half


def test_the_combination_trusts_what_the_ranks_checked_of_the_reference(tmp_path, monkeypatch):
    """The ranks' online results list the reference's files each checked (path, bytes, mtime); the
    combination's reader hashes none of them again, and a file changed since is checked again."""
    from ttrace_megatron import online, trace_store

    make_trace(tmp_path / "ref", world=4)
    write_run_info(str(tmp_path / "cand"), {"role": "candidate", "world_size": 2, "num_layers": 2,
                                            "model_config": {"model": {"hidden_size": 8}},
                                            "online_reference": str(tmp_path / "ref")})
    for r in range(2):
        comparer = online.OnlineComparer(str(tmp_path / "ref"), str(tmp_path / "cand"), r, {"tp": (r, 2)}, world_size=2)
        comparer.close()
        assert comparer.failed is None
    parent, verified = TraceReader(str(tmp_path / "ref")), set()
    for r in range(2):
        online._read_rank(str(tmp_path / "cand"), r, verified)
    files = [(rt, f) for rt in parent.ranks for f in rt.files]
    assert len(verified) == len(files)
    parent.verified |= verified
    hashed = []
    verify = trace_store._verify
    monkeypatch.setattr(trace_store, "_verify", lambda f, info: hashed.append(f.name) or verify(f, info))
    parent.verify(files)
    assert hashed == []
    rt, fname = files[0]
    data = tmp_path / "ref" / f"rank-{rt.rank:05d}" / fname
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    stat = os.stat(data)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # (a coarse clock's same mtime)
    with pytest.raises(TraceError, match="corrupt"):
        parent.verify(files)
    assert len(hashed) == 1


def test_online_ranks_check_the_reference_once_between_them(tmp_path, monkeypatch):
    """Each candidate rank checks its share of the reference's files against their checksums (the
    shares cover every file once, the same way on every rank) and trusts the others': a damaged
    file fails the check on the rank that owns it, at its close, named, even where it never read
    it; the rank that read it without hashing it does not hash it."""
    from ttrace_megatron import trace_store
    from ttrace_megatron.online import OnlineComparer, combine_online

    make_trace(tmp_path / "ref", world=4)  # 4 ranks' files, of two sizes
    reader = TraceReader(str(tmp_path / "ref"))
    shares = [TraceReader(str(tmp_path / "ref")).share_verification(i, 2) for i in range(2)]
    names = [{(rt.rank, f) for rt, f in share} for share in shares]
    assert not names[0] & names[1] and names[0] | names[1] == {(rt.rank, f) for rt in reader.ranks for f in rt.files}
    assert all(names)
    rank, fname = shares[1][0][0].rank, shares[1][0][1]  # the first rank 1 checks (its largest)
    data = tmp_path / "ref" / f"rank-{rank:05d}" / fname
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    write_run_info(str(tmp_path / "cand"), {"role": "candidate", "world_size": 2, "num_layers": 2,
                                            "model_config": {"model": {"hidden_size": 8}},
                                            "online_reference": str(tmp_path / "ref")})
    hashed = []
    verify = trace_store._verify
    monkeypatch.setattr(trace_store, "_verify", lambda f, info: hashed.append(f.name) or verify(f, info))
    for r in range(2):
        hashed.clear()
        comparer = OnlineComparer(str(tmp_path / "ref"), str(tmp_path / "cand"), r, {"tp": (r, 2)}, world_size=2)
        comparer.close()
        seen = {os.path.basename(os.path.dirname(p)) + "/" + os.path.basename(p) for p in hashed}
        share = {f"rank-{k:05d}/{f}" for k, f in names[r]}
        # rank 1 stops at the damaged file, the first of its share
        assert seen == share if r == 0 else seen == {f"rank-{rank:05d}/{fname}"}
        assert (comparer.failed is None) == (r == 0)
    with pytest.raises(TraceError, match="incomplete online results: the reference is damaged") as e:
        combine_online(str(tmp_path / "cand"))
    assert e.value.rank == 1


def test_a_mapped_reader_reads_what_a_reader_reads_and_writes_no_file(tmp_path):
    """Through memory maps: the same tensors, bit for bit (whole, a row view, a column view, a record
    whose offset is not a multiple of its element size, read the usual way); what is written into a
    tensor read so reaches neither the file nor another reader; a file that changed size since it
    was verified is named, not mapped."""
    from ttrace_megatron.compare import group_records, reference_piece

    write_run_info(str(tmp_path), {"role": "reference", "world_size": 1, "num_layers": 2})
    w = TraceWriter(str(tmp_path), 0, {"tp": (0, 1)})
    full, late = torch.randn(64, 48), torch.randn(5)
    odd = TensorKey(1, 0, "decoder.layers.0.mlp.linear_fc1", "forward", "input")
    late_key = TensorKey(1, 0, "decoder.layers.0.mlp.linear_fc2", "forward", "output")
    w.add(KEY, full, Layout((), tuple(full.shape)), depth=1)
    w.add(odd, torch.arange(7, dtype=torch.uint8), Layout((), (7,)), depth=1)
    w.add(late_key, late, Layout((), (5,)), depth=1)  # 7 bytes after an element boundary
    w.flush(1)
    w.close()
    plain, mapped = TraceReader(str(tmp_path)), TraceReader(str(tmp_path), mapped=True)
    (rt, rec), (_, rec_odd), (_, rec_late) = list(mapped.records())
    reads, read_into = [], mapped._read_into
    mapped._read_into = lambda *a: (reads.append(a[2].key), read_into(*a))
    assert torch.equal(mapped.load(rt, rec_late), late) and reads == [late_key]  # unaligned: read, not viewed
    for reader in (plain, mapped):
        assert torch.equal(reader.load(rt, rec), full)
        assert torch.equal(reader.load(rt, rec_odd), torch.arange(7, dtype=torch.uint8))
    # the others: views of the map each file was hashed from (a map a file)
    assert reads == [late_key] and len(mapped._maps) == len(rt.files)
    for placement in (Shard(0, "tp"), Shard(1, "tp")):
        layout = Layout((placement,), tuple(full.shape))
        shape = tuple(full.chunk(2, dim=placement.dim)[1].shape)
        got = [reference_piece(r, group_records(r)[KEY], layout, {"tp": (1, 2)}, shape) for r in (plain, mapped)]
        assert torch.equal(got[0], full.chunk(2, dim=placement.dim)[1]) and torch.equal(got[1], got[0])
    # a view given to the buffer pool, as an online rank gives back a step's pieces, is not taken:
    # the pool's next buffer of that size would be the map itself, and a write into it what later
    # reads of the record see
    from ttrace_megatron.streaming import BufferPool

    pool = BufferPool()
    pool.give(mapped.load(rt, rec))
    pool.take(tuple(full.shape), full.dtype).fill_(7.0)
    assert torch.equal(mapped.load(rt, rec), full)
    viewed = mapped.load(rt, rec)
    viewed.add_(1.0)  # the map is private: the file and other readers keep the recorded values
    assert torch.equal(TraceReader(str(tmp_path), mapped=True).load(rt, rec), full)
    assert torch.equal(TraceReader(str(tmp_path)).load(rt, rec), full)
    # a file of another size than its manifest's, though vouched for (another process checked it,
    # TraceReader.verified): named where it is mapped, not read past what was checked
    from ttrace_megatron.trace_store import _fingerprint

    path = os.path.join(rt.dir, rec.file)
    with open(path, "ab") as f:
        f.write(b"0" * 8)
    again = TraceReader(str(tmp_path), mapped=True)
    again.verified.add(_fingerprint(path, os.stat(path)))
    with pytest.raises(TraceError, match="changed since it was verified") as e:
        again.load(rt, rec)
    assert e.value.path.endswith(rec.file) and e.value.rank == 0 and e.value.tensor == str(KEY)
    # flipped bits: named when the mapped reader hashes the file from its map, which it then lets go
    raw = bytearray(open(os.path.join(rt.dir, rec.file), "rb").read()[:-8])
    raw[-3] ^= 0xFF
    open(os.path.join(rt.dir, rec.file), "wb").write(bytes(raw))
    corrupt = TraceReader(str(tmp_path), mapped=True)
    with pytest.raises(TraceError, match="corrupt") as e:
        corrupt.load(rt, rec)
    assert e.value.path.endswith(rec.file) and corrupt._maps == {}


def test_a_mapped_piece_kept_whole_is_the_map_itself(tmp_path):
    """What an online rank keeps of a step (``BufferPool.read``): a piece that lies contiguous in a
    mapped file is the map's own view, not a copy (the same values, sharing the map's memory, never
    taken back by the pool); a piece that does not (a column shard), and any piece of a reader that
    does not map, is read into a buffer of the pool. It fails if the pool copies a contiguous piece
    of a map, or hands out a view of one that is not contiguous. A view that does not fit the record
    is named, shared or read."""
    from ttrace_megatron.compare import group_records, reference_piece_source
    from ttrace_megatron.streaming import BufferPool

    write_run_info(str(tmp_path), {"role": "reference", "world_size": 1, "num_layers": 2})
    w = TraceWriter(str(tmp_path), 0, {"tp": (0, 1)})
    full = torch.randn(64, 48)
    w.add(KEY, full, Layout((), tuple(full.shape)), depth=1)
    w.flush(1)
    w.close()
    for mapped in (False, True):
        reader = TraceReader(str(tmp_path), mapped=mapped)
        (rt, rec), = list(reader.records())
        base = reader.load(rt, rec) if mapped else None  # the map's view of the whole record
        for placement, contiguous in ((Shard(0, "tp"), True), (Shard(1, "tp"), False)):
            layout = Layout((placement,), tuple(full.shape))
            want = full.chunk(2, dim=placement.dim)[1]
            source = reference_piece_source(reader, group_records(reader)[KEY], layout, {"tp": (1, 2)},
                                            tuple(want.shape))
            pool = BufferPool()
            got = pool.read(source)
            assert torch.equal(got, want)
            shares = base is not None and got.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            assert shares == (mapped and contiguous)
            assert got.untyped_storage().resizable() != shares  # a pool buffer is torch's, a view the map's
            pool.give(got)
            assert bool(pool._free) != shares  # the map's view is not taken back
        # a view past the record's end is named alike, shared (a mapped reader) or read
        for read in ((reader.shared_view,) if mapped else ()) + (reader.load_view,):
            with pytest.raises(TraceError, match="does not fit") as e:
                read(rt, rec, (65, 48), (48, 1), 0)
            assert e.value.path.endswith(rec.file) and e.value.rank == 0 and e.value.tensor == str(KEY)


@pytest.mark.parametrize("in_memory", [True, False])
def test_a_check_maps_only_its_own_reference_in_memory(tmp_path, monkeypatch, in_memory):
    """``ttrace run`` has the candidate (and the perturbation run) read the reference through maps
    only where the reference is the check's own, in memory: never a reference under --out."""
    import argparse

    from rich.console import Console

    from conftest import load
    from ttrace_megatron import cli

    sides = {}

    def run_side(role, trace_dir, inject=(), **trace):
        sides[os.path.basename(trace_dir)] = trace
        os.makedirs(trace_dir, exist_ok=True)

    monkeypatch.setattr(cli, "_compare", lambda *a, **kw: {"verdict": "pass", "first_mismatch": None})
    args = argparse.Namespace(online=True, no_lockstep=False, inject=[], perturb=True, no_localize=False,
                              workers=None, tensorboard=None)
    ref_dir = str(tmp_path / "shm" / "reference") if in_memory else None
    cli._run_and_compare(load("gpt_tp2_sp"), str(tmp_path / "out"), args, Console(file=io.StringIO()), run_side,
                         ref_dir=ref_dir)
    assert sides["candidate"]["map_reference"] is in_memory
    assert sides["reference-perturbed"]["map_reference"] is in_memory
    assert "map_reference" not in sides["reference"]


def _streamed_reference(tmp, readers=1, iterations=3):
    """A reference written one iteration at a time (Turns): each iteration a matrix's per-microbatch
    grad (overwritable) and a bias's (kept), each reader's mark written ahead so the writer never
    waits. Returns the values written, by key."""
    from ttrace_megatron.online import overwritable
    from ttrace_megatron.trace_store import Turns, release_iteration

    write_run_info(str(tmp), {"role": "reference", "world_size": 1, "num_layers": 2})
    for r in range(readers):
        release_iteration(str(tmp), r, iterations)
    w = TraceWriter(str(tmp), 0, {"tp": (0, 1)}, page_cache=True, turns=Turns(readers, overwritable))
    written = {}
    for it in range(1, iterations + 1):
        for name, value in (("weight.grad", torch.full((64, 64), float(it))), ("bias.grad", torch.full((64,), -it))):
            key = TensorKey(it, 0, "decoder.layers.0.mlp.linear_fc1", "backward", name)
            w.add(key, value, Layout((), tuple(value.shape)), depth=1)
            written[key] = value
        w.flush(it)
    w.close()
    return written


def test_a_streamed_writer_tells_a_matrix_by_its_logical_shape():
    """A distributed optimizer records a matrix's state as a flat range: written over like the
    matrix's own; a bias's state, and any activation, kept."""
    from ttrace_megatron import keys
    from ttrace_megatron.online import overwritable
    from ttrace_megatron.placement import RangeShard

    def state(param):
        return TensorKey(1, -1, "decoder.layers.0.mlp.linear_fc1", keys.OPTIMIZER,
                         keys.optimizer_state(param, keys.EXP_AVG))

    assert overwritable(state("weight"), Layout((RangeShard("dp", (0, 16), (4, 4)),), (4, 4)))
    assert overwritable(state("weight"), Layout((), (4, 4)))
    assert not overwritable(state("bias"), Layout((RangeShard("dp", (0, 4), (4,)),), (4,)))
    assert not overwritable(TensorKey(1, 0, "decoder.layers.0.mlp.linear_fc1", keys.FORWARD, keys.OUTPUT),
                            Layout((), (4, 4)))


def test_a_streamed_reference_overwrites_only_what_its_comparison_never_reads(tmp_path):
    written = _streamed_reference(tmp_path)
    manifest = json.loads((tmp_path / "rank-00000" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["whole_through"] == 3
    # iteration 1's matrix file became iteration 2's, then iteration 3's: one file holds the matrices
    assert sorted(manifest["released"].values()) == [2, 3]
    on_disk = sorted(f for f in os.listdir(tmp_path / "rank-00000") if f.endswith(".safetensors"))
    assert len(on_disk) == 3 + 1  # a kept file per iteration, and the last iteration's overwritten one
    reader = TraceReader(str(tmp_path))
    loaded = 0
    for rt, rec in reader.records():
        if rec.key.tensor == "bias.grad" or rec.key.iteration == 3:
            assert torch.equal(reader.load(rt, rec), written[rec.key])
            loaded += 1
        else:
            with pytest.raises(TraceError, match="overwritten by iteration") as e:
                reader.load(rt, rec)
            assert "weight.grad" in str(e.value) and "rank: 0" in str(e.value)
    assert loaded == 4


def test_a_streamed_reference_waits_for_every_reader_before_it_overwrites(tmp_path):
    import threading
    import time

    from ttrace_megatron.online import overwritable
    from ttrace_megatron.trace_store import Turns, release_iteration, wait_for_iteration

    write_run_info(str(tmp_path), {"role": "reference", "world_size": 1, "num_layers": 2})
    w = TraceWriter(str(tmp_path), 0, {"tp": (0, 1)}, page_cache=True, turns=Turns(2, overwritable, poll_s=0.005))
    grad = TensorKey(1, 0, "decoder.layers.0.mlp.linear_fc1", "backward", "weight.grad")
    w.add(grad, torch.ones(8, 8), Layout((), (8, 8)), depth=1)
    w.flush(1)
    wait_for_iteration(str(tmp_path), 1)  # published whole
    order = []

    def readers():
        reader = TraceReader(str(tmp_path), allow_incomplete=True)
        rt, rec = next(reader.records())
        order.append(("read", float(reader.load(rt, rec)[0, 0])))
        release_iteration(str(tmp_path), 0, 1)
        time.sleep(0.2)  # the writer must still wait for the second reader
        order.append(("released", 1))
        release_iteration(str(tmp_path), 1, 1)

    thread = threading.Thread(target=readers)
    thread.start()
    w.add(TensorKey(2, 0, grad.module, grad.phase, grad.tensor), torch.full((8, 8), 2.0), Layout((), (8, 8)), depth=1)
    order.append(("wrote", 2))
    thread.join()
    w.flush(2)
    w.close()
    assert order == [("read", 1.0), ("released", 1), ("wrote", 2)]


def test_waiting_for_an_iteration_names_a_trace_that_stopped(tmp_path):
    from ttrace_megatron.trace_store import wait_for_iteration

    write_run_info(str(tmp_path), {"role": "reference", "world_size": 1, "num_layers": 2})
    w = TraceWriter(str(tmp_path), 0, {"tp": (0, 1)})
    w.abandon("the rank was stopped")
    with pytest.raises(TraceError, match="stopped being recorded: the rank was stopped"):
        wait_for_iteration(str(tmp_path), 1, poll_s=0.001)


def test_a_writer_without_turns_uses_both_lanes_and_never_waits(tmp_path):
    """Only a trace written one iteration at a time waits for readers: a whole reference's second
    lane (open past LANE_OPENS_AT bytes) goes on into the next iteration without a turn."""
    import threading

    from ttrace_megatron.trace_store import LANE_OPENS_AT

    write_run_info(str(tmp_path), {"role": "reference", "world_size": 1, "num_layers": 2})
    big = torch.zeros(LANE_OPENS_AT // 4 + 1024)  # past the second lane's threshold alone

    def write():
        w = TraceWriter(str(tmp_path), 0, {"tp": (0, 1)}, page_cache=True)
        for it in (1, 2):
            for t in range(3):
                w.add(TensorKey(it, 0, "m", "backward", f"t{t}.grad"), big.reshape(-1, 1024),
                      Layout((), (big.numel() // 1024, 1024)))
            w.flush(it)
        w.close()

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    manifest = json.loads((tmp_path / "rank-00000" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["files"]) == 4  # two lanes an iteration


def test_a_streamed_candidate_keeps_its_reference_bookkeeping_as_a_whole_regrouping_would(tmp_path):
    """At each iteration a streamed candidate rank adds the reference's new records to its groups,
    its counts of each step's updated values and its order of keys: what grouping every record
    listed so far gives."""
    from ttrace_megatron.compare import group_records, reference_order
    from ttrace_megatron.online import OnlineComparer, overwritable
    from ttrace_megatron.trace_store import Turns

    ref = tmp_path / "ref"
    write_run_info(str(ref), {"role": "reference", "world_size": 1, "num_layers": 2})
    w = TraceWriter(str(ref), 0, {"tp": (0, 1)}, page_cache=True, turns=Turns(1, overwritable, poll_s=0.005))
    module, comparer = "decoder.layers.0.mlp.linear_fc1", None
    for it in (1, 2, 3):
        w.add(TensorKey(it, 0, module, "forward", "output"), torch.ones(4, 4), Layout((), (4, 4)), depth=1)
        for name in ("weight", "bias"):
            w.add(TensorKey(it, -1, module, "optimizer", name), torch.ones(4), Layout((), (4,)), depth=1)
            w.add(TensorKey(it, -1, module, "optimizer", f"{name}.main_param"), torch.ones(4), Layout((), (4,)),
                  depth=1)
        w.flush(it)
        if comparer is None:  # (waits for iteration 1)
            comparer = OnlineComparer(str(ref), str(tmp_path / "cand"), 0, {"tp": (0, 1)}, streamed=True)
        else:
            before = len(comparer._order)
            comparer.ensure(it)
            assert len(comparer._order) == before + 5  # (read at this iteration: the path under test)
            assert comparer._reference_groups == group_records(comparer.reference)
            assert comparer._order == reference_order(comparer._reference_groups)
            assert comparer._values_of == comparer._count_values()
        comparer.flush(it)  # (lets the iteration go: the writer may write over it)
    w.close()
    assert comparer._values_of[(3, module, "bias")] == 2 and len(comparer._order) == 3 * 5


def test_a_reload_parses_only_the_records_it_has_not_seen(tmp_path, monkeypatch):
    """A trace read while it is written (a streamed reference): a reload keeps the Records of the
    entries it read before, as they were, and returns the ones listed since (what the online
    candidate adds to its groups); where an entry listed before changed, None (regroup them all)."""
    from ttrace_megatron import trace_store
    from ttrace_megatron.online import overwritable
    from ttrace_megatron.trace_store import Turns, wait_for_iteration

    write_run_info(str(tmp_path), {"role": "reference", "world_size": 1, "num_layers": 2})
    w = TraceWriter(str(tmp_path), 0, {"tp": (0, 1)}, page_cache=True, turns=Turns(1, overwritable, poll_s=0.005))
    # (outputs: nothing the next iteration writes over, so the writer never waits for this reader)
    keys = [TensorKey(i, 0, "decoder.layers.0.mlp.linear_fc1", "forward", "output") for i in (1, 2)]
    w.add(keys[0], torch.ones(8, 8), Layout((), (8, 8)), depth=1)
    w.flush(1)
    wait_for_iteration(str(tmp_path), 1)
    reader = TraceReader(str(tmp_path), allow_incomplete=True)
    first = [rec for _, rec in reader.records()]
    assert [rec.key for rec in first] == [keys[0]]
    w.add(keys[1], torch.ones(8, 8), Layout((), (8, 8)), depth=1)
    w.flush(2)
    w.close()
    wait_for_iteration(str(tmp_path), 2)
    reads = []
    read_log = trace_store._read_log
    monkeypatch.setattr(trace_store, "_read_log", lambda path, rank, start, end, digest: (
        reads.append((start, end)), read_log(path, rank, start, end, digest))[1])
    appended = reader.reload()
    assert [rec.key for _, rec in appended] == [keys[1]]
    assert next(reader.records())[1] is first[0]  # (parsed once)
    assert reads[0][0] > 0 and reads[0][1] > reads[0][0]  # the log read from where the last read stopped
    assert reader.reload() == []
    # an entry listed before, changed: the caller is told to regroup (and it is parsed anew)
    manifest = read_manifest(tmp_path / "rank-00000")
    manifest["records"][0]["depth"] = 2
    write_manifest(tmp_path / "rank-00000", manifest)
    assert reader.reload() is None
    assert [rec.depth for _, rec in reader.records()] == [2, 1]
    # an entry gone (here: the first listed twice, the second no more): None too
    manifest["records"][1] = manifest["records"][0]
    write_manifest(tmp_path / "rank-00000", manifest)
    assert reader.reload() is None
