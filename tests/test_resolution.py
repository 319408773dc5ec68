"""The report's resolution: the loosest relative tolerance of a comparison, and the warning past 10 %
(BENCHMARKS.md, "On paper at 8B-70B": bf16 past ~40 layers)."""

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
