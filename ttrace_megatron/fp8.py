"""FP8 emulation on CPU, with TransformerEngine's per-tensor scaling semantics.

A TE FP8 GEMM quantizes each operand with a per-tensor scale, multiplies the FP8 values with
fp32 accumulation, and dequantizes into a higher-precision output (bf16 in training recipes).
Emulated here with torch's float8 dtypes (cast = round to nearest, saturating in this module):

    scale = fp8_max / amax / 2**margin          (TE: ``(fp8_max / amax) / 2**margin``)
    q     = cast_to_fp8(x · scale)
    y     = (q_a.float() @ q_b.float()) / (scale_a · scale_b)   → rounded to the output dtype

Delayed scaling takes ``amax`` from a history of earlier iterations (``amax_compute_algo``
``max`` or ``most_recent``); current scaling uses this tensor's own amax. **The amax is that of
the logical tensor**: a tensor sharded over a group must reduce its shard amaxes over that group
(max), otherwise ranks quantize with different scales — one of the bug-zoo entries.

Knows nothing about megatron; used by tests today and meant for FP8 recipes on CPU (issue #3).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_dtype(fmt: str) -> torch.dtype:
    if fmt not in FP8_DTYPES:
        raise ValueError(f"unknown FP8 format {fmt!r}; known: {sorted(FP8_DTYPES)}")
    return FP8_DTYPES[fmt]


def scale_from_amax(amax: float, fmt: str, margin: int = 0) -> float:
    """TE's scale for a tensor whose absolute maximum is ``amax`` (1 when amax is 0 or not finite)."""
    fp8_max = torch.finfo(fp8_dtype(fmt)).max
    if not amax > 0 or amax == float("inf"):
        return 1.0
    return fp8_max / amax / 2.0 ** margin


def logical_amax(shard_amaxes: Sequence[float]) -> float:
    """The amax of a sharded tensor: the max over its shards (TE reduces amax over the group)."""
    return max(float(a) for a in shard_amaxes)


def quantize(x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """FP8 values of ``x · scale``, saturated to the format's range (TE casts saturate)."""
    fp8_max = torch.finfo(fp8_dtype(fmt)).max
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype(fmt))


def dequantize(q: torch.Tensor, scale: float) -> torch.Tensor:
    return q.float() / scale


@dataclasses.dataclass
class DelayedScaling:
    """Per-tensor delayed scaling: the scale of step t comes from the amaxes of earlier steps."""

    fmt: str = "e4m3"
    margin: int = 0
    history_len: int = 1024
    amax_compute_algo: str = "max"  # max | most_recent
    history: List[float] = dataclasses.field(default_factory=list)

    @property
    def scale(self) -> float:
        if not self.history:
            return 1.0
        amax = max(self.history) if self.amax_compute_algo == "max" else self.history[-1]
        return scale_from_amax(amax, self.fmt, self.margin)

    def update(self, amax: float) -> None:
        self.history.append(float(amax))
        del self.history[:-self.history_len]


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, *, fmt_a: str = "e4m3", fmt_b: str = "e4m3",
               scale_a: Optional[float] = None, scale_b: Optional[float] = None, margin: int = 0,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ b`` as an FP8 GEMM: quantized operands, fp32 accumulation, ``out_dtype`` output.

    Without explicit scales, current scaling from each operand's own amax.
    """
    sa = scale_a if scale_a is not None else scale_from_amax(float(a.abs().max()), fmt_a, margin)
    sb = scale_b if scale_b is not None else scale_from_amax(float(b.abs().max()), fmt_b, margin)
    qa, qb = quantize(a, sa, fmt_a), quantize(b, sb, fmt_b)
    return ((qa.float() @ qb.float()) / (sa * sb)).to(out_dtype)
