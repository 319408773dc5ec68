"""The scale ladder's extrapolation to 8B/70B shapes (benchmarks/scale.py --paper --table): the error
a clean check should show there, from the ladder's measured slopes."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import scale  # noqa: E402


def _row(axis, value, error, dtype="fp32"):
    shape = dict(scale.BASE, **{scale.AXIS_FIELD[axis]: value})
    return dict(family="gpt3", layout="tp2_sp", axis=axis, value=value, seed=1, dtype=dtype, shape=shape,
                worst={"forward": dict(ratio=0.1, error_eps=error, tolerance_eps=10 * error, tensor="t")})


def test_expected_error_follows_the_measured_slopes():
    rows = [_row("width", 256, 4.0), _row("width", 1024, 8.0),  # error ∝ √h
            _row("depth", 2, 4.0), _row("depth", 32, 2.0)]  # shrinks with depth: counted as flat
    shape = dict(h=4096, L=64, V=scale.BASE["vocab"], s=scale.BASE["seq"], gbs=scale.BASE["tokens"] // scale.BASE["seq"])
    value, fit = scale.expected_error(rows, "fp32", "forward", shape)
    assert value == pytest.approx(4.0 * (4096 / 256) ** 0.5)
    assert fit == "all axes"  # width and depth measured (depth's slope clamped at 0); the rest at the base
    wider_vocab = dict(shape, V=8 * scale.BASE["vocab"])
    assert scale.expected_error(rows, "fp32", "forward", wider_vocab) == (value, "flat along vocab")
    assert scale.expected_error(rows, "bf16", "forward", shape) == (None, "not measured")


def test_paper_lists_bound_and_expected_error():
    text = scale.paper([_row("width", 256, 4.0), _row("width", 1024, 8.0)])
    assert "| expected error (ε) |" in text and "8B" in text and "70B" in text
    assert "flat along depth, vocab, seq, tokens" in text
