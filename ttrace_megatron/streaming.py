"""Tensors read a chunk at a time: where compare's peak memory is bounded.

Why. Judging a key needs, at once, the candidate's piece, the reference at the same positions, and
for an updated parameter both sides' moments: six tensors of the parameter's size. Read whole,
compare's peak is several times the largest tensor (8× at the scale ladder's 50M rung, measured).
Read in chunks of :data:`STREAM_CHUNK` elements, it is the chunks.

How. A tensor is a :class:`TensorSource`: something that gives the elements a strided view of it
covers, a meta-device tensor that says which (``shape``, ``stride``, ``storage_offset``, in
elements). A record in a trace gives them by reading only those bytes
(``TraceReader.load_view``); a tensor in memory by ``as_strided``. The views are what the placement
rules make of meta tensors (``placement.slice_logical``), so a rank's piece of a logical tensor is
sliced by the same rules it is merged and judged by; where those rules concatenate blocks (an
interleaved shard), the piece is the :class:`Cat` of their views. :func:`flat_views` cuts any view
(:func:`piece_flat` any such piece) into views that cover a range of its elements in row-major
order, so two tensors of one shape, however strided, are read chunk by chunk at the same positions.

Knows nothing about megatron.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode

STREAM_CHUNK = 1 << 18  # elements a chunk: tolerance.difference_norms' chunk (1 MiB of fp32)


class TensorSource:
    """The elements of one tensor of :attr:`shape`, given a view (a meta tensor) of it: :meth:`read`."""

    shape: Tuple[int, ...]

    def read(self, view: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def shared(self, view: torch.Tensor) -> Optional[torch.Tensor]:
        """The elements of ``view`` as a view of memory this source shares with others (a trace's
        map), no copy, never to be written into; None where they can only be read (the default)."""
        return None

    def meta(self) -> torch.Tensor:
        """The whole tensor, as a view to cut: a contiguous meta tensor of its shape."""
        return torch.empty(self.shape, device="meta")


@dataclasses.dataclass
class RecordSource(TensorSource):
    """One record of a trace, read a view at a time (``TraceReader.load_view``). ``logical_shape``:
    the shape its elements are viewed in, where it is stored flat (the record's by default)."""

    reader: object  # trace_store.TraceReader
    rank_trace: object  # trace_store.RankTrace
    record: object  # trace_store.Record
    logical_shape: Tuple[int, ...] = None

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.record.shape if self.logical_shape is None else self.logical_shape)

    def read(self, view: torch.Tensor) -> torch.Tensor:
        return self.reader.load_view(self.rank_trace, self.record, view.shape, view.stride(), view.storage_offset())

    def shared(self, view: torch.Tensor) -> Optional[torch.Tensor]:
        return self.reader.shared_view(self.rank_trace, self.record, view.shape, view.stride(), view.storage_offset())


@dataclasses.dataclass
class MemorySource(TensorSource):
    """A tensor already in memory (a logical tensor merged from pieces): views of it, no copies."""

    tensor: torch.Tensor

    def __post_init__(self):
        self.tensor = self.tensor.contiguous()

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, view: torch.Tensor) -> torch.Tensor:
        return self.tensor.as_strided(view.shape, view.stride(), self.tensor.storage_offset() + view.storage_offset())


@dataclasses.dataclass
class MappedSource(TensorSource):
    """Element-wise ``combine`` of sources of one shape, read at the same view (a reference's
    optimizer state re-clipped by its main grad, chunk by chunk)."""

    sources: Sequence[TensorSource]
    combine: Callable[..., torch.Tensor]

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.sources[0].shape

    def read(self, view: torch.Tensor) -> torch.Tensor:
        return self.combine(*(s.read(view) for s in self.sources))


@dataclasses.dataclass
class PieceSource(TensorSource):
    """A piece of another source (``piece``: a :class:`Cat` of views of it, as
    ``compare.piece_view`` makes them) as a tensor of its own: a range of its elements is read as
    that range of the piece, never the whole piece at once. What an online rank judges a reference
    tensor through when it keeps nothing of it: a chunk's bytes land in memory malloc reuses, where a
    whole piece of over 32 MiB lands in fresh pages that the kernel zeroes first (such a read ran
    at a quarter to a third of the speed, measured on a tmpfs)."""

    source: TensorSource
    piece: "Cat"

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.piece.shape

    def read(self, view: torch.Tensor) -> torch.Tensor:
        if view.is_contiguous() and view.numel():  # a range of the piece's elements, row-major
            begin = view.storage_offset()
            return read_flat(self.source, self.piece, begin, begin + view.numel()).reshape(view.shape)
        return read_piece(self.source, self.piece).as_strided(view.shape, view.stride(), view.storage_offset())

    def shared(self, view: torch.Tensor) -> Optional[torch.Tensor]:
        """The whole piece where it is one view of its source (not a concatenation) that the source
        shares; None for anything else."""
        whole = (tuple(view.shape) == tuple(self.shape) and view.is_contiguous() and not view.storage_offset())
        return self.source.shared(self.piece.parts[0]) if whole and len(self.piece.parts) == 1 else None


