"""Lock-step: every judged iteration of the candidate starts from the reference's state.

Two correct runs drift apart by round-off, and an optimizer can amplify the drift: Adam's update
is scale-free, so an element whose gradient is pure round-off moves by about ±lr whatever its
sign, and the next iteration's forward and backward then see weights that differ by 2·lr there.
Judged end to end, iteration 2 onwards would compare runs that no longer share their inputs.

In lock-step, once the candidate's step is recorded, its parameters and optimizer state — the
model parameters, the fp32 main copies, Adam's moments, SGD's momentum — are replaced by the
reference's after the same step, sliced to this rank through the layouts the recorder gives those
keys (owned ranges of the distributed optimizer included). Each iteration is then judged given
identical weights and state, and its step given identical prior state: the differences it shows
are that iteration's own. Recorded values are the candidate's own, before the replacement.

MoE routers follow the reference's top-k choice where theirs differs (``routing``): a near-tie
that round-off flips would otherwise send a token to another expert, and everything after it
would differ by far more than round-off. The candidate's own choice is recorded and judged
against its scores.

Like the localization replay, this changes the candidate's numerics on purpose; the observed
training is the run without it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ... import keys
from ...keys import TensorKey
from ...placement import owned_piece
from ...trace_store import TraceReader
from ..cpu import cuda_shim
from ..record.layouts import Site
from ..record.recorder import Recorder
from .replay import ReferenceValues


class LockStep:
    def __init__(self, reference_dir: str, recorder: Recorder, reader: Optional[TraceReader] = None, groups=None,
                 ensure: Optional[Callable[[int], None]] = None):
        # ``ensure``: a streamed reference's wait for an iteration (the online comparer's), before
        # its parameters and states are read
        self.reference = ReferenceValues(reference_dir, recorder.coords, reader, groups)
        self.ensure = ensure
        self.recorder = recorder
        self.layouts = recorder.layouts
        recorder.after_step.append(self.align)
        for tap in recorder.routing_taps:  # MoE routers take the reference's choice where theirs differs
            tap.follow = self.reference

    @torch.no_grad()
    def align(self) -> None:
        """After the step: the reference's parameters and optimizer state of this iteration."""
        clock = self.recorder.clock
        if not clock.in_iteration:
            return
        absent = self.reference.absent
        if self.ensure is not None:
            self.ensure(clock.iteration)
        with cuda_shim.suspended():  # reading and copying on the host: no device named
            self._put_step(clock)
        followed = sum(tap.followed_tokens for tap in self.recorder.routing_taps)
        if followed:
            print(f"[ttrace] rank {self.recorder.rank}: lock-step: MoE routers followed the reference's choice (the "
                  f"experts a token picks, the tokens an expert keeps at capacity) on {followed} token(s) of iteration "
                  f"{clock.iteration} where theirs differed (their own choice is recorded and judged against their "
                  f"scores)", flush=True)
            for tap in self.recorder.routing_taps:
                tap.followed_tokens = 0
        if self.reference.absent > absent:
            print(f"[ttrace] rank {self.recorder.rank}: lock-step: the reference recorded "
                  f"{self.reference.absent - absent} parameter or state tensor(s) of iteration {clock.iteration} "
                  f"not: those stay the candidate's own (record every iteration of the reference)", flush=True)

    def _put_step(self, clock) -> None:
        """The reference's parameters and optimizer states of this iteration, into this rank's."""
        for mname, pname, module, param in self.recorder._params:
            if not param.requires_grad:
                continue
            site = Site(mname, module, pname, param)
            key = TensorKey(clock.iteration, -1, mname, keys.OPTIMIZER, keys.updated_param(pname))
            # the parameter as the step left it: whole, or under overlap_param_gather this rank's owned
            # range, the rest left stale for the next forward's all-gather to bring (from the owners,
            # who took the reference's)
            layout = self.layouts.of(key, site, tuple(param.shape))
            self.reference.put(key, layout, owned_piece(param.data, layout, self.reference.coords))
            main = self.recorder.main_params.get(param)
            if main is None:
                continue
            for name, tensor in main.states().items():
                key = TensorKey(clock.iteration, -1, mname, keys.OPTIMIZER, keys.optimizer_state(pname, name))
                self.reference.put(key, self.layouts.of(key, site, tuple(tensor.shape)), tensor)
