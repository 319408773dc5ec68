"""A check's verdicts as scalars per iteration, where Megatron-LM users look: TensorBoard and W&B.

Per iteration: the worst error / tolerance per phase and per layer, how many tensors (offline) or
shards (online, during the run, under ``ttrace/live/``: each shard under its own bound, a heads-up
the verdict after the run settles) exceed their tolerance, and the first failing tensor as text. The
same :class:`IterationScalars` is written from a finished report (``ttrace report DIR
--tensorboard OUT``) and, during an online check, from every rank's own shards (merged on the rank
that holds Megatron-LM's writers: ``adapter/megatron_lm`` and ``adapter/run/live_scalars``).

A writer is anything with TensorBoard's ``add_scalar(tag, value, step)`` and ``add_text(tag, text,
step)`` (``torch.utils.tensorboard.SummaryWriter``), or W&B's ``log(dict, step)`` (the ``wandb``
module Megatron-LM hands out as its writer).

Knows nothing about megatron.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterable, List, Optional

from .keys import PHASES

TAG = "ttrace"
# during an online check each rank judges its own shards under the shard's own bound (the verdict
# combines them after the run, with the step's bounds): those scalars go under their own prefix
LIVE_TAG = "ttrace/live"
WORST_PHASE = "{tag}/worst_ratio/{phase}"
WORST_LAYER = "{tag}/worst_ratio_by_layer/{layer}"
TENSORS_OVER = TAG + "/tensors_over_tolerance"  # a finished report: logical tensors
SHARDS_OVER = LIVE_TAG + "/shards_over_tolerance"  # during an online check: the ranks' own shards
FIRST_FAILURE = "{tag}/first_failure"
FAIL = "fail"


def layer_label(depth: int, num_layers: int) -> str:
    """The layer a tensor's depth names: embedding, layer i, output / loss."""
    if depth == 0:
        return "embedding"
    if depth > num_layers:
        return "output / loss"
    return f"layer {depth - 1}"


def _tag_part(label: str) -> str:
    return label.replace(" / ", "_").replace(" ", "_")


def ratio_of(error_eps, tolerance_eps) -> float:
    """error / tolerance of a report's tensor (numbers, or "inf"/"nan" as the JSON report writes them)."""
    e, t = float(error_eps), float(tolerance_eps)
    if math.isinf(t) and math.isfinite(e):
        return 0.0  # a bound that admits anything (a top-k choice at an exact tie)
    if t == 0.0:
        return 0.0 if e == 0.0 else math.inf  # judged exactly
    r = e / t
    return math.inf if math.isnan(r) else r


@dataclasses.dataclass
class IterationScalars:
    iteration: int
    worst_by_phase: Dict[str, float]
    worst_by_layer: Dict[str, float]
    over_tolerance: int
    first_failure: str  # "" when nothing failed
    first_order: float = math.inf  # execution order of the first failure (to merge ranks' summaries)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def iteration_scalars(tensors: Iterable[dict], num_layers: int) -> List[IterationScalars]:
    """One :class:`IterationScalars` per iteration of ``tensors`` (the JSON report's ``tensors``:
    module, phase, tensor, iteration, depth, order, verdict, error_eps, tolerance_eps, reason)."""
    out: Dict[int, IterationScalars] = {}
    for t in tensors:
        it = int(t["iteration"])
        s = out.setdefault(it, IterationScalars(it, {}, {}, 0, ""))
        ratio = ratio_of(t["error_eps"], t["tolerance_eps"])
        phase, layer = t["phase"], layer_label(int(t["depth"]), num_layers)
        s.worst_by_phase[phase] = max(s.worst_by_phase.get(phase, 0.0), ratio)
        s.worst_by_layer[layer] = max(s.worst_by_layer.get(layer, 0.0), ratio)
        if t["verdict"] == FAIL:
            s.over_tolerance += 1
            if t.get("order", math.inf) < s.first_order:
                s.first_order = t.get("order", math.inf)
                s.first_failure = failure_text(t)
    return [out[i] for i in sorted(out)]