class BufferPool:
    """Host buffers given back to be taken again, by byte count: what an online rank holds of a
    step until it is judged (each side's moments and updated values) is read and copied into
    memory it held before. Fresh memory of a few MiB and over comes from the kernel as pages it
    zeroes on first touch: reading a piece into it ran at 2.3 GB/s where reading the same bytes into
    reused memory ran at 7 GB/s (a tmpfs, 2 ranks on 2 cores, the scale ladder's 50M rung). A
    buffer is given back only once nothing reads it; one never given back is freed as usual."""

    def __init__(self):
        self._free: Dict[int, List[torch.Tensor]] = {}

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        free = self._free.get(nbytes)
        raw = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8)
        return raw.view(dtype).view(tuple(shape)) if nbytes else torch.empty(tuple(shape), dtype=dtype)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (contiguous, its shape and dtype) in a taken buffer."""
        return self.take(tuple(tensor.shape), tensor.dtype).copy_(tensor)

    def read(self, source: TensorSource) -> torch.Tensor:
        """All of ``source``: the memory it shares where it does (a view of a trace's map: no copy,
        never given back), else read a chunk at a time into a taken buffer."""
        meta, out = source.meta(), None
        shared = source.shared(meta)
        if shared is not None:
            return shared.view(source.shape)
        for begin, end in chunks(meta.numel()):
            part = read_flat(source, meta, begin, end)
            out = self.take(source.shape, part.dtype) if out is None else out
            out.view(-1)[begin:end].copy_(part)
        return out if out is not None else read_piece(source, meta)

    def give(self, *tensors: Optional[torch.Tensor]) -> None:
        """Take back buffers :meth:`take` gave out (whole, as given: not views of them). Memory torch
        did not allocate is never taken: a piece read through a trace's map (``TraceReader``'s
        ``mapped``) looks like a whole buffer, and writing into it would change what later reads of
        that file in this process see."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() and t.is_contiguous() and t.storage_offset() == 0 and (
                    t.untyped_storage().nbytes() == t.numel() * t.element_size()) and t.untyped_storage().resizable():
                self._free.setdefault(t.untyped_storage().nbytes(), []).append(
                    torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()))


