"""The placement vocabulary: slice then merge is the identity, and bad pieces are named."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ttrace_megatron.placement import (Layout, Partial, PlacementError, RangeShard, Replicate, Shard, ZIGZAG,
                                       logical_mask, merge_pieces, merge_shards, placement_from_json, placement_to_json,
                                       slice_logical)

AXES = ("tp", "cp", "dp")


def _all_coords(sizes):
    coords = [{}]
    for axis, n in sizes.items():
        coords = [dict(c, **{axis: (r, n)}) for c in coords for r in range(n)]
    return coords


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 3))
    n_pl = draw(st.integers(1, 3))
    axes = draw(st.permutations(AXES))[:n_pl]
    sizes = {a: draw(st.integers(1, 3)) for a in axes}
    placements = []
    divisors = [1] * ndim  # what each dim's stored size must be divisible by
    for a in axes:
        kind = draw(st.sampled_from(["shard", "shard", "replicate", "partial"]))
        if kind == "shard":
            dim = draw(st.integers(0, ndim - 1))
            layout = draw(st.sampled_from(["contiguous", "contiguous", ZIGZAG]))
            stride = 1 if layout == ZIGZAG else draw(st.integers(1, 2))
            blocks = 2 if layout == ZIGZAG else stride
            divisors[dim] *= sizes[a] * blocks
            placements.append(Shard(dim, a, stride, layout))
        elif kind == "replicate":
            placements.append(Replicate(a))
        else:
            placements.append(Partial(a))
    stored = [d * draw(st.integers(1, 2)) for d in divisors]
    # padding: the logical size may be smaller than what the shards hold (vocab padding),
    # only for dims split once with a contiguous layout
    logical = list(stored)
    for p in placements:
        if isinstance(p, Shard) and p.layout == "contiguous" and p.stride == 1 and \
                sum(isinstance(q, Shard) and q.dim == p.dim for q in placements) == 1:
            logical[p.dim] = stored[p.dim] - draw(st.integers(0, stored[p.dim] // sizes[p.axis] - 1)) \
                if stored[p.dim] // sizes[p.axis] > 1 else stored[p.dim]
    permute = tuple(draw(st.permutations(range(ndim)))) if draw(st.booleans()) else None
    logical_perm = tuple(logical[d] for d in permute) if permute else tuple(logical)
    if draw(st.booleans()):  # a distributed-optimizer style flat range split, innermost
        local = list(stored)
        for p in placements:
            if isinstance(p, Shard):
                local[p.dim] //= sizes[p.axis]
        n = draw(st.integers(1, 3))
        numel = 1
        for d in local:
            numel *= d
        cuts = sorted(draw(st.lists(st.integers(0, numel), min_size=n - 1, max_size=n - 1)))
        placements.append(RangeShard("zero", (0, *cuts, numel), tuple(local)))
        sizes["zero"] = n
    return Layout(tuple(placements), logical_perm, permute), sizes, stored


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(0, 2**31 - 1))
def test_slice_then_merge_is_identity(case, seed):
    layout, sizes, stored = case
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(layout.logical_shape, generator=g, dtype=torch.float64)
    local_shape = list(stored)
    for p in layout.placements:
        if isinstance(p, Shard):
            local_shape[p.dim] //= sizes[p.axis]

    def shape_at(coords):
        last = layout.placements[-1]
        if isinstance(last, RangeShard):
            start, end = last.piece(coords[last.axis][0])
            return (end - start,)
        return local_shape

    pieces = [(c, slice_logical(full, layout, c, shape_at(c))) for c in _all_coords(sizes)]
    merged = merge_shards(pieces, layout)
    assert merged.replica_mismatches == []
    assert torch.equal(merged.tensor, full)


def test_megatron_stride_matches_its_initializer():
    """Stride-2 column shards (the gated MLP's fc1) are laid out as megatron's CPU init lays them."""
    out, inp, tp, stride = 8, 3, 2, 2
    master = torch.arange(out * inp, dtype=torch.float32).reshape(out, inp)
    # megatron.core.tensor_parallel.layers._initialize_affine_weight_cpu: split the master weight
    # into per_partition/stride chunks and give rank r the chunks r::tp
    chunks = torch.split(master, out // tp // stride, dim=0)
    shards = [torch.cat(chunks[r::tp], dim=0) for r in range(tp)]
    layout = Layout((Shard(0, "tp", stride=stride),), (out, inp))
    merged = merge_shards([({"tp": (r, tp)}, s) for r, s in enumerate(shards)], layout)
    assert torch.equal(merged.tensor, master)
    for r in range(tp):
        assert torch.equal(slice_logical(master, layout, {"tp": (r, tp)}, shards[r].shape), shards[r])


def test_zigzag_matches_context_parallel_chunk_order():
    """CP rank r holds chunks r and 2·cp−1−r (megatron's get_batch_on_this_cp_rank)."""
    seq = torch.arange(8)
    layout = Layout((Shard(0, "cp", layout=ZIGZAG),), (8,))
    assert slice_logical(seq, layout, {"cp": (0, 2)}, (4,)).tolist() == [0, 1, 6, 7]
    assert slice_logical(seq, layout, {"cp": (1, 2)}, (4,)).tolist() == [2, 3, 4, 5]


def test_partial_sums_and_replica_disagreement_reported():
    layout = Layout((Replicate("dp"), Partial("tp")), (3,))
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.5, 0.5])
    pieces = [({"dp": (0, 2), "tp": (0, 2)}, a), ({"dp": (0, 2), "tp": (1, 2)}, b),
              ({"dp": (1, 2), "tp": (0, 2)}, a), ({"dp": (1, 2), "tp": (1, 2)}, b + 1)]
    merged = merge_shards(pieces, layout)
    assert torch.equal(merged.tensor, torch.tensor([1.5, 2.5, 3.5]))
    assert len(merged.replica_mismatches) == 1 and merged.replica_mismatches[0].axis == "dp"


