"""Tolerances of the optimizer step's scalars, and of what the clip coefficient scales.

The grad norm is not a GEMM output, and its round-off does not grow with the iteration's tokens:

* **Its own reductions.** Each rank sums the squares of every grad element it holds (tens of
  millions at 50M parameters), then the ranks sum their partial sums. How close that lands to the
  exact norm depends on the kernel by orders of magnitude (apex's chunked tree on a GPU; torch's
  sequential CPU norm, which rounds terms below half an ulp of the running sum away). The run
  measures it: the adapter twins each of megatron's norm calls in fp64 over the same grads and
  groups, and records the difference as the norm's ``roundoff`` (``Record.roundoff``) and the twin
  as ``grad_norm_fp64``.
* **The grads it is the norm of.** Both twins are exact norms of each side's grads, so by the
  triangle inequality they differ by at most ‖g_cand − g_ref‖: the square root of the sum of the
  main grads' squared differences, which the comparison has just measured tensor by tensor
  (:meth:`StepBounds.note`). Where some main grad was not compared (selective recording), the
  largest analytic main-grad bound stands in for all of them (Cauchy–Schwarz).

So the twin is judged by the grads' difference alone (sharp at any size on any platform: a norm
over the wrong grads or groups fails it), and megatron's norm by that plus both sides' measured
round-off. The clip coefficient ``max_norm / (norm + 1e-6)`` has the norm's relative error. Adam's
moments and SGD's momentum are linear in ``clip · grad`` (the second moment in its square): the
clip coefficient's error is a common factor of all of them. Where the step's rule says how, the
reference's state is **re-clipped** by the candidate's coefficient before it is compared
(:func:`reclip_delta`: both coefficients are recorded, and so is the reference's main grad), so the
state is judged by its grads alone, as sharply as without clipping; elsewhere the coefficient's
observed error adds to the state's bound.

Derivations in docs/tolerance.md ("The grad norm and what the clip coefficient scales").
Knows nothing about megatron.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import keys
from .keys import TensorKey, TensorKind
from .tolerance import Tolerance, ToleranceConfig, local_error, tolerance_for
from .update_rules import AdamRule

# the optimizer states linear in the clipped grad (their power: the second moment sums its squares)
_CLIPPED_STATES = (keys.EXP_AVG, keys.EXP_AVG_SQ, keys.MOMENTUM_BUFFER)
RECLIPPED = "the reference's state re-clipped by the candidate's coefficient"
_FP32_UNIT_ROUNDOFF = 2.0 ** -24  # the optimizer's unscaling of a main grad, one rounding per element


def state_of(key: TensorKey) -> str:
    return key.tensor.rsplit(".", 1)[-1]


def reclippable(state: str, rule: dict) -> bool:
    """Whether ``rule`` (run.json ``update_rule``) says how ``state`` depends on the clip coefficient
    c alone: Adam's m' = β1·m + (1 − β1)·(c·g + λ·p) (λ·p the same in both runs: lock-step or not,
    it cancels from the difference), its v' = β2·v + (1 − β2)·(c·g)² with decoupled weight decay,
    SGD's buf' = μ·buf + c·g + λ·p."""
    kind = rule.get("kind")
    if kind == "adam":
        return state == keys.EXP_AVG or (state == keys.EXP_AVG_SQ and bool(rule.get("decoupled_weight_decay")))
    return kind == "sgd" and state == keys.MOMENTUM_BUFFER


def reclip_delta(state: str, rule: dict, reference_main_grad, candidate_clip: float, reference_clip: float):
    """What the reference's ``state`` would have been, had it clipped its grads by the candidate's
    coefficient, minus what it is (float64): ``(1 − β1)(c_c − c_r)·g`` for Adam's first moment,
    ``(1 − β2)(c_c² − c_r²)·g²`` for its second, ``(c_c − c_r)·g`` for SGD's momentum, with the
    reference's main grad g. The rest of the state (β·m, the weight decay) is the same in both."""
    import torch

    g = reference_main_grad.to(torch.float64)
    # each product as written above, left to right, into one new tensor (g may be the caller's)
    if state == keys.EXP_AVG:
        return torch.mul(g, (1.0 - float(rule["beta1"])) * (candidate_clip - reference_clip))
    if state == keys.EXP_AVG_SQ:
        return torch.mul(g, (1.0 - float(rule["beta2"])) * (candidate_clip ** 2 - reference_clip ** 2)).mul_(g)
    return torch.mul(g, candidate_clip - reference_clip)


def main_grad_key(key: TensorKey) -> TensorKey:
    """The main grad an optimizer state of the same parameter and iteration was stepped with."""
    return TensorKey(key.iteration, -1, key.module, keys.MAIN_GRAD, keys.main_grad(keys.param_name_of(key.tensor)))


@dataclasses.dataclass
class _Grads:
    diff_sq: float = 0.0
    ref_sq: float = 0.0
    count: int = 0


