"""The local GEMM bound against fp64, for every number format (issue #3's acceptance test).

For each input format and reduction length K: 1000 random GEMMs with inputs rounded to the
format (FP8 with TE-style per-tensor scaling), accumulated in fp32 in tensor-core order
(sequential along K, one rounding per FMA), output rounded to the GEMM's output format. The
bound ``tolerance.single_gemm_error`` must hold in ≥ 99.9 % of draws and must not be looser than
10× the largest error observed: a bound that is always met because it is huge is not a bound.
"""

import math

import pytest
import torch

from ttrace_megatron.roundoff import OUTPUT_FORMAT, gemm_errors_vs_fp64
from ttrace_megatron.tolerance import single_gemm_error

DRAWS = 1000


@pytest.mark.parametrize("k", [16, 256, 4096])
@pytest.mark.parametrize("fmt", ["fp32", "tf32", "bf16", "fp16", "e4m3", "e5m2"])
def test_single_gemm_bound_holds_and_is_tight(fmt, k):
    g = torch.Generator().manual_seed(k * 31 + len(fmt))
    errors = gemm_errors_vs_fp64(fmt, k, DRAWS, g)
    bound = single_gemm_error(k, OUTPUT_FORMAT[fmt])
    within = int((errors <= bound).sum())
    assert within >= math.ceil(0.999 * DRAWS), f"{fmt} K={k}: {DRAWS - within} draws above the bound"
    worst = float(errors.max())
    assert worst > 0
    assert bound <= 10 * worst, f"{fmt} K={k}: bound {bound:.3g} is {bound / worst:.1f}× the worst error {worst:.3g}"


def test_the_accumulation_term_is_what_grows_with_k():
    """fp32 outputs: the error grows like √K (the accumulation term); bf16 outputs: it does not
    (the output rounding dominates), so the bound must be the sum of both terms."""
    g = torch.Generator().manual_seed(7)
    fp32 = [float(gemm_errors_vs_fp64("fp32", k, 200, g).mean()) for k in (64, 4096)]
    bf16 = [float(gemm_errors_vs_fp64("bf16", k, 200, g).mean()) for k in (64, 4096)]
    assert 4 < fp32[1] / fp32[0] < 16  # √64 = 8
    assert 0.5 < bf16[1] / bf16[0] < 2


def test_partial_sums_that_cancel_scale_the_tolerance():
    """A tensor added up from partial sums (a TP-partial grad) carries each partial's round-off,
    relative to the partial: where they cancel, the bound scales by Σ‖pᵢ‖ / ‖Σ pᵢ‖ — and only then."""
    import torch

    from ttrace_megatron.compare import cancellation_factor, decide
    from ttrace_megatron.keys import BACKWARD, TensorKey, param_grad
    from ttrace_megatron.placement import Layout
    from ttrace_megatron.tolerance import ToleranceConfig
    from ttrace_megatron.trace_store import Record

    p0, p1 = torch.tensor([1.0, -1.0]), torch.tensor([-0.99, 1.01])
    assert cancellation_factor(float(p0.norm() + p1.norm()), p0 + p1) > 50
    assert cancellation_factor(float(2 * p0.norm()), p0 + p0) == 1.0
    assert cancellation_factor(1.0, torch.zeros(2)) == 1.0  # an exact zero: nothing to scale
    key = TensorKey(1, 0, "decoder.layers.0.self_attention.q_layernorm", BACKWARD, param_grad("weight"))
    rec = Record(key=key, layout=Layout((), (2,)), dtype="bfloat16", shape=(2,), seq=0, file="", name="", depth=1,
                 reduction=64)
    plain = decide(key, rec, 2, 0, ToleranceConfig(), (2,), 1e-3)
    scaled = decide(key, rec, 2, 0, ToleranceConfig(), (2,), 1e-3, cancellation=3.0)
    assert scaled.tolerance_eps == 3.0 * plain.tolerance_eps and "a sum whose terms cancel" in scaled.tolerance_source
