"""Align and judge: merge each side's shards into logical tensors and compare them one by one.

Knows nothing about megatron: it reads traces, merges by placements, and applies tolerances.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import itertools
import math
import os
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from . import coverage, keys, selection, streaming
from .errors import ConfigMismatchError, TraceError
from .keys import TensorKey, TensorKind, phase_label  # noqa: F401  (phase_label: part of this module's face)
from .placement import (SHARDING, Coords, Layout, Merged, Partial, PlacementError, Replicate, check_coords,
                        content_digest, logical_mask, merge_pieces, replicas_split_alike, alike_but_scale,
                        slice_logical, with_scale)
from .step_bounds import StepBounds, judged_terms, main_grad_key, reclip_delta, state_of
from .streaming import (Cat, MappedSource, MemorySource, PieceSource, RecordSource, TensorSource, cat_of_views,
                        chunks, read_flat, read_piece, source_norm)
from .tolerance import (Tolerance, ToleranceConfig, difference_sums, relative_error, tolerance_for,
                        with_perturbation)
from .update_rules import AdamRule, UpdateVerdict, judge_adam_chunks, judge_adam_update
from .trace_store import RankTrace, Record, TraceReader

PASS = "pass"
FAIL = "fail"


@dataclasses.dataclass
class TensorResult:
    key: TensorKey
    verdict: str
    error: float  # relative Frobenius error ‖cand − ref‖ / ‖ref‖
    eps: float  # ε of the format the error is expressed in
    tolerance_eps: float
    order: int  # execution order (the reference's recording order)
    depth: int
    shape: Tuple[int, ...]
    tolerance_source: str = ""
    reason: str = ""
    arrival: bool = False  # what arrived at a module, not what a module computed (see arrives_at_module)
    reference_norm: float = math.nan  # ‖ref‖ of the logical tensor

    @property
    def error_eps(self) -> float:
        return self.error / self.eps

    @property
    def ratio(self) -> float:
        if self.tolerance_eps > 0:
            return self.error_eps / self.tolerance_eps
        return 0.0 if self.error == 0.0 else math.inf  # judged exactly (keys.is_exact_data)


@dataclasses.dataclass
class Comparison:
    reference_dir: str
    candidate_dir: str
    results: List[TensorResult]
    missing_in_candidate: List[TensorKey]
    missing_in_reference: List[TensorKey]
    reference_run: dict
    candidate_run: dict
    skipped: List[TensorKey] = dataclasses.field(default_factory=list)  # not judgeable (online partial sums)
    # tensors of parameters a run declares it does not judge (run.json unjudged_params), with why
    unjudged: List[TensorKey] = dataclasses.field(default_factory=list)
    # not judged: computed after the first step by two sides that, not in lock-step, train different
    # weights (FREE_RUNNING says why); their updated parameters are judged element by element
    diverged: List[TensorKey] = dataclasses.field(default_factory=list)
    # compare's workers: the most any held over its memory once its judge was open (bytes; None
    # without workers or where it cannot be read): the bound per worker, measured
    worker_peak: Optional[int] = None

    @property
    def coverage(self) -> dict:
        """Which of the model's parameters were judged, by module type (:mod:`.coverage`)."""
        return coverage.summary(coverage.param_coverage(self.reference_run, self.candidate_run,
                                                        (r.key for r in self.results)),
                                coverage.not_the_models(self.candidate_run))

    @property
    def failures(self) -> List[TensorResult]:
        return [r for r in self.results if r.verdict == FAIL]

    @property
    def verdict(self) -> str:
        return FAIL if self.failures or self.missing_in_candidate or self.missing_in_reference else PASS

    @property
    def first_mismatch(self) -> Optional[TensorResult]:
        fails = self.failures
        return min(fails, key=lambda r: r.order) if fails else None


def _flatten(obj, prefix="") -> Dict[str, object]:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def check_compatible(reference_run: dict, candidate_run: dict, candidate_dir: str) -> None:
    """Reference and candidate must describe the same model, data and training."""
    a = _flatten(reference_run.get("model_config", {}))
    b = _flatten(candidate_run.get("model_config", {}))
    differing = sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>"))
    if differing:
        detail = ", ".join(f"{k}: reference={a.get(k, '<unset>')!r} candidate={b.get(k, '<unset>')!r}"
                           for k in differing[:8])
        raise ConfigMismatchError(f"reference and candidate configs differ in {len(differing)} field(s): {detail}",
                                  path=candidate_dir)


def group_records(reader: TraceReader) -> Dict[TensorKey, List[Tuple[RankTrace, Record]]]:
    groups: Dict[TensorKey, List[Tuple[RankTrace, Record]]] = {}
    for rt, rec in reader.records():
        groups.setdefault(rec.key, []).append((rt, rec))
    return groups


def logical_tensor(reader: TraceReader, pieces: List[Tuple[RankTrace, Record]]) -> Merged:
    """Merge one key's pieces into the logical tensor (the layout's scale divided out)."""
    first_rt, first = pieces[0]
    _common_layout(pieces)
    loaded = [(rt.coords, reader.load(rt, rec), rec.layout) for rt, rec in pieces]
    try:
        return merge_pieces(loaded)
    except PlacementError as e:
        raise TraceError(f"cannot merge shards: {e}", path=reader.dir, rank=first_rt.rank,
                         tensor=str(first.key)) from None


def reference_piece(reader: TraceReader, pieces: List[Tuple[RankTrace, Record]], layout: Layout, coords: Coords,
                    local_shape: Sequence[int], *, scaled: bool = True) -> torch.Tensor:
    """``slice_logical(logical_tensor(reader, pieces).tensor, layout, coords, local_shape)``: the
    piece of a reference tensor a rank at ``coords`` holds under ``layout``, as it stores it
    (``scaled=False``: the layout's scale left out), reading only the bytes that piece covers where
    the reference holds the logical tensor whole (a single-device reference) and the piece is a
    view of it or blocks of views (:func:`piece_view`); else the logical tensor is read whole and
    sliced. The views are what ``slice_logical`` makes of a tensor on the meta device: the
    placement rules stay in one place."""
    rt, rec = pieces[0]
    piece = None
    if len(pieces) == 1 and _whole_logical(rt, rec):
        view = piece_view(rec.shape, layout, coords, local_shape)
        if view is not None:
            piece = read_piece(RecordSource(reader, rt, rec), view)
    if piece is None:
        piece = slice_logical(logical_tensor(reader, pieces).tensor, dataclasses.replace(layout, scale=1.0), coords,
                              local_shape)
    return with_scale(piece, layout) if scaled else piece


def reference_piece_source(reader: TraceReader, pieces: List[Tuple[RankTrace, Record]], layout: Layout,
                           coords: Coords, local_shape: Sequence[int]) -> Optional[TensorSource]:
    """:func:`reference_piece` (``scaled=False``) as a source to read a chunk at a time
    (``streaming.PieceSource``), where it reads only the piece's bytes (a single-device reference
    holding the logical tensor whole, the piece a view or blocks of views); None elsewhere."""
    rt, rec = pieces[0]
    if len(pieces) != 1 or not _whole_logical(rt, rec):
        return None
    view = piece_view(rec.shape, layout, coords, local_shape)
    return None if view is None else PieceSource(RecordSource(reader, rt, rec), view)


def piece_view(logical_shape: Sequence[int], layout: Layout, coords: Coords,
               local_shape: Sequence[int]) -> Optional[Cat]:
    """Where a rank's piece lies in its logical tensor: the view ``slice_logical`` makes of a meta
    tensor of ``logical_shape`` (the layout's scale left out; offsets and strides count elements,
    of any dtype), or the views it concatenates (an interleaved shard's blocks); None where the
    piece is neither (padding). Raises :class:`PlacementError` where the piece does not fit.

    Kept per (shapes, layout, coordinates): a parameter's grads, moments and values of every
    iteration lie alike, and making the views runs the placement rules on meta tensors (0.2 ms a
    key, 0.3 s of an online rank's judging at the scale ladder's 50M rung). Meta tensors hold no
    data, and nothing changes a view in place."""
    unscaled = dataclasses.replace(layout, scale=1.0)
    where = tuple(sorted((axis, tuple(int(x) for x in at)) for axis, at in coords.items()))
    args = (tuple(int(n) for n in logical_shape), unscaled, where, tuple(int(n) for n in local_shape))
    try:
        hash(unscaled)
    except TypeError:  # a layout built with a list in it: made each time
        return _piece_view.__wrapped__(*args)
    return _piece_view(*args)


@functools.lru_cache(maxsize=4096)
def _piece_view(logical_shape: Tuple[int, ...], layout: Layout, where: Tuple[Tuple[str, Tuple[int, int]], ...],
                local_shape: Tuple[int, ...]) -> Optional[Cat]:
    """:func:`piece_view`'s views, made once (a :class:`PlacementError` is not kept: it is raised again)."""
    coords = dict(where)
    return cat_of_views(torch.empty(logical_shape, device="meta"),
                        lambda meta: slice_logical(meta, layout, coords, local_shape, contiguous=False))


def logical_source(reader: TraceReader, pieces: List[Tuple[RankTrace, Record]]) -> Tuple[TensorSource, list]:
    """A logical tensor to read a chunk at a time (``streaming``): its record where one rank holds
    it whole as stored (a single-device reference), else merged in memory; and the mismatches of
    its replicas (merged)."""
    rt, rec = pieces[0]
    if len(pieces) == 1 and _whole_logical(rt, rec, flattened=True):
        return RecordSource(reader, rt, rec, tuple(rec.layout.logical_shape)), []
    merged = logical_tensor(reader, pieces)
    return MemorySource(merged.tensor), merged.replica_mismatches


def _whole_logical(rt: RankTrace, rec: Record, flattened: bool = False) -> bool:
    """A record that is its logical tensor as stored: one rank's, every axis of its layout of size 1,
    no scale, permutation or padding. ``flattened``: or its elements in the same order under
    another shape (a single-device distributed optimizer's one range of a whole parameter)."""
    lay = rec.layout
    same = (tuple(rec.shape) == tuple(lay.logical_shape) if not flattened
            else math.prod(rec.shape) == math.prod(lay.logical_shape))
    return (lay.scale == 1.0 and lay.permute is None and same
            and all(rt.coords.get(p.axis, (0, 1))[1] == 1 for p in lay.placements))


def nonfinite_message(candidate_count: int, reference_count: int, same_positions: bool) -> Optional[str]:
    if candidate_count == 0 and reference_count == 0:
        return None
    if same_positions:
        return f"non-finite values: the same {candidate_count} NaN/Inf positions on both sides"
    return f"non-finite values: candidate has {candidate_count} NaN/Inf, reference has {reference_count}"


