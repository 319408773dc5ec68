"""One hook dispatcher: which modules are hooked, the run's clock, and the order of the features.

Tracing features that act on module tensors — the perturbation run's noise, recording, the
localization replay's substitution — do not register hooks of their own. A :class:`Dispatcher`
registers one forward pre-hook and one forward hook on every hooked module (and one tensor hook
where a grad passes), and calls the features in one declared order, whatever order they were
added in:

    PERTURB → RECORD → SUBSTITUTE

Each feature sees the four events of a module in that order:

* **input arrives** (forward pre-hook): RECORD notes what arrived, SUBSTITUTE then replaces it
  by the reference's value;
* **output leaves** (forward hook): PERTURB adds round-off-sized noise (it plays another correct
  implementation of the module), RECORD notes the result;
* **grad arrives** at the output (backward): RECORD notes it, SUBSTITUTE replaces it;
* **grad leaves** through the input (the module's dgrad): PERTURB adds noise, RECORD notes it.

So what is recorded is what arrived at a module (before a substitution) and what the module
produced (after a perturbation).

A module that runs more than once per microbatch (with multi-token prediction, the word
embeddings embed each depth's shifted tokens and the output layer projects every depth's hidden
states) is one call per run: the dispatcher counts a module's calls within the microbatch and
``naming.call_name`` says what each is recorded under (``mtp.layers.0.output_layer``), so two
runs name the same computation alike whatever their layout. The model under test — FP8 emulation and injected bugs, which
exist with tracing off too — runs inside ``module.forward``, before every feature.

The dispatcher also keeps the clock every feature reads: the iteration, whether one is running,
and the global microbatch whose forward (and whose backward) runs now. Microbatches are counted by
a forward pre-hook on each model chunk: every schedule (no pipelining, 1F1B, interleaved) calls
each chunk once per microbatch, in megatron's data order. Pipeline schedules run a microbatch's
backward after later forwards, so a hook on each chunk's output grad marks which microbatch the
parameter grads that follow belong to.

Activation recomputation runs a module's forward twice: first without grad (its values), then
inside backward with grad (the graph its grads flow through). Both are one call of the same
microbatch (the second takes the microbatch whose backward runs): features that act on values
(a substitution, a perturbation) act on both alike, so the recomputed graph is the first run's;
the recorder records the values once and the grads once.

Neutrality: a feature that only observes copies tensors. To see the grad w.r.t. a module's own
input (not the sum over every consumer of that tensor) the input is passed to the module through
``view_as``, an identity in forward and backward. No hook issues a collective.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import layouts
from ..recipe.naming import call_name, calls_made_elsewhere, canonical_module_names, mtp_layers, mtp_repeated

PERTURB = "perturb"
RECORD = "record"
SUBSTITUTE = "substitute"
ORDER = (PERTURB, RECORD, SUBSTITUTE)


@dataclasses.dataclass
class Clock:
    """Where the run is: set by the training loop (iterations) and the chunk hooks (microbatches)."""

    iteration: int = 0
    in_iteration: bool = False
    dp_rank: int = 0
    dp_size: int = 1
    microbatch: int = -1  # global id of the microbatch whose forward runs now
    backward_microbatch: int = -1  # ... whose backward runs now

    def begin_microbatch(self, local_microbatch: int) -> None:
        """Megatron's data order: DP rank r's j-th microbatch is global microbatch j·dp + r.

        Without pipelining each microbatch's backward follows its forward, so parameter grads
        that arrive next belong to it (grad hooks of hooked modules also set it, from the id
        captured at forward time)."""
        self.microbatch = local_microbatch * self.dp_size + self.dp_rank
        self.backward_microbatch = self.microbatch


@dataclasses.dataclass(frozen=True)
class Call:
    """One forward of one hooked module: where, and which iteration and microbatch.

    ``recompute``: the forward runs again inside backward (activation recomputation: megatron's
    ``tensor_parallel.checkpoint`` ran it first without grad, and runs it again, now with grad, when
    the backward reaches it). Its values are the first run's; its grads exist only now."""

    site: layouts.Site
    iteration: int
    microbatch: int
    recompute: bool = False
    name: str = ""  # what this call is recorded under: ``naming.call_name`` (the module's name, most calls)

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.site.module_name)


