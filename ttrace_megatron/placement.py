"""Partition metadata: how a rank's tensor relates to the logical (single-device) tensor.

This is the project's one placement vocabulary. The same :class:`Layout` drives

* ``merge``: shards recorded on many ranks -> the logical tensor (for comparison),
* ``slice``: a logical tensor -> this rank's shard (for the seed checkpoint and for replay),

so there is exactly one set of rules for every parallel dimension. The vocabulary follows
``torch.distributed.tensor`` (Shard / Replicate / Partial over named mesh axes) and adds what
megatron-core needs beyond it: interleaved ``stride`` blocks (``partition_stride``; e.g. the gated
MLP's ``[gate; up]`` per rank), the context-parallel ``zigzag`` chunk order, and a logical shape
that trims padding (the vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp``).

A layout also says how a rank's stored values relate to the logical values: ``scale`` (every
rank stores ``scale`` × its piece of the logical tensor; per-microbatch grads carry the loss
scale 1/num_microbatches of their run, which depends on its DP size, and under fp16 the loss scale).
``merge_shards`` divides it out and ``slice_logical`` multiplies it in, so no other code scales
values by hand. Ranks may record different scales (:func:`alike_but_scale`): each piece is divided by
its own.

Placements are listed from the outermost split to the innermost: for a sequence split first over
CP and then over TP (sequence parallelism) it is ``(Shard(0, "cp", layout="zigzag"), Shard(0, "tp"))``.
Axes that are not listed do not relate the tensors of different ranks (another pipeline stage,
another data-parallel microbatch): such tensors have different keys and are never merged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

CONTIGUOUS = "contiguous"
# no device holds a tensor with a dimension of 2^40 elements (2 TiB in bf16): a trace that says so is
# damaged, and its shape must not reach the placement rules, whose padding would size tensors by it
MAX_DIM = 1 << 40
ZIGZAG = "zigzag"


class PlacementError(ValueError):
    """Shards that cannot be merged (missing, duplicated or inconsistent pieces)."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """Split along ``dim`` over the ranks of mesh ``axis``.

    ``stride > 1``: each rank's piece is ``stride`` equal blocks, and block ``j`` of rank ``r`` is
    logical chunk ``j * n + r`` (megatron's ``partition_stride``). ``layout="zigzag"``: the logical
    dim is ``2 n`` chunks and rank ``r`` holds chunks ``r`` and ``2 n - 1 - r`` (causal CP).
    """

    dim: int
    axis: str
    stride: int = 1
    layout: str = CONTIGUOUS

    def __post_init__(self):
        if self.stride < 1:
            raise ValueError(f"Shard stride must be >= 1, got {self.stride}")
        if self.layout not in (CONTIGUOUS, ZIGZAG):
            raise ValueError(f"unknown Shard layout {self.layout!r}")
        if self.layout == ZIGZAG and self.stride != 1:
            raise ValueError("a zigzag Shard cannot also be strided")


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Every rank of ``axis`` holds the whole value; the copies must agree bit for bit."""

    axis: str


@dataclasses.dataclass(frozen=True)
class Partial:
    """The logical value is the sum of the ranks' values over ``axis`` (an unreduced partial sum)."""

    axis: str


@dataclasses.dataclass(frozen=True)
class RangeShard:
    """Rank ``r`` of ``axis`` holds elements ``[bounds[r], bounds[r + 1])`` of the tensor flattened.

    ``shape`` is the shape of the tensor that is flattened (what the outer placements leave), so
    the pieces can be put back. This is how a ZeRO-style optimizer owns its shard of a flat grad
    buffer: ranges that ignore the tensor's dims, and a rank may own nothing. It must be the
    innermost placement, and the rank stores its range as a 1-D tensor.
    """

    axis: str
    bounds: Tuple[int, ...]
    shape: Tuple[int, ...]

    def __post_init__(self):
        b = tuple(int(x) for x in self.bounds)
        object.__setattr__(self, "bounds", b)
        object.__setattr__(self, "shape", tuple(int(x) for x in self.shape))
        if len(b) < 2 or b[0] != 0 or b[-1] != math.prod(self.shape) or any(x > y for x, y in zip(b, b[1:])):
            raise ValueError(f"RangeShard bounds {b} must rise from 0 to {math.prod(self.shape)} (shape {self.shape})")

    @property
    def size(self) -> int:
        return len(self.bounds) - 1

    def piece(self, rank: int) -> Tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]


