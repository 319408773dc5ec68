"""Compare reads tensors a chunk at a time (issue #35: its peak ≤ 2× the largest tensor): the
chunks cover what the whole gives, and the verdicts are the whole-tensor verdicts."""

import dataclasses
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import load
from ttrace_megatron import keys, streaming
from ttrace_megatron.compare import (_TraceJudge, compare_traces, group_records, piece_view, shard_sums,
                                     streamed_shard_sums)
from ttrace_megatron.placement import slice_logical
from ttrace_megatron.streaming import MemorySource, RecordSource, flat_views, read_flat
from ttrace_megatron.trace_store import TraceReader
from test_placement import layouts
from test_trace_store import KEY, rank_pieces, single_device_reference


@st.composite
def strided_views(draw):
    """A tensor and a view of it: sliced along some dims, its dims permuted."""
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    base = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    view = base
    for d, n in enumerate(shape):
        lo = draw(st.integers(0, n - 1))
        hi = draw(st.integers(lo + 1, n))
        view = view.narrow(d, lo, hi - lo)
    view = view.permute(draw(st.permutations(range(len(shape)))))
    n = view.numel()
    begin = draw(st.integers(0, n))
    return base, view, begin, draw(st.integers(begin, n))


@settings(max_examples=300, deadline=None)
@given(strided_views())
def test_flat_views_cover_a_range_of_any_view_with_views(case):
    base, view, begin, end = case
    parts = flat_views(view, begin, end)
    got = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.empty(0)
    assert torch.equal(got, view.reshape(-1)[begin:end])
    assert all(p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for p in parts)
    meta = torch.empty(base.shape, device="meta").as_strided(view.shape, view.stride(), view.storage_offset())
    source = MemorySource(base)
    assert torch.equal(read_flat(source, meta, begin, end) if end > begin else torch.empty(0), got)


def _reference(tmp, full):
    reader = single_device_reference(tmp, full)
    rt, rec = group_records(reader)[KEY][0]
    return RecordSource(reader, rt, rec)


@settings(max_examples=120, deadline=None)
@given(layouts(), st.integers(0, 2**31 - 1), st.sampled_from([1.0, 0.5]), st.integers(1, 40), st.booleans())
def test_streamed_sums_are_the_whole_tensors_sums(case, seed, scale, chunk, nonfinite):
    """streamed_shard_sums, a few elements at a time from the reference's file, gives what
    shard_sums gives on the whole tensors: the digest and counts exactly, the sums to round-off;
    None only where the piece is no view of the logical tensor (padding)."""
    import tempfile

    layout, sizes, stored = case
    layout = dataclasses.replace(layout, scale=scale)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(layout.logical_shape, generator=gen, dtype=torch.float32)
    if nonfinite and full.numel() > 2:
        full.view(-1)[1] = math.nan
    before = streaming.STREAM_CHUNK
    streaming.STREAM_CHUNK = chunk
    try:
        with tempfile.TemporaryDirectory() as tmp:
            reference = _reference(tmp, full)
            for coords, shape in rank_pieces(layout, sizes, stored):
                piece = slice_logical(full, layout, coords, shape)
                cand = (piece.double() * (1 + 1e-6 * torch.randn(piece.shape, generator=gen, dtype=torch.float64))
                        ).float().contiguous()
                if nonfinite and cand.numel() > 3:
                    cand.view(-1)[3] = math.inf
                got = streamed_shard_sums(KEY, MemorySource(cand), layout, coords, reference)
                want = shard_sums(KEY, cand, layout, coords, full)
                assert (got is None) == _not_a_view(layout, coords, shape, full.shape)
                if got is None:
                    continue
                assert (got.status, got.digest, got.compared, got.candidate_nonfinite, got.reference_nonfinite,
                        got.same_nonfinite, got.shard) == (want.status, want.digest, want.compared,
                                                           want.candidate_nonfinite, want.reference_nonfinite,
                                                           want.same_nonfinite, want.shard)
                # float32 norms of chunks (difference_sums): each to ~1e-6 relative whatever the cut
                assert got.diff_sq == pytest.approx(want.diff_sq, rel=1e-5, abs=1e-30)
                assert got.ref_sq == pytest.approx(want.ref_sq, rel=1e-5)
    finally:
        streaming.STREAM_CHUNK = before