def test_missing_piece_is_named():
    layout = Layout((Shard(0, "tp"),), (4,))
    with pytest.raises(PlacementError, match=r"rank\(s\) \[1\] along axis 'tp'"):
        merge_shards([({"tp": (0, 3)}, torch.zeros(2)), ({"tp": (2, 3)}, torch.zeros(2))], layout)


def test_duplicate_piece_is_rejected():
    layout = Layout((Shard(0, "tp"),), (4,))
    with pytest.raises(PlacementError, match="two pieces"):
        merge_shards([({"tp": (0, 2)}, torch.zeros(2)), ({"tp": (0, 2)}, torch.zeros(2))], layout)


def test_range_shard_follows_flat_ownership_with_padding():
    """The distributed optimizer's view: rank r owns a flat range of its TP shard, possibly empty;
    padding (a vocabulary padded per TP size) is masked in the flat piece too."""
    full = torch.arange(5 * 2, dtype=torch.float32).reshape(5, 2)  # logical vocab 5, padded to 3 per TP rank
    layout = Layout((Shard(0, "tp"), RangeShard("dp", (0, 6, 6), (3, 2))), (5, 2))
    tp1 = {"tp": (1, 2), "dp": (0, 2)}
    assert slice_logical(full, layout, tp1, (6,)).tolist() == [6, 7, 8, 9, 0, 0]
    assert slice_logical(full, layout, {"tp": (1, 2), "dp": (1, 2)}, (0,)).numel() == 0
    assert logical_mask(layout, tp1, (6,)).tolist() == [True] * 4 + [False] * 2
    pieces = [({"tp": (t, 2), "dp": (d, 2)}, slice_logical(full, layout, {"tp": (t, 2), "dp": (d, 2)},
                                                            ((6,) if d == 0 else (0,))))
              for t in range(2) for d in range(2)]
    assert torch.equal(merge_shards(pieces, layout).tensor, full)
    with pytest.raises(PlacementError, match="its range"):
        merge_shards([(c, torch.zeros(1)) for c, _ in pieces], layout)
    with pytest.raises(ValueError, match="innermost"):
        Layout((RangeShard("dp", (0, 6), (3, 2)), Shard(0, "tp")), (5, 2))
    with pytest.raises(ValueError, match="rise from 0"):
        RangeShard("dp", (0, 7, 6), (3, 2))


def test_json_round_trip():
    for p in (Shard(-1, "tp", 2), Shard(0, "cp", layout=ZIGZAG), Replicate("dp"), Partial("tp"),
              RangeShard("dp", (0, 2, 6), (3, 2))):
        assert placement_from_json(placement_to_json(p)) == p
    layout = Layout((Shard(0, "tp"),), (2, 3, 4), (1, 0, 2))
    assert Layout.from_json(layout.to_json()) == layout


def test_replicas_with_size_one_dims_compare_bitwise():
    """Found by hypothesis: a permuted replica with a size-1 dim kept a stride that forbade a byte view."""
    full = torch.randn(1, 2, dtype=torch.float64)
    layout = Layout((Shard(0, "tp"), Replicate("cp")), (1, 2), (1, 0))
    coords = [{"tp": (r, 2), "cp": (c, 2)} for r in range(2) for c in range(2)]
    pieces = [(c, slice_logical(full, layout, c, (1, 1))) for c in coords]
    merged = merge_shards(pieces, layout)
    assert merged.replica_mismatches == [] and torch.equal(merged.tensor, full)



def test_scale_is_divided_out_by_merge_and_applied_by_slice():
    """Per-microbatch grads of a DP=2 run are stored at twice a DP=1 run's scale: merge gives the
    logical value, slice gives what a rank stores, and neither changes the positions (mask)."""
    full = torch.randn(4, 6, dtype=torch.float64)
    layout = Layout((Shard(1, "tp"),), (4, 6), scale=2.0)
    coords = [{"tp": (r, 2)} for r in range(2)]
    pieces = [(c, slice_logical(full, layout, c, (4, 3))) for c in coords]
    assert torch.equal(pieces[1][1], 2.0 * full[:, 3:])
    assert torch.equal(merge_shards(pieces, layout).tensor, full)
    assert logical_mask(layout, coords[0], (4, 3)) is None
    assert Layout.from_json(layout.to_json()) == layout
    assert "scale" not in Layout((Shard(1, "tp"),), (4, 6)).to_json()  # the default is not written
    with pytest.raises(ValueError, match="scale"):
        Layout((Shard(1, "tp"),), (4, 6), scale=0.0)