Placement = Union[Shard, Replicate, Partial, RangeShard]
SHARDING = (Shard, RangeShard)  # placements whose ranks hold different parts of the tensor


def stored_copies(placements: Sequence[Placement], sizes: Mapping[str, int]) -> int:
    """How many times the ranks of the listed axes together store a tensor's logical elements: a
    Shard or RangeShard splits them over its axis (once), a Replicate or Partial keeps them whole on
    every rank of it (the axis size). Padding of uneven shards is not counted. What a trace of the
    tensor costs on disk, summed over ranks (``plan``)."""
    return math.prod(1 if isinstance(p, SHARDING) else int(sizes.get(p.axis, 1)) for p in placements)


def _range_shard(layout: "Layout") -> Optional[RangeShard]:
    last = layout.placements[-1] if layout.placements else None
    return last if isinstance(last, RangeShard) else None

# rank coordinates of one recorded tensor: axis name -> (rank along the axis, axis size)
Coords = Mapping[str, Tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Placements of one tensor plus the logical shape after padding is trimmed.

    Shard dims refer to the tensor as ranks store it. ``permute`` (optional) maps the stored dim
    order to the logical one, for tensors whose memory layout depends on the parallel mode (the
    embedding output is ``[b, s, h]`` without sequence parallelism and ``[s/tp, b, h]`` with it):
    ``logical = merged.permute(permute)``. ``logical_shape`` is in logical dim order. ``scale``:
    every rank stores ``scale`` times the logical value (see the module docstring).
    """

    placements: Tuple[Placement, ...]
    logical_shape: Tuple[int, ...]
    permute: Optional[Tuple[int, ...]] = None
    scale: float = 1.0  # each rank stores scale × the logical value

    @property
    def axes(self) -> Tuple[str, ...]:
        return tuple(p.axis for p in self.placements)

    def __post_init__(self):
        seen = set()
        for p in self.placements:
            if p.axis in seen:
                raise ValueError(f"axis {p.axis!r} appears twice in {self.placements}")
            seen.add(p.axis)
        for i, p in enumerate(self.placements):
            if isinstance(p, Shard) and not -len(self.logical_shape) <= p.dim < len(self.logical_shape):
                raise ValueError(f"{p} is out of range for a tensor of rank {len(self.logical_shape)}")
            if isinstance(p, RangeShard) and i != len(self.placements) - 1:
                raise ValueError(f"{p} must be the innermost (last) placement")
            if isinstance(p, RangeShard) and len(p.shape) != len(self.logical_shape):
                raise ValueError(f"{p} flattens a tensor of rank {len(p.shape)}, the logical tensor has rank "
                                 f"{len(self.logical_shape)}")
        if self.permute is not None and sorted(self.permute) != list(range(len(self.logical_shape))):
            raise ValueError(f"permute {self.permute} is not a permutation of {len(self.logical_shape)} dims")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a positive finite number, got {self.scale}")

    def to_json(self) -> dict:
        obj = {
            "placements": [placement_to_json(p) for p in self.placements],
            "logical_shape": list(self.logical_shape),
        }
        if self.permute is not None:
            obj["permute"] = list(self.permute)
        if self.scale != 1.0:
            obj["scale"] = self.scale
        return obj

    @staticmethod
    def from_json(obj: dict) -> "Layout":
        permute = obj.get("permute")
        return Layout(
            placements=tuple(placement_from_json(p) for p in obj["placements"]),
            logical_shape=shape_from_json(obj["logical_shape"]),
            permute=None if permute is None else tuple(int(d) for d in permute),
            scale=float(obj.get("scale", 1.0)),
        )


def shape_from_json(values) -> Tuple[int, ...]:
    """A tensor shape as a trace lists it: each dimension an integer from 0 to :data:`MAX_DIM`
    (ValueError otherwise: a damaged trace, which its reader names)."""
    dims = tuple(int(v) for v in values)
    if any(isinstance(v, bool) for v in values) or not all(0 <= d <= MAX_DIM for d in dims):
        raise ValueError(f"shape {list(values)!r} is not a tensor's")
    return dims


def placement_to_json(p: Placement) -> dict:
    if isinstance(p, Shard):
        return {"type": "shard", "dim": p.dim, "axis": p.axis, "stride": p.stride, "layout": p.layout}
    if isinstance(p, Replicate):
        return {"type": "replicate", "axis": p.axis}
    if isinstance(p, Partial):
        return {"type": "partial", "axis": p.axis}
    if isinstance(p, RangeShard):
        return {"type": "range_shard", "axis": p.axis, "bounds": list(p.bounds), "shape": list(p.shape)}
    raise TypeError(f"not a placement: {p!r}")


def placement_from_json(obj: dict) -> Placement:
    kind = obj.get("type")
    if kind == "shard":
        return Shard(int(obj["dim"]), str(obj["axis"]), int(obj.get("stride", 1)), str(obj.get("layout", CONTIGUOUS)))
    if kind == "replicate":
        return Replicate(str(obj["axis"]))
    if kind == "partial":
        return Partial(str(obj["axis"]))
    if kind == "range_shard":
        return RangeShard(str(obj["axis"]), tuple(int(b) for b in obj["bounds"]), tuple(int(d) for d in obj["shape"]))
    raise ValueError(f"unknown placement {obj!r}")


# --------------------------------------------------------------------------------------------
# piece arithmetic for one Shard placement


def _chunk_order(shard: Shard, n: int) -> List[Tuple[int, int]]:
    """(rank, block within the rank's piece) for each logical chunk, in logical order."""
    if shard.layout == ZIGZAG:
        order = [None] * (2 * n)
        for r in range(n):
            order[r] = (r, 0)
            order[2 * n - 1 - r] = (r, 1)
        return order
    return [(r, j) for j in range(shard.stride) for r in range(n)]


def _blocks_per_piece(shard: Shard) -> int:
    return 2 if shard.layout == ZIGZAG else shard.stride


def _join(shard: Shard, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    n = len(pieces)
    k = _blocks_per_piece(shard)
    dim = shard.dim
    if n == 1 and k == 1:
        return pieces[0]  # one rank holds it all (a single-device reference): no copy
    if k == 1:
        return torch.cat(list(pieces), dim=dim)
    blocks = []
    for p in pieces:
        if p.shape[dim] % k:
            raise PlacementError(f"a piece of size {p.shape[dim]} on dim {dim} cannot hold {k} blocks of {shard}")
        blocks.append(torch.chunk(p, k, dim=dim))
    return torch.cat([blocks[r][j] for r, j in _chunk_order(shard, n)], dim=dim)


def _split(shard: Shard, full: torch.Tensor, n: int, rank: int, piece_size: int) -> torch.Tensor:
    """This rank's piece of ``full`` (already padded to ``n * piece_size`` along the dim)."""
    k = _blocks_per_piece(shard)
    dim = shard.dim
    if piece_size % k:
        raise PlacementError(f"piece size {piece_size} is not a multiple of {k} blocks for {shard}")
    block = piece_size // k
    chunks = torch.split(full, block, dim=dim)
    mine = [chunks[c] for c, (r, _) in enumerate(_chunk_order(shard, n)) if r == rank]
    return torch.cat(mine, dim=dim) if len(mine) > 1 else mine[0]


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    have = t.shape[dim]
    if have == size:
        return t
    if have > size:
        raise PlacementError(f"logical size {have} on dim {dim} exceeds the {size} the shards hold")
    pad_shape = list(t.shape)
    pad_shape[dim] = size - have
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


# --------------------------------------------------------------------------------------------
# slice: logical -> this rank's shard


def slice_logical(full: torch.Tensor, layout: Layout, coords: Coords, local_shape: Sequence[int],
                  *, contiguous: bool = True) -> torch.Tensor:
    """The piece of the logical tensor ``full`` that the rank at ``coords`` holds.

    ``local_shape`` is the shape of the rank's tensor; it determines padding (a vocab padded to a
    multiple of 128·tp). A :class:`Partial` gives the whole value to rank 0 and zeros elsewhere,
    which is one valid decomposition of the sum. The layout's ``scale`` is applied (in float64),
    so the result is what the rank stores. ``contiguous=False`` may return a view of ``full`` (no
    copy, when the scale is 1), for a caller that only reads it.
    """
    if tuple(full.shape) != tuple(layout.logical_shape):
        raise PlacementError(f"logical tensor has shape {tuple(full.shape)}, layout says {layout.logical_shape}")
    local_shape = tuple(local_shape)
    ranges = _range_shard(layout)
    stored_shape = ranges.shape if ranges is not None else local_shape  # the rank's tensor before flattening
    t = full
    if layout.permute is not None:
        inverse = [0] * len(layout.permute)
        for logical_dim, stored_dim in enumerate(layout.permute):
            inverse[stored_dim] = logical_dim
        t = t.permute(inverse)
    for i, p in enumerate(layout.placements):
        rank, size = _coord(coords, p.axis)
        if isinstance(p, Shard):
            dim = p.dim % t.dim()
            if dim >= len(stored_shape):  # (a damaged manifest's shape: a named error, not an IndexError)
                raise PlacementError(f"the rank's tensor has {len(stored_shape)} dims, and its layout shards dim {dim}")
            inner = math.prod(
                _coord(coords, q.axis)[1]
                for q in layout.placements[i + 1:]
                if isinstance(q, Shard) and q.dim % t.dim() == dim
            )
            piece = stored_shape[dim] * inner
            t = _pad_to(t, dim, piece * size)
            t = _split(dataclasses.replace(p, dim=dim), t, size, rank, piece)
        elif isinstance(p, Partial) and rank != 0:
            t = torch.zeros_like(t)
        elif isinstance(p, RangeShard):
            if p.size != size:
                raise PlacementError(f"{p} has {p.size} ranges, axis {p.axis!r} has {size} ranks")
            if tuple(t.shape) != p.shape:
                raise PlacementError(f"{p} flattens shape {p.shape}, the outer placements leave {tuple(t.shape)}")
            start, end = p.piece(rank)
            t = t.reshape(-1)[start:end]
    if tuple(t.shape) != local_shape:
        raise PlacementError(f"slice gave shape {tuple(t.shape)}, the rank holds {local_shape}")
    if layout.scale != 1.0:
        return with_scale(t, layout)
    return t.contiguous() if contiguous else t


def with_scale(piece: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A rank's piece in logical units as the rank stores it: the layout's scale applied in float64
    (:func:`slice_logical`'s last step; the piece itself where the scale is 1)."""
    return piece.to(torch.float64) * layout.scale if layout.scale != 1.0 else piece


def owned_piece(whole: torch.Tensor, layout: Layout, coords: Coords) -> torch.Tensor:
    """What a rank stores of a tensor it holds whole but owns only a range of (the distributed
    optimizer's main grads: the rank's whole grad buffer, of which only its :class:`RangeShard`
    range is reduced): a view of that range, flattened. Without a RangeShard, ``whole`` itself."""
    ranges = _range_shard(layout)
    if ranges is None:
        return whole
    rank, size = _coord(coords, ranges.axis)
    if ranges.size != size:
        raise PlacementError(f"{ranges} has {ranges.size} ranges, axis {ranges.axis!r} has {size} ranks")
    if tuple(whole.shape) != ranges.shape:
        raise PlacementError(f"{ranges} cuts a tensor of shape {ranges.shape}, the rank holds {tuple(whole.shape)}")
    start, end = ranges.piece(rank)
    return whole.view(-1)[start:end]


def logical_mask(layout: Layout, coords: Coords, local_shape: Sequence[int]) -> Optional[torch.Tensor]:
    """Which positions of the rank's piece belong to the logical tensor (False on padding, e.g. a
    vocabulary padded per TP size); None when the piece has no padding."""
    layout = dataclasses.replace(layout, scale=1.0)  # positions, not values
    pieces = math.prod(_coord(coords, p.axis)[1] for p in layout.placements if isinstance(p, Shard))
    ranges = _range_shard(layout)
    if ranges is not None:
        local_shape_before = ranges.shape
        if math.prod(local_shape_before) * pieces == math.prod(layout.logical_shape):
            return None
        return slice_logical(torch.ones(layout.logical_shape, dtype=torch.bool), layout, coords, local_shape)
    if math.prod(local_shape) * pieces == math.prod(layout.logical_shape):
        return None
    return slice_logical(torch.ones(layout.logical_shape, dtype=torch.bool), layout, coords, local_shape)


# --------------------------------------------------------------------------------------------
# merge: shards -> logical


@dataclasses.dataclass
class ReplicaMismatch:
    """Replicas over ``axis`` that differ (the copies held by ``ranks``)."""

    axis: str
    ranks: Tuple[int, ...]
    max_abs_diff: float


@dataclasses.dataclass
class Merged:
    tensor: torch.Tensor
    replica_mismatches: List[ReplicaMismatch]


def _coord(coords: Coords, axis: str) -> Tuple[int, int]:
    if axis not in coords:
        raise PlacementError(f"rank coordinates {dict(coords)} do not name axis {axis!r}")
    rank, size = coords[axis]
    if not 0 <= rank < size:
        raise PlacementError(f"rank {rank} is outside axis {axis!r} of size {size}")
    return int(rank), int(size)


def check_coords(coords: Coords, layout: Layout) -> None:
    """Raise PlacementError unless ``coords`` names every axis of ``layout`` with a valid rank."""
    for p in layout.placements:
        _coord(coords, p.axis)


def merge_shards(pieces: Iterable[Tuple[Coords, torch.Tensor]], layout: Layout) -> Merged:
    """Reassemble the logical tensor from every rank's piece.

    Shards are concatenated (de-interleaved for strided and zigzag layouts), partial sums are added
    in float64, and replicas are checked to be bitwise identical; a disagreement is returned, not
    hidden, and the lowest rank's copy is used. The layout's ``scale`` is divided out (in float64).
    """
    axes = layout.axes
    current: Dict[Tuple[int, ...], torch.Tensor] = {}
    sizes: Dict[str, int] = {}
    for coords, tensor in pieces:
        key = []
        for axis in axes:
            rank, size = _coord(coords, axis)
            if sizes.setdefault(axis, size) != size:
                raise PlacementError(f"axis {axis!r} has size {size} on one rank and {sizes[axis]} on another")
            key.append(rank)
        key = tuple(key)
        if key in current:
            raise PlacementError(f"two pieces claim position {dict(zip(axes, key))}")
        current[key] = tensor
    if not current:
        raise PlacementError("no pieces to merge")
    for axis in axes:
        have = {k[axes.index(axis)] for k in current}
        missing = sorted(set(range(sizes[axis])) - have)
        if missing:
            raise PlacementError(f"missing the piece(s) of rank(s) {missing} along axis {axis!r}")

    mismatches: List[ReplicaMismatch] = []
    for level in reversed(range(len(axes))):
        p = layout.placements[level]
        groups: Dict[Tuple[int, ...], List[Tuple[int, torch.Tensor]]] = {}
        for key, tensor in current.items():
            groups.setdefault(key[:level], []).append((key[level], tensor))
        merged: Dict[Tuple[int, ...], torch.Tensor] = {}
        for outer, members in groups.items():
            members.sort(key=lambda m: m[0])
            ranks = [m[0] for m in members]
            if ranks != list(range(sizes[p.axis])):
                raise PlacementError(f"pieces along axis {p.axis!r} at {outer} are ranks {ranks}")
            tensors = [m[1] for m in members]
            if isinstance(p, RangeShard):
                merged[outer] = _join_ranges(p, tensors)
            elif isinstance(p, Shard):
                merged[outer] = _join(dataclasses.replace(p, dim=p.dim % tensors[0].dim()), tensors)
            elif isinstance(p, Partial):
                acc = torch.zeros(tensors[0].shape, dtype=torch.float64)
                for t in tensors:
                    acc += t.to(torch.float64)
                merged[outer] = acc.to(_accumulation_dtype(tensors[0].dtype))
            else:
                first = tensors[0]
                differing = [r for r, t in zip(ranks[1:], tensors[1:]) if not _bitwise_equal(first, t)]
                if differing:
                    diff = max(_max_abs_diff(first, t) for t in tensors[1:])
                    mismatches.append(ReplicaMismatch(p.axis, tuple(ranks), diff))
                merged[outer] = first
        current = merged
    (tensor,) = current.values()
    if layout.permute is not None:
        tensor = tensor.permute(layout.permute)
    tensor = _trim(tensor, layout.logical_shape)
    if layout.scale != 1.0:
        tensor = tensor.to(torch.float64) / layout.scale
    return Merged(tensor, mismatches)


def alike_but_scale(layouts: Sequence[Layout]) -> bool:
    """Whether ``layouts`` differ in their per-rank ``scale`` alone: ranks whose values carry
    different factors (a loss scale each rank keeps for itself). Each piece is then brought to
    logical units by its own scale; replicas that then differ are still a mismatch."""
    return all(dataclasses.replace(lay, scale=1.0) == dataclasses.replace(layouts[0], scale=1.0) for lay in layouts)


def replicas_split_alike(layouts: Sequence[Layout]) -> bool:
    """Whether pieces recorded under ``layouts`` are copies of one tensor over an outer ``Replicate``
    axis whose layouts differ only in their owned ranges: a tied weight's copies on two pipeline
    stages, each in its own stage's distributed-optimizer buckets, own different ranges. Any other
    difference between two ranks' layouts is an error, never a replica mismatch."""
    first = layouts[0]
    if not first.placements or not isinstance(first.placements[0], Replicate):
        return False
    return all(_without_range_bounds(lay) == _without_range_bounds(first) for lay in layouts)


def _without_range_bounds(layout: Layout) -> Layout:
    """The layout with its owned ranges set aside: the only thing copies may differ in."""
    return dataclasses.replace(layout, placements=tuple(
        dataclasses.replace(p, bounds=(0, math.prod(p.shape))) if isinstance(p, RangeShard) else p
        for p in layout.placements))


def merge_pieces(pieces: Sequence[Tuple[Coords, torch.Tensor, Layout]]) -> Merged:
    """:func:`merge_shards` for pieces that each carry their layout. One layout: merged under it.
    Layouts that differ below an outer ``Replicate`` axis (:func:`replicas_split_alike`): each copy
    is merged under its own layout, then the copies are checked to be bitwise identical, like any
    replicas (the lowest copy is used). Anything else is a :class:`PlacementError`."""
    layouts = [lay for _, _, lay in pieces]
    if all(lay == layouts[0] for lay in layouts[1:]):
        return merge_shards([(c, t) for c, t, _ in pieces], layouts[0])
    if alike_but_scale(layouts):  # each rank's piece in logical units first (its own scale divided out)
        return merge_shards([(c, t.to(torch.float64) / lay.scale) for c, t, lay in pieces],
                            dataclasses.replace(layouts[0], scale=1.0))
    if not replicas_split_alike(layouts):
        raise PlacementError(f"the pieces record different placements ({layouts[0].to_json()} vs "
                             f"{next(lay for lay in layouts if lay != layouts[0]).to_json()})")
    axis = layouts[0].placements[0].axis
    copies: Dict[int, List[Tuple[Coords, torch.Tensor, Layout]]] = {}
    sizes = set()
    for coords, tensor, lay in pieces:
        rank, size = _coord(coords, axis)
        sizes.add(size)
        copies.setdefault(rank, []).append((coords, tensor, dataclasses.replace(lay, placements=lay.placements[1:])))
    if len(sizes) > 1:
        raise PlacementError(f"axis {axis!r} has sizes {sorted(sizes)} on different ranks")
    if sorted(copies) != list(range(size)):
        raise PlacementError(f"pieces along axis {axis!r} are ranks {sorted(copies)}, not all {size}")
    merged = [merge_pieces(copies[r]) for r in sorted(copies)]
    mismatches = [m for part in merged for m in part.replica_mismatches]
    first = merged[0].tensor
    differing = [m.tensor for m in merged[1:] if not _bitwise_equal(first, m.tensor)]
    if differing:
        mismatches.append(ReplicaMismatch(axis, tuple(sorted(copies)),
                                          max(_max_abs_diff(first, t) for t in differing)))
    return Merged(first, mismatches)


def _join_ranges(p: RangeShard, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    for rank, piece in enumerate(pieces):
        start, end = p.piece(rank)
        if piece.dim() != 1 or piece.numel() != end - start:
            raise PlacementError(f"rank {rank} of axis {p.axis!r} holds shape {tuple(piece.shape)}, its range "
                                 f"[{start}, {end}) has {end - start} elements")
    return torch.cat(list(pieces)).reshape(p.shape)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: a view when it is contiguous (no copy of a large tensor), else a dense
    copy (views of size-1 dims can keep strides that forbid a dtype view)."""
    if t.is_contiguous():
        try:
            return t.reshape(-1).view(torch.uint8)
        except RuntimeError:
            pass
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.reshape(-1))
    return flat.view(torch.uint8)


def content_digest(t: torch.Tensor, start: int = 0) -> int:
    """CRC32 of a tensor's bytes: replicas that agree bit for bit have equal digests, so ranks
    can check replicas without exchanging tensors (online compare). ``start``: the digest of the
    bytes before these (a tensor read a chunk at a time gives the whole's digest)."""
    import zlib

    return zlib.crc32(_as_bytes(t.detach().cpu()).numpy(), start) if t.numel() else start


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaNs with the same bits are equal, unlike torch.equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(_as_bytes(a), _as_bytes(b))) if a.numel() else True


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _trim(t: torch.Tensor, logical_shape: Sequence[int]) -> torch.Tensor:
    if tuple(t.shape) == tuple(logical_shape):
        return t
    if t.dim() != len(logical_shape) or any(have < want for have, want in zip(t.shape, logical_shape)):
        raise PlacementError(f"merged shape {tuple(t.shape)} cannot hold logical shape {tuple(logical_shape)}")
    return t[tuple(slice(0, n) for n in logical_shape)].contiguous()