def overflowed_iterations(reader: TraceReader, groups) -> Set[int]:
    """The iterations whose step the reference skipped because its loss-scaled grads overflowed
    (``step_skipped`` 1: fp16's dynamic loss scaler). Their grads hold Inf/NaN by design; the
    optimizer discards them and lowers the scale. Whether the candidate skipped the same steps is
    judged on its own ``step_skipped``."""
    out = set()
    for key, pieces in groups.items():
        if key.module == keys.OPTIMIZER_MODULE and key.tensor == keys.STEP_SKIPPED:
            if float(logical_tensor(reader, pieces).tensor.reshape(-1)[0]) == 1.0:
                out.add(key.iteration)
    return out


OVERFLOW_PHASES = (keys.BACKWARD, keys.MAIN_GRAD)


def replica_note(side: str, ranks: Sequence[int], max_abs_diff: Optional[float] = None, axis: str = "") -> str:
    """Replicas that should agree bit for bit and do not (``side``: candidate or reference)."""
    over = f" over {axis}" if axis else ""
    detail = "" if max_abs_diff is None else f", max |Δ| {max_abs_diff:.3g}"
    return f"{side} replicas{over} differ (ranks {list(ranks)}{detail})"


def arrives_at_module(key: TensorKey, rec: Optional[Record] = None) -> bool:
    """What arrives at a module (its input, its output-grad), as opposed to what it computes.

    In a localization replay these are replaced by the reference's values before the module runs,
    so the trace holds what arrived (judged like an end-to-end tensor), and everything the module
    computes from them is judged under the local bound. The recorder marks tensors computed from
    values the replay cannot substitute (``Record.arrival``); they are judged like arrivals too.
    """
    return keys.is_arrival(key) or bool(rec is not None and rec.arrival)


def decide(key: TensorKey, rec: Record, num_layers: int, order: int, tol_config: ToleranceConfig,
           shape: Tuple[int, ...], error: float, reason: str = "", observed: Optional[float] = None,
           cancellation: float = 1.0, bound: Optional[Tolerance] = None,
           added: Sequence[Tuple[float, str]] = ()) -> TensorResult:
    """The verdict on one logical tensor: a stated reason fails it, else error against tolerance.

    ``observed``: the perturbation estimate's relative error for this tensor, if one was run.
    ``cancellation``: for a sum whose terms cancel (partial sums over ranks, a bias grad's tokens),
    Σ‖termᵢ‖ / ‖Σ termᵢ‖ (:class:`Cancellation`): each term was computed and rounded relative to its
    own magnitude, so where they cancel the round-off of the sum is that much larger relative to
    the sum (the tolerance scales by it).
    ``bound``: a tolerance derived for this tensor in place of the analytic GEMM bound (the step's
    scalars: :class:`~ttrace_megatron.step_bounds.StepBounds`); ``added``: relative terms that add
    to it (what the clip coefficient scales).
    """
    arrival = arrives_at_module(key, rec)
    tol = bound or tolerance_for(key.phase, rec.depth, num_layers, rec.compute_dtype or rec.dtype, rec.reduction,
                                 tol_config, propagate=not (tol_config.replay and not arrival),
                                 power=keys.value_power(key))
    if cancellation > 1.0 and math.isfinite(cancellation):
        tol = dataclasses.replace(tol, tolerance_eps=tol.tolerance_eps * cancellation,
                                  source=f"{tol.source} × {cancellation:.3g} (a sum whose terms cancel)")
    tol = judged_terms(tol, added)
    if observed is not None:
        tol = with_perturbation(tol, observed, tol_config)
    if keys.is_exact_data(key):  # a mask the model was handed: no round-off, so no tolerance
        tol = Tolerance(tol.eps, 0.0, 0, "data, compared exactly: two correct runs hand the model the same mask")
    ok = not reason and error / tol.eps <= tol.tolerance_eps
    return TensorResult(key=key, verdict=PASS if ok else FAIL, error=error, eps=tol.eps,
                        tolerance_eps=tol.tolerance_eps, order=order, depth=rec.depth, shape=tuple(shape),
                        tolerance_source=tol.source, reason=reason, arrival=arrival)


# --------------------------------------------------------------------------------------------
# shard by shard: each candidate piece against the reference sliced to it (offline and online)


@dataclasses.dataclass
class ShardSums:
    """One rank's contribution to the verdict on one logical tensor.

    Sums over the positions of the rank's piece that belong to the logical tensor (padding
    excluded). Adding the sums of the distinct pieces gives the relative Frobenius error of the
    merged tensor without ever merging it; replicas share a position and are checked by digest.
    """

    key: TensorKey
    shard: Dict[str, Tuple[int, int]]  # (position, size) along each Shard axis; replicas share it
    digest: int
    diff_sq: float
    ref_sq: float
    compared: int  # positions where both sides are finite
    candidate_nonfinite: int
    reference_nonfinite: int
    same_nonfinite: bool
    logical_shape: Tuple[int, ...]
    status: str = "ok"  # ok | shape | partial | missing_reference
    detail: str = ""
    partial_norm: float = 0.0  # a partial sum's ‖piece‖ in logical units (status partial): piece_norm
    roundoff: float = 0.0  # the candidate's own measured round-off of the value (Record.roundoff)
    # a scalar partial sum (status partial): the piece's value in logical units, and the rank's
    # position along the Partial axes, so the ranks' pieces add up after the run (online)
    partial_value: Optional[float] = None
    partial_position: Dict[str, Tuple[int, int]] = dataclasses.field(default_factory=dict)
    # an updated value's element-wise Adam check on this piece (online, in lock-step): its verdict's
    # worst element (ratio to its slack under k = ``update_k``), or only ``update_detail`` (why not)
    update_ratio: Optional[float] = None
    update_index: int = -1
    update_residual: float = 0.0
    update_slack: float = 0.0
    update_k: float = 0.0
    update_detail: str = ""
    # a top-k choice judged by its scores on this piece (online: ``selection.judge_along`` over the
    # rows the rank holds whole): rows, rows chosen differently, the worst near-tie (its ratio and
    # row of the piece), why the choice fails; ``choice_detail`` says why it was not judged (None ratio)
    choice_rows: int = 0
    choice_flipped: int = 0
    choice_ratio: Optional[float] = None
    choice_row: int = -1
    choice_problem: str = ""
    choice_detail: str = ""

    def to_json(self) -> dict:
        """Fields at their default are left out (``from_json`` restores them): an online check writes
        one of these per record and rank."""
        obj = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               or getattr(self, f.name) != (f.default if f.default is not dataclasses.MISSING else f.default_factory())}
        obj["key"] = self.key.to_json()
        obj["logical_shape"] = list(self.logical_shape)
        return obj

    @staticmethod
    def from_json(obj: dict) -> "ShardSums":
        fields = dict(obj)
        fields["key"] = TensorKey.from_json(obj["key"])
        fields["shard"] = {str(k): (int(v[0]), int(v[1])) for k, v in obj["shard"].items()}
        fields["logical_shape"] = tuple(int(s) for s in obj["logical_shape"])
        for name in ("digest", "compared", "candidate_nonfinite", "reference_nonfinite"):
            fields[name] = int(obj[name])
        for name in ("diff_sq", "ref_sq"):
            fields[name] = float(obj[name])
        fields["partial_norm"] = float(obj.get("partial_norm", 0.0))
        fields["roundoff"] = float(obj.get("roundoff", 0.0))
        value = obj.get("partial_value")
        fields["partial_value"] = None if value is None else float(value)
        fields["partial_position"] = {str(k): (int(v[0]), int(v[1])) for k, v in obj.get("partial_position", {}).items()}
        ratio = obj.get("update_ratio")
        fields["update_ratio"] = None if ratio is None else float(ratio)
        fields["update_index"] = int(obj.get("update_index", -1))
        for name in ("update_residual", "update_slack", "update_k"):
            fields[name] = float(obj.get(name, 0.0))
        fields["update_detail"] = str(obj.get("update_detail", ""))
        ratio = obj.get("choice_ratio")
        fields["choice_ratio"] = None if ratio is None else float(ratio)
        for name, default in (("choice_rows", 0), ("choice_flipped", 0), ("choice_row", -1)):
            fields[name] = int(obj.get(name, default))
        for name in ("choice_problem", "choice_detail"):
            fields[name] = str(obj.get(name, ""))
        return ShardSums(**fields)


def blank_shard_sums(key: TensorKey, cand: Optional[torch.Tensor], layout: Layout, coords: Coords) -> dict:
    """A piece's sums before any are taken (``cand`` None: its digest too, taken as it is read)."""
    shard = {p.axis: tuple(coords[p.axis]) for p in layout.placements if isinstance(p, SHARDING)}
    replicated = cand is not None and has_replicas(layout, coords)
    return dict(key=key, shard=shard, digest=content_digest(cand) if replicated else 0, diff_sq=0.0, ref_sq=0.0,
                compared=0,
                candidate_nonfinite=0, reference_nonfinite=0, same_nonfinite=True,
                logical_shape=tuple(layout.logical_shape))


def has_replicas(layout: Layout, coords: Coords) -> bool:
    """Whether other ranks hold copies of this rank's piece: a digest only matters where replicas
    exist to compare it with (a Replicate over an axis of one rank, such as data parallelism of one,
    has none: at the 50M rung 2.5 GB of pieces were hashed for nothing)."""
    return any(isinstance(p, Replicate) and coords.get(p.axis, (0, 1))[1] > 1 for p in layout.placements)


def missing_reference(key: TensorKey, cand: torch.Tensor, layout: Layout, coords: Coords) -> ShardSums:
    return ShardSums(**dict(blank_shard_sums(key, cand, layout, coords), status="missing_reference"))


def shard_sums(key: TensorKey, cand: torch.Tensor, layout: Layout, coords: Coords, ref_full: torch.Tensor) -> ShardSums:
    """Judge one candidate piece, as the rank stores it, against the logical reference sliced to it
    (``slice_logical``, which also applies the layout's scale)."""
    local = tuple(cand.shape)
    return sliced_shard_sums(key, cand, layout, coords, tuple(ref_full.shape),
                             lambda: slice_logical(ref_full, layout, coords, local, contiguous=False))