class StepBounds:
    """The bounds of one comparison's optimizer scalars, built up in execution order (main grads
    come before the step's scalars, the clip coefficient before the moments). Offline and online
    compare keep one each and feed it the same results."""

    def __init__(self, reference_run: dict, num_layers: int, tol_config: ToleranceConfig,
                 has_reference: Callable[[TensorKey], bool] = lambda key: False):
        params = [p for p in reference_run.get("parameters", []) if p.get("requires_grad", True)]
        self.expected_grads = len(params)
        self.elements = sum(int(p.get("numel", 0)) for p in params)
        self.num_layers = num_layers
        self.tol_config = tol_config
        self._grads: Dict[int, _Grads] = {}
        self._main_grad_error: Dict[TensorKey, float] = {}  # each main grad's measured relative error
        self._norm: Dict[int, Tolerance] = {}  # iteration -> the grad norm's bound
        self._clip_error: Dict[int, float] = {}
        self._state_norm: Dict[Tuple[int, str, str], float] = {}  # ‖ref‖ of each optimizer state judged
        rule = AdamRule.from_run(reference_run)
        self.beta1 = rule.beta1 if rule is not None else 1.0  # SGD's momentum: μ ≤ 1
        self.rule = reference_run.get("update_rule") or {}
        self.has_reference = has_reference

    # ---- what the comparison has judged so far
    def note(self, key: TensorKey, error: float, reference_norm: float) -> None:
        """A judged tensor: a main grad's difference (absolute: ``error · ‖ref‖``), or the clip
        coefficient's relative error."""
        if key.kind is TensorKind.MAIN_GRAD and math.isfinite(error) and math.isfinite(reference_norm):
            g = self._grads.setdefault(key.iteration, _Grads())
            g.diff_sq += (error * reference_norm) ** 2
            g.ref_sq += reference_norm ** 2
            g.count += 1
            self._main_grad_error[key] = error
        elif key.kind is TensorKind.OPTIMIZER_SCALAR and key.tensor == keys.CLIP_COEFFICIENT and math.isfinite(error):
            self._clip_error[key.iteration] = error
        elif key.kind is TensorKind.OPTIMIZER_STATE and math.isfinite(reference_norm):
            self._state_norm[(key.iteration, key.module, key.tensor)] = reference_norm

    # ---- bounds
    def bound(self, key: TensorKey, dtype: str, reduction: int, reference_value: float,
              reference_roundoff: float, candidate_roundoff: float) -> Optional[Tolerance]:
        """The tolerance of a grad norm, its fp64 twin, the clip coefficient or a parameter's term of
        the norm; None for any other tensor (the analytic bound applies)."""
        eps = tolerance_for(keys.OPTIMIZER, 0, self.num_layers, dtype, reduction, self.tol_config).eps
        if key.kind is TensorKind.GRAD_NORM_TERM:
            return self._term_bound(key, eps, dtype, reduction)
        if key.kind is not TensorKind.OPTIMIZER_SCALAR or key.tensor not in (
                keys.GRAD_NORM, keys.GRAD_NORM_FP64, keys.CLIP_COEFFICIENT):
            return None
        if key.tensor == keys.CLIP_COEFFICIENT:
            norm = self._norm.get(key.iteration)
            if norm is None:
                return None
            return Tolerance(eps, norm.tolerance_eps, norm.depth,
                             f"the grad norm's bound (max_norm / norm has its relative error): {norm.source}")
        grads, grads_source = self._grads_term(key.iteration, dtype, reduction)
        fp64 = 2 * local_error(max(self.elements, 1), "float64")  # each side's twin, summed in fp64
        terms = [(grads, grads_source), (fp64, "the twins' fp64 sums")]
        if key.tensor == keys.GRAD_NORM:
            if not (reference_roundoff or candidate_roundoff) or not reference_value:
                return None  # not measured (a trace of an older ttrace): the analytic bound
            terms.append(((abs(reference_roundoff) + abs(candidate_roundoff)) / abs(reference_value),
                          f"own round-off measured against fp64 (reference "
                          f"{abs(reference_roundoff) / abs(reference_value) / eps:.3g}ε, candidate "
                          f"{abs(candidate_roundoff) / abs(reference_value) / eps:.3g}ε)"))
        relative = sum(t for t, _ in terms)
        tol = Tolerance(eps, relative / eps, 0, " + ".join(f"{s} {t / eps:.3g}ε" for t, s in terms))
        if key.tensor == keys.GRAD_NORM:
            self._norm[key.iteration] = tol
        return tol

    def _term_bound(self, key: TensorKey, eps: float, dtype: str, reduction: int) -> Tolerance:
        """A parameter's term of the grad norm, ‖g‖² of its main grad as the norm counted it, merged
        over the ranks (a partial sum: each rank's count of its piece). Both sides' terms are exact
        squares of each side's main grad (summed in fp64), so by the triangle inequality
        |‖g_c‖² − ‖g_r‖²| = (‖g_c‖ + ‖g_r‖)·|‖g_c‖ − ‖g_r‖| ≤ (2 + e)·e·‖g_r‖² with e = ‖g_c − g_r‖ / ‖g_r‖,
        the main grad's relative error as the comparison has just measured it (plus one fp32
        rounding per element: the optimizer unscales the grads it takes the norm of). A norm that
        counts a parameter twice, misses a rank's piece of it or takes it from another group is off
        by a fraction of the term, whatever the model's size: a verdict that does not dilute as the
        grad norm's does. Where the main grad was not compared, its largest analytic bound stands in."""
        e = self._main_grad_error.get(main_grad_key(key))
        if e is not None and math.isfinite(e):
            source = f"e = the main grad's measured error {e / eps:.3g}ε"
        else:
            tol = tolerance_for(keys.MAIN_GRAD, 0, self.num_layers, dtype, reduction, self.tol_config)
            e = tol.tolerance_eps * tol.eps
            source = f"e = the largest main-grad bound, its main grad not compared ({tol.source})"
        e += _FP32_UNIT_ROUNDOFF
        fp64 = 2 * local_error(max(self.elements, 1), "float64")
        relative = (2.0 + e) * e + fp64
        return Tolerance(eps, relative / eps, 0, f"(2 + e)·e, {source} + u32; + the terms' fp64 sums {fp64 / eps:.3g}ε")

    def _grads_term(self, iteration: int, dtype: str, reduction: int) -> Tuple[float, str]:
        """‖g_cand − g_ref‖ / ‖g_ref‖ over every main grad of the iteration, as compared; where some
        were not compared, the largest analytic main-grad bound (the embedding's depth, 2(L + 1)), which bounds the
        weighted mean of them all."""
        g = self._grads.get(iteration)
        if g is not None and g.count >= self.expected_grads > 0 and g.ref_sq > 0:
            return math.sqrt(g.diff_sq / g.ref_sq), f"‖Δ main grads‖ (all {g.count} compared)"
        tol = tolerance_for(keys.MAIN_GRAD, 0, self.num_layers, dtype, reduction, self.tol_config)
        compared = g.count if g is not None else 0
        return tol.tolerance_eps * tol.eps, (f"the largest main-grad bound ({compared} of {self.expected_grads} "
                                             f"main grads compared: {tol.source})")

    def reclipped(self, key: TensorKey) -> bool:
        """Whether the comparison re-clips the reference's value of ``key`` (:func:`reclip_delta`):
        an optimizer state the rule says how to re-clip, in an iteration whose clip coefficients
        differ, whose reference main grad is recorded. Offline and online decide it alike."""
        return (key.kind is TensorKind.OPTIMIZER_STATE and reclippable(state_of(key), self.rule)
                and bool(self._clip_error.get(key.iteration)) and self.has_reference(main_grad_key(key)))

    def added(self, key: TensorKey) -> Sequence[Tuple[float, str]]:
        """Terms (relative, source) that add to a tensor's bound: an optimizer state linear in the
        clipped grad carries the clip coefficient's observed error (the power of it it sums), unless
        it is re-clipped (then a zero term names that in the source)."""
        if key.kind is not TensorKind.OPTIMIZER_STATE:
            return ()
        state = state_of(key)
        error = self._clip_error.get(key.iteration, 0.0)
        if state not in _CLIPPED_STATES or not error:
            return ()
        if self.reclipped(key):
            return ((0.0, RECLIPPED),)
        power = keys.value_power(key)
        return ((power * error, f"{power}·the clip coefficient's error" if power != 1 else "the clip coefficient's error"),)

    def carried(self, key: TensorKey, reference_norm: float) -> float:
        """How much larger than the new step's term a first moment's round-off may be, relative to
        the moment: m' = β·m + (1 − β)·c·g, where β·m is the same in both runs (lock-step: the same
        m, one multiplication) and all the round-off is in the new term, whose norm is at most
        ‖m'‖ + β·‖m‖ (triangle inequality). Where the terms cancel (a grad that turns against the
        moment) the new term is larger than m' itself, and its error, relative to m', with it.
        ``(‖m'‖ + β‖m‖) / ‖m'‖`` with the reference's norms; 1 at the first step (m = 0) and where the
        previous moment was not judged. The second moment sums squares: its terms never cancel."""
        state = key.tensor.rsplit(".", 1)[-1]
        if key.kind is not TensorKind.OPTIMIZER_STATE or state not in (keys.EXP_AVG, keys.MOMENTUM_BUFFER):
            return 1.0
        previous = self._state_norm.get((key.iteration - 1, key.module, key.tensor))
        if not previous or not reference_norm or not math.isfinite(reference_norm):
            return 1.0
        beta = self.beta1 if state == keys.EXP_AVG else 1.0
        return (reference_norm + beta * previous) / reference_norm


def judged_terms(tol: Tolerance, added: Sequence[Tuple[float, str]]) -> Tolerance:
    """``tol`` with relative terms added to it."""
    if not added:
        return tol
    extra = sum(t for t, _ in added)
    return dataclasses.replace(tol, tolerance_eps=tol.tolerance_eps + extra / tol.eps,
                               source=tol.source + "".join(f" + {s} {t / tol.eps:.3g}ε" if t else f"; {s}"
                                                           for t, s in added))


__all__: List[str] = ["StepBounds", "judged_terms", "reclip_delta", "reclippable", "main_grad_key"]