class Feature:
    """A tracing feature. Every event method is optional: it returns the tensor to pass on
    (the same one to leave it alone). ``wants(call, event)`` says whether it acts on an event now."""

    name: str = ""

    def hooks(self, site: layouts.Site) -> bool:
        """Whether this feature acts on this module at all (decided once, at attach)."""
        return True

    def wants(self, call: Call, event: str) -> bool:
        return True

    def tracks_backward(self) -> bool:
        """Whether this feature needs to know whose backward runs now, in this iteration (the
        recorder, for parameter grads)."""
        return False

    def end_iteration(self, iteration: int) -> None:
        pass

    def close(self) -> None:
        pass


def recomputing() -> bool:
    """Whether the forward running now is a recomputation inside the backward (activation
    recomputation: megatron's checkpoint runs it again, with grad, when the backward reaches it)."""
    return torch._C._current_autograd_node() is not None


INPUT_ARRIVES = "input_arrives"
OUTPUT_LEAVES = "output_leaves"
GRAD_ARRIVES = "grad_arrives"
GRAD_LEAVES = "grad_leaves"


def hooked_modules(chunks: Sequence[torch.nn.Module]) -> List[layouts.Site]:
    """Every module whose tensors the features see, under its canonical name."""
    recorded = layouts.recorded_module_types()
    return [layouts.Site(name, module) for chunk in chunks
            for module, name in canonical_module_names(chunk).items() if isinstance(module, recorded)]


