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
sliced by the same rules it is merged and judged by. :func:`flat_views` cuts any view into views
that cover a range of its elements in row-major order, so two tensors of one shape, however
strided, are read chunk by chunk at the same positions.

Knows nothing about megatron.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator, List, Sequence, Tuple

import torch

STREAM_CHUNK = 1 << 18  # elements a chunk: tolerance.difference_norms' chunk (1 MiB of fp32)


class TensorSource:
    """The elements of one tensor of :attr:`shape`, given a view (a meta tensor) of it: :meth:`read`."""

    shape: Tuple[int, ...]

    def read(self, view: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

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


def read_flat(source: TensorSource, view: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """Elements ``begin`` to ``end`` of ``view`` of ``source``, row-major, as one flat tensor."""
    parts = [source.read(v).reshape(-1) for v in flat_views(view, begin, end)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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