def scalar_row(r) -> dict:
    """A :class:`~ttrace_megatron.compare.TensorResult` in the form :func:`iteration_scalars` reads
    (the JSON report's)."""
    return {"module": r.key.module, "phase": r.key.phase, "tensor": r.key.tensor, "iteration": r.key.iteration,
            "microbatch": r.key.microbatch, "depth": r.depth, "order": r.order, "verdict": r.verdict,
            "error_eps": r.error_eps, "tolerance_eps": r.tolerance_eps, "reason": r.reason}


def failure_text(t: dict) -> str:
    mb = "" if int(t.get("microbatch", -1)) < 0 else f", microbatch {t['microbatch']}"
    reason = f" — {t['reason']}" if t.get("reason") else ""
    return (f"{t['module']}, {t['phase']}, {t['tensor']} (iteration {t['iteration']}{mb}): "
            f"{float(t['error_eps']):.3g} ε against a tolerance of {float(t['tolerance_eps']):.3g} ε{reason}")


def merge(parts: Iterable[IterationScalars]) -> Optional[IterationScalars]:
    """The ranks' summaries of one iteration as one: worst of the worst, counts added, the first
    failure in execution order."""
    parts = list(parts)
    if not parts:
        return None
    merged = IterationScalars(parts[0].iteration, {}, {}, 0, "")
    for p in parts:
        for target, source in ((merged.worst_by_phase, p.worst_by_phase), (merged.worst_by_layer, p.worst_by_layer)):
            for k, v in source.items():
                target[k] = max(target.get(k, 0.0), v)
        merged.over_tolerance += p.over_tolerance
        if p.first_failure and p.first_order < merged.first_order:
            merged.first_order, merged.first_failure = p.first_order, p.first_failure
    return merged


def write(writer, s: IterationScalars, live: bool = False) -> None:
    """``s`` through a TensorBoard ``SummaryWriter`` or W&B's ``log``, at step ``s.iteration``;
    ``live``: an online check's shards during the run (under ``ttrace/live/``)."""
    tag = LIVE_TAG if live else TAG
    values: Dict[str, float] = {}
    for phase in PHASES:
        if phase in s.worst_by_phase:
            values[WORST_PHASE.format(tag=tag, phase=phase)] = s.worst_by_phase[phase]
    for layer, v in s.worst_by_layer.items():
        values[WORST_LAYER.format(tag=tag, layer=_tag_part(layer))] = v
    values[SHARDS_OVER if live else TENSORS_OVER] = float(s.over_tolerance)
    first = FIRST_FAILURE.format(tag=tag)
    if hasattr(writer, "add_scalar"):
        for name, v in values.items():
            writer.add_scalar(name, v, s.iteration)
        if s.first_failure:
            writer.add_text(first, s.first_failure, s.iteration)
    else:
        logged = dict(values)
        if s.first_failure:
            logged[first] = s.first_failure
        writer.log(logged, step=s.iteration)


def write_report(report: dict, out_dir: str, num_layers: Optional[int] = None) -> int:
    """A finished report's scalars into a TensorBoard event file under ``out_dir``; with an fp32
    twin, the twin's under ``out_dir/fp32_twin``. Returns the iterations written."""
    import os

    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

    from .recipe import FP32_TWIN

    def one(rep: dict, path: str) -> int:
        layers = num_layers if num_layers is not None else rep.get("num_layers")
        if layers is None:
            layers = max((int(t["depth"]) for t in rep["tensors"]), default=1) - 1
        rows = iteration_scalars(rep["tensors"], layers)
        writer = SummaryWriter(log_dir=path)
        try:
            for s in rows:
                write(writer, s)
        finally:
            writer.close()
        return len(rows)

    n = one(report, out_dir)
    if isinstance(report.get(FP32_TWIN), dict) and report[FP32_TWIN].get("tensors"):
        one(report[FP32_TWIN], os.path.join(out_dir, FP32_TWIN))
    return n
