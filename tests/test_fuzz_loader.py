"""Fuzzing the manifest and trace loader: mutated traces give a TraceError or load, nothing else."""

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ttrace_megatron.compare import compare_traces
from ttrace_megatron.errors import TraceError

from test_trace_store import make_trace
from trace_files import read_manifest, write_manifest

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    make_trace(root / "ref")
    return root


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_manifest_gives_named_error(pristine, tmp_path_factory, data):
    work = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(pristine / "ref", work / "cand")
    which = data.draw(st.sampled_from(["rank-00000/manifest.json", "rank-00001/manifest.json", "run.json"]))
    path = work / "cand" / which
    obj = json.loads(path.read_text())
    paths = list(_paths(obj))
    target = data.draw(st.sampled_from(paths[1:]))
    value = data.draw(JSON_VALUES)
    node = obj
    for part in target[:-1]:
        node = node[part]
    if data.draw(st.booleans()) and isinstance(node, dict):
        node.pop(target[-1], None)
    else:
        node[target[-1]] = value
    path.write_text(json.dumps(obj))
    try:
        compare_traces(str(pristine / "ref"), str(work / "cand"))
    except TraceError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_record_gives_named_error(pristine, tmp_path_factory, data):
    """A record in a rank's log changed and the manifest's digest made to agree with it: the
    loader's own parsing of the record is what meets the damage."""
    work = tmp_path_factory.mktemp("fuzzlog")
    shutil.copytree(pristine / "ref", work / "cand")
    rank_dir = work / "cand" / data.draw(st.sampled_from(["rank-00000", "rank-00001"]))
    m = read_manifest(rank_dir)
    paths = list(_paths(m["records"]))
    target = data.draw(st.sampled_from(paths[1:]))
    node = m["records"]
    for part in target[:-1]:
        node = node[part]
    if data.draw(st.booleans()) and isinstance(node, dict):
        node.pop(target[-1], None)
    else:
        node[target[-1]] = data.draw(JSON_VALUES)
    write_manifest(rank_dir, m)
    try:
        compare_traces(str(pristine / "ref"), str(work / "cand"))
    except TraceError:
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 400), flip=st.integers(0, 10**6))
def test_damaged_data_file_gives_named_error(pristine, tmp_path_factory, cut, flip):
    work = tmp_path_factory.mktemp("fuzzdata")
    shutil.copytree(pristine / "ref", work / "cand")
    data_file = work / "cand" / "rank-00001" / "iter-000001.safetensors"
    raw = bytearray(data_file.read_bytes())
    raw[flip % len(raw)] ^= 0x5A
    data_file.write_bytes(bytes(raw[: max(0, len(raw) - cut)]))
    with pytest.raises(TraceError) as e:
        compare_traces(str(pristine / "ref"), str(work / "cand"))
    assert e.value.rank == 1 and "rank-00001" in (e.value.path or "")


def _rewrite_with_valid_checksum(cand_dir, raw: bytes):
    """Replace rank 1's data file and make the manifest's size and checksum agree with it, so the
    loader's own safetensors header parsing is what meets the damage."""
    from ttrace_megatron.stream_writer import CHECKSUM, checksum_entry

    data_file = cand_dir / "rank-00001" / "iter-000001.safetensors"
    data_file.write_bytes(raw)
    manifest = cand_dir / "rank-00001" / "manifest.json"
    m = json.loads(manifest.read_text())
    head_bytes = m["files"]["iter-000001.safetensors"][CHECKSUM]["head_bytes"]
    m["files"]["iter-000001.safetensors"] = {"bytes": len(raw), **checksum_entry(raw, head_bytes)}
    manifest.write_text(json.dumps(m))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_checksummed_but_malformed_header_gives_named_error(pristine, tmp_path_factory, data):
    import struct

    work = tmp_path_factory.mktemp("fuzzheader")
    shutil.copytree(pristine / "ref", work / "cand")
    raw = (work / "cand" / "rank-00001" / "iter-000001.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    mode = data.draw(st.sampled_from(["value", "length", "garbage"]))
    if mode == "value":
        paths = [p for p in _paths(header) if p]
        target = data.draw(st.sampled_from(paths))
        node = header
        for part in target[:-1]:
            node = node[part]
        node[target[-1]] = data.draw(JSON_VALUES)
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        new = struct.pack("<Q", len(blob)) + blob + raw[8 + n:]
    elif mode == "length":
        new = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1))) + raw[8:]
    else:
        new = data.draw(st.binary(max_size=64)) + raw[data.draw(st.integers(0, len(raw))):]
    _rewrite_with_valid_checksum(work / "cand", new)
    try:
        compare_traces(str(pristine / "ref"), str(work / "cand"))
    except TraceError as e:
        assert e.rank == 1