def sliced_shard_sums(key: TensorKey, cand: torch.Tensor, layout: Layout, coords: Coords,
                      ref_shape: Sequence[int], reference_piece: Callable[[], "torch.Tensor | TensorSource"]
                      ) -> ShardSums:
    """:func:`shard_sums` given the reference's logical shape and a function that gives its piece
    as the rank stores it (raising :class:`PlacementError` where the piece does not fit): an online
    rank reads only that piece (:func:`reference_piece`). A piece given as a source of its elements
    (a state re-clipped element-wise: ``streaming.MappedSource``) is read a chunk at a time, its
    float64 values never held whole: the sums of the whole, bit for bit, at cache speed."""
    base = blank_shard_sums(key, cand, layout, coords)
    if tuple(ref_shape) != tuple(layout.logical_shape):
        return _shape_sums(base, _logical_shape_differs(layout, ref_shape))
    local = tuple(cand.shape)
    try:
        ref_piece = reference_piece()
    except PlacementError as e:
        return _shape_sums(base, _piece_does_not_fit(local, e))
    cand = cand.detach().cpu()
    mask = logical_mask(layout, coords, local)
    if isinstance(ref_piece, TensorSource):
        if mask is None and cand.is_contiguous():
            flat, whole, sums = cand.reshape(-1), ref_piece.meta(), None
            for begin, end in chunks(flat.numel()):
                sums = piece_sums(flat[begin:end], read_flat(ref_piece, whole, begin, end), sums)
            return ShardSums(**dict(base, **(sums or piece_sums(flat, flat))))
        ref_piece = read_piece(ref_piece, ref_piece.meta())
    if mask is not None:
        cand, ref_piece = cand.reshape(-1)[mask.reshape(-1)], ref_piece.reshape(-1)[mask.reshape(-1)]
    return ShardSums(**dict(base, **piece_sums(cand, ref_piece)))


def piece_sums(cand: torch.Tensor, ref: torch.Tensor, total: Optional[dict] = None) -> dict:
    """The sums of a piece (or of a chunk of it, added to ``total``, the chunks before it) against
    the reference at its positions, over the positions where both are finite."""
    total = total or dict(diff_sq=0.0, ref_sq=0.0, compared=0, candidate_nonfinite=0, reference_nonfinite=0,
                          same_nonfinite=True)
    diff_sq, ref_sq = difference_sums(cand, ref)
    if math.isfinite(diff_sq) and math.isfinite(ref_sq):  # no NaN/Inf: no element-wise scan
        return dict(total, diff_sq=total["diff_sq"] + diff_sq, ref_sq=total["ref_sq"] + ref_sq,
                    compared=total["compared"] + cand.numel())
    bad_c, bad_r = ~torch.isfinite(cand), ~torch.isfinite(ref)
    keep = ~bad_c & ~bad_r
    diff_sq, ref_sq = difference_sums(cand[keep], ref[keep])
    return dict(diff_sq=total["diff_sq"] + diff_sq, ref_sq=total["ref_sq"] + ref_sq,
                compared=total["compared"] + int(keep.sum()),
                candidate_nonfinite=total["candidate_nonfinite"] + int(bad_c.sum()),
                reference_nonfinite=total["reference_nonfinite"] + int(bad_r.sum()),
                same_nonfinite=total["same_nonfinite"] and bool(torch.equal(bad_c, bad_r)))


def _shape_sums(base: dict, detail: str) -> ShardSums:
    return ShardSums(**dict(base, status="shape", detail=detail))


def _logical_shape_differs(layout: Layout, ref_shape: Sequence[int]) -> str:
    return f"logical shape {tuple(layout.logical_shape)} differs from the reference's {tuple(ref_shape)}"


def _piece_does_not_fit(local: Sequence[int], e: PlacementError) -> str:
    return f"the candidate's piece {tuple(local)} does not fit the reference's logical shape: {e}"


def streamed_shard_sums(key: TensorKey, cand: TensorSource, layout: Layout, coords: Coords,
                        reference: TensorSource) -> Optional[ShardSums]:
    """:func:`shard_sums` a chunk at a time (``streaming``): the candidate's piece as the rank
    stores it and the logical ``reference`` at its positions, :data:`streaming.STREAM_CHUNK`
    elements of each in memory at once. None where the piece is no view of the logical tensor
    (padding): the caller reads it whole."""
    local = tuple(cand.shape)
    base = blank_shard_sums(key, None, layout, coords)
    if tuple(reference.shape) != tuple(layout.logical_shape):
        return _shape_sums(base, _logical_shape_differs(layout, reference.shape))
    try:
        view = piece_view(reference.shape, layout, coords, local)
    except PlacementError as e:
        return _shape_sums(base, _piece_does_not_fit(local, e))
    if view is None or logical_mask(layout, coords, local) is not None:
        return None
    replicated, whole, digest, sums = has_replicas(layout, coords), cand.meta(), 0, None
    for begin, end in chunks(view.numel()):
        c = read_flat(cand, whole, begin, end)
        if replicated:
            digest = content_digest(c, digest)
        sums = piece_sums(c, with_scale(read_flat(reference, view, begin, end), layout), sums)
    return ShardSums(**dict(base, digest=digest, **(sums or {})))


def relative_from_sums(diff_sq: float, ref_sq: float) -> float:
    """‖cand − ref‖ / ‖ref‖ from the squared norms: 0 when both are zero, inf when only the reference is."""
    if ref_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else math.inf
    return math.sqrt(diff_sq) / math.sqrt(ref_sq)


def combine_shards(key: TensorKey, entries: List[Tuple[int, ShardSums]], rec: Record, num_layers: int, order: int,
                   tol_config: ToleranceConfig, where: str, notes: Sequence[str] = (),
                   replica_max_abs_diff: Optional[Callable[[List[int]], float]] = None,
                   observed: Optional[float] = None, cancellation: float = 1.0,
                   step: Optional[StepBounds] = None, overflowed: bool = False) -> TensorResult:
    """The verdict on one logical tensor from its pieces' sums (``entries``: (rank, sums)).

    The one place where the rules of a verdict live: a shape that does not fit, pieces that do not
    cover the tensor, replicas that differ, non-finite values, a zero reference. A tensor that is
    merged before it is judged (partial sums) comes here as a single piece. ``step``: the
    comparison's :class:`~ttrace_megatron.step_bounds.StepBounds`, which bounds the step's scalars
    and learns from every verdict. ``overflowed``: a grad of a step the reference skipped for
    overflow (:func:`overflowed_iterations`): its non-finite values are expected, and its finite
    ones are judged."""
    shape = entries[0][1].logical_shape
    args = (key, rec, num_layers, order, tol_config, shape)

    def terms(reference_norm: float = math.nan) -> dict:
        if step is None:
            return dict(observed=observed, cancellation=cancellation)
        carried = step.carried(key, reference_norm)
        return dict(observed=observed, cancellation=cancellation * carried,
                    added=[(t * carried, s) for t, s in step.added(key)],
                    bound=step.bound(key, rec.compute_dtype or rec.dtype, rec.reduction,
                                     math.sqrt(entries[0][1].ref_sq), rec.roundoff,
                                     max((e.roundoff for _, e in entries), key=abs)))

    shaped = [e for _, e in entries if e.status == "shape"]
    if shaped:
        return decide(*args, math.inf, shaped[0].detail, **terms())
    positions = shard_positions(entries)
    expected = {tuple(sorted(zip(entries[0][1].shard, combo)))
                for combo in itertools.product(*(range(size) for _, size in entries[0][1].shard.values()))}
    if set(positions) != expected:
        missing = sorted(expected - set(positions))
        raise TraceError(f"the candidate's pieces cover {len(set(positions) & expected)} of {len(expected)} shards "
                         f"(missing {[dict(m) for m in missing[:4]]})", path=where, tensor=str(key))
    notes = list(notes)
    diff_sq, ref_sq, compared, nc, nr, same, poisoned = _lowest_copies(positions, notes, replica_max_abs_diff)
    expected_nonfinite = None
    if overflowed and nc + nr:
        expected_nonfinite = (f"{nonfinite_message(nc, nr, bool(nc and nr and same))} expected (the reference "
                              f"skipped this step: its loss-scaled grads overflowed); the finite values judged")
        nc = nr = 0
    error = math.nan if compared == 0 and nc + nr else relative_from_sums(diff_sq, ref_sq)  # nan: nothing finite
    nonfinite = nonfinite_message(nc, nr, bool(nc and nr and same))
    if poisoned and not overflowed:
        # the merge takes the lowest rank's copy; another copy of the same values holds NaN/Inf: that
        # copy is what its rank computes on, so the tensor's error is that copy's
        error = math.inf
        nonfinite = (f"non-finite values: the candidate's copy on rank(s) {sorted(poisoned)} holds "
                     f"{sum(poisoned.values())} NaN/Inf" + (f"; {nonfinite}" if nonfinite else ""))
    result = decide(*args, error, "; ".join(([nonfinite] if nonfinite else []) + notes), **terms(math.sqrt(ref_sq)))
    result.reference_norm = math.sqrt(ref_sq)
    if expected_nonfinite:
        result.tolerance_source = f"{result.tolerance_source}; {expected_nonfinite}"
    if step is not None and not overflowed:
        step.note(key, result.error, result.reference_norm)
    return result


def shard_positions(entries: List[Tuple[int, ShardSums]]) -> Dict[Tuple, List[Tuple[int, ShardSums]]]:
    """Each shard position's copies ((rank, sums) of the ranks that hold it); replicas share one."""
    positions: Dict[Tuple, List[Tuple[int, ShardSums]]] = {}
    for rank, e in entries:
        positions.setdefault(tuple(sorted((axis, pos) for axis, (pos, _) in e.shard.items())), []).append((rank, e))
    return positions


def _lowest_copies(positions: Dict[Tuple, List[Tuple[int, ShardSums]]], notes: List[str],
                   replica_max_abs_diff: Optional[Callable[[List[int]], float]]):
    """The sums of each shard position's lowest-rank copy, as a merge takes it: (Σ diff², Σ ref²,
    compared, candidate and reference NaN/Inf counts, whether those sit at the same positions, and
    the ranks whose copy holds more NaN/Inf than the lowest rank's: rank -> count). Replicas that
    differ are noted in ``notes``."""
    diff_sq = ref_sq = 0.0
    nc = nr = compared = 0
    same = True
    poisoned: Dict[int, int] = {}
    for _, copies in sorted(positions.items()):
        if len({e.digest for _, e in copies}) > 1:
            ranks = sorted(r for r, _ in copies)
            notes.append(replica_note("candidate", ranks, replica_max_abs_diff(ranks) if replica_max_abs_diff else None))
        _, first = min(copies, key=lambda c: c[0])
        for rank, e in copies:
            if e.candidate_nonfinite > first.candidate_nonfinite:
                poisoned[rank] = poisoned.get(rank, 0) + e.candidate_nonfinite
        diff_sq += first.diff_sq
        ref_sq += first.ref_sq
        compared += first.compared
        nc += first.candidate_nonfinite
        nr += first.reference_nonfinite
        same = same and first.same_nonfinite
    return diff_sq, ref_sq, compared, nc, nr, same, poisoned


