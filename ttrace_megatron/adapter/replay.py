"""Localization replay: every recorded module runs on the reference's inputs and output-grads.

The candidate runs again, from the same seed checkpoint and data, with two substitutions per
recorded module (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding):

* forward: the module's first input is replaced by the reference's logical input, sliced to this
  rank's shard (``slice_logical``, the placements the recorder uses);
* backward: the grad arriving at the module's first output is replaced by the reference's
  logical output-grad, sliced likewise;
* optimizer: once the candidate's main grads are recorded, they are replaced by the reference's,
  so the step is judged given the reference's inputs.

Each module's outputs — forward output, grad w.r.t. its input, its parameters' grads — then
depend only on the module itself and on inputs both runs share, so they are judged under the
*local* tolerance (no depth factor); the first module that fails on its own is the culprit.
The recorder's hooks are registered first, so the trace also holds what *arrived* at each
module before substitution.

The substitution keeps the autograd graph: the replaced input passes its grad straight to the
candidate's own tensor, so parameters upstream still receive grads and grad reduction, the
optimizer and main grads run as usual. This run is a diagnosis, not the observed training: its
numerics are changed on purpose.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..compare import group_records, logical_tensor
from ..errors import TraceError
from ..placement import Coords, Layout, PlacementError, logical_mask, slice_logical
from ..trace_store import TensorKey, TraceReader
from . import layouts
from .naming import all_parameters, canonical_module_names


class _Substitute(torch.autograd.Function):
    """Forward: ``value`` instead of ``x``. Backward: the grad goes to ``x`` unchanged."""

    @staticmethod
    def forward(ctx, x, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Replayer:
    def __init__(self, reference_dir: str, recorder, coords: Coords, facts: layouts.ModelFacts):
        self.reference = TraceReader(reference_dir)
        self._groups = group_records(self.reference)
        self.recorder = recorder
        self.coords = coords
        self.facts = facts
        self.substituted = 0
        self._handles: List = []

    def substitute_main_grads(self, chunks: List[torch.nn.Module]) -> None:
        """Before the optimizer steps: the reference's main grads, so the step (grad norm, clipping,
        update) is judged given the reference's inputs. The candidate's own main grads were recorded
        just before, and are judged as the grad reduction's output."""
        if not self._active():
            return
        with torch.no_grad():
            for mname, pname, module, param in all_parameters(chunks):
                main_grad = getattr(param, "main_grad", None)
                if main_grad is None or not param.requires_grad:
                    continue
                key = TensorKey(self.recorder.iteration, -1, mname, "main_grad", f"{pname}.main_grad")
                layout = layouts.param_layout(mname, pname, module, param, self.facts)
                value = self._reference_shard(key, layout, main_grad)
                if value is not None:
                    main_grad.copy_(value)

    def attach(self, chunks: List[torch.nn.Module]) -> "Replayer":
        for chunk in chunks:
            for module, name in canonical_module_names(chunk).items():
                if isinstance(module, layouts.recorded_module_types()) and not self.recorder._skip_per_microbatch(module):
                    self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
                    self._handles.append(module.register_forward_hook(self._post_hook(name), with_kwargs=True))
        self.recorder.before_step.append(lambda: self.substitute_main_grads(chunks))
        return self

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _reference_shard(self, key: TensorKey, layout: Layout, like: torch.Tensor,
                         scale: float = 1.0) -> Optional[torch.Tensor]:
        """The reference's value of ``key`` as this rank holds it (times ``scale``), shaped like ``like``."""
        pieces = self._groups.get(key)
        if pieces is None:
            return None  # not recorded by the reference (selective recording): leave the candidate's value
        full = logical_tensor(self.reference, pieces).tensor
        try:
            shard = slice_logical(full, layout, self.coords, like.shape)
            if scale != 1.0:
                shard = shard.to(torch.float64) * scale
            shard = shard.to(dtype=like.dtype, device=like.device)
            mask = logical_mask(layout, self.coords, tuple(like.shape))
            if mask is not None:
                # padding (the vocabulary padded per TP size) is not in the logical tensor: keep the
                # candidate's own values there (padding logits take part in the softmax and their
                # grads reach the output layer's padding rows and the grad norm)
                shard = torch.where(mask.to(like.device), shard, like.detach())
        except PlacementError as e:
            raise TraceError(f"cannot slice the reference to this rank's shard: {e}", path=self.reference.dir,
                             tensor=str(key)) from None
        self.substituted += 1
        return shard

    def _active(self) -> bool:
        return self.recorder.in_iteration

    def _pre_hook(self, name: str):
        def hook(module, args, kwargs):
            if not self._active() or not args or not isinstance(args[0], torch.Tensor):
                return None
            x = args[0]
            if not x.is_floating_point():
                return None  # token ids: nothing to substitute
            in_layout, _ = layouts.activation_layouts(name, module, self.facts, tuple(x.shape), None)
            key = TensorKey(self.recorder.iteration, self.recorder.microbatch, name, "forward", "input")
            value = self._reference_shard(key, in_layout, x)
            if value is None:
                return None
            return (_Substitute.apply(x, value),) + tuple(args[1:]), kwargs
        return hook

    def _post_hook(self, name: str):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            if not self._active() or not isinstance(out, torch.Tensor) or not out.requires_grad:
                return None
            _, out_layout = layouts.activation_layouts(name, module, self.facts, tuple(args[0].shape), tuple(out.shape))
            out_layout = layouts.grad_layout(out_layout, module)
            key = TensorKey(self.recorder.iteration, self.recorder.microbatch, name, "backward", "grad_output")

            def substitute_grad(grad):
                # this run's per-microbatch grads are dp times a DP=1 run's (Recorder.scale_for)
                value = self._reference_shard(key, out_layout, grad, self.recorder.scale_for("backward"))
                return value if value is not None else grad

            out.register_hook(substitute_grad)
            return None
        return hook

