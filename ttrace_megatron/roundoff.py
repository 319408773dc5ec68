"""Reference implementations of rounding, for the experiments that check the tolerance model.

The local bound (:func:`ttrace_megatron.tolerance.single_gemm_error`) claims how far one correct
GEMM lands from the exact product, for every input format. It is checked against fp64 (the exact
answer for these sizes) on random GEMMs whose inputs are first rounded to the format, computed
the way a tensor core does it: products accumulated *sequentially along K* in an fp32 register
with one rounding per fused multiply-add, then scaled and rounded once to the output format.
That order is the worst any production kernel uses (CPU kernels block the reduction and do
better; split-K does better), so a bound that holds for it holds for them.

Used by ``tests/test_tolerance_bounds.py`` and ``benchmarks/gemm_bounds.py``.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .fp8 import FP8_DTYPES, quantize, scale_from_amax

FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the output format of a GEMM with these inputs (FP8 GEMMs write bf16 in training recipes)
OUTPUT_FORMAT = {"fp32": "fp32", "tf32": "fp32", "bf16": "bf16", "fp16": "fp16", "e4m3": "bf16", "e5m2": "bf16"}


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to 10 mantissa bits (nearest, ties away), as tensor cores read TF32 inputs."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def to_input_format(x: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, float]:
    """``(values, scale)``: ``x`` rounded to ``fmt``, held in fp32 (exactly), and the per-tensor
    scale that was applied (FP8: TE-style current scaling from the tensor's amax; else 1)."""
    if fmt == "tf32":
        return round_to_tf32(x), 1.0
    if fmt in FP8_DTYPES:
        scale = scale_from_amax(float(x.abs().max()), fmt)
        return quantize(x, scale, fmt).float(), scale
    return x.to(FLOAT_DTYPES[fmt]).float(), 1.0


def sequential_fma_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for batches ``[B, m, K] @ [B, K, n]`` of fp32 values, accumulated in K order in
    fp32 with one rounding per step (the product is exact in fp64, so ``fp32(acc + a·b)`` is a
    fused multiply-add up to a double rounding 2⁻⁵³ away)."""
    acc = torch.zeros(a.shape[0], a.shape[1], b.shape[2], dtype=torch.float32)
    a64, b64 = a.double(), b.double()
    for k in range(a.shape[2]):
        acc = (acc.double() + a64[:, :, k, None] * b64[:, None, k, :]).float()
    return acc


def gemm_errors_vs_fp64(fmt: str, k: int, draws: int, generator: torch.Generator, m: int = 8,
                        n: int = 8) -> torch.Tensor:
    """Relative Frobenius error of ``draws`` random ``[m, K] @ [K, n]`` GEMMs with ``fmt`` inputs
    (standard normal before rounding), tensor-core order, output rounded to the GEMM's output
    format, against the exact product of the same rounded inputs."""
    a, sa = to_input_format(torch.randn(draws, m, k, generator=generator), fmt)
    b, sb = to_input_format(torch.randn(draws, k, n, generator=generator), fmt)
    exact = (a.double() @ b.double()) / (sa * sb)
    out = FLOAT_DTYPES[OUTPUT_FORMAT[fmt]]
    computed = (sequential_fma_gemm(a, b) * (1.0 / (sa * sb))).to(out).double()
    return (computed - exact).flatten(1).norm(dim=1) / exact.flatten(1).norm(dim=1)
