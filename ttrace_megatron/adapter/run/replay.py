"""Localization replay: every recorded module runs on the reference's inputs and output-grads.

The candidate runs again, from the same seed checkpoint and data, with two substitutions per
hooked module (the SUBSTITUTE feature of the :class:`~.hooks.Dispatcher`):

* forward: the module's first input is replaced by the reference's logical input, sliced to this
  rank's shard (``slice_logical``, the placements the recorder uses);
* backward: the grad arriving at the module's first output is replaced by the reference's
  logical output-grad, sliced likewise;
* optimizer: once the candidate's main grads are recorded, they are replaced by the reference's,
  so the step is judged given the reference's inputs;
* MoE routing: a router whose top-k choice differs from the reference's takes the reference's
  (``routing``), so each expert receives the tokens it received in the reference.

Each module's outputs — forward output, grad w.r.t. its input, its parameters' grads — then
depend only on the module itself and on inputs both runs share, so they are judged under the
*local* tolerance (no depth factor); the first module that fails on its own is the culprit.
The dispatcher runs the recorder before the substitution, so the trace also holds what
*arrived* at each module before it was replaced. Every substituted value has the layout the
recorder gives its key (:class:`.layouts.KeyLayouts`), loss scale and owned ranges included.

The substitution keeps the autograd graph: the replaced input passes its grad straight to the
candidate's own tensor, so parameters upstream still receive grads and grad reduction, the
optimizer and main grads run as usual. This run is a diagnosis, not the observed training: its
numerics are changed on purpose.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import keys
from ...compare import group_records, reference_piece, reference_piece_source
from ...errors import TraceError
from ...keys import TensorKey
from ...placement import Coords, Layout, PlacementError, logical_mask, owned_piece
from ...streaming import chunks, read_flat
from ...trace_store import TraceReader
from ..record.hooks import GRAD_ARRIVES, INPUT_ARRIVES, SUBSTITUTE, Call, Feature
from ..record.layouts import Site
from ..record.recorder import Recorder, skips_per_microbatch


class _Substitute(torch.autograd.Function):
    """Forward: ``value`` instead of ``x``. Backward: the grad goes to ``x`` unchanged."""

    @staticmethod
    def forward(ctx, x, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReferenceValues:
    """The reference trace's values, sliced to this rank as it stores them: what the replay and the
    lock-step put into the candidate."""

    def __init__(self, reference_dir: str, coords: Coords, reader: Optional[TraceReader] = None, groups=None):
        # ``reader``: one already open on the same trace (the online comparer's), whose files are
        # then verified once for both; ``groups``: its records grouped by key, where the comparer
        # keeps them (a streamed reference's, updated in place as each iteration comes)
        if reader is None:
            reader = TraceReader(reference_dir)
            reader.prefetch()
        self.reader = reader
        self._groups = group_records(self.reader) if groups is None else groups
        self.coords = coords
        self.substituted = 0
        self.absent = 0

    def shard(self, key: TensorKey, layout: Layout, like: torch.Tensor) -> Optional[torch.Tensor]:
        """The reference's value of ``key`` as this rank stores it (``layout``), shaped like ``like``;
        None when the reference did not record it (selective recording)."""
        pieces = self._groups.get(key)
        if pieces is None:
            self.absent += 1
            return None
        try:
            shard = reference_piece(self.reader, pieces, layout, self.coords, tuple(like.shape)).to(
                dtype=like.dtype, device=like.device)
            mask = logical_mask(layout, self.coords, tuple(like.shape))
            if mask is not None:
                # padding (the vocabulary padded per TP size) is not in the logical tensor: keep the
                # candidate's own values there (padding logits take part in the softmax and their
                # grads reach the output layer's padding rows and the grad norm)
                shard = torch.where(mask.to(like.device), shard, like.detach())
        except PlacementError as e:
            raise TraceError(f"cannot slice the reference to this rank's shard: {e}", path=self.reader.dir,
                             tensor=str(key)) from None
        self.substituted += 1
        return shard

    def put(self, key: TensorKey, layout: Layout, target: torch.Tensor) -> bool:
        """``target.copy_(self.shard(key, layout, target))``, a chunk at a time where the piece is a
        view of a single-device reference's record and holds no padding: no host copy of the whole
        piece (fresh memory, zeroed page by page by the kernel, at a third of the read's speed), the
        same values. False where the reference did not record ``key``."""
        pieces = self._groups.get(key)
        local = tuple(target.shape)
        try:
            source = None if pieces is None or layout.scale != 1.0 or not target.is_contiguous() else (
                reference_piece_source(self.reader, pieces, layout, self.coords, local))
        except PlacementError as e:
            raise TraceError(f"cannot slice the reference to this rank's shard: {e}", path=self.reader.dir,
                             tensor=str(key)) from None
        if source is None or logical_mask(layout, self.coords, local) is not None:
            value = self.shard(key, layout, target)
            if value is not None:
                target.copy_(value)
            return value is not None
        flat, whole = target.view(-1), source.meta()
        for begin, end in chunks(flat.numel()):
            flat[begin:end].copy_(read_flat(source, whole, begin, end))
        self.substituted += 1
        return True


class Replayer(Feature):
    name = SUBSTITUTE

    def __init__(self, reference_dir: str, recorder: Recorder):
        self.reference = ReferenceValues(reference_dir, recorder.coords)
        self.recorder = recorder
        self.layouts = recorder.layouts  # the recorder's: a substituted value has its key's recorded layout
        recorder.before_step.append(self.substitute_main_grads)
        for tap in recorder.routing_taps:  # the reference's tokens reach the experts (``routing``)
            tap.follow = self.reference

    def hooks(self, site: Site) -> bool:
        return not skips_per_microbatch(site, self.layouts.facts)

    def wants(self, call: Call, event: str) -> bool:
        return event in (INPUT_ARRIVES, GRAD_ARRIVES)

    def input_arrives(self, call: Call, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x  # token ids: nothing to substitute
        key = TensorKey(call.iteration, call.microbatch, call.name, keys.FORWARD, keys.INPUT)
        value = self.reference.shard(key, self.layouts.of(key, call.site, tuple(x.shape)), x)
        return x if value is None else _Substitute.apply(x, value)

    def grad_arrives(self, call: Call, grad: torch.Tensor) -> torch.Tensor:
        key = TensorKey(call.iteration, call.microbatch, call.name, keys.BACKWARD, keys.GRAD_OUTPUT)
        value = self.reference.shard(key, self.layouts.of(key, call.site, tuple(grad.shape)), grad)
        return grad if value is None else value

    def substitute_main_grads(self) -> None:
        """Before the optimizer steps: the reference's main grads, so the step (grad norm, clipping,
        update) is judged given the reference's inputs. The candidate's own main grads were recorded
        just before, and are judged as the grad reduction's output. Under the distributed optimizer
        only the range this rank owns is replaced: the only part its optimizer reads."""
        if not self.recorder.clock.in_iteration:
            return
        with torch.no_grad():
            for key, site, layout in self.recorder.main_grad_keys():
                mine = owned_piece(site.param.main_grad, layout, self.reference.coords)
                value = self.reference.shard(key, layout, mine)
                if value is not None:
                    mine.copy_(value)