def distinct_pieces(pieces: List[Tuple[RankTrace, Record]]) -> List[Tuple[RankTrace, Record]]:
    """One piece per position along the axes that are not replicas (the lowest rank's), as a merge
    takes them: a partial sum's magnitude counts each term once, not once per replica of it."""
    seen, out = set(), []
    for rt, r in sorted(pieces, key=lambda p: p[0].rank):
        at = tuple((p.axis, tuple(rt.coords.get(p.axis, (0, 1)))) for p in r.layout.placements
                   if not isinstance(p, Replicate))
        if at not in seen:
            seen.add(at)
            out.append((rt, r))
    return out


def piece_norm(piece: torch.Tensor, layout: Layout) -> float:
    """‖piece‖ of one rank's partial sum, in logical units (the layout's scale divided out)."""
    return float(torch.linalg.vector_norm(piece.detach().to(torch.float64))) / layout.scale


def fp64_norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.to(torch.float64)))


def cancellation_factor(magnitude: float, total) -> float:
    """Σᵢ‖partialᵢ‖ / ‖Σᵢ partialᵢ‖ (≥ 1): how much larger than the sum its round-off may be, each
    partial having been rounded relative to its own magnitude. Σ‖pᵢ‖ bounds ‖Σ|pᵢ|‖ from above and
    is what online compare can add up from per-rank norms, so both modes use it. ``total``: the sum,
    or its fp64 norm already taken."""
    norm = total if isinstance(total, float) else fp64_norm(total)
    return max(1.0, magnitude / norm) if norm > 0 else 1.0


