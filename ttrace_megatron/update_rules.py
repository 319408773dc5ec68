"""Judging an updated parameter by the optimizer's update rule, element by element.

Why. Adam normalizes each element's step by its own gradient history: at the first step the
update is ``lr·g/(|g|+ε) ≈ lr·sign(g)``. Where the exact gradient is zero (the key bias of
attention: softmax is shift-invariant), the computed one is pure round-off, its sign is a coin
flip, and two correct runs move that element by ±lr: a difference of 2·lr that no relative bound
on the whole tensor can tell from a bug. Judged element by element, the difference is explained.

How. Under lock-step (``adapter.run.lockstep``) both runs start the step from the same parameter and
the same optimizer state. For Adam(W),

    p' = p·(1 − lr·wd) − lr·u,   u = (m'/c1) / (√(v'/c2) + ε),   c1 = 1 − β1^t, c2 = 1 − β2^t,

where m', v' are the moments after the step (recorded: ``exp_avg``, ``exp_avg_sq``). Everything
but u is the same in both runs, so the candidate's updated parameter must be

    p'_cand = p'_ref − lr·(u(m'_cand, v'_cand) − u(m'_ref, v'_ref))

up to the round-off of the two updates, element by element. The moments themselves are judged
like every tensor (they are linear in the grads, and the grads are judged too); this check asks
whether the parameter moved the way its own moments say. An element whose grad is round-off may
flip its direction — its moments say so, and the check accepts it; a step that applied another
lr, another weight decay, a stale parameter or moments it did not record fails, on the elements
that show it, however Adam normalizes.

The slack per element is the round-off of the two updates: each computes ``p·(1−lr·wd)`` and
subtracts ``lr·u`` in fp32 and stores the result in the parameter's format (u_fmt: bf16 for a
bf16 model parameter), and computes u in fp32 from its moments (a few u_32):

    slack = k · ( u_fmt·(|p'_cand| + |p'_ref|) + s_fmt + 4·u_32·lr·(|u_cand| + |u_ref|) )

(s_fmt: the format's subnormal gap, twice the most a rounding below its smallest normal number can
err: 2^-24 for fp16, negligible for bf16 and fp32)

with the k of the analytic bound. ``docs/tolerance.md`` derives it; ``tests/test_update_rules.py``
checks it against fp64 updates.

Knows nothing about megatron.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import numpy
import torch

from .formats import number_format

ADAM = "adam"
U_32 = number_format("float32").unit_roundoff


@dataclasses.dataclass(frozen=True)
class AdamRule:
    beta1: float
    beta2: float
    eps: float

    @staticmethod
    def from_run(run: dict) -> Optional["AdamRule"]:
        rule = run.get("update_rule") or {}
        if rule.get("kind") != ADAM:
            return None
        return AdamRule(float(rule["beta1"]), float(rule["beta2"]), float(rule["eps"]))

    def scaled_direction(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float, q: torch.Tensor,
                         v: torch.Tensor) -> Tuple[torch.Tensor, float]:
        """u = (m'/c1) / (√v'/√c2 + ε) (torch's Adam/AdamW arithmetic, from the moments after step
        ``step``) as ``(q, s)`` with u = s·q, q = m' / (√v' + ε·√c2) and s = √c2 / c1: q in float64,
        computed in ``q`` (returned) with ``v`` as scratch, float64 buffers of the moments' size.
        The same u up to float64 round-off in two divisions fewer an element: the caller folds s
        into the scalars it multiplies u by."""
        c1 = 1.0 - self.beta1 ** step
        root_c2 = (1.0 - self.beta2 ** step) ** 0.5
        v.copy_(exp_avg_sq)
        # numpy's float64 sqrt, the correctly rounded one: torch's (2.13, CPU, AVX2) rounded 1.4 % of
        # elements otherwise and ran at half the rate, most of the check's time. A negative moment (a
        # bug) gives NaN either way: numpy's warning about it is not printed
        with numpy.errstate(invalid="ignore"):
            numpy.sqrt(v.numpy(), out=v.numpy())
        v.add_(self.eps * root_c2)
        return q.copy_(exp_avg).div_(v), root_c2 / c1


@dataclasses.dataclass
class UpdateVerdict:
    worst_ratio: float  # max over elements of |residual| / slack
    worst_index: int
    residual: float  # at the worst element
    slack: float


# elements judged at a time: the float64 temporaries of a chunk stay in cache (the whole tensor's did
# not: the update check was most of an online rank's judging time at the 50M rung)
UPDATE_CHUNK = 1 << 16


def judge_adam_update(rule: AdamRule, lr: float, step: float, param_dtype: str,
                      cand_param: torch.Tensor, ref_param: torch.Tensor,
                      cand_moments, ref_moments, k: float = 4.0,
                      previous=None, weight_decay: float = 0.0) -> UpdateVerdict:
    """Element by element: is the candidate's updated parameter the reference's moved by the
    difference of the two runs' own Adam directions? (``*_moments``: (exp_avg, exp_avg_sq)
    after the step; all logical tensors of one shape.)

    ``previous``: (candidate's, reference's) parameter before the step, when the two runs did not
    start it from the same one (no lock-step: each side steps from its own). Their difference,
    decayed as the step decays it, is then part of the expected difference, and each side's own
    rounding of ``p·(1 − lr·wd)`` part of the slack: the step's own round-off is judged at every
    iteration, not what earlier steps left behind.

    Judged ``UPDATE_CHUNK`` elements at a time; the worst element is the first of the largest ratio
    (a NaN first), as ``torch.argmax`` over the whole tensor picks it."""
    operands = [cand_param, ref_param, *cand_moments, *ref_moments, *(previous or ())]
    flat = [t.reshape(-1) for t in operands]
    return judge_adam_chunks(rule, lr, step, param_dtype, ((0, flat),), k, previous is not None, weight_decay)


def judge_adam_chunks(rule: AdamRule, lr: float, step: float, param_dtype: str, operands, k: float = 4.0,
                      stepped_apart: bool = False, weight_decay: float = 0.0) -> UpdateVerdict:
    """:func:`judge_adam_update` of operands given in consecutive ranges (``streaming``): each item
    of ``operands`` is (the range's first flat index, [the flat operands over that range, in
    :func:`judge_adam_update`'s order]). Each range is judged ``UPDATE_CHUNK`` elements at a time from
    its start: ranges of a multiple of that size give the verdict of the whole, bit for bit."""
    best = UpdateVerdict(0.0, -1, 0.0, 0.0)
    scratch = _AdamScratch(stepped_apart)
    for start, flat in operands:
        for begin in range(0, flat[0].numel(), UPDATE_CHUNK):
            piece = [t[begin:begin + UPDATE_CHUNK] for t in flat]
            ratio, residual, slack = _adam_ratios(rule, lr, step, param_dtype, piece, k, stepped_apart, weight_decay,
                                                  scratch)
            # the chunk's largest ratio first (a NaN if any), its position only where it is the worst
            # so far: torch.argmax took a fifth of the check's time on every chunk
            value = float(torch.amax(ratio))
            if best.worst_index < 0 or value > best.worst_ratio or (
                    math.isnan(value) and not math.isnan(best.worst_ratio)):
                worst = int(torch.argmax(ratio))
                best = UpdateVerdict(value, start + begin + worst, float(residual[worst]), float(slack[worst]))
    return best


class _AdamScratch:
    """The float64 buffers one chunk's check works in, reused chunk after chunk: each operation
    writes into one of them instead of a new tensor (the same arithmetic, and so every bit of the
    verdict, as new tensors would give; ~20 % faster on one core)."""

    def __init__(self, stepped_apart: bool):
        self.buffers = [torch.empty(UPDATE_CHUNK, dtype=torch.float64) for _ in range(8 if stepped_apart else 6)]

    def take(self, n: int):
        return [b[:n] for b in self.buffers]


def _adam_ratios(rule: AdamRule, lr: float, step: float, param_dtype: str, piece, k: float, stepped_apart: bool,
                 weight_decay: float, scratch: Optional[_AdamScratch] = None):
    """|residual| / slack of one chunk's elements (flat), with the residual and the slack:

        residual = (p'_c − p'_r) + lr·(u_c − u_r)  [− (1 − lr·wd)·(p_c − p_r), stepped apart]
        slack = max(k·(u_fmt·(|p'_c| + |p'_r|) + s_fmt [+ max(u_fmt, u_32)·(|p_c| + |p_r|)]
                       + 4·u_32·lr·(|u_c| + |u_r|)), tiny)

    in float64, into ``scratch``'s buffers, u as s·q (:meth:`AdamRule.scaled_direction`) and each
    constant factor folded into one scalar: 27 passes over the chunk where the expression term by
    term took 33 (and the chunk's largest ratio found without its position), and 3 divisions an element where it took 7 (the check was half a compare worker's
    time at the 50M rung). The float64 round-off this reorders is ~1e-16 of each term, against a
    slack of u_fmt or 4·u_32 of it."""
    scratch = scratch or _AdamScratch(stepped_apart)
    bufs = scratch.take(piece[0].numel())
    q_c, s = rule.scaled_direction(piece[2], piece[3], step, bufs[2], bufs[3])
    q_r, _ = rule.scaled_direction(piece[4], piece[5], step, bufs[4], bufs[5])
    pc, pr = bufs[0].copy_(piece[0]), bufs[1].copy_(piece[1])
    residual = torch.sub(pc, pr, out=bufs[3]).add_(torch.sub(q_c, q_r, out=bufs[5]), alpha=lr * s)
    fmt = number_format(param_dtype)
    # each stored parameter is rounded once: by u_fmt of its size, or by half the subnormal gap
    # below the smallest normal number (fp16's: weights under 6e-5 round to multiples of 2^-24)
    slack = pc.abs_().add_(pr.abs_()).mul_(k * fmt.unit_roundoff)
    if fmt.smallest_subnormal:
        slack.add_(k * fmt.smallest_subnormal)
    if stepped_apart:
        # as recorded, each previous parameter is its step's stored value: a bf16 model parameter is
        # the rounding of the fp32 main parameter the optimizer stepped from, so their difference is
        # known to u_fmt of each (and each side rounds its own p·(1 − lr·wd), u_32, below that)
        prev_c, prev_r = bufs[6].copy_(piece[6]), bufs[7].copy_(piece[7])
        residual.sub_(torch.sub(prev_c, prev_r, out=bufs[5]), alpha=1.0 - lr * weight_decay)
        slack.add_(prev_c.abs_().add_(prev_r.abs_()), alpha=k * max(fmt.unit_roundoff, U_32))
    slack.add_(q_c.abs_().add_(q_r.abs_()), alpha=k * 4.0 * U_32 * lr * s)
    slack.clamp_(min=torch.finfo(torch.float64).tiny)
    return torch.abs(residual, out=bufs[1]).div_(slack), residual, slack
