"""The report's resolution: the loosest relative tolerance of a comparison, and the warning past 10 %
(BENCHMARKS.md, "On paper at 8B-70B": bf16 forward tensors past ~40 layers, backward past ~19)."""

import io

from rich.console import Console

from ttrace_megatron import keys
from ttrace_megatron.compare import PASS, TensorResult
from ttrace_megatron.keys import TensorKey
from ttrace_megatron.report import RESOLUTION_WARNING, render, resolution
from ttrace_megatron.tolerance import tolerance_for

BF16 = 2.0 ** -7


def _result(depth, num_layers, dtype="bfloat16", phase=keys.FORWARD, tensor=keys.OUTPUT, source=""):
    tol = tolerance_for(keys.FORWARD, depth, num_layers, dtype, 4096)
    key = TensorKey(1, 0 if phase == keys.FORWARD else -1, f"decoder.layers.{depth - 1}.mlp.linear_fc2", phase, tensor)
    return TensorResult(key=key, verdict=PASS, error=0.0, eps=tol.eps, tolerance_eps=tol.tolerance_eps, order=depth,
                        depth=depth, shape=(4,), tolerance_source=source or tol.source)


def test_deep_bf16_warns_and_fp32_does_not():
    shallow = resolution([_result(d, 32) for d in range(1, 33)])
    deep = resolution([_result(d, 80) for d in range(1, 81)])
    fp32 = resolution([_result(d, 80, "float32") for d in range(1, 81)])
    assert not shallow["warn"] and 0.05 < shallow["loosest_relative"] < RESOLUTION_WARNING  # 8B: 8 %
    assert deep["warn"] and deep["loosest_relative"] > 0.3  # 70B: 33 %
    assert "layers.79" in deep["tensor"]
    assert not fp32["warn"] and fp32["loosest_relative"] < 1e-3


def test_deep_bf16_backward_warns_from_about_20_layers():
    """A backward tensor's depth counts the forward pass (2(L + 1) − l): the embedding's grads of an
    8B-deep (32-layer) bf16 model are bounded at ~22 %, of a 16-layer one below 10 %."""
    def grads(layers):
        tol = tolerance_for(keys.BACKWARD, 0, layers, "bfloat16", 4096)
        key = TensorKey(1, 0, "embedding.word_embeddings", keys.BACKWARD, "weight.grad")
        return resolution([TensorResult(key=key, verdict=PASS, error=0.0, eps=tol.eps, tolerance_eps=tol.tolerance_eps,
                                        order=0, depth=0, shape=(4,), tolerance_source=tol.source)])

    assert not grads(16)["warn"]
    assert grads(32)["warn"] and 0.15 < grads(32)["loosest_relative"] < 0.3


def test_element_wise_adam_bounds_do_not_count():
    adam = _result(1, 2, phase=keys.OPTIMIZER, tensor="weight", source="Adam update, element-wise (lock-step): ...")
    adam.tolerance_eps = 1e9
    assert resolution([_result(1, 2), adam])["loosest_relative"] < 0.1


def test_the_warning_is_printed():
    r = _result(80, 80)
    report = {"verdict": PASS, "tensors": [], "summary": {"compared": 1, "failed": 0}, "first_mismatch": None,
              "resolution": resolution([r])}
    out = io.StringIO()
    render(report, Console(file=out, width=200))
    assert "resolution: a tolerance of 0.33 relative error" in out.getvalue()
    assert "fewest layers the layout allows" in out.getvalue()


def test_an_infinite_tolerance_renders():
    """A top-k choice at an exact tie of its scores has an infinite tolerance (written "inf" in the
    JSON): it is no layer's worst, and the report renders (a Mixtral-like bf16 rung of the scale
    ladder crashed the report here)."""
    from ttrace_megatron.report import _mismatch_json

    tie = _result(1, 2)
    tie.tolerance_eps = float("inf")
    tie.error = 8 * tie.eps
    other = _result(1, 2)
    other.error = 0.5 * other.eps
    tensors = [dict(_mismatch_json(r), verdict=r.verdict, error=r.error, eps=r.eps, depth=r.depth, order=r.order,
                    shape=list(r.shape)) for r in (tie, other)]
    report = {"verdict": PASS, "tensors": tensors, "summary": {"compared": 2, "failed": 0}, "first_mismatch": None}
    out = io.StringIO()
    render(report, Console(file=out, width=200), num_layers=2)
    assert "0.5 / " in out.getvalue()


def test_measured_step_bounds_are_not_the_resolution():
    """The grad norm, the clip coefficient and each parameter's term of the norm are bounded by
    what the run measured (a bug in a main grad widens its term's bound to 6.4 in one zoo run):
    the check's resolution is that of its analytic bounds."""
    import dataclasses

    fp32 = [_result(d, 8, "float32") for d in range(1, 9)]
    measured = [dataclasses.replace(fp32[0], key=TensorKey(1, -1, keys.OPTIMIZER_MODULE, keys.OPTIMIZER, tensor),
                                    tolerance_eps=6.4 / fp32[0].eps)
                for tensor in (keys.grad_norm_term("decoder.layers.0.mlp.linear_fc2.weight"), keys.GRAD_NORM)]
    assert resolution(fp32 + measured) == resolution(fp32)
    assert not resolution(fp32 + measured)["warn"]
