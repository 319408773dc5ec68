"""Align and judge: merge each side's shards into logical tensors and compare them one by one.

Knows nothing about megatron: it reads traces, merges by placements, and applies tolerances.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .errors import ConfigMismatchError, TraceError
from .placement import PlacementError, merge_shards
from .tolerance import ToleranceConfig, relative_error, tolerance_for
from .trace_store import RankTrace, Record, TensorKey, TraceReader

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

    @property
    def error_eps(self) -> float:
        return self.error / self.eps

    @property
    def ratio(self) -> float:
        return self.error_eps / self.tolerance_eps if self.tolerance_eps > 0 else math.inf


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


def logical_tensor(reader: TraceReader, pieces: List[Tuple[RankTrace, Record]]):
    first_rt, first = pieces[0]
    for rt, rec in pieces[1:]:
        if rec.layout != first.layout:
            raise TraceError(f"ranks {first_rt.rank} and {rt.rank} record different placements "
                             f"({first.layout.to_json()} vs {rec.layout.to_json()})",
                             path=rt.dir, rank=rt.rank, tensor=str(rec.key))
    loaded = [(rt.coords, reader.load(rt, rec)) for rt, rec in pieces]
    try:
        merged = merge_shards(loaded, first.layout)
    except PlacementError as e:
        raise TraceError(f"cannot merge shards: {e}", path=reader.dir, rank=first_rt.rank,
                         tensor=str(first.key)) from None
    if first.scale != 1.0:
        merged.tensor = merged.tensor.to(torch.float64) / first.scale
    return merged


def nonfinite_message(candidate_count: int, reference_count: int, same_positions: bool) -> Optional[str]:
    if candidate_count == 0 and reference_count == 0:
        return None
    if same_positions:
        return f"non-finite values: the same {candidate_count} NaN/Inf positions on both sides"
    return f"non-finite values: candidate has {candidate_count} NaN/Inf, reference has {reference_count}"


def _nonfinite_reason(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    fa = ~torch.isfinite(a)
    fb = ~torch.isfinite(b)
    na, nb = int(fa.sum()), int(fb.sum())
    return nonfinite_message(na, nb, bool(na and nb and torch.equal(fa, fb)))


def decide(key: TensorKey, rec: Record, num_layers: int, order: int, tol_config: ToleranceConfig,
           shape: Tuple[int, ...], error: float, reason: str = "") -> TensorResult:
    """The verdict on one logical tensor: a stated reason fails it, else error against tolerance."""
    tol = tolerance_for(key.phase, rec.depth, num_layers, rec.compute_dtype or rec.dtype, rec.reduction, tol_config)
    ok = not reason and error / tol.eps <= tol.tolerance_eps
    return TensorResult(key=key, verdict=PASS if ok else FAIL, error=error, eps=tol.eps,
                        tolerance_eps=tol.tolerance_eps, order=order, depth=rec.depth, shape=tuple(shape),
                        tolerance_source=tol.source, reason=reason)


def judge(key: TensorKey, cand: torch.Tensor, ref: torch.Tensor, rec: Record, num_layers: int, order: int,
          tol_config: ToleranceConfig, replica_note: str = "") -> TensorResult:
    args = (key, rec, num_layers, order, tol_config, tuple(ref.shape))
    if tuple(cand.shape) != tuple(ref.shape):
        return decide(*args, math.inf, f"shape {tuple(cand.shape)} differs from the reference's {tuple(ref.shape)}")
    err, ref_norm = relative_error(cand, ref)
    # finite norms on both sides mean no NaN/Inf anywhere: the element-wise scan is skipped
    nonfinite = None if math.isfinite(err) and math.isfinite(ref_norm) else _nonfinite_reason(cand, ref)
    if nonfinite:
        finite = torch.isfinite(cand) & torch.isfinite(ref)
        err = relative_error(cand[finite], ref[finite])[0] if bool(finite.any()) else math.nan
        return decide(*args, err, nonfinite)
    return decide(*args, err, replica_note)


def reference_order(groups: Dict[TensorKey, List[Tuple[RankTrace, Record]]]) -> Dict[TensorKey, int]:
    """Execution order of each key: the reference's recording order."""
    return {key: min(rec.seq + rt.rank * 10**9 for rt, rec in pieces) for key, pieces in groups.items()}


def compare_traces(reference_dir: str, candidate_dir: str, *, tol_config: ToleranceConfig = ToleranceConfig(),
                   progress: Optional[Callable[[int, int], None]] = None) -> Comparison:
    ref = TraceReader(reference_dir)
    cand = TraceReader(candidate_dir)
    check_compatible(ref.run, cand.run, cand.dir)
    num_layers = int(ref.run.get("num_layers", 0))
    ref_groups = group_records(ref)
    cand_groups = group_records(cand)
    order = reference_order(ref_groups)
    common = sorted(set(ref_groups) & set(cand_groups), key=lambda k: order[k])
    results: List[TensorResult] = []
    for i, key in enumerate(common):
        ref_merged = logical_tensor(ref, ref_groups[key])
        cand_merged = logical_tensor(cand, cand_groups[key])
        notes = []
        for side, merged in (("candidate", cand_merged), ("reference", ref_merged)):
            for m in merged.replica_mismatches:
                notes.append(f"{side} replicas over {m.axis} differ (ranks {list(m.ranks)}, max |Δ| {m.max_abs_diff:.3g})")
        rec = ref_groups[key][0][1]
        results.append(judge(key, cand_merged.tensor, ref_merged.tensor, rec, num_layers, order[key], tol_config,
                             "; ".join(notes)))
        if progress:
            progress(i + 1, len(common))
    missing_in_candidate = sorted(set(ref_groups) - set(cand_groups), key=lambda k: order[k])
    missing_in_reference = sorted(set(cand_groups) - set(ref_groups), key=str)
    return Comparison(reference_dir, candidate_dir, results, missing_in_candidate, missing_in_reference,
                      ref.run, cand.run)
