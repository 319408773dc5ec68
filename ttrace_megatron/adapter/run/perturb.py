"""The perturbation estimate: a second reference run with round-off-sized noise in every module.

A correct candidate differs from the reference only by round-off introduced at every GEMM and
carried to the end. How far that carries is a property of the model and the data, not only of
the formats: an Adam update of an element whose grad is within round-off of zero can flip sign;
a softmax near saturation amplifies; a router near a tie changes its choice. The analytic bound
(:mod:`ttrace_megatron.tolerance`) cannot see those. The TTrace paper's dynamic tolerance
measures them instead: run the reference again with a *legal* perturbation and observe how far
each recorded tensor moves.

The perturbation here imitates another correct implementation of every recorded module:

* forward: the module's output is multiplied element-wise by ``1 + ε·z`` (ε of its dtype, z
  standard normal), as if its GEMM had rounded differently;
* backward: likewise the grad the module sends to its input (its dgrad).

Weight grads then differ through their perturbed inputs and output-grads, and everything after
the first module (grad reduction, grad norm, the optimizer step) sees what it would see from
another implementation. The noise comes from a private generator seeded by ``seed``, so the run
is reproducible and the global RNG state is untouched.

This run is a calibration, not the observed training: its numerics are changed on purpose, the
way the localization replay's are. :func:`ttrace_megatron.compare.compare_traces` uses it with
``perturbed=``: a tensor's tolerance becomes ``max(analytic, k_p · observed)``.
"""

from __future__ import annotations

import torch

from ..record.hooks import GRAD_LEAVES, OUTPUT_LEAVES, PERTURB, Call, Feature


def _relative_noise(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x · (1 + ε·z)`` in float32, rounded back to ``x``'s dtype."""
    eps = torch.finfo(x.dtype).eps
    z = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device)
    return (x.float() * (1.0 + eps * z)).to(x.dtype)


class _ForwardNoise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, generator):
        return _relative_noise(x, generator)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Perturber(Feature):
    """Round-off-sized noise on what every hooked module produces (see the module docstring): the
    PERTURB feature of the :class:`~.hooks.Dispatcher`, which runs before the recorder, so the
    recorder records the perturbed output and the perturbed dgrad."""

    name = PERTURB

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(int(seed))

    def wants(self, call: Call, event: str) -> bool:
        return event in (OUTPUT_LEAVES, GRAD_LEAVES)

    def output_leaves(self, call: Call, out: torch.Tensor) -> torch.Tensor:
        return _ForwardNoise.apply(out, self.generator) if out.is_floating_point() else out

    def grad_leaves(self, call: Call, grad: torch.Tensor) -> torch.Tensor:
        return _relative_noise(grad, self.generator)
