"""Tolerances that separate floating-point round-off from bugs (first version).

Two correct implementations of the same computation differ by round-off only: another reduction
order (a row-parallel all-reduce splits a GEMM's reduction into partial sums), another rounding
of an intermediate. The bound has two factors.

**Local term.** For an output computed by a length-``K`` reduction accumulated in format
``acc`` and stored in format ``out``, the probabilistic error model (Higham & Mary, 2019: the
error of a length-K sum grows like √K·u with high probability, not like the worst case K·u) gives
each implementation a relative error of about ``√K·u_acc + u_out``. Two correct implementations
err independently, so they differ by up to twice that: ``√K·ε_acc + ε_out`` (ε = 2u).
GEMMs accumulate in fp32 (CPU kernels and tensor cores alike), so bf16 tensors are dominated by
the final rounding ``u_out`` and fp32 tensors by the accumulation.

**Propagation.** The TTrace paper's Theorem 5.3, in the form Megatron-LM adopted
(``tests/functional_tests/python_test_utils/test_optimizer_grads_match.py``), bounds the error of
a tensor at depth ``d`` by ``k·C**d·ε``: round-off introduced in each layer is amplified by ``C``
(close to 1) per layer it travels through. Forward tensors of layer ``l`` have travelled ``l``
layers. A backward tensor of layer ``l`` is computed from the loss, which every forward layer fed,
and then back through ``L + 1 − l`` layers: it has travelled ``2(L + 1) − l`` (the embedding is
layer 0, the output layer and loss ``L + 1``).

Together: ``tolerance = k · C**d · (√K·ε_acc + ε_out)``, expressed in ε of the reported format.
This module knows nothing about megatron; it sees a tensor's phase, depth, storage dtype and
reduction length. The calibration (k, C against measured clean runs) is tracked in BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Tuple

from .formats import number_format, report_format
from .keys import FORWARD


@dataclasses.dataclass(frozen=True)
class ToleranceConfig:
    k: float = 4.0  # the big-O constant of Theorem 5.3 (Megatron-LM uses 4; BioNeMo 5)
    C: float = 1.03  # per-layer amplification of round-off (Megatron-LM: 1.01-1.05)
    accumulate: str = "float32"  # accumulation format of GEMMs and reductions
    replay: bool = False  # a localization replay: tensors computed from substituted inputs get the local bound
    perturbation_k: float = 4.0  # with a perturbation run: tolerance ≥ k_p · (how far the noise moved the tensor)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    eps: float  # ε of the format errors are reported in
    tolerance_eps: float  # the bound, in units of eps
    depth: int
    source: str  # which terms set the bound, for the report


def propagation_depth(phase: str, depth: int, num_layers: int) -> int:
    """How many layers round-off has travelled through to reach a tensor of layer ``depth``.

    Backward: the forward pass's ``L + 1`` layers to the loss, then ``L + 1 − depth`` back. Counting
    only the way back (the first version) left the last layer's weight grads with the depth-1 bound
    while they carry all of the forward's round-off: their error / tolerance climbed with depth
    (0.10 at 2 layers to 0.22 at 32, BENCHMARKS.md "Depth")."""
    if phase == FORWARD:
        return max(depth, 1)
    return max(2 * (num_layers + 1) - depth, 1)


def single_gemm_error(reduction: int, output_format: str, accumulate: str = "float32") -> float:
    """How far one correct length-K reduction lands from the exact result (relative Frobenius,
    absolute units): ``√K·u_acc + u_out``.

    Accumulating K products in precision u_acc sequentially (the tensor-core order, the worst
    production kernels use) errs like a random walk of K roundings, ≈ 0.4·√K·u_acc for random-sign
    terms; rounding the result to the output format adds at most u_out per element. The bound is
    checked against fp64 for every format in ``tests/test_tolerance_bounds.py`` (it holds in ≥ 99.9 %
    of draws and is within 10× of the largest observed error).
    """
    k = max(int(reduction), 1)
    u_acc = number_format(accumulate).unit_roundoff
    u_out = number_format(output_format).unit_roundoff
    if number_format(output_format).mantissa_bits > number_format(accumulate).mantissa_bits:
        u_acc = u_out  # fp64 tensors are accumulated in fp64
    return math.sqrt(k) * u_acc + u_out


def local_error(reduction: int, storage_dtype: str, accumulate: str = "float32") -> float:
    """Expected relative difference of two correct length-K reductions (absolute, not in ε):
    each errs by up to :func:`single_gemm_error`, so they differ by up to twice that,
    ``√K·ε_acc + ε_out``."""
    return 2.0 * single_gemm_error(reduction, storage_dtype, accumulate)


def tolerance_for(phase: str, depth: int, num_layers: int, storage_dtype: str, reduction: int,
                  config: ToleranceConfig = ToleranceConfig(), *, propagate: bool = True,
                  power: int = 1) -> Tolerance:
    """``propagate=False``: the local bound of a tensor computed from inputs both runs share
    (localization replay), without the depth factor. ``power``: the tensor is a running sum of the
    ``power``-th power of a reduced value (Adam's second moment sums squared grads): a relative
    error δ of the value is one of ``power·δ`` in it (keys.value_power)."""
    fmt = report_format(storage_dtype)
    local = power * local_error(reduction, storage_dtype, config.accumulate)
    times = f"{power}·" if power != 1 else ""
    if not propagate:
        return Tolerance(fmt.eps, config.k * local / fmt.eps, 0,
                         f"local {times}k·(√K·ε_acc+ε_out): k={config.k:g} K={max(reduction, 1)}")
    d = propagation_depth(phase, depth, num_layers)
    bound = config.k * config.C ** d * local / fmt.eps
    return Tolerance(fmt.eps, bound, d,
                     f"{times}k·C^d·(√K·ε_acc+ε_out): k={config.k:g} C={config.C:g} d={d} K={max(reduction, 1)}")


def with_perturbation(tol: Tolerance, observed: float, config: ToleranceConfig = ToleranceConfig()) -> Tolerance:
    """The perturbation estimate (the TTrace paper's dynamic tolerance): ``max(analytic, k_p·observed)``.

    ``observed`` is the relative error between the reference and a second reference run with
    round-off-sized noise in every module (``adapter.run.perturb``): how far legitimate round-off moves
    this tensor, amplification included, which the analytic bound cannot see (Adam's sign-like
    first steps, saturated softmaxes). The empirical term only ever raises the bound: a tensor the
    noise does not move keeps the analytic bound. A non-finite observation (the noise changed the
    tensor's shape, e.g. a routing near-tie) is not used, and the source says so.
    """
    if not math.isfinite(observed):
        return dataclasses.replace(tol, source=f"{tol.source}; perturbation: not finite, not used")
    empirical = config.perturbation_k * observed / tol.eps
    if empirical > tol.tolerance_eps:
        return Tolerance(tol.eps, empirical, tol.depth,
                         f"perturbation k_p·observed: k_p={config.perturbation_k:g} observed={observed / tol.eps:.3g}ε "
                         f"(analytic {tol.tolerance_eps:.3g}ε: {tol.source})")
    return dataclasses.replace(tol, source=f"{tol.source}; perturbation observed {observed / tol.eps:.3g}ε")


def _flat_chunks(t, chunk: int, by_rows: bool):
    """Consecutive pieces of ``t`` of about ``chunk`` elements, flattened, in row-major order.
    ``by_rows``: cut along the leading dims into views and make only each small piece dense, so a
    non-contiguous tensor (a slice along its last dim) is never copied whole. Two tensors of one
    shape cut with the same ``by_rows`` give pieces of the same sizes."""
    if not by_rows or t.dim() <= 1:
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), chunk):
            yield flat[start:start + chunk]
        return
    per_row = max(t[0].numel(), 1)
    if per_row > chunk:
        for row in t:
            yield from _flat_chunks(row, chunk, by_rows)
        return
    rows = max(chunk // per_row, 1)
    for start in range(0, t.shape[0], rows):
        yield t[start:start + rows].reshape(-1)


def difference_norms(a, b, chunk: int = 1 << 18) -> Tuple[float, float]:
    """(‖a−b‖, ‖b‖), in chunks, in float32 (float64 for float64 tensors), summed in float64.

    For fp32/bf16/fp16 inputs the difference of two nearby values is exact in float32 (Sterbenz),
    and a 256 Ki-element float32 norm is accurate to ~1e-5 relative, far below what a verdict
    needs; it runs near memory bandwidth, where float64 copies of every chunk did not. Neither
    input is copied whole (a reference sliced to a rank's shard stays a view).
    """
    diff_sq, ref_sq = difference_sums(a, b, chunk)
    return math.sqrt(diff_sq), math.sqrt(ref_sq)


def difference_sums(a, b, chunk: int = 1 << 18) -> Tuple[float, float]:
    """(‖a−b‖², ‖b‖²) as :func:`difference_norms` sums them: a tensor read a chunk at a time
    (``streaming``) adds its chunks' sums, and gets the whole's where its chunks are these."""
    import torch

    if tuple(a.shape) != tuple(b.shape):
        a, b = a.reshape(-1), b.reshape(-1)
    wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    ref_sq = 0.0
    diff_sq = 0.0
    by_rows = not (a.is_contiguous() and b.is_contiguous())
    for ac, bc in zip(_flat_chunks(a, chunk, by_rows), _flat_chunks(b, chunk, by_rows)):
        bc = bc.to(wide)
        ref_sq += float(torch.linalg.vector_norm(bc)) ** 2
        diff_sq += float(torch.linalg.vector_norm(ac.to(wide) - bc)) ** 2
    return diff_sq, ref_sq


def relative_error(a, b, chunk: int = 1 << 18) -> Tuple[float, float]:
    """(‖a−b‖/‖b‖, ‖b‖): 0 when both are zero, inf when only the reference is zero."""
    diff_norm, ref_norm = difference_norms(a, b, chunk)
    if ref_norm == 0.0:
        return (0.0 if diff_norm == 0.0 else float("inf")), ref_norm
    return diff_norm / ref_norm, ref_norm