def test_owned_piece_is_a_view_of_the_rank_range():
    from ttrace_megatron.placement import owned_piece

    layout = Layout((Replicate("tp"), RangeShard("dp", (0, 5, 12), (3, 4))), (3, 4))
    whole = torch.arange(12.0).reshape(3, 4)
    mine = owned_piece(whole, layout, {"tp": (0, 1), "dp": (1, 2)})
    assert torch.equal(mine, torch.arange(5.0, 12.0))
    mine.zero_()  # a view: writes reach the whole tensor (the replay substitutes main grads this way)
    assert float(whole.view(-1)[5:].abs().sum()) == 0.0
    assert owned_piece(whole, Layout((Replicate("dp"),), (3, 4)), {"dp": (0, 2)}) is whole
    with pytest.raises(PlacementError, match="ranges"):
        owned_piece(whole, layout, {"tp": (0, 1), "dp": (1, 3)})


def _copies_split_by_stage(logical, bounds_per_stage):
    """A tied weight's copies on two pipeline stages, each owned by DP ranks over its own ranges."""
    pieces = []
    flat = logical.reshape(-1)
    for pp, bounds in enumerate(bounds_per_stage):
        layout = Layout((Replicate("pp"), RangeShard("dp", bounds, tuple(logical.shape))), tuple(logical.shape))
        for dp in range(len(bounds) - 1):
            pieces.append(({"pp": (pp, 2), "dp": (dp, len(bounds) - 1)}, flat[bounds[dp]:bounds[dp + 1]].clone(),
                           layout))
    return pieces


def test_replicas_split_each_their_own_way_merge_and_are_compared():
    logical = torch.arange(12.0).reshape(4, 3)
    pieces = _copies_split_by_stage(logical, [(0, 0, 12), (0, 12, 12)])
    merged = merge_pieces(pieces)
    assert torch.equal(merged.tensor, logical) and not merged.replica_mismatches
    # the copies disagree: reported like any replicas that differ, not an error
    pieces[-2] = (pieces[-2][0], pieces[-2][1] + 1.0, pieces[-2][2])
    merged = merge_pieces(pieces)
    assert [(m.axis, m.ranks, m.max_abs_diff) for m in merged.replica_mismatches] == [("pp", (0, 1), 1.0)]


def test_pieces_split_otherwise_differently_still_refuse():
    a = Layout((Shard(0, "tp"), RangeShard("dp", (0, 6, 6), (3, 2))), (6, 2))
    b = Layout((Shard(0, "tp"), RangeShard("dp", (0, 2, 6), (3, 2))), (6, 2))
    pieces = [({"tp": (0, 2), "dp": (0, 2)}, torch.zeros(6), a), ({"tp": (1, 2), "dp": (0, 2)}, torch.zeros(2), b)]
    with pytest.raises(PlacementError, match="different placements"):
        merge_pieces(pieces)


def test_copies_may_differ_in_their_owned_ranges_only():
    """Below a Replicate axis, copies split with other placements than each other are an error (a
    disagreement between two ranks' layouts is ttrace's, never a replica mismatch of the run)."""
    logical = torch.arange(12.0).reshape(4, 3)
    a = Layout((Replicate("pp"), Shard(0, "tp")), (4, 3))
    b = Layout((Replicate("pp"), Partial("tp")), (4, 3))
    pieces = [({"pp": (0, 2), "tp": (r, 2)}, logical[2 * r:2 * r + 2], a) for r in range(2)]
    pieces += [({"pp": (1, 2), "tp": (r, 2)}, logical / 2, b) for r in range(2)]
    with pytest.raises(PlacementError, match="different placements"):
        merge_pieces(pieces)


def test_pieces_that_differ_in_scale_alone_merge_each_by_its_own():
    """A per-rank scale (each rank's own loss scale): every piece is divided by its own scale
    before the merge; anything else that differs is still refused."""
    import dataclasses

    import torch

    from ttrace_megatron.placement import Layout, PlacementError, Shard, alike_but_scale, merge_pieces

    full = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    base = Layout((Shard(-1, "tp"),), (2, 4))
    pieces = [({"tp": (0, 2)}, full[:, :2] * 4096, dataclasses.replace(base, scale=4096.0)),
              ({"tp": (1, 2)}, full[:, 2:] * 2048, dataclasses.replace(base, scale=2048.0))]
    assert alike_but_scale([lay for _, _, lay in pieces])
    assert torch.equal(merge_pieces(pieces).tensor, full.double())
    other = Layout((Shard(0, "tp"),), (2, 4), scale=2048.0)
    with pytest.raises(PlacementError):
        merge_pieces([pieces[0], ({"tp": (1, 2)}, full[1:], other)])