def _not_a_view(layout, coords, shape, logical_shape):
    from ttrace_megatron.compare import piece_view
    from ttrace_megatron.placement import logical_mask

    return piece_view(logical_shape, layout, coords, shape) is None or logical_mask(layout, coords, shape) is not None


def _verdicts(comparison):
    return [(r.key, r.verdict, r.error, r.tolerance_eps, r.tolerance_source) for r in comparison.results]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,dtype,lockstep", [
    ("gpt_tp2_sp", "fp32", True),  # TP row and column shards, SP sequence shards, re-clipped moments
    ("gpt_tp2", "fp32", False),  # free-running: each side's previous parameter read a chunk at a time too
    ("gpt_dp2_distopt", "bf16", True),  # a distributed optimizer's ranges, the perturbation run's movement
])
def test_streamed_compare_gives_the_whole_tensor_verdicts(runs, monkeypatch, name, dtype, lockstep):
    """Offline compare reading each piece a chunk at a time gives the verdicts of the same compare
    on whole tensors: the same keys, verdicts and tolerances, errors and the Adam check's worst
    element to float32 norms' round-off; no tensor larger than a chunk read at once for a key it
    streamed."""
    recipe = load(name, dtype=dtype)
    ref, cand = runs.candidate(recipe, name="streamed", lockstep=lockstep)
    perturbed = runs.perturbed(recipe) if dtype != "fp32" else None
    monkeypatch.setattr(streaming, "STREAM_CHUNK", 4096)
    streamed_keys, whole_reads, judging = set(), [], []
    real_streamed, real_load = _TraceJudge._streamed, TraceReader.load

    def counted(self, key, stop_before_state):
        judging.append(key)
        try:
            out = real_streamed(self, key, stop_before_state)
        finally:
            judging.pop()
        if out is not None:
            streamed_keys.add(key)
        return out

    def loaded(self, rank_trace, rec):
        t = real_load(self, rank_trace, rec)
        if judging and t.numel() > streaming.STREAM_CHUNK:
            whole_reads.append((judging[-1], rec.key))
        return t

    monkeypatch.setattr(_TraceJudge, "_streamed", counted)
    monkeypatch.setattr(TraceReader, "load", loaded)
    streamed = compare_traces(ref, cand, perturbed=perturbed)
    # what a streamed key read whole: only small tensors (a bias's reference, for its token terms)
    assert streamed_keys and not [(k, r) for k, r in whole_reads if k in streamed_keys]
    monkeypatch.setattr(_TraceJudge, "_streamed", lambda self, key, stop: None)
    whole = compare_traces(ref, cand, perturbed=perturbed)
    assert streamed.verdict == whole.verdict == "pass"
    assert [k for k, *_ in _verdicts(streamed)] == [k for k, *_ in _verdicts(whole)]
    updates = 0
    for (key, verdict, error, tol, source), (_, verdict_w, error_w, tol_w, source_w) in zip(_verdicts(streamed),
                                                                                            _verdicts(whole)):
        assert verdict == verdict_w, key
        assert error == pytest.approx(error_w, rel=1e-5, abs=1e-12), key
        if "element-wise" in source_w:
            updates += 1
            ratio, ratio_w = (float(s.split("worst element ")[1].split("×")[0]) for s in (source, source_w))
            assert ratio == pytest.approx(ratio_w, rel=1e-3), key  # (%.3g in the source)
        else:
            assert tol == pytest.approx(tol_w, rel=1e-5), key
    updated = {r.key for r in whole.results if keys.is_updated_value(r.key)}
    assert updates and updated & streamed_keys
    if name != "gpt_dp2_distopt":  # there a bf16 parameter's moments are the fp32 main parameter's ranges
        # judged whole: only pieces that are no view of the logical tensor (SwiGLU's interleaved fc1)
        groups = group_records(TraceReader(cand))
        for key in updated - streamed_keys:
            rt, r = groups[key][0]
            assert piece_view(r.layout.logical_shape, r.layout, rt.coords, r.shape) is None, key