class Dispatcher:
    def __init__(self, chunks: Sequence[torch.nn.Module], clock: Clock):
        self.chunks = list(chunks)
        self.clock = clock
        self.features: Dict[str, Feature] = {}
        self._handles: List = []
        self._local_microbatch = [0] * len(self.chunks)
        self._mtp_layers = mtp_layers(self.chunks)
        self._mtp_repeated = mtp_repeated(self.chunks)
        self._elsewhere = calls_made_elsewhere(self.chunks)
        # calls so far of (module, microbatch, recompute) in this iteration, and the calls whose
        # forward runs now (the pre-hook names a call, the forward hook of the same module takes it)
        self._calls: Dict[Tuple[int, int, bool], int] = {}
        self._open: Dict[int, List[Call]] = {}

    def add(self, feature: Feature) -> Feature:
        if feature.name not in ORDER:
            raise ValueError(f"unknown feature {feature.name!r}; the order is {ORDER}")
        if feature.name in self.features:
            raise ValueError(f"feature {feature.name!r} added twice")
        self.features[feature.name] = feature
        if hasattr(feature, "open_call_name"):  # the recorder's taps key their tensors by the call
            feature.open_call_name = self.open_call_name
        return feature

    def open_call_name(self, module: torch.nn.Module) -> Optional[str]:
        """The name the call of ``module`` whose forward runs now is recorded under (None: none runs)."""
        open_calls = self._open.get(id(module))
        return open_calls[-1].name if open_calls else None

    def _ordered(self) -> List[Feature]:
        return [self.features[n] for n in ORDER if n in self.features]

    # ---- the training loop
    def begin_iteration(self, iteration: int) -> None:
        self.clock.iteration = iteration
        self.clock.in_iteration = True
        self._local_microbatch = [0] * len(self.chunks)
        self._calls.clear()
        self._open.clear()

    def end_iteration(self, iteration: int) -> None:
        self.clock.in_iteration = False
        for f in self._ordered():
            f.end_iteration(iteration)

    # ---- hooks
    def attach(self) -> "Dispatcher":
        features = self._ordered()
        for index, chunk in enumerate(self.chunks):
            self._handles.append(chunk.register_forward_pre_hook(self._count_microbatch(index)))
            self._handles.append(chunk.register_forward_hook(self._mark_backward_microbatch))
        for site in hooked_modules(self.chunks):
            acting = [f for f in features if f.hooks(site)]
            if acting:
                self._handles.append(site.module.register_forward_pre_hook(self._pre_hook(site, acting),
                                                                           with_kwargs=True))
                self._handles.append(site.module.register_forward_hook(self._post_hook(site, acting),
                                                                       with_kwargs=True))
        return self

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for f in self._ordered():
            f.close()

    def _count_microbatch(self, index: int):
        """Each chunk runs its microbatches in data order, under every schedule (with virtual
        pipelining too, per chunk)."""
        def hook(module, args):
            if self.clock.in_iteration:
                self.clock.begin_microbatch(self._local_microbatch[index])
                self._local_microbatch[index] += 1
        return hook

    def _mark_backward_microbatch(self, module, args, output):
        """The grad of a chunk's output is the first thing each microbatch's backward computes on
        this stage: it says which microbatch the parameter grads that follow belong to. Only on
        iterations some feature records (no hook on idle steps)."""
        out = output[0] if isinstance(output, (tuple, list)) else output
        if not (self.clock.in_iteration and isinstance(out, torch.Tensor) and out.requires_grad):
            return None
        if any(f.tracks_backward() for f in self._ordered()):
            mb = self.clock.microbatch

            def hook(grad):
                self.clock.backward_microbatch = mb

            out.register_hook(hook)
        return None

    def _grad_chain(self, call: Call, features: List[Feature], event: str) -> Optional[Callable]:
        """A tensor hook that runs ``event`` through ``features`` in order, or None if none wants it."""
        wanting = [f for f in features if f.wants(call, event)]
        if not wanting:
            return None
        clock = self.clock

        def hook(grad):
            clock.backward_microbatch = call.microbatch
            for f in wanting:
                grad = getattr(f, event)(call, grad)
            return grad

        return hook

    def _call(self, site: layouts.Site) -> Call:
        """This forward of ``site``: inside backward it is a recomputation, of the microbatch whose
        backward runs (counted apart: a recomputation calls the modules again, in the same order)."""
        recompute = recomputing()
        microbatch = self.clock.backward_microbatch if recompute else self.clock.microbatch
        counted = (id(site.module), microbatch, recompute)
        occurrence = self._calls.get(counted, 0)
        self._calls[counted] = occurrence + 1
        return Call(site, self.clock.iteration, microbatch, recompute,
                    call_name(site.module_name, occurrence + self._elsewhere.get(site.module, 0), self._mtp_layers,
                              self._mtp_repeated))

    def _open_call(self, site: layouts.Site) -> Call:
        call = self._call(site)
        self._open.setdefault(id(site.module), []).append(call)
        return call

    def _close_call(self, site: layouts.Site) -> Call:
        open_calls = self._open.get(id(site.module))
        return open_calls.pop() if open_calls else self._call(site)

    def _pre_hook(self, site: layouts.Site, features: List[Feature]):
        def hook(module, args, kwargs):
            if not self.clock.in_iteration:
                return None
            call = self._open_call(site)
            if not args or not isinstance(args[0], torch.Tensor):
                return None
            x = args[0]
            if x.requires_grad and torch.is_grad_enabled():  # not the first, grad-less run of a recomputation
                leaves = self._grad_chain(call, features, GRAD_LEAVES)
                if leaves is not None:
                    x = x.view_as(x)  # this module's own input: its grad is the module's dgrad alone
                    x.register_hook(leaves)
            for f in features:
                if f.wants(call, INPUT_ARRIVES):
                    x = f.input_arrives(call, x)
            if x is args[0]:
                return None
            return (x,) + tuple(args[1:]), kwargs
        return hook

    def _post_hook(self, site: layouts.Site, features: List[Feature]):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            if not self.clock.in_iteration:
                return None
            call = self._close_call(site)
            if not isinstance(out, torch.Tensor):
                return None
            first = out
            for f in features:
                if f.wants(call, OUTPUT_LEAVES):
                    out = f.output_leaves(call, out)
            if out.requires_grad:
                arrives = self._grad_chain(call, features, GRAD_ARRIVES)
                if arrives is not None:
                    out.register_hook(arrives)
            if out is first:
                return None
            return (out,) + tuple(output[1:]) if isinstance(output, tuple) else out
        return hook