class BiasTerms:
    """Σₜ‖…|gₜ|…‖ of a bias grad's terms, from the reference's recorded output-grads of its module.

    A bias grad is the sum over tokens of the grad arriving at the module's output; its round-off,
    and the round-off those grads carry from upstream, is relative to the terms, not to their sum,
    which cancels where tokens pull both ways (a correct bf16 run then differs by several ε of the
    sum). The factor Σ‖|g|‖ / ‖bias grad‖ scales its tolerance (:func:`cancellation_factor`), and its
    main grad's and moments' with the iteration's microbatches. Read from the reference alone, so
    offline and online compare use the same factor; 1 where the output-grads were not recorded."""

    def __init__(self, reader: TraceReader, groups: Dict[TensorKey, List[Tuple[RankTrace, Record]]]):
        self.reader, self.groups = reader, groups
        self._by_iteration: Dict[Tuple[int, str], List[TensorKey]] = {}
        for k in groups:
            if k.kind is TensorKind.GRAD_OUTPUT:
                self._by_iteration.setdefault((k.iteration, k.module), []).append(k)
        self._magnitudes: Dict[TensorKey, Optional[torch.Tensor]] = {}
        self._main_factor: Dict[Tuple[int, str], float] = {}  # a bias's main-grad factor, for its moments

    def _magnitude(self, key: TensorKey) -> Optional[torch.Tensor]:
        if key not in self._magnitudes:
            source = logical_source(self.reader, self.groups[key])[0]
            self._magnitudes[key] = None
            if source.shape:  # Σ over tokens of |g|, whole rows a chunk at a time
                width, whole, total = source.shape[-1], source.meta(), 0
                for begin, end in chunks(whole.numel(), max(streaming.STREAM_CHUNK // width, 1) * width):
                    total = total + read_flat(source, whole, begin, end).to(torch.float64).abs().reshape(-1, width).sum(0)
                self._magnitudes[key] = total if whole.numel() else torch.zeros(width, dtype=torch.float64)
        return self._magnitudes[key]

    def factor(self, key: TensorKey, reference: Optional[torch.Tensor]) -> float:
        """(``reference``: the bias grad's tensor; a moment's factor, its main grad's, needs none.)"""
        if keys.param_name_of(key.tensor) != "bias" or key.kind not in (
                TensorKind.PARAM_GRAD, TensorKind.MAIN_GRAD, TensorKind.OPTIMIZER_STATE):
            return 1.0
        if key.kind is TensorKind.PARAM_GRAD:
            grads = [k for k in self._by_iteration.get((key.iteration, key.module), []) if k.microbatch == key.microbatch]
        else:
            grads = self._by_iteration.get((key.iteration, key.module), [])
        if key.kind is TensorKind.OPTIMIZER_STATE:
            # a moment is a scaled copy of the main grad (or of its square): its terms cancel as the
            # main grad's did, and the factor is the main grad's — the state's own norm is not the
            # scale of its terms (Adam's second moment is of the order g², not g)
            return self._main_factor.get((key.iteration, key.module), 1.0)
        magnitudes = [self._magnitude(k) for k in grads]
        if not magnitudes or any(m is None or m.numel() != reference.numel() for m in magnitudes):
            return 1.0
        factor = cancellation_factor(float(torch.linalg.vector_norm(sum(magnitudes))), reference)
        if key.kind is TensorKind.MAIN_GRAD:
            self.set_main_factor(key, factor)
        return factor

    def set_main_factor(self, key: TensorKey, factor: float) -> None:
        """A bias's main-grad factor, which its moments take (measured here or by a compare worker)."""
        self._main_factor[(key.iteration, key.module)] = factor


class Cancellation:
    """The cancellation factors of one comparison (offline and online keep the same state): a
    partial-sum tensor's own (:meth:`note_partial`), the main grad summed from per-microbatch grads
    that were partial sums, the optimizer states stepped with that main grad (linear in it, or in
    its square), and a bias grad's token terms (:class:`BiasTerms`)."""

    def __init__(self, reader: TraceReader, groups: Dict[TensorKey, List[Tuple[RankTrace, Record]]]):
        self.bias_terms = BiasTerms(reader, groups)
        self._grad_magnitude: Dict[Tuple[int, str], float] = {}  # Σ over microbatches of Σᵢ‖partialᵢ‖
        self._main_grad: Dict[Tuple[int, str], float] = {}

    def note_partial(self, key: TensorKey, magnitude: float, total: Optional[torch.Tensor] = None) -> float:
        """A tensor added up from partials of norms summing to ``magnitude``: kept for its
        parameter's main grad when it is a per-microbatch grad; its own factor given its ``total``."""
        if key.kind is TensorKind.PARAM_GRAD:
            at = (key.iteration, coverage.param_of(key))
            self._grad_magnitude[at] = self._grad_magnitude.get(at, 0.0) + magnitude
        return 1.0 if total is None else cancellation_factor(magnitude, total)

    def needs_reference(self, key: TensorKey) -> bool:
        """Whether :meth:`factor` can be more than 1 for ``key`` (online loads the reference only then)."""
        return keys.param_name_of(key.tensor) == "bias" or (
            key.kind in (TensorKind.MAIN_GRAD, TensorKind.OPTIMIZER_STATE)
            and (key.iteration, coverage.param_of(key)) in self._grad_magnitude)

    def reads_reference(self, key: TensorKey) -> bool:
        """Whether :meth:`factor` reads the reference tensor itself (a main grad's norm, a bias
        grad's size beside its terms). A moment takes its main grad's factor, and a bias's other
        keys none: :meth:`factor` takes None for them, and online does not load them (the moments of
        every weight whose grads are SP replicas' partial sums, and a bias's moments and updated
        values, were read whole after the run for nothing)."""
        return self.needs_reference(key) and key.kind in (TensorKind.PARAM_GRAD, TensorKind.MAIN_GRAD)

    def factor(self, key: TensorKey, reference: Optional[torch.Tensor]) -> float:
        """The factor of ``key`` given the reference's tensor (None where :meth:`reads_reference`
        says it is not read)."""
        return self.factor_measured(key, fp64_norm(reference) if self.reduced(key) else 0.0,
                                    self.bias_terms.factor(key, reference))

    def reduced(self, key: TensorKey) -> bool:
        """Whether ``key`` is a main grad added up from partial sums (its factor needs ‖reference‖)."""
        return key.kind is TensorKind.MAIN_GRAD and (key.iteration, coverage.param_of(key)) in self._grad_magnitude

    def factor_measured(self, key: TensorKey, reference_norm: float, bias: float) -> float:
        """:meth:`factor` from what a worker measured of the reference (compare_workers): its fp64
        norm and its bias-terms factor (which a moment of the same bias takes later)."""
        at = (key.iteration, coverage.param_of(key))
        reduced = 1.0
        if self.reduced(key):
            reduced = self._main_grad[at] = cancellation_factor(self._grad_magnitude[at], reference_norm)
        elif key.kind is TensorKind.OPTIMIZER_STATE:
            reduced = self._main_grad.get(at, 1.0)
        if key.kind is TensorKind.MAIN_GRAD and keys.param_name_of(key.tensor) == "bias":
            self.bias_terms.set_main_factor(key, bias)
        return max(reduced, bias)


def _common_layout(pieces: List[Tuple[RankTrace, Record]]) -> Layout:
    """The pieces' layout (the first piece's where replicas are split alike: ``replicas_split_alike``)."""
    first_rt, first = pieces[0]
    if replicas_split_alike([rec.layout for _, rec in pieces]) or alike_but_scale([rec.layout for _, rec in pieces]):
        return first.layout
    for rt, rec in pieces[1:]:
        if rec.layout != first.layout:
            raise TraceError(f"ranks {first_rt.rank} and {rt.rank} record different placements "
                             f"({first.layout.to_json()} vs {rec.layout.to_json()})",
                             path=rt.dir, rank=rt.rank, tensor=str(rec.key))
    return first.layout


def with_recomputed_aliases(ref_groups: Dict[TensorKey, List[Tuple[RankTrace, Record]]],
                            candidate_keys: Iterable[TensorKey]) -> None:
    """A candidate that recomputes activations records each recomputed module's output again
    (``keys.RECOMPUTED_OUTPUT``): it is judged against the reference's output of the same call, so
    that a recomputation which computes something else is named as such (BENCHMARKS.md, issue #33)."""
    for key in candidate_keys:
        base = keys.reference_key(key)
        if base != key and base in ref_groups:
            ref_groups[key] = ref_groups[base]


def in_order(keys_: Iterable[TensorKey], order: Dict[TensorKey, int]) -> List[TensorKey]:
    """Keys in execution order; a recomputed output right after the output it recomputes."""
    return sorted(keys_, key=lambda k: (order[k], k.tensor == keys.RECOMPUTED_OUTPUT))


def reference_order(groups: Dict[TensorKey, List[Tuple[RankTrace, Record]]]) -> Dict[TensorKey, int]:
    """Execution order of each key: the reference's recording order (its first piece's :func:`record_order`)."""
    return {key: min(record_order(rt, rec) for rt, rec in pieces) for key, pieces in groups.items()}


def record_order(rt: RankTrace, rec: Record) -> int:
    """Where one record of the reference falls in :func:`reference_order`: by rank, then as recorded."""
    return rec.seq + rt.rank * 10**9


def perturbation_observed(perturbed: TraceReader, groups: Dict[TensorKey, List[Tuple[RankTrace, Record]]],
                          key: TensorKey, ref_tensor: torch.Tensor) -> Optional[float]:
    """How far the perturbation run moved ``key`` from the reference (relative error): None when the
    perturbation run did not record it, inf when the noise changed its shape."""
    pieces = groups.get(key)
    if pieces is None:
        return None
    moved = logical_tensor(perturbed, pieces).tensor
    if tuple(moved.shape) != tuple(ref_tensor.shape):
        return math.inf
    return relative_error(moved, ref_tensor)[0]


def statistic_observed(perturbed: TraceReader, pert_groups, reference: TraceReader, ref_groups,
                       key: TensorKey, rec: Record) -> float:
    """How far the perturbation moved the tensor a statistic summarizes (an amax's operand), 0 if
    either run lacks it. A max moves with one element, which the noise may leave alone where
    round-off does not; the whole tensor's movement is the better estimate of how far it can go."""
    source = dataclasses.replace(key, tensor=rec.statistic_of)
    if source not in ref_groups or source not in pert_groups:
        return 0.0
    observed = perturbation_observed(perturbed, pert_groups, source, logical_tensor(reference, ref_groups[source]).tensor)
    return observed if observed is not None and math.isfinite(observed) else 0.0


def open_judge(reference_dir: str, candidate_dir: str, perturbed: Optional[str],
               tol_config: ToleranceConfig) -> "_TraceJudge":
    """Both traces (and the perturbation run's) read, checked to be comparable, and grouped."""
    ref = TraceReader(reference_dir)
    cand = TraceReader(candidate_dir)
    check_compatible(ref.run, cand.run, cand.dir)
    pert = TraceReader(perturbed) if perturbed else None
    if pert is not None:
        check_compatible(ref.run, pert.run, pert.dir)
        if not pert.run.get("perturbation_seed"):
            raise ConfigMismatchError("this trace is not a perturbation run (run.json has no perturbation_seed)",
                                      path=pert.dir)
    return _TraceJudge(ref, cand, pert, tol_config)


def compare_traces(reference_dir: str, candidate_dir: str, *, tol_config: ToleranceConfig = ToleranceConfig(),
                   progress: Optional[Callable[[int, int], None]] = None,
                   perturbed: Optional[str] = None, workers: int = 1, distributed: bool = False
                   ) -> Optional[Comparison]:
    """``perturbed``: the trace of a perturbation-estimate run of the reference (``adapter.run.perturb``):
    each tensor's tolerance is then at least k_p times how far that run moved it. ``workers``: judge
    on this many processes (:mod:`.compare_workers`); the verdict is the same, bit for bit.
    ``distributed``: judged by every rank of torch.distributed's default group instead
    (``compare_workers.judged_across_ranks``); rank 0 returns the comparison, the others None."""
    from .allocator import keep_freed_memory
    from .compare_workers import judged_across_ranks, judged_in_order

    keep_freed_memory()  # chunks in memory freed before, not fresh pages (allocator's docstring)
    judge = open_judge(reference_dir, candidate_dir, perturbed, tol_config)
    ref, cand = judge.ref, judge.cand
    results: List[TensorResult] = []
    dirs = (reference_dir, candidate_dir, perturbed)
    peaks: list = []
    verdicts = judged_across_ranks(judge, dirs, open_judge) if distributed else \
        judged_in_order(judge, dirs, workers, open_judge, peaks)
    if distributed:
        import torch.distributed as dist

        if dist.get_rank() != 0:
            for _ in verdicts:  # (it measures its share, then yields nothing)
                pass
            return None
    for i, result in enumerate(verdicts):
        results.append(result)
        if progress:
            progress(i + 1, len(judge.common))
    absent = sorted((k for k in set(judge.ref_groups) - set(judge.cand_groups) if recorded_by_choice(cand.run, k)),
                    key=lambda k: judge.order[k])
    skipped = [k for k in absent if not_recorded_by(cand.run, k)]
    missing_in_candidate = [k for k in absent if not not_recorded_by(cand.run, k)]
    missing_in_reference = sorted(set(judge.cand_groups) - set(judge.ref_groups), key=str)
    known = [p for p in peaks if p is not None]
    return Comparison(reference_dir, candidate_dir, results, missing_in_candidate, missing_in_reference,
                      ref.run, cand.run, skipped=skipped, unjudged=judge.unjudged, diverged=judge.diverged,
                      worker_peak=max(known) if known else None)


@dataclasses.dataclass
class Measured:
    """A key's measurements, for a verdict decided in order from the comparison's state
    (:meth:`_TraceJudge.main_grad_measured`, :meth:`_TraceJudge.step_measured`,
    :meth:`_TraceJudge.decided`): small, sent between processes. A main grad's, or a step's
    optimizer state's or updated value's."""

    entries: list
    notes: list
    observed: Optional[float]
    cancellation: float  # its own, as a merged partial sum
    reference_norm: float  # ‖ref‖ in fp64, for the cancellation factor of its microbatches' partials
    bias_factor: Optional[float]  # a bias's token-terms factor (1 otherwise); None: the parent's (a moment's)
    replicas_split: bool  # judged shard by shard: replicas' differences can be measured if asked
    update: Optional[tuple] = None  # an updated value's element-wise check: apply_update_verdict's arguments


class _TraceJudge:
    """One offline comparison's state: both traces' records grouped by key, the keys to judge in the
    reference's order (and the ones no comparison can judge), and what judging a key needs beside
    its own records: cancellation factors, the step's bounds, re-clipping, the update check."""

    def __init__(self, ref: TraceReader, cand: TraceReader, pert: Optional[TraceReader], tol_config: ToleranceConfig):
        self.ref, self.cand, self.pert, self.tol_config = ref, cand, pert, tol_config
        self.pert_groups = group_records(pert) if pert is not None else {}
        self.num_layers = int(ref.run.get("num_layers", 0))
        self.ref_groups = ref_groups = group_records(ref)
        self.cand_groups = group_records(cand)
        with_recomputed_aliases(ref_groups, self.cand_groups)
        with_recomputed_aliases(self.pert_groups, self.cand_groups)
        self.update_check = UpdateCheck.for_runs(ref, ref_groups, cand, self.cand_groups, tol_config)
        self.order = order = reference_order(ref_groups)
        unjudged_params = {**coverage.unjudged_params(ref.run), **coverage.unjudged_params(cand.run)}
        both = set(ref_groups) & set(self.cand_groups)
        self.unjudged = in_order((k for k in both if coverage.param_of(k) in unjudged_params), order)
        free = self.update_check is not None and not self.update_check.lockstep
        # a candidate lock-stepped with another reference started each step from that reference's
        # parameters, which this comparison does not have: its updates after the first step cannot
        # be judged either
        elsewhere = stepped_with(cand.run) is not None
        # an update after the first step is judged from the previous step's parameters, where recorded
        self.diverged = in_order((k for k in both if free and k.iteration > FIRST_STEP and k not in self.unjudged
                                  and (elsewhere or not keys.is_updated_value(k)
                                       or dataclasses.replace(k, iteration=k.iteration - 1) not in both)), order)
        self.common = in_order(both - set(self.unjudged) - set(self.diverged), order)
        self.cancellations = Cancellation(ref, ref_groups)
        self.step_bounds = StepBounds(ref.run, self.num_layers, tol_config, has_reference=lambda k: k in ref_groups)
        self.reclip = Reclip(ref, ref_groups)
        self.overflowed = overflowed_iterations(ref, ref_groups)
        self.partial_magnitudes: Dict[TensorKey, float] = {}  # what note_partial was told, for compare_workers

    def main_grad_measured(self, key: TensorKey) -> Measured:
        """What a main grad's verdict needs from the tensors, none of it from the judge's state: a
        compare worker measures it, the parent decides it in order (:meth:`decided`)."""
        return self.tensor(key, stop_before_state=True)

    def step_measured(self, key: TensorKey, reclipped: bool) -> Optional[Measured]:
        """The same for an optimizer state or an updated value (its element-wise check included),
        read a chunk at a time, given whether the step's states are re-clipped
        (``StepBounds.reclipped``, as the caller decided it: ``compare_workers.reclipped_here``).
        None where it must be judged whole: the parent judges it."""
        return self._streamed(key, True, reclipped)

    def decided(self, key: TensorKey, m: Measured) -> TensorResult:
        """A measured key's verdict, from this judge's state in order."""
        bias = m.bias_factor if m.bias_factor is not None else self.cancellations.bias_terms.factor(key, None)
        cancellation = max(m.cancellation, self.cancellations.factor_measured(key, m.reference_norm, bias))
        result = self._combine(key, m.entries, m.notes, m.observed, cancellation,
                               self._replica_diff(key) if m.replicas_split else None)
        if m.update is None or not math.isfinite(result.error):
            return result
        return apply_update_verdict(result, *m.update)

    def _replica_diff(self, key: TensorKey):
        """How far the candidate's replicas of a piece differ, measured only when asked."""
        by_rank = {rt.rank: (rt, r) for rt, r in self.cand_groups[key]}

        def replica_max_abs_diff(ranks):
            loaded = [self.cand.load(*by_rank[r]) for r in ranks]
            return max(float((t.double() - loaded[0].double()).abs().max()) for t in loaded[1:])

        return replica_max_abs_diff

    def _combine(self, key, entries, notes, observed, cancellation, replica_max_abs_diff):
        rec = self.ref_groups[key][0][1]
        pieces = self.cand_groups[key]
        roundoff = max((r.roundoff for _, r in pieces), key=abs)
        if roundoff:
            entries = [(rank, dataclasses.replace(e, roundoff=roundoff)) for rank, e in entries]
        return combine_shards(key, entries, rec, self.num_layers, self.order[key], self.tol_config, self.cand.dir,
                              notes, replica_max_abs_diff, observed, cancellation, step=self.step_bounds,
                              overflowed=key.phase in OVERFLOW_PHASES and key.iteration in self.overflowed)

    def tensor(self, key: TensorKey, stop_before_state: bool = False) -> "TensorResult | Measured":
        """One key's verdict: the reference merged, the candidate merged or shard by shard.
        ``stop_before_state``: a main grad's measurements only (:meth:`main_grad_measured`)."""
        streamed = self._streamed(key, stop_before_state)
        if streamed is not None:
            return streamed
        ref, cand, pert = self.ref, self.cand, self.pert
        rec = self.ref_groups[key][0][1]
        ref_merged = logical_tensor(ref, self.ref_groups[key])
        judged_against = ref_merged.tensor
        if self.step_bounds.reclipped(key):  # judged by its grads alone: the coefficients' difference taken out
            judged_against = self.reclip.state(key, ref_merged.tensor,
                                               self.reclip.clip(cand, self.cand_groups, key.iteration))
        notes = [replica_note("reference", m.ranks, m.max_abs_diff, m.axis) for m in ref_merged.replica_mismatches]
        observed = perturbation_observed(pert, self.pert_groups, key, ref_merged.tensor) if pert is not None else None
        if observed is not None and rec.statistic_of:
            observed = max(observed, statistic_observed(pert, self.pert_groups, ref, self.ref_groups, key, rec))
        pieces = self.cand_groups[key]
        layout = _common_layout(pieces)
        replica_max_abs_diff = None
        cancellation = 1.0
        cand_merged = None
        element_wise = self.update_check is not None and keys.is_updated_value(key)
        choice = key.kind is TensorKind.SELECTION
        split_alike = any(r.layout != layout for _, r in pieces)  # replicas split each their own way
        if element_wise or choice or split_alike or any(isinstance(p, Partial) for p in layout.placements):
            # merged first, then judged as one piece: partial sums only mean something added up, an
            # updated parameter is judged element by element on the merged tensor too, and copies
            # split each their own way are compared once each is whole
            cand_merged = logical_tensor(cand, pieces)
            notes += [replica_note("candidate", m.ranks, m.max_abs_diff, m.axis)
                      for m in cand_merged.replica_mismatches]
            whole = Layout((), tuple(cand_merged.tensor.shape))
            if any(isinstance(p, Partial) for p in layout.placements):
                magnitude = sum(piece_norm(cand.load(rt, r), r.layout) for rt, r in distinct_pieces(pieces))
                cancellation = self.cancellations.note_partial(key, magnitude, cand_merged.tensor)
                self.partial_magnitudes[key] = magnitude
            entries = [(pieces[0][0].rank, shard_sums(key, cand_merged.tensor, whole, {}, judged_against))]
        else:
            entries, replica_max_abs_diff = self._shard_by_shard(key, pieces, judged_against)
        if stop_before_state:
            return Measured(entries, notes, observed, cancellation, fp64_norm(ref_merged.tensor),
                            self.cancellations.bias_terms.factor(key, ref_merged.tensor), replica_max_abs_diff is not None)
        cancellation = max(cancellation, self.cancellations.factor(key, ref_merged.tensor))
        result = self._combine(key, entries, notes, observed, cancellation, replica_max_abs_diff)
        if element_wise:
            result = self.update_check.judge(result, key, cand_merged.tensor, ref_merged.tensor, pieces[0][1].dtype)
        if choice:
            result = judge_choice(result, key, cand_merged.tensor, ref_merged.tensor, (cand, self.cand_groups),
                                  (ref, self.ref_groups))
        return result

    def _streamed(self, key: TensorKey, stop_before_state: bool,
                  reclipped: Optional[bool] = None) -> "TensorResult | Measured | None":
        """:meth:`tensor` with each candidate piece judged a chunk at a time against the reference
        at its positions (``streamed_shard_sums``), an updated value's Adam check too: compare's
        peak is then the chunks, not the tensors (a reference held by several ranks is merged
        first). None where a key needs its pieces merged (partial sums, a top-k choice, replicas
        split each their own way, padding) or its moments are not each piece's: judged whole.
        ``stop_before_state``: its :class:`Measured` (``reclipped``: the caller's decision)."""
        pieces = self.cand_groups[key]
        layout = _common_layout(pieces)
        if (key.kind is TensorKind.SELECTION or any(r.layout != layout for _, r in pieces)
                or any(isinstance(p, Partial) for p in layout.placements)):
            return None
        operands = None
        if self.update_check is not None and keys.is_updated_value(key):
            operands = self._update_operands(key, pieces)
            if operands is None:
                return None
        for rt, r in pieces:
            try:
                check_coords(rt.coords, r.layout)
            except PlacementError as e:
                raise TraceError(f"bad rank coordinates: {e}", path=rt.dir, rank=rt.rank, tensor=str(key)) from None
        reference, mismatches = logical_source(self.ref, self.ref_groups[key])
        against = reference
        if self.step_bounds.reclipped(key) if reclipped is None else reclipped:
            # judged by its grads alone: the coefficients' difference taken out
            grad = logical_source(self.ref, self.ref_groups[main_grad_key(key)])[0]
            against = MappedSource((reference, grad), self.reclip.chunked(
                key, self.reclip.clip(self.cand, self.cand_groups, key.iteration)))
        entries = []
        for rt, r in pieces:
            sums = streamed_shard_sums(key, RecordSource(self.cand, rt, r), r.layout, rt.coords, against)
            if sums is None:
                return None
            entries.append((rt.rank, sums))
        notes = [replica_note("reference", m.ranks, m.max_abs_diff, m.axis) for m in mismatches]
        observed = self._observed_streamed(key, reference)
        bias = self.cancellations.bias_terms.factor(
            key, reference.read(reference.meta()) if keys.param_name_of(key.tensor) == "bias" else None)
        main_grad = key.kind is TensorKind.MAIN_GRAD
        norm = source_norm(reference) if main_grad and (stop_before_state or self.cancellations.reduced(key)) else 0.0
        if stop_before_state:  # (a moment's bias factor is its main grad's, in the parent)
            return Measured(entries, notes, observed, 1.0, norm,
                            None if key.kind is TensorKind.OPTIMIZER_STATE else bias, True,
                            None if operands is None else self._update_outcome(key, operands, reference))
        result = self._combine(key, entries, notes, observed, self.cancellations.factor_measured(key, norm, bias),
                               self._replica_diff(key))
        if operands is None or not math.isfinite(result.error):
            return result
        return apply_update_verdict(result, *self._update_outcome(key, operands, reference))

    def _update_operands(self, key: TensorKey, pieces) -> Optional[Tuple[list, List[TensorSource]]]:
        """What the element-wise Adam check of an updated value reads a chunk at a time: for each
        distinct piece, (its rank's trace, layout, [the rank's value, moments and, stepping apart,
        previous value]), and the reference's logical moments (and previous value). None where one
        is missing or a rank holds its moments otherwise than its value (a distributed optimizer's
        range): judged whole, which says what is missing."""
        param = keys.param_name_of(key.tensor)
        siblings = [keys.sibling(key, keys.optimizer_state(param, s)) for s in (keys.EXP_AVG, keys.EXP_AVG_SQ)]
        if not self.update_check.lockstep and key.iteration > FIRST_STEP:
            siblings.append(dataclasses.replace(key, iteration=key.iteration - 1))
        if any(k not in self.cand_groups or k not in self.ref_groups for k in siblings):
            return None
        by_rank = [{rt.rank: r for rt, r in self.cand_groups[k]} for k in siblings]
        operands = []
        for rt, r in distinct_pieces(pieces):
            mine = [ranks.get(rt.rank) for ranks in by_rank]
            if any(m is None or m.layout != r.layout or tuple(m.shape) != tuple(r.shape) for m in mine):
                return None
            operands.append((rt, r, [RecordSource(self.cand, rt, m) for m in (r, *mine)]))
        return operands, [logical_source(self.ref, self.ref_groups[k])[0] for k in siblings]

    def _update_outcome(self, key: TensorKey, operands, reference: TensorSource) -> tuple:
        """:meth:`UpdateCheck.judge` of each distinct piece a chunk at a time (``judge_adam_chunks``):
        the worst element over the pieces, its flat index in its rank's piece; as
        :func:`apply_update_verdict`'s arguments after the result (verdict, detail, how, where)."""
        check, (pieces, references) = self.update_check, operands
        stepped_apart = len(references) == 3
        how, missing, decay = "lock-step", [], 0.0
        if stepped_apart:
            how, decay = "not in lock-step: each side from its own previous parameter", check.weight_decay(key)
            missing = ["previous parameters or weight decay"] if decay is None else []
        elif not check.lockstep:
            how = "not in lock-step, first iteration: both from the seed checkpoint"
        if any(tuple(s.shape) != tuple(reference.shape) for s in references):
            missing.append("moments of the parameter's shape")
        settings, detail = check.settings(key, missing)
        if settings is None:
            return None, detail, how, ""
        rule, lr, step = settings
        refs, worst = [reference, *references], None
        for rt, r, cands in pieces:
            view, whole = piece_view(reference.shape, r.layout, rt.coords, r.shape), cands[0].meta()

            def in_chunks():
                for begin, end in chunks(whole.numel()):
                    c = [read_flat(s, whole, begin, end) for s in cands]
                    ref = [with_scale(read_flat(s, view, begin, end), r.layout) for s in refs]
                    yield begin, [c[0], ref[0], c[1], c[2], ref[1], ref[2]] + ([c[3], ref[3]] if stepped_apart else [])

            v = judge_adam_chunks(rule, lr, step, r.dtype, in_chunks(), check.k, stepped_apart, decay or 0.0)
            if worst is None or v.worst_ratio > worst[1].worst_ratio or (
                    math.isnan(v.worst_ratio) and not math.isnan(worst[1].worst_ratio)):
                worst = (rt.rank, v)
        whole_piece = len(pieces) == 1 and tuple(pieces[0][1].shape) == tuple(reference.shape)
        return worst[1], detail, how, "" if whole_piece else f" of rank {worst[0]}'s piece"

    def _observed_streamed(self, key: TensorKey, reference: TensorSource) -> Optional[float]:
        """:func:`perturbation_observed` (and :func:`statistic_observed`) with the perturbation
        run's tensor and the reference's read a chunk at a time."""
        pieces = self.pert_groups.get(key) if self.pert is not None else None
        if pieces is None:
            return None
        moved = logical_source(self.pert, pieces)[0]
        if tuple(moved.shape) != tuple(reference.shape):
            return math.inf
        diff_sq = ref_sq = 0.0
        whole = reference.meta()
        for begin, end in chunks(whole.numel()):
            d, r = difference_sums(read_flat(moved, whole, begin, end), read_flat(reference, whole, begin, end))
            diff_sq, ref_sq = diff_sq + d, ref_sq + r
        observed = (0.0 if diff_sq == 0.0 else math.inf) if ref_sq == 0.0 else math.sqrt(diff_sq) / math.sqrt(ref_sq)
        rec = self.ref_groups[key][0][1]
        if rec.statistic_of:
            observed = max(observed, statistic_observed(self.pert, self.pert_groups, self.ref, self.ref_groups, key,
                                                        rec))
        return observed

    def _shard_by_shard(self, key: TensorKey, pieces, judged_against: torch.Tensor):
        """Each candidate piece's sums against its slice of the reference: never more than the
        reference, one candidate piece and its slice in memory. Also how to measure, only when
        asked, how far the candidate's replicas of a piece differ."""
        cand = self.cand
        for rt, r in pieces:
            try:
                check_coords(rt.coords, r.layout)
            except PlacementError as e:
                raise TraceError(f"bad rank coordinates: {e}", path=rt.dir, rank=rt.rank, tensor=str(key)) from None
        entries = [(rt.rank, shard_sums(key, cand.load(rt, r), r.layout, rt.coords, judged_against))
                   for rt, r in pieces]
        return entries, self._replica_diff(key)


class Reclip:
    """The reference's optimizer states re-clipped by the candidate's clip coefficient
    (``step_bounds.reclip_delta``), from the reference's clip coefficient and main grad. Offline
    compare and each online candidate rank use it alike (the candidate's own coefficient from its
    trace, or as the rank recorded it)."""

    def __init__(self, reference: TraceReader, groups: Dict[TensorKey, List[Tuple[RankTrace, Record]]]):
        self.reader, self.groups = reference, groups
        self.rule = reference.run.get("update_rule") or {}
        self._grad: Tuple[Optional[TensorKey], Optional[torch.Tensor]] = (None, None)  # the last main grad read

    @staticmethod
    def clip(reader: TraceReader, groups, iteration: int) -> Optional[float]:
        pieces = groups.get(TensorKey(iteration, -1, keys.OPTIMIZER_MODULE, keys.OPTIMIZER, keys.CLIP_COEFFICIENT))
        return None if pieces is None else float(logical_tensor(reader, pieces).tensor.reshape(-1)[0])

    def state(self, key: TensorKey, state: torch.Tensor, candidate_clip: float) -> torch.Tensor:
        """The reference's logical ``state`` (of ``key``) as it would be with ``candidate_clip``, in
        float64, by the logical main grad (an online rank re-clips its piece with :meth:`chunked`)."""
        grad_key = main_grad_key(key)
        if self._grad[0] != grad_key:  # a parameter's states come one after another
            self._grad = (grad_key, logical_tensor(self.reader, self.groups[grad_key]).tensor)
        return self.chunked(key, candidate_clip)(state, self._grad[1])

    def chunked(self, key: TensorKey, candidate_clip: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """:meth:`state` of ``key`` as a function of (state, main grad at the same positions), the
        reference's coefficient read once: a state re-clipped a chunk at a time."""
        reference_clip = self.clip(self.reader, self.groups, key.iteration)
        name = state_of(key)

        def reclipped(state: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
            delta = reclip_delta(name, self.rule, grad, candidate_clip, reference_clip)
            return delta.reshape(state.shape).add_(state)  # (a new tensor: reclip_delta's)

        return reclipped


class UpdateCheck:
    """Updated parameters judged element by element by the update rule (``update_rules``), for Adam.
    In lock-step with this reference both steps started from the same parameters. Otherwise each
    side stepped from its own: its previous parameter (the iteration before's, as recorded; at the
    first iteration the seed checkpoint both started from) enters the expected difference, so a
    free-running pair is judged by each step's own round-off too (issue #38)."""

    def __init__(self, rule: AdamRule, ref: TraceReader, ref_groups, cand: TraceReader, cand_groups,
                 tol_config: ToleranceConfig, lockstep: bool = True):
        self.rule, self.ref, self.ref_groups, self.cand, self.cand_groups = rule, ref, ref_groups, cand, cand_groups
        self.lockstep = lockstep
        self.k = tol_config.k
        self.param_groups = ref.run.get("param_groups") or {}
        self._scalars: Dict[TensorKey, Optional[float]] = {}  # the reference's lr and step, read once

    @staticmethod
    def for_runs(ref: TraceReader, ref_groups, cand: TraceReader, cand_groups,
                 tol_config: ToleranceConfig) -> Optional["UpdateCheck"]:
        rule = AdamRule.from_run(ref.run)
        if rule is None:
            return None
        return UpdateCheck(rule, ref, ref_groups, cand, cand_groups, tol_config,
                           lockstep=in_lockstep(ref.run, cand.run, ref.dir))

    def _scalar(self, key: TensorKey) -> Optional[float]:
        if key not in self._scalars:
            value = self._value(self.ref, self.ref_groups, key)
            self._scalars[key] = None if value is None else float(value.reshape(-1)[0])
        return self._scalars[key]

    def _value(self, reader, groups, key) -> Optional[torch.Tensor]:
        pieces = groups.get(key)
        return None if pieces is None else logical_tensor(reader, pieces).tensor

    def judge(self, result: TensorResult, key: TensorKey, cand_param: torch.Tensor, ref_param: torch.Tensor,
              param_dtype: str) -> TensorResult:
        if not math.isfinite(result.error) or tuple(cand_param.shape) != tuple(ref_param.shape):
            return result
        param = keys.param_name_of(key.tensor)
        moments = [tuple(self._value(reader, groups, keys.sibling(key, keys.optimizer_state(param, s)))
                         for s in (keys.EXP_AVG, keys.EXP_AVG_SQ))
                   for reader, groups in ((self.cand, self.cand_groups), (self.ref, self.ref_groups))]
        previous, decay, how, missing = None, 0.0, "lock-step", []
        if not self.lockstep and key.iteration > FIRST_STEP:
            before = dataclasses.replace(key, iteration=key.iteration - 1)
            previous = tuple(self._value(reader, groups, before)
                             for reader, groups in ((self.cand, self.cand_groups), (self.ref, self.ref_groups)))
            decay = self.weight_decay(key)
            if any(p is None for p in previous) or decay is None:
                missing.append("previous parameters or weight decay")
            how = "not in lock-step: each side from its own previous parameter"
        elif not self.lockstep:
            how = "not in lock-step, first iteration: both from the seed checkpoint"
        verdict, detail = self.element_wise(key, cand_param, ref_param, moments[0], moments[1], param_dtype,
                                            previous=previous, weight_decay=decay or 0.0, missing=missing)
        return apply_update_verdict(result, verdict, detail, how)

    def weight_decay(self, key: TensorKey) -> Optional[float]:
        """The weight decay of ``key``'s parameter group at its step, as the reference recorded it."""
        group = self.param_groups.get(f"{key.module}.{keys.param_name_of(key.tensor)}")
        return self._scalar(TensorKey(key.iteration, -1, keys.OPTIMIZER_MODULE, keys.OPTIMIZER,
                                      keys.step_setting(group, keys.WEIGHT_DECAY))) if group else None

    def element_wise(self, key: TensorKey, cand_param: torch.Tensor, ref_param: torch.Tensor, cand_moments,
                     ref_moments, param_dtype: str, *, previous=None, weight_decay: float = 0.0,
                     missing: Sequence[str] = ()) -> Tuple[Optional[UpdateVerdict], str]:
        """The element-wise verdict on an updated value (the whole tensor, or one rank's piece of it
        with the same elements of each operand: ``online``), with the step's lr, step count and the
        group's ε read from the reference; (None, what is missing) when it cannot be judged."""
        missing = (["moments"] if any(m is None for m in (*cand_moments, *ref_moments)) else []) + list(missing)
        settings, detail = self.settings(key, missing)
        if settings is None:
            return None, detail
        rule, lr, step = settings
        return judge_adam_update(rule, lr, step, param_dtype, cand_param, ref_param, cand_moments, ref_moments,
                                 k=self.k, previous=previous, weight_decay=weight_decay), detail

    def settings(self, key: TensorKey, missing: Sequence[str] = ()
                 ) -> Tuple[Optional[Tuple[AdamRule, float, float]], str]:
        """(the rule with the group's ε, lr, step count) of ``key``'s step as the reference recorded
        them, and the detail a verdict quotes; (None, what is missing: those or ``missing``)."""
        param = keys.param_name_of(key.tensor)
        group = self.param_groups.get(f"{key.module}.{param}")
        scalars = {}
        for name, tensor in (("lr", keys.step_setting(group, keys.LR) if group else None), ("step", keys.STEP_COUNT)):
            scalars[name] = None if tensor is None else self._scalar(
                TensorKey(key.iteration, -1, keys.OPTIMIZER_MODULE, keys.OPTIMIZER, tensor))
        missing = [n for n, v in scalars.items() if v is None] + list(missing)
        if missing:
            return None, f"no {', '.join(missing)} recorded"
        rule = self.rule
        if group:  # a group with an ε of its own (μP's hidden matrices) recorded it beside its lr
            eps = self._scalar(TensorKey(key.iteration, -1, keys.OPTIMIZER_MODULE, keys.OPTIMIZER,
                                         keys.step_setting(group, keys.ADAM_EPS)))
            rule = rule if eps is None else dataclasses.replace(rule, eps=eps)
        return (rule, scalars["lr"], scalars["step"]), (
            f"lr={scalars['lr']:g}, step {scalars['step']:g}"
            + ("" if rule is self.rule else f", the group's ε={rule.eps:g}"))


def apply_update_verdict(result: TensorResult, verdict: Optional[UpdateVerdict], detail: str, how: str,
                         where: str = "") -> TensorResult:
    """An updated value's verdict from its element-wise check (``UpdateCheck.element_wise``; None:
    not possible, ``detail`` says why, and the relative-error verdict stands). ``where``: whose flat
    index the worst element's is (one rank's piece, online)."""
    if verdict is None:
        return dataclasses.replace(result, tolerance_source=result.tolerance_source
                                   + f"; element-wise Adam check not possible: {detail}")
    ok = verdict.worst_ratio <= 1.0 and not result.reason
    tolerance_eps = result.error_eps / verdict.worst_ratio if verdict.worst_ratio > 0 and result.error_eps > 0 else \
        result.tolerance_eps
    source = (f"Adam update, element-wise ({how}): worst element {verdict.worst_ratio:.3g}× its round-off slack "
              f"(flat index {verdict.worst_index}{where}: residual {verdict.residual:.3g}, slack {verdict.slack:.3g}; "
              f"{detail})")
    return dataclasses.replace(result, verdict=PASS if ok else FAIL, tolerance_eps=tolerance_eps,
                               tolerance_source=source)


def judge_choice(result: TensorResult, key: TensorKey, cand_choice: torch.Tensor, ref_choice: torch.Tensor,
                 cand_side, ref_side) -> TensorResult:
    """A top-k choice judged by the scores each side took it on (``selection``), not by its
    relative error: a near-tie that round-off flips passes, a choice that is not the top k fails."""
    scores_key = keys.sibling(key, keys.SELECTION_SCORES_OF[key.tensor])
    scores = [None if scores_key not in groups else logical_tensor(reader, groups[scores_key]).tensor
              for reader, groups in (cand_side, ref_side)]
    if any(s is None for s in scores) or tuple(cand_choice.shape) != tuple(ref_choice.shape):
        why = "no scores recorded" if any(s is None for s in scores) else "the shapes differ"
        return dataclasses.replace(result, verdict=FAIL, reason=result.reason or f"top-k choice not judged: {why}")
    return apply_choice_verdict(result, *selection.judge_along(cand_choice, ref_choice, scores[0], scores[1],
                                                               keys.SELECTION_AXIS[key.tensor]))


def apply_choice_verdict(result: TensorResult, v: selection.ChoiceVerdict, row: str, where: str = "") -> TensorResult:
    """A top-k choice's verdict from its ``selection`` judgement (offline of the merged choice, online
    of the ranks' pieces added up); ``where``: whose row index the worst near-tie's is (one rank's
    piece, online)."""
    ok = not v.problem and not result.reason and v.worst_ratio <= 1.0
    # the ratio shown is the worst near-tie's margin over the scores' differences (0: an exact tie)
    tolerance_eps = (result.tolerance_eps if result.error_eps == 0 or not ok else
                     result.error_eps / v.worst_ratio if v.worst_ratio > 0 else math.inf)
    return dataclasses.replace(result, verdict=PASS if ok else FAIL, tolerance_eps=tolerance_eps,
                               reason=result.reason or v.problem,
                               tolerance_source=f"top-k choice judged by its scores: {selection.describe(v, row, where)}")


# the iteration whose step both sides take from the seed checkpoint they both start from (iterations
# count from 1); a later one, even the first a selective recording kept, starts from diverged weights
FIRST_STEP = 1

FREE_RUNNING = ("not in lock-step with this reference: after the first step the two sides train different "
                "weights, since Adam moves each element by about ±lr whatever its grad, so an element whose grad "
                "is round-off moves either way; what the diverged weights compute has no round-off bound (nor do "
                "the updates of a candidate that stepped from another reference's weights). Run the candidate in "
                "lock-step with this reference to judge it")


def in_lockstep(reference_run: dict, candidate_run: dict, reference_dir: str) -> bool:
    """Whether the candidate ran in lock-step with this reference: by the reference's ``run_id``,
    wherever the two directories lie now; traces from before run ids, by the path recorded."""
    wanted = candidate_run.get("lockstep_reference_id")
    if wanted or reference_run.get("run_id"):
        return bool(wanted) and wanted == reference_run.get("run_id")
    lockstep = candidate_run.get("lockstep_reference")
    return bool(lockstep) and _same_dir(lockstep, reference_dir)


def stepped_with(candidate_run: dict) -> Optional[str]:
    """The reference a candidate ran in lock-step with (its run id, or for older traces its path)."""
    return candidate_run.get("lockstep_reference_id") or candidate_run.get("lockstep_reference") or None


def lockstep_note(reference_run: dict, candidate_run: dict, reference_dir: str) -> Optional[str]:
    """What the report says when the candidate stepped in lock-step with another reference than this
    one (None: in lock-step with this one, or never in lock-step)."""
    partner = stepped_with(candidate_run)
    if partner is None or in_lockstep(reference_run, candidate_run, reference_dir):
        return None
    return (f"not in lock-step with this reference (the candidate stepped with run {partner}): its first step "
            "is judged, what came after it is listed as not judged")


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def recorded_by_choice(run: dict, key: TensorKey) -> bool:
    """Whether a run's selective recording (``run.json`` ``record_filter``: iterations, module
    patterns, microbatches) covers ``key``: a tensor outside it is not missing, the run chose not to
    record it. (A rank filter leaves tensors without pieces: those are missing.)"""
    f = run.get("record_filter") or {}
    iterations, microbatches = f.get("iterations"), f.get("microbatches")
    if iterations is not None and key.iteration not in iterations:
        return False
    if microbatches is not None and keys.is_per_microbatch(key) and key.microbatch not in microbatches:
        return False
    return any(fnmatch.fnmatchcase(key.module, p) for p in f.get("modules") or ["*"])


def not_recorded_by(run: dict, key: TensorKey) -> bool:
    """Tensors a run declares it cannot record in its layout (``run.json`` ``not_recorded``: module
    patterns whose per-microbatch tensors have no counterpart there): skipped, not missing."""
    return keys.is_per_microbatch(key) and any(fnmatch.fnmatchcase(key.module, rule["modules"])
                                       for rule in run.get("not_recorded", []))


# --------------------------------------------------------------------------------------------
# localization: a replay trace (every module run on the reference's inputs) judged locally

@dataclasses.dataclass
class Localization:
    comparison: Comparison
    culprits: List[TensorResult]  # what modules computed and failed on their own, in execution order

    @property
    def culprit(self) -> Optional[TensorResult]:
        return self.culprits[0] if self.culprits else None


def explain(result: TensorResult) -> str:
    if result.reason:
        return result.reason
    return f"{result.ratio:.3g}× its local tolerance, given the reference's inputs"


def describe_difference(cand: torch.Tensor, ref: torch.Tensor) -> Optional[str]:
    """Simple checks that name the kind of a difference, for the culprit's explanation."""
    if cand.shape != ref.shape or cand.numel() == 0:
        return None
    c = cand.reshape(-1).to(torch.float64)
    r = ref.reshape(-1).to(torch.float64)
    if not (bool(torch.isfinite(c).all()) and bool(torch.isfinite(r).all())):
        return None
    rn, cn = float(r.norm()), float(c.norm())
    if rn == 0.0:
        return "the reference is zero here" if cn else None
    if float((c + r).norm()) <= 1e-3 * rn:
        return "the sign is flipped"
    ratio = cn / rn
    for k in (2, 3, 4, 8, 1 / 2, 1 / 3, 1 / 4, 1 / 8):
        if abs(ratio / k - 1) < 0.01 and float((c - k * r).norm()) <= 0.01 * k * rn:
            return (f"the candidate is {k:g}× the reference: a sum counted {k:g} times or a missing 1/{k:g} scale"
                    if k > 1 else f"the candidate is 1/{1 / k:g} of the reference: a missing reduction over "
                                  f"{1 / k:g} ranks or an extra 1/{1 / k:g} scale")
    for k in (2, 4, 8):
        if abs(ratio * math.sqrt(k) - 1) < 0.03:
            return (f"norm ≈ 1/√{k} of the reference, like one of {k} uncorrelated partial sums "
                    f"(a missing all-reduce or reduce-scatter?)")
    # sorting must explain a difference that is there: a tensor off by little (or a scalar) sorts alike too
    if (1 < c.numel() <= 1 << 22 and float((c - r).norm()) > 1e-2 * rn
            and float((torch.sort(c).values - torch.sort(r).values).norm()) <= 1e-3 * rn):
        return "the same values in another order: a permutation (a wrong stride or layout?)"
    cos = float(torch.dot(c, r)) / (cn * rn) if cn else 0.0
    return f"norm ratio {ratio:.3g}, cosine similarity {cos:.3g} to the reference"


def localize(reference_dir: str, replay_dir: str, *, tol_config: ToleranceConfig = ToleranceConfig()) -> Localization:
    """Judge a replay trace: what each module computed from the reference's inputs, under the local
    bound. Iterations the replay did not record are not reported missing."""
    comparison = compare_traces(reference_dir, replay_dir, tol_config=dataclasses.replace(tol_config, replay=True))
    replayed = {r.key.iteration for r in comparison.results}
    comparison.missing_in_candidate = [k for k in comparison.missing_in_candidate if k.iteration in replayed]
    culprits = sorted((r for r in comparison.failures if not r.arrival and not _inputs_failed(r, comparison)),
                      key=lambda r: r.order)
    if culprits and not culprits[0].reason:
        _describe(culprits[0], reference_dir, replay_dir)
    arrivals = sorted((r for r in comparison.failures if r.arrival), key=lambda r: r.order)
    if not culprits and arrivals:
        # every recorded module is right given the reference's inputs, yet wrong values reach one:
        # the fault lies in what connects the modules (an op ttrace does not hook, a p2p transfer).
        # Name the first module input or output-grad that arrives wrong.
        at_modules = [r for r in arrivals if keys.is_arrival(r.key)]
        first = (at_modules or arrivals)[0]
        where = (f"before {first.key.module} (between it and the module whose output feeds it)"
                 if first.key.phase == keys.FORWARD else
                 f"after {first.key.module} (between its output and the module whose grad flows back to it)")
        first.reason = (f"every module passes given the reference's inputs, but this {first.key.tensor} arrives "
                        f"{first.ratio:.3g}× over tolerance: the fault is {where}, in an op ttrace does not hook "
                        f"or a communication such as a pipeline transfer" + (f"; {first.reason}" if first.reason else ""))
        culprits = [first]
    return Localization(comparison, culprits)


def _inputs_failed(result: TensorResult, comparison: Comparison) -> bool:
    """A main grad is reduced from the per-microbatch grads of its parameter. When those already
    fail (they were computed from values the replay does not substitute), the reduction is not
    where the error came from."""
    if result.key.kind is not keys.TensorKind.MAIN_GRAD:
        return False
    grad = keys.microbatch_grad_key(result.key, 0)
    return any(r.verdict == FAIL and r.key.phase == grad.phase and r.key.tensor == grad.tensor
               and r.key.module == grad.module and r.key.iteration == grad.iteration
               for r in comparison.results)


def _describe(result: TensorResult, reference_dir: str, replay_dir: str) -> None:
    """Add what kind of difference the culprit shows to its reason (merged tensors, one key)."""
    tensors = []
    for d in (replay_dir, reference_dir):
        reader = TraceReader(d)
        pieces = [(rt, rec) for rt, rec in reader.records() if rec.key == result.key]
        tensors.append(logical_tensor(reader, pieces).tensor)
    kind = describe_difference(*tensors)
    if kind:
        result.reason = f"{result.ratio:.3g}× its local tolerance given the reference's inputs; {kind}"