@dataclasses.dataclass(frozen=True)
class Cat:
    """A piece made of views concatenated along ``dim``: the blocks an interleaved shard takes
    (SwiGLU's gate and up halves, zigzag's sequence chunks). One view: ``Cat((view,), 0)``."""

    parts: Tuple[torch.Tensor, ...]
    dim: int

    @property
    def shape(self) -> Tuple[int, ...]:
        shape = list(self.parts[0].shape)
        if shape:
            shape[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        return tuple(shape)

    def numel(self) -> int:
        return sum(p.numel() for p in self.parts)


def cat_of_views(base: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> Optional[Cat]:
    """What ``fn`` makes of ``base`` (a meta tensor), as views of it: the view it returns, or the
    views it concatenated last (``torch.cat``, seen as it runs). None where the result is neither
    (a zero padding was concatenated, or a concatenation was cut again): no view covers it."""
    with _CatsSeen() as seen:
        out = fn(base)
    if out is base or out._base is base:
        return Cat((out,), 0)
    cat = seen.cats.get(id(out))
    if cat is None or cat[0] is not out or not all(p is base or p._base is base for p in cat[1]):
        return None
    return Cat(tuple(cat[1]), cat[2] % out.dim())


class _CatsSeen(TorchFunctionMode):
    """Each ``torch.cat`` run inside: its result, inputs and dim, by the result's id. A cat of meta
    tensors is not run but made (an empty meta tensor of its shape): torch's meta kernel for it
    imports its Python decompositions on first use, ~140 MiB of a process's memory."""

    def __init__(self):
        super().__init__()
        self.cats = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.cat:
            return func(*args, **kwargs)
        tensors, dim = list(args[0]), kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if tensors and all(t.is_meta for t in tensors) and len({t.dim() for t in tensors}) == 1 and tensors[0].dim():
            shape = list(tensors[0].shape)
            shape[dim] = sum(t.shape[dim] for t in tensors)
            out = torch.empty(shape, dtype=tensors[0].dtype, device="meta")
        else:
            out = func(*args, **kwargs)
        self.cats[id(out)] = (out, tensors, dim)
        return out


def piece_flat(piece: Cat, begin: int, end: int) -> List["torch.Tensor | Cat"]:
    """:func:`flat_views` of a piece of concatenated views: views, and where a range spans whole
    rows of every part, those rows as a smaller :class:`Cat` (read part by part, concatenated)."""
    parts, dim = piece.parts, piece.dim
    if len(parts) == 1:
        return flat_views(parts[0], begin, end)
    if begin >= end:
        return []
    if dim == 0:  # the parts one after another
        out, at = [], 0
        for p in parts:
            lo, hi = max(begin - at, 0), min(end - at, p.numel())
            if lo < hi:
                out += flat_views(p, lo, hi)
            at += p.numel()
        return out
    inner = math.prod(piece.shape[1:])
    first, last = begin // inner, (end - 1) // inner
    row = lambda i: Cat(tuple(p[i] for p in parts), dim - 1)  # noqa: E731
    if first == last:
        return piece_flat(row(first), begin - first * inner, end - first * inner)
    out, lo, hi = [], first, last + 1
    if begin % inner:
        out += piece_flat(row(first), begin % inner, inner)
        lo = first + 1
    tail = end - last * inner
    if tail < inner:
        hi = last
    if hi > lo:
        out.append(Cat(tuple(p[lo:hi] for p in parts), dim))
    if tail < inner:
        out += piece_flat(row(last), 0, tail)
    return out


def flat_views(view: torch.Tensor, begin: int, end: int) -> List[torch.Tensor]:
    """Views of ``view`` that together cover its elements ``begin`` to ``end`` in row-major order
    (the order of ``view.reshape(-1)``): whole rows as one view, a partial first or last row cut
    further. Each is basic indexing of ``view``, so it is a view of what ``view`` views."""
    if begin >= end:
        return []
    if view.dim() <= 1 or view.is_contiguous():
        return [view.reshape(-1)[begin:end]]
    inner = math.prod(view.shape[1:])
    first, last = begin // inner, (end - 1) // inner
    if first == last:
        return flat_views(view[first], begin - first * inner, end - first * inner)
    out, lo, hi = [], first, last + 1
    if begin % inner:
        out += flat_views(view[first], begin % inner, inner)
        lo = first + 1
    tail = end - last * inner
    if tail < inner:
        hi = last
    if hi > lo:
        out.append(view[lo:hi])
    if tail < inner:
        out += flat_views(view[last], 0, tail)
    return out


def read_flat(source: TensorSource, view: "torch.Tensor | Cat", begin: int, end: int) -> torch.Tensor:
    """Elements ``begin`` to ``end`` of ``view`` (or a :class:`Cat` of views) of ``source``,
    row-major, as one flat tensor."""
    items = piece_flat(view, begin, end) if isinstance(view, Cat) else flat_views(view, begin, end)
    parts = [read_piece(source, v).reshape(-1) for v in items]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def read_piece(source: TensorSource, piece: "torch.Tensor | Cat") -> torch.Tensor:
    """The elements of a view (or a :class:`Cat` of views) of ``source``, in its shape."""
    if not isinstance(piece, Cat):
        return source.read(piece)
    if len(piece.parts) == 1:
        return source.read(piece.parts[0])
    return torch.cat([source.read(p) for p in piece.parts], dim=piece.dim)


def chunks(numel: int, chunk: int = 0) -> Iterator[Tuple[int, int]]:
    """(begin, end) of consecutive ranges of at most ``chunk`` (:data:`STREAM_CHUNK`) of ``numel`` elements."""
    chunk = chunk or STREAM_CHUNK
    for begin in range(0, numel, chunk):
        yield begin, min(numel, begin + chunk)


def source_norm(source: TensorSource, view: torch.Tensor = None) -> float:
    """‖source‖ (or of ``view`` of it) in float64, a chunk at a time."""
    view = source.meta() if view is None else view
    total = 0.0
    for begin, end in chunks(view.numel()):
        total += float(torch.linalg.vector_norm(read_flat(source, view, begin, end).to(torch.float64))) ** 2
    return math.sqrt(total)
