"""FP8 emulation: TE-style scaling, amax of the logical tensor, delayed scaling history."""

import pytest
import torch

from ttrace_megatron.fp8 import (DelayedScaling, dequantize, fp8_matmul, logical_amax, quantize,
                                 scale_from_amax)


@pytest.mark.parametrize("fmt,max_value,mantissa", [("e4m3", 448.0, 3), ("e5m2", 57344.0, 2)])
def test_quantize_round_trip_error_is_the_formats(fmt, max_value, mantissa):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 3
    scale = scale_from_amax(float(x.abs().max()), fmt)
    q = quantize(x, scale, fmt)
    assert float(q.float().abs().max()) == pytest.approx(max_value)  # amax maps to the format's max
    rel = ((dequantize(q, scale) - x).abs() / x.abs()).clamp(max=1)
    big = x.abs() > x.abs().max() / 2 ** 6  # normal range of the scaled values (e4m3 subnormals below)
    assert float(rel[big].max()) <= 2.0 ** -(mantissa + 1) * 1.0001  # round to nearest: u = ε/2


def test_saturation_and_degenerate_amax():
    assert scale_from_amax(0.0, "e4m3") == 1.0 and scale_from_amax(float("inf"), "e4m3") == 1.0
    q = quantize(torch.tensor([1e6, -1e6]), 1.0, "e4m3")
    assert q.float().tolist() == [448.0, -448.0]


def test_sharded_tensor_needs_the_logical_amax():
    """Quantizing each shard with its own amax is not the logical tensor's quantization."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g)
    x[:, 64:] *= 10  # the second shard has a larger range
    shards = x.chunk(2, dim=1)
    right = scale_from_amax(logical_amax([float(s.abs().max()) for s in shards]), "e4m3")
    logical = dequantize(quantize(x, right, "e4m3"), right)
    with_group_amax = torch.cat([dequantize(quantize(s, right, "e4m3"), right) for s in shards], dim=1)
    assert torch.equal(with_group_amax, logical)
    own = [scale_from_amax(float(s.abs().max()), "e4m3") for s in shards]
    with_own_amax = torch.cat([dequantize(quantize(s, sc, "e4m3"), sc) for s, sc in zip(shards, own)], dim=1)
    assert not torch.equal(with_own_amax, logical)


def test_delayed_scaling_uses_the_history():
    d = DelayedScaling(fmt="e4m3", history_len=2)
    assert d.scale == 1.0
    d.update(2.0)
    d.update(8.0)
    assert d.scale == pytest.approx(448.0 / 8.0)
    d.update(1.0)
    d.update(1.0)  # 8.0 fell out of the window
    assert d.scale == pytest.approx(448.0)
    d.amax_compute_algo = "most_recent"
    assert d.scale == pytest.approx(448.0)


def test_fp8_matmul_is_close_to_the_exact_product():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(16, 256, generator=g), torch.randn(256, 16, generator=g)
    exact = a.double() @ b.double()
    rel = float((fp8_matmul(a, b).double() - exact).norm() / exact.norm())
    assert 0 < rel < 0.1  # e4m3 inputs (u = 2^-4) averaged over K = 256
