"""FP8 GEMMs on CPU for megatron-core's local linears, with TransformerEngine's semantics.

TE runs a transformer layer's linears in FP8 (``--fp8-format hybrid``: e4m3 activations and
weights in forward, e5m2 output-grads in backward), with fp32 accumulation and a bf16 output, and
keeps the embedding, the output layer, attention's core and the router in bf16. TE needs a GPU; this
module gives reference and candidate alike the same arithmetic on CPU, so FP8 recipes can be checked
without one. It wraps each decoder-layer ``ColumnParallelLinear`` / ``RowParallelLinear``'s
``_forward_impl`` (megatron's GEMM + TP communication function):

    forward:  y    = round_bf16( Q(x) @ Q(W)ᵀ )                 Q: quantize-dequantize, fp32 GEMM
    backward: dx   = Q_bwd(dy) @ Q(W)        dW = Q_bwd(dy)ᵀ @ Q(x)

Each operand is quantized with current (per-tensor, per-microbatch) scaling from **the amax of the
logical tensor**: the max of the shard amaxes, all-reduced (MAX) over the groups that shard the
operand. Which groups those are is read from the operand's placement
(:func:`layouts.gemm_operand_placements`), the same vocabulary merge and slice use. Without that
reduction ranks quantize their shards with different scales, which a single-device reference never
does: ``bugs.fp8_amax_wrong_group``.

The amax reduction is part of the emulated model's arithmetic, the same with tracing on or off, on
every rank of the group (it is not a tracing hook). An observer, set by the recorder while it is
attached, receives every amax the GEMM used: replicas over TP that must agree bit for bit.

Not emulated: delayed scaling (amax histories), MXFP8 / blockwise recipes, expert linears, FP8
communication. TE-backed layers on a GPU use TE itself.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ... import keys
from ...fp8 import quantize, scale_from_amax
from ..record import layouts

FP8_MODULES = "decoder.layers.*"  # TE's FP8 covers the transformer layers' linears only

# TE's --fp8-format: forward (activations, weights) and backward (output-grads) formats
FP8_FORMATS = {"hybrid": ("e4m3", "e5m2"), "e4m3": ("e4m3", "e4m3")}


@dataclasses.dataclass(frozen=True)
class FP8Settings:
    fmt: str = "hybrid"
    margin: int = 0

    def __post_init__(self):
        if self.fmt not in FP8_FORMATS:
            raise ValueError(f"unknown FP8 format {self.fmt!r}; known: {sorted(FP8_FORMATS)}")

    @property
    def forward_format(self) -> str:
        return FP8_FORMATS[self.fmt][0]

    @property
    def backward_format(self) -> str:
        return FP8_FORMATS[self.fmt][1]


def _logical_amax(x: torch.Tensor, groups: Sequence) -> torch.Tensor:
    amax = x.detach().abs().max().float().reshape(1) if x.numel() else torch.zeros(1)
    for group in groups:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


def _fake_quantize(x: torch.Tensor, amax: torch.Tensor, fmt: str, margin: int) -> torch.Tensor:
    """The fp32 values an FP8 GEMM multiplies: ``x`` quantized with the scale of ``amax``, dequantized."""
    scale = scale_from_amax(float(amax), fmt, margin)
    return quantize(x, scale, fmt).float() / scale


class _QuantizeOperand(torch.autograd.Function):
    """Forward: quantize-dequantize to fp32. Backward: the grad passes straight through (TE
    differentiates the GEMM with respect to the high-precision operand); autograd casts it back to
    the operand's dtype."""

    @staticmethod
    def forward(ctx, x, amax, fmt, margin):
        return _fake_quantize(x, amax, fmt, margin)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _QuantizeGradOutput(torch.autograd.Function):
    """Forward: identity. Backward: the output-grad, quantized like TE's ``grad_output`` before
    both the dgrad and the wgrad GEMM."""

    @staticmethod
    def forward(ctx, y, emulated):
        ctx.emulated = emulated
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        em = ctx.emulated
        amax = _logical_amax(grad, em.groups[keys.GRAD_OUTPUT])
        em.observe(keys.BACKWARD, keys.GRAD_OUTPUT, amax)
        return _fake_quantize(grad, amax, em.settings.backward_format, em.settings.margin), None


class EmulatedFP8Linear:
    """The FP8 GEMM of one megatron linear: replaces its ``_forward_impl``, keeps the original."""

    def __init__(self, module: torch.nn.Module, settings: FP8Settings, groups: Dict[str, List]):
        self.module = module
        self.settings = settings
        self.groups = groups  # operand -> process groups its amax is reduced over
        self.observer: Optional[Callable[[str, str, torch.Tensor], None]] = None  # (phase, operand, amax)
        self.original = module._forward_impl
        module._forward_impl = self
        module._ttrace_fp8 = self

    def observe(self, phase: str, operand: str, amax: torch.Tensor) -> None:
        if self.observer is not None:
            self.observer(phase, operand, amax)

    def __call__(self, input, weight, *args, **kwargs):
        s = self.settings
        amax_in = _logical_amax(input, self.groups[keys.INPUT])
        amax_w = _logical_amax(weight, self.groups[keys.WEIGHT])
        self.observe(keys.FORWARD, keys.INPUT, amax_in)
        self.observe(keys.FORWARD, keys.WEIGHT, amax_w)
        q_in = _QuantizeOperand.apply(input, amax_in, s.forward_format, s.margin)
        q_w = _QuantizeOperand.apply(weight, amax_w, s.forward_format, s.margin)
        out = self.original(q_in, q_w, *args, **kwargs)  # fp32 GEMM (+ megatron's TP communication)
        if out.requires_grad:
            out = _QuantizeGradOutput.apply(out, self)
        return out.to(input.dtype)  # TE writes the GEMM's output in the activation dtype (bf16)


def install(chunks, settings: FP8Settings, facts: layouts.ModelFacts) -> List[EmulatedFP8Linear]:
    """Run every decoder-layer linear of ``chunks`` as an emulated FP8 GEMM (before DDP wraps them)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from ..recipe.naming import named_modules

    installed = []
    for name, module in named_modules(chunks, FP8_MODULES, (ColumnParallelLinear, RowParallelLinear)):
        if not layouts.is_expert(module) and not hasattr(module, "_ttrace_fp8"):
            placements = layouts.gemm_operand_placements(name, module, facts)
            groups = {operand: [layouts.axis_group(axis) for axis in layouts.sharded_axes(pl)]
                      for operand, pl in placements.items()}
            installed.append(EmulatedFP8Linear(module, settings, groups))
    return installed