@st.composite
def cats_of_views(draw):
    """Blocks of a tensor along one dim, some of them taken and concatenated (an interleaved shard)."""
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    dim = draw(st.integers(0, len(shape) - 1))
    blocks = draw(st.integers(2, 4))
    shape[dim] *= blocks
    base = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    taken = sorted(draw(st.sets(st.integers(0, blocks - 1), min_size=2, max_size=blocks)))
    parts = [base.chunk(blocks, dim)[b] for b in taken]
    n = sum(p.numel() for p in parts)
    begin = draw(st.integers(0, n))
    return base, parts, dim, begin, draw(st.integers(begin, n))


@settings(max_examples=300, deadline=None)
@given(cats_of_views())
def test_a_cat_of_views_is_read_a_range_at_a_time(case):
    base, parts, dim, begin, end = case
    meta = torch.empty(base.shape, device="meta")
    piece = streaming.Cat(tuple(meta.as_strided(p.shape, p.stride(), p.storage_offset()) for p in parts), dim)
    want = torch.cat(parts, dim).reshape(-1)[begin:end]
    got = read_flat(MemorySource(base), piece, begin, end) if end > begin else torch.empty(0)
    assert piece.shape == tuple(torch.cat(parts, dim).shape) and torch.equal(got, want)


def test_where_a_piece_lies_is_found_without_torch_meta_kernels():
    """piece_view runs slice_logical on a meta tensor; a concatenation of meta tensors (an
    interleaved shard's blocks) is made, not run: torch's meta kernel for it imports ~900 modules
    (~140 MiB of a comparing process, measured as compare's peak)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from ttrace_megatron.compare import piece_view\n"
            "from ttrace_megatron.placement import Layout, Shard\n"
            "before = set(sys.modules)\n"
            "p = piece_view((8, 6), Layout((Shard(1, 'tp', 2),), (8, 6)), {'tp': (1, 3)}, (8, 2))\n"
            "assert p.dim == 1 and len(p.parts) == 2, p\n"
            "print(len(set(sys.modules) - before))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "0"


@settings(max_examples=12, deadline=None)
@given(numel=st.sampled_from([0, 1, 1000, streaming.STREAM_CHUNK, streaming.STREAM_CHUNK + 1,
                              3 * streaming.STREAM_CHUNK + 7]), seed=st.integers(0, 1000), nonfinite=st.booleans())
def test_an_online_rank_sums_a_reclipped_state_a_chunk_at_a_time_as_whole(numel, seed, nonfinite):
    """An online rank's re-clipped moment is an element-wise map of its raw piece and the main grad's
    (``MappedSource``), summed a chunk at a time: the sums of the whole float64 piece, bit for bit
    where every element is finite (with NaN/Inf, the same counts and finite sums up to the order
    they are added in)."""
    from ttrace_megatron.compare import sliced_shard_sums
    from ttrace_megatron.placement import Layout, Shard
    from ttrace_megatron.step_bounds import reclip_delta

    # (the chunks are tolerance.difference_sums' own: the whole piece's sums add the same chunks)
    gen = torch.Generator().manual_seed(seed)
    state, grad = torch.rand(numel, generator=gen) * 1e-6, torch.randn(numel, generator=gen)
    cand = state * (1 + 1e-6 * torch.randn(numel, generator=gen))
    if nonfinite and numel:
        cand[numel // 2] = float("nan")
    rule = {"beta1": 0.9, "beta2": 0.95}

    def reclipped(s, g):
        return reclip_delta(keys.EXP_AVG_SQ, rule, g, 0.5, 0.5000001).reshape(s.shape).add_(s)

    layout, coords, key = Layout((Shard(0, "tp"),), (2 * numel,)), {"tp": (1, 2)}, KEY
    whole = sliced_shard_sums(key, cand, layout, coords, (2 * numel,), lambda: reclipped(state, grad))
    streamed = sliced_shard_sums(key, cand, layout, coords, (2 * numel,), lambda: streaming.MappedSource(
        [MemorySource(state), MemorySource(grad)], reclipped))
    if nonfinite:
        assert (streamed.compared, streamed.candidate_nonfinite) == (whole.compared, whole.candidate_nonfinite)
        assert streamed.diff_sq == pytest.approx(whole.diff_sq, rel=1e-12)
    else:
        assert streamed == whole


@settings(max_examples=80, deadline=None)
@given(layouts(), st.integers(0, 2**31 - 1), st.sampled_from([1.0, 0.5]))
def test_an_online_rank_sums_a_piece_it_keeps_nothing_of_a_chunk_at_a_time_as_whole(case, seed, scale):
    """A reference piece an online rank keeps nothing of is read through ``PieceSource`` a chunk at
    a time (never whole: a piece of over 32 MiB lands in fresh pages): the sums are the whole
    piece's, bit for bit, at the default chunk."""
    import tempfile

    from ttrace_megatron.compare import reference_piece, reference_piece_source, sliced_shard_sums
    from ttrace_megatron.placement import with_scale

    layout, sizes, stored = case
    layout = dataclasses.replace(layout, scale=scale)
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(layout.logical_shape, generator=gen, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        reader = single_device_reference(tmp, full)
        pieces = group_records(reader)[KEY]
        for coords, shape in rank_pieces(layout, sizes, stored):
            piece = slice_logical(full, layout, coords, shape)
            cand = (piece.double() * (1 + 1e-6 * torch.randn(piece.shape, generator=gen, dtype=torch.float64))
                    ).to(piece.dtype).contiguous()
            source = reference_piece_source(reader, pieces, layout, coords, shape)
            if source is None:
                assert _not_a_view(layout, coords, shape, full.shape)
                continue
            assert source.shape == tuple(shape)
            scaled = source if scale == 1.0 else streaming.MappedSource([source], lambda t: with_scale(t, layout))
            streamed = sliced_shard_sums(KEY, cand, layout, coords, full.shape, lambda: scaled)
            whole = sliced_shard_sums(KEY, cand, layout, coords, full.shape,
                                      lambda: reference_piece(reader, pieces, layout, coords, shape))
            assert streamed == whole


@pytest.mark.parametrize("shape,layout,coords,local", [
    ((3, streaming.STREAM_CHUNK + 10), "cols", {"tp": (1, 2)}, None),
    ((2 * streaming.STREAM_CHUNK + 6, 4), "rows", {"tp": (0, 2)}, None),
])
def test_a_piece_of_many_chunks_is_summed_as_whole(shape, layout, coords, local):
    """:func:`test_an_online_rank_sums_a_piece_it_keeps_nothing_of_a_chunk_at_a_time_as_whole` where
    the piece spans several chunks, strided (a column shard) or not (a row shard)."""
    import tempfile

    from ttrace_megatron.compare import reference_piece, reference_piece_source, sliced_shard_sums
    from ttrace_megatron.placement import Layout, Shard

    dim = 1 if layout == "cols" else 0
    lay = Layout((Shard(dim, "tp"),), shape)
    local = tuple(n // 2 if d == dim else n for d, n in enumerate(shape))
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(shape, generator=gen)
    with tempfile.TemporaryDirectory() as tmp:
        reader = single_device_reference(tmp, full)
        pieces = group_records(reader)[KEY]
        cand = slice_logical(full, lay, coords, local).contiguous() * (1 + 1e-6 * torch.randn(local, generator=gen))
        source = reference_piece_source(reader, pieces, lay, coords, local)
        assert isinstance(source, streaming.PieceSource)
        streamed = sliced_shard_sums(KEY, cand, lay, coords, shape, lambda: source)
        whole = sliced_shard_sums(KEY, cand, lay, coords, shape, lambda: reference_piece(reader, pieces, lay, coords,
                                                                                           local))
        assert streamed == whole and streamed.compared == cand.numel()


def test_a_buffer_given_back_is_taken_again_and_views_are_not():
    """``BufferPool``: a buffer given back is the next one of its byte count taken (any dtype and
    shape of that size); a view of a buffer is not taken back (its storage is still the buffer's);
    a source read into a buffer is the source, whole."""
    pool = streaming.BufferPool()
    a = pool.copy(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(a, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    pool.give(a[1:], a.t())  # views: not taken back
    b = pool.take((6,), torch.float64)
    assert b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    pool.give(a)
    c = pool.take((2, 6), torch.int32)
    assert c.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and c.shape == (2, 6)
    assert pool.take((0,), torch.float32).numel() == 0
    base = torch.randn(5, 2 * streaming.STREAM_CHUNK + 3)
    meta = torch.empty(base.shape, device="meta")[:, 1:]
    source = streaming.PieceSource(MemorySource(base), streaming.Cat((meta,), 0))
    assert torch.equal(pool.read(source), base[:, 1:])
