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

from typing import List

import torch

from . import layouts
from .naming import canonical_module_names


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


class _BackwardNoise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, generator):
        ctx.generator = generator
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return _relative_noise(grad, ctx.generator), None


class Perturber:
    """Hooks on every recorded module that add round-off-sized noise (see the module docstring).

    The forward hook is prepended, so the recorder records the perturbed output; the pre-hook is
    appended after the recorder's, so the grad the recorder sees at the module's input is the
    perturbed dgrad.
    """

    def __init__(self, seed: int, recorder):
        self.generator = torch.Generator().manual_seed(int(seed))
        self.recorder = recorder
        self._handles: List = []

    def attach(self, chunks: List[torch.nn.Module]) -> "Perturber":
        for chunk in chunks:
            for module in canonical_module_names(chunk):
                if isinstance(module, layouts.recorded_module_types()):
                    self._handles.append(module.register_forward_pre_hook(self._pre_hook))
                    self._handles.append(module.register_forward_hook(self._post_hook, prepend=True))
        return self

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _active(self) -> bool:
        return self.recorder.in_iteration

    def _pre_hook(self, module, args):
        if not self._active() or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        if not x.is_floating_point() or not x.requires_grad:
            return None
        return (_BackwardNoise.apply(x, self.generator),) + tuple(args[1:])

    def _post_hook(self, module, args, output):
        if not self._active():
            return None
        out = output[0] if isinstance(output, tuple) else output
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        noisy = _ForwardNoise.apply(out, self.generator)
        return (noisy,) + tuple(output[1:]) if isinstance(output, tuple) else noisy
