"""Recording: module tensors, the loss, grad finalization and the optimizer.

What is recorded, each with its placement (:class:`.layouts.KeyLayouts`) under its key
(:mod:`ttrace_megatron.keys`):

* forward: the first input and output of every hooked module (ColumnParallelLinear,
  RowParallelLinear, VocabParallelEmbedding — the output layer included —, MoE routers and MoE
  layers), and the per-token loss (the GPTModel's output when it is given labels);
* backward: the grads w.r.t. those inputs and outputs, and each parameter's grad per microbatch;
* main_grad: ``param.main_grad`` when ``optimizer.step()`` starts (``finalize_model_grads`` has
  reduced them by then, whoever set ``config.finalize_model_grads_func``);
* optimizer: the grad norm, the clip coefficient and the updated parameters after ``optimizer.step()``,
  each parameter's optimizer state (Adam's moments, SGD's momentum, the fp32 main copy of a bf16
  parameter) and what the step applied to it (lr, weight decay, Adam's step count);
* MoE routers: their aux losses (load balancing, z-loss) per microbatch (``_AuxLossTap``);
* FP8 (emulated) GEMMs: each operand's amax (``_FP8AmaxTap``).

Module tensors come through the :class:`~.hooks.Dispatcher` (the RECORD feature); parameter
grads, the loss and the optimizer through hooks of the recorder's own. Tensors go to *sinks*: a
:class:`~ttrace_megatron.trace_store.TraceWriter` (offline compare) and/or an
:class:`~ttrace_megatron.online.OnlineComparer` (verdicts only). Nothing is recorded outside
``begin_iteration`` … ``end_iteration``, so evaluation passes between steps are ignored.

Neutrality: the recorder copies tensors and never writes to the run's tensors. One collective is
added, never on some ranks only: inside megatron's own grad-norm computation (a collective over
the same groups, on every rank that runs it), the fp64 twin of the norm is all-reduced over those
groups too (``_GradNormTwin``), in every iteration the filter selects, whatever this rank records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
from typing import Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch

from ... import keys
from ...keys import TensorKey
from ...placement import Coords, Layout, owned_piece
from ..recipe import compat
from ..recipe.config import loss_scale_multiplier
from . import layouts
from .hooks import INPUT_ARRIVES, OUTPUT_LEAVES, RECORD, Call, Clock, Feature, recomputing
from .layouts import Site
from ..recipe.naming import all_parameters, canonical_module_names, mtp_layers, mtp_loss_name, unwrap
from .optimizer_state import expected_states, grad_scaler, group_settings, loss_scale, main_params, step_count


# elements of a grad squared in fp64 at once, for the grad norm's fp64 twin: on a GPU 32 MiB a piece
# (few launches); on a host 2 MiB, which the copy writes and the norm reads again while in cache.
# 4M-element pieces took 5-7× as long (16M fp32 elements: 24-34 ms against 4.7-5.8 ms, the Zen 5 VM):
# at the 50M rung a TP2 candidate rank's twins took 0.10-0.11 s of its three steps, now 0.04-0.05
NORM_PIECE = 1 << 22
NORM_PIECE_HOST = 1 << 18


@dataclasses.dataclass
class RecordFilter:
    """Selective recording. ``None`` means everything."""

    iterations: Optional[Sequence[int]] = None
    modules: Sequence[str] = ("*",)  # fnmatch patterns of canonical module names
    microbatches: Optional[Sequence[int]] = None  # global microbatch ids
    ranks: Optional[Sequence[int]] = None

    def wants_module(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.modules)


def skips_per_microbatch(site: Site, facts: layouts.ModelFacts) -> bool:
    """Experts whose tokens mix several DP ranks' microbatches have no per-microbatch counterpart
    in the reference: only their main grads and parameters are recorded (and substituted)."""
    return facts.experts_mix_microbatches and layouts.is_expert(site.module)


class Recorder(Feature):
    name = RECORD

    def __init__(self, sinks: Sequence, chunks: List[torch.nn.Module], key_layouts: layouts.KeyLayouts,
                 clock: Clock, rank: int, coords: Coords, record_filter: RecordFilter = RecordFilter()):
        self.sinks = list(sinks)
        self.chunks = chunks
        self.layouts = key_layouts
        self.facts = key_layouts.facts
        self.clock = clock
        self.rank = rank
        self.coords = coords
        self.filter = record_filter
        self._handles = []
        self.before_step: List = []  # called after main grads are recorded, before the optimizer steps
        self.router: Optional[Tuple[str, torch.nn.Module]] = None  # the router whose forward runs now
        # module -> the name its call running now is recorded under (hooks.Dispatcher.open_call_name,
        # set when the dispatcher takes this recorder; None: no call of it runs now)
        self.open_call_name: Callable[[torch.nn.Module], Optional[str]] = lambda module: None
        self._params: List[Tuple[str, str, torch.nn.Module, torch.nn.Parameter]] = list(all_parameters(chunks))
        self.after_step: List = []  # called after the step is recorded (lock-step)
        self.main_params = {}  # model param -> optimizer_state.MainParam, set by wrap_optimizer
        self.routing_taps = []  # routing.RoutingTap per MoE router, set by attach
        self.optimizer = None
        # what the sinks' work runs in: the run sets it (on CPU, outside the CUDA-to-CPU rewrite)
        self.sink_context: Callable[[], ContextManager] = contextlib.nullcontext
        self._recorded: set = set()  # keys recorded in this iteration (tap_key)
        self._said_unattributed = False
        self._compute_dtype = next((p.dtype for *_, p in self._params if p.is_floating_point()), torch.float32)

    # ---- selection
    @property
    def recording(self) -> bool:
        f = self.filter
        return (self.clock.in_iteration and any(s.active for s in self.sinks)
                and (f.iterations is None or self.clock.iteration in f.iterations)
                and (f.ranks is None or self.rank in f.ranks))

    def _wants(self, module_name: str, microbatch: int) -> bool:
        f = self.filter
        return (self.recording and f.wants_module(module_name)
                and (microbatch < 0 or f.microbatches is None or microbatch in f.microbatches))

    # ---- the dispatcher's feature
    def hooks(self, site: Site) -> bool:
        return not skips_per_microbatch(site, self.facts)

    def wants(self, call: Call, event: str) -> bool:
        if event == INPUT_ARRIVES and layouts.is_router(call.site.module):
            return True  # the recorder notes which router runs, recorded or not (_AuxLossTap)
        if call.recompute and event == INPUT_ARRIVES:
            return False  # a recomputed forward: its input was recorded when it first ran
        # a recomputed forward's output is recorded again (keys.RECOMPUTED_OUTPUT) and judged against
        # the reference's output: a recomputation that computes something else is named as such
        return self._wants(call.name, call.microbatch)

    def tracks_backward(self) -> bool:
        return self.recording

    def input_arrives(self, call: Call, x: torch.Tensor) -> torch.Tensor:
        site = call.site
        if layouts.is_router(site.module):
            self.router = None
            if not self._wants(call.name, call.microbatch):
                return x
            self.router = (site.module_name, site.module)
            if call.recompute:
                return x  # its input was recorded when it first ran; what only a recomputation computes is not
        self._add(TensorKey(call.iteration, call.microbatch, call.name, keys.FORWARD, keys.INPUT), x, site)
        return x

    def output_leaves(self, call: Call, out: torch.Tensor) -> torch.Tensor:
        tensor = keys.RECOMPUTED_OUTPUT if call.recompute else keys.OUTPUT
        self._add(TensorKey(call.iteration, call.microbatch, call.name, keys.FORWARD, tensor), out, call.site)
        return out

    def grad_arrives(self, call: Call, grad: torch.Tensor) -> torch.Tensor:
        self._add(TensorKey(call.iteration, call.microbatch, call.name, keys.BACKWARD, keys.GRAD_OUTPUT),
                  grad, call.site)
        return grad

    def grad_leaves(self, call: Call, grad: torch.Tensor) -> torch.Tensor:
        self._add(TensorKey(call.iteration, call.microbatch, call.name, keys.BACKWARD, keys.GRAD_INPUT),
                  grad, call.site)
        return grad

    def end_iteration(self, iteration: int) -> None:
        self._recorded.clear()
        for sink in self.sinks:
            sink.flush(iteration)

    def tap_key(self, module_name: str, tensor: str,
                module: Optional[torch.nn.Module] = None) -> Tuple[TensorKey, bool, bool]:
        """(the key a tap's tensor of this forward goes under, whether to record it, whether the
        forward is a recomputation). A recomputed forward's is the microbatch whose backward runs,
        and it records only what its first, grad-less run did not (megatron's routers compute their
        aux losses and balancing top-k only with grad enabled: under full recomputation, only there).
        Inside a call of ``module`` the key is that call's name (``naming.call_name``: a module run
        more than once a microbatch, as under ``mlp_chunks_for_training`` or a repeated MTP layer)."""
        if module is not None:
            module_name = self.open_call_name(module) or module_name
        recompute = recomputing()
        mb = self.clock.backward_microbatch if recompute else self.clock.microbatch
        key = TensorKey(self.clock.iteration, mb, module_name, keys.FORWARD, tensor)
        return key, self._wants(module_name, mb) and not (recompute and key in self._recorded), recompute

    def close(self) -> None:
        """Remove the hooks and finish the sinks; a run that stops inside an iteration (an
        exception, then the atexit flush) leaves its trace marked incomplete, not complete."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for sink in self.sinks:
            if self.clock.in_iteration:
                sink.abandon(f"the run stopped during iteration {self.clock.iteration}")
            else:
                sink.close()

    # ---- the recorder's own hooks: parameter grads, the loss, routers' aux losses, FP8 amaxes
    def attach(self) -> "Recorder":
        for chunk in self.chunks:
            self._handles.append(unwrap(chunk).register_forward_hook(self._loss_hook, with_kwargs=True))
            if mtp_layers([chunk]) and getattr(unwrap(chunk), "post_process", False):
                self._handles.append(_MTPLossTap(self, unwrap(chunk)))
            for module, name in canonical_module_names(chunk).items():
                if hasattr(module, "_ttrace_fp8"):
                    self._handles.append(_FP8AmaxTap(self, Site(name, module)))
        for mname, pname, module, param in self._params:
            site = Site(mname, module, pname, param)
            if param.requires_grad and self.hooks(site):
                self._handles.append(param.register_hook(self._param_grad_hook(site)))
        if any(layouts.is_router(m) for chunk in self.chunks for m in chunk.modules()):
            self._handles.append(_AuxLossTap(self))
            from .routing import attach_routing_taps

            self.routing_taps = attach_routing_taps(self, self.chunks)
            self._handles.extend(self.routing_taps)
        return self

    def _add(self, key: TensorKey, tensor: torch.Tensor, site: Site, *, arrival: bool = False,
             statistic_of: str = "", layout: Optional[Layout] = None, roundoff: float = 0.0):
        depth = layouts.layer_depth(key.module, self.facts.num_layers)
        kind = keys.operand_kind(statistic_of) if statistic_of else key.kind
        reduction = layouts.reduction_length(key.module, site.module, kind, self.facts)
        layout = layout or self.layouts.of(key, site, tuple(tensor.shape))
        self._recorded.add(key)
        with self.sink_context():  # the sinks' own work names no device
            for sink in self.sinks:
                sink.add(key, tensor, layout, depth=depth, compute_dtype=self._compute_dtype, reduction=reduction,
                         arrival=arrival, statistic_of=statistic_of, roundoff=roundoff)

    def _loss_hook(self, module, args, kwargs, output):
        """GPTModel returns the per-token loss [b, s] when it is given labels (on the last stage)."""
        if (kwargs.get("labels") is not None and isinstance(output, torch.Tensor)
                and getattr(module, "post_process", True)):
            self.record_loss(output)
            if isinstance(kwargs.get("loss_mask"), torch.Tensor):
                self.record_loss(kwargs["loss_mask"], tensor=keys.LOSS_MASK)
            if isinstance(kwargs.get("padding_mask"), torch.Tensor):  # as handed in: [b, s]
                self.record_loss(kwargs["padding_mask"].float(), tensor=keys.PADDING_MASK)

    def _param_grad_hook(self, site: Site):
        def hook(grad):
            mb = self.clock.backward_microbatch
            if self._wants(site.module_name, mb):
                key = TensorKey(self.clock.iteration, mb, site.module_name, keys.BACKWARD,
                                keys.param_grad(site.param_name))
                self._add(key, grad, site, arrival=layouts.grad_computed_outside(site.module, site.param_name))
            return None
        return hook

    # ---- loss, grad finalization, optimizer
    def record_loss(self, per_token_loss: torch.Tensor, module: str = keys.LOSS_MODULE,
                    tensor: str = keys.PER_TOKEN_LOSS) -> None:
        """The per-token loss of the decoder (``loss``) or of a multi-token prediction depth
        (``mtp.layers.0.loss``), before the loss mask: [b, s], whole on every TP rank. Or
        (``tensor`` LOSS_MASK) the loss mask the model was handed, [b, s]: which tokens count."""
        mb = self.clock.microbatch
        if self._wants(module, mb):
            self._add(TensorKey(self.clock.iteration, mb, module, keys.FORWARD, tensor),
                      per_token_loss, Site(keys.LOSS_MODULE))

    def main_grad_keys(self):
        """(key, site, layout) of every main grad this rank holds now."""
        for mname, pname, module, param in self._params:
            if getattr(param, "main_grad", None) is None or not param.requires_grad:
                continue
            key = TensorKey(self.clock.iteration, -1, mname, keys.MAIN_GRAD, keys.main_grad(pname))
            site = Site(mname, module, pname, param)
            yield key, site, self.layouts.of(key, site, tuple(param.shape))

    def record_main_grads(self) -> None:
        """The reduced grads. Under the distributed optimizer only this rank's range of each is
        reduced (the rest of the buffer holds unreduced local grads), so only that range is
        recorded: the layout's owned range, cut through the placement module."""
        if not self.recording:
            return  # an idle iteration computes no layout
        for key, site, layout in self.main_grad_keys():
            if self._wants(site.module_name, -1):
                self._add(key, owned_piece(site.param.main_grad, layout, self.coords), site, layout=layout)

    def record_optimizer_step(self, grad_norm: Optional[float], clip_coefficient: Optional[float] = None,
                              norms: Optional["_GradNormTwin"] = None, decisions: Optional[dict] = None) -> None:
        """The step's scalars — grad norm and the clip coefficient it applied — and the updated
        parameters. The scalars are the same on every rank of a stage (reduced over the
        model-parallel group), so replicas.

        With ``norms`` (the step's grad-norm calls and their fp64 twins, :class:`_GradNormTwin`),
        the grad norm carries its own round-off as measured against the twin (``Record.roundoff``),
        and the twin itself is recorded (``grad_norm_fp64``): the norm of the same grads over the same
        groups, without the round-off of megatron's fp32 kernel.

        ``decisions``: under fp16, the scale the step's grads were computed at and whether the
        step was skipped (a grad not finite): both exact, so a candidate that overflows where the
        reference does not is a mismatch at the step that skipped.

        The number of zeros in the grads (``--log-num-zeros-in-grad``) is not recorded: it is a
        count, not a rounded value, and two correct runs differ in it (measured: by 1 to 3 of
        ~6000 between the reference and TP2×DP2, and between the reference and its perturbation
        run, as sums cancel to exactly 0 in one order and not the other). The grads it counts are
        compared element by element as main grads."""
        if not self.recording:
            return
        it = self.clock.iteration
        if norms is not None and any(axes for _, axes, _ in norms.call_terms):
            self.record_grad_norm_terms(norms, grad_norm)
        if self._wants(keys.OPTIMIZER_MODULE, -1):
            twin, roundoff = norms.explain(grad_norm) if norms is not None and grad_norm is not None else (None, 0.0)
            scalars = [(keys.GRAD_NORM, grad_norm), (keys.GRAD_NORM_FP64, twin),
                       (keys.CLIP_COEFFICIENT, clip_coefficient), (keys.STEP_COUNT, step_count(self.main_params))]
            scalars += sorted((decisions or {}).items())
            for group, settings in sorted(group_settings(self.optimizer).items()):
                scalars += [(keys.step_setting(group, name), value) for name, value in settings.items()]
            for name, value in scalars:
                if value is not None:
                    self._add(TensorKey(it, -1, keys.OPTIMIZER_MODULE, keys.OPTIMIZER, name),
                              torch.tensor([float(value)], dtype=torch.float64), Site(keys.OPTIMIZER_MODULE),
                              roundoff=roundoff if name == keys.GRAD_NORM else 0.0)
        # an fp16 run that skipped every step so far has no moments yet (nor had the reference, or its
        # step_skipped differs): the parameters and their main copies, unchanged
        stateless = bool((decisions or {}).get(keys.STEP_SKIPPED)) and step_count(self.main_params) is None
        for mname, pname, module, param in self._params:
            if param.requires_grad and self._wants(mname, -1):
                site = Site(mname, module, pname, param)
                key = TensorKey(it, -1, mname, keys.OPTIMIZER, keys.updated_param(pname))
                layout = self.layouts.of(key, site, tuple(param.shape))  # an owned range under overlap_param_gather
                self._add(key, owned_piece(param.detach(), layout, self.coords), site, layout=layout)
                main = self.main_params.get(param)
                states = main.states() if main is not None else {}
                for name in expected_states(self.optimizer.config, param):
                    value = states.get(name)
                    if stateless and name != keys.MAIN_PARAM:
                        continue
                    if value is None:
                        if param not in self.layouts.owned_ranges:
                            raise RuntimeError(f"the optimizer holds no {name} for {mname}.{pname}")
                        value = param.new_empty((0,), dtype=torch.float32)  # this rank owns none of it
                    self._add(TensorKey(it, -1, mname, keys.OPTIMIZER, keys.optimizer_state(pname, name)), value, site)

    def _norm_grads(self) -> Dict[Tuple[int, int, torch.dtype], Tuple[torch.nn.Parameter, bool]]:
        """{identity of the grad megatron takes the norm of: (model parameter, whether an expert's)}.
        The norm is of each main copy's ``.grad`` (the main grad itself under FP32Optimizer, its fp32
        copy under the fp16/bf16 optimizers, the owned range's under the distributed optimizer)."""
        owners = {}
        for _, _, module, param in self._params:
            main = self.main_params.get(param)
            grads = [] if main is None else [main.main.grad, getattr(main.main, "decoupled_grad", None)]
            for g in grads:
                if isinstance(g, torch.Tensor) and g.numel():
                    owners[_identity(g)] = (param, layouts.is_expert(module))
        return owners

    def record_grad_norm_terms(self, norms: "_GradNormTwin", grad_norm: Optional[float]) -> None:
        """Each parameter's term of the step's grad norm (``keys.grad_norm_term``): the squares of its
        main grad this rank counted, 0 where it holds the parameter and did not count it. Merged over
        the ranks (:func:`layouts.grad_norm_term_layout`) a term is the parameter's ‖g‖² as the norm
        saw it, judged against the reference's ‖g‖² by the main grad's own measured error: a norm that
        counts a parameter twice or misses a piece of it fails there, by the same fraction of the
        term at any model size (the whole norm dilutes such an error by the size of the model).
        Grads in a norm that are no parameter's main grad are not attributed: the run says so once,
        with how many elements, and the fp64 twin of the whole norm still judges them."""
        terms, axes_of = norms.terms_of(grad_norm)
        if norms.unattributed and not self._said_unattributed:
            self._said_unattributed = True  # once a run: the optimizer's layout does not change
            print(f"[ttrace] rank {self.rank}: {norms.unattributed} elements of megatron's grad norm are no "
                  f"parameter's main grad: they are in no parameter's term of the norm (grad_norm_sq); the whole "
                  f"norm's fp64 twin still judges them", flush=True)
        for key, site, main_layout in self.main_grad_keys():
            if not self._wants(site.module_name, -1):
                continue
            term_key = TensorKey(key.iteration, -1, key.module, keys.OPTIMIZER, keys.grad_norm_term(site.param_name))
            axes = axes_of(site.param, layouts.is_expert(site.module))
            value = torch.tensor([terms.get(site.param, 0.0)], dtype=torch.float64)
            self._add(term_key, value, site, layout=layouts.grad_norm_term_layout(main_layout, axes))

    def wrap_optimizer(self, optimizer) -> None:
        """Record main grads as ``optimizer.step()`` starts, grad norm and parameters after it.

        The wrapper is an instance attribute, so megatron's ``train_step`` (which calls
        ``optimizer.step()``) goes through it; :meth:`unwrap_optimizer` restores the method.
        """
        original = optimizer.step
        self.optimizer = optimizer
        self.main_params = main_params(optimizer)
        self.layouts.loss_scale = loss_scale(optimizer)

        def step(*args, **kwargs):
            self.record_main_grads()
            for callback in self.before_step:
                callback()
            twin = self.filter.iterations is None or self.clock.iteration in self.filter.iterations
            # the scale as a one-rank run of the same batch has it
            scaled = self.layouts.loss_scale * loss_scale_multiplier(self.layouts.dp_size, self.facts.per_token_loss)
            with _observe_clipping() as clipping, _observe_grad_norm(twin, self._norm_grads) as norms:
                result = original(*args, **kwargs)
            result_tuple = result if isinstance(result, tuple) else ()
            grad_norm = result_tuple[1] if len(result_tuple) >= 2 else None
            decisions = {}
            if grad_scaler(optimizer) is not None:  # fp16: the scale the grads had, and whether the step was skipped
                decisions = {keys.LOSS_SCALE: scaled, keys.STEP_SKIPPED: 0.0 if result_tuple[0] else 1.0}
            self.layouts.loss_scale = loss_scale(optimizer)  # the next backward's
            self.record_optimizer_step(grad_norm, clipping.coefficient, norms, decisions)
            for callback in self.after_step:
                callback()
            return result

        step.ttrace_original = original
        optimizer.step = step

    @staticmethod
    def unwrap_optimizer(optimizer) -> None:
        original = getattr(optimizer.step, "ttrace_original", None)
        if original is not None:
            optimizer.step = original


def _identity(t: torch.Tensor) -> Tuple[int, int, torch.dtype]:
    """A grad tensor's identity across the views megatron hands around: where its data lies."""
    return t.data_ptr(), t.numel(), t.dtype


class _ClipObserver:
    coefficient: Optional[float] = None


@contextlib.contextmanager
def _observe_clipping():
    """While the optimizer steps, note the clip coefficient megatron applies (``max_norm /
    (total_norm + 1e-6)``, capped at 1, as ``clip_grad_by_total_norm_fp32`` computes it) from the
    arguments of its own calls. The original function runs unchanged. Without clipping the
    coefficient stays None and is not recorded."""
    from megatron.core.optimizer import optimizer as optimizer_module

    observer = _ClipObserver()
    original = optimizer_module.clip_grad_by_total_norm_fp32

    def observed(parameters, max_norm, total_norm, *args, **kwargs):
        if observer.coefficient is None:  # a ChainedOptimizer clips each part with the same total norm
            observer.coefficient = min(1.0, float(max_norm) / (float(total_norm) + 1.0e-6))
        return original(parameters, max_norm, total_norm, *args, **kwargs)

    optimizer_module.clip_grad_by_total_norm_fp32 = observed
    try:
        yield observer
    finally:
        optimizer_module.clip_grad_by_total_norm_fp32 = original


class _GradNormTwin:
    """The grad-norm calls of one optimizer step, each with its fp64 twin.

    megatron computes the grad norm in fp32: per tensor on each rank (apex's or TE's
    ``multi_tensor_l2norm`` on a GPU; ``torch.norm`` per tensor in megatron's CPU fallback,
    ``local_multi_tensor_l2_norm``), then a sum of squares over the grad-stats group(s). How far
    that lands from the exact norm depends on the kernel by orders of magnitude: torch's CPU norm
    adds tens of millions of squares one after another, and once the terms fall below half an ulp
    of the running sum they are rounded away (measured: 3e-3 relative on a 25M-element embedding
    grad). No bound on the kernel is both sound on every platform and sharp on any; the error
    itself is cheap to measure. Each call is therefore computed a second time in fp64, from the
    same grads, reduced over the same groups (the only collective ttrace adds: on the ranks of
    megatron's own, right after it), and the difference is the call's own round-off.
    """

    def __init__(self, attribute=None):
        self.calls: List[Tuple[float, float]] = []  # (megatron's result, the fp64 twin)
        self.attribute = attribute
        # per call (aligned with ``calls``): each model parameter's squares this rank counted (fp64),
        # the axes the call reduced over, whether it counted experts' grads
        self.call_terms: List[Tuple[Dict[torch.nn.Parameter, float], Tuple[str, ...], bool]] = []
        self.unattributed = 0  # grads in a norm that are no model parameter's main grad (elements)

    def observe(self, grads_for_norm, norm_type, grad_stats_parallel_group, result) -> None:
        from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

        grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
        value = float(result)
        if float(norm_type) != 2.0:  # a max is exact; other p-norms are not twinned
            self.calls.append((value, value))
            self.call_terms.append(({}, (), False))
            return
        dp_group = None
        for g in grads:
            dp_group = get_data_parallel_group_if_dtensor(g, dp_group)
        device = grads[0].device if grads else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        owners = self.attribute() if self.attribute is not None else {}
        axes = layouts.counted_axes(grad_stats_parallel_group) if owners else ()
        squares = torch.zeros(len(grads) + 1, dtype=torch.float64, device=device)  # per grad; the last: 0
        # fp64 in pieces, each copied into one buffer for the call: never a whole fp64 copy, and not a
        # fresh 32 MiB allocation a piece (on a host, each was fresh pages: 0.78 s of a 50M-parameter
        # reference's three iterations); the same values, so the same norms, as a copy a piece
        most = max((to_local_if_dtensor(g).numel() for g in grads), default=0)
        step = NORM_PIECE_HOST if device.type == "cpu" else NORM_PIECE
        wide = torch.empty(min(step, most), dtype=torch.float64, device=device)
        for i, g in enumerate(grads):
            local = to_local_if_dtensor(g).detach().reshape(-1)
            for start in range(0, local.numel(), step):
                piece = local[start:start + step]
                squares[i] += torch.linalg.vector_norm(wide[:piece.numel()].copy_(piece)) ** 2
        total = squares.sum().reshape(1)
        experts = False
        terms: Dict[torch.nn.Parameter, float] = {}
        # one copy to the host for the whole call, not one per grad (each would sync a GPU)
        for g, square in zip(grads, squares.tolist() if owners else ()):
            owner = owners.get(_identity(g))
            if owner is None:
                self.unattributed += g.numel()
                continue
            param, expert = owner
            terms[param] = terms.get(param, 0.0) + square
            experts = experts or expert
        self.call_terms.append((terms, axes, experts))
        if dp_group:
            torch.distributed.all_reduce(total, group=dp_group)
        torch.distributed.all_reduce(total, group=grad_stats_parallel_group)
        self.calls.append((value, float(total.item()) ** 0.5))

    def terms_of(self, grad_norm: Optional[float]):
        """The step's terms: (parameter -> the squares this rank counted, parameter -> the axes its
        call reduced over, a function giving an uncounted parameter's axes). Only the calls that
        make up the step's norm (:meth:`norm_calls`; every call where none reproduces it) count: a
        step that also takes other norms (a part of a ChainedOptimizer clipping by its own) is
        judged on its norm and clip coefficient, not counted twice here."""
        chosen = self.norm_calls(grad_norm) if grad_norm is not None else None
        calls = [self.call_terms[i] for i in (chosen if chosen is not None else range(len(self.call_terms)))]
        calls = [c for c in calls if c[0] or c[1]]  # twinned calls
        terms: Dict[torch.nn.Parameter, float] = {}
        counted_over: Dict[torch.nn.Parameter, Tuple[str, ...]] = {}
        for call, axes, _ in calls:
            for param, value in call.items():
                terms[param] = terms.get(param, 0.0) + value
                counted_over[param] = axes

        def axes_of(param: torch.nn.Parameter, expert: bool) -> Tuple[str, ...]:
            """Those of the call that counted ``param``, or, where this rank did not count it (a TP
            replica, the last stage's tied embedding), those of this rank's call of the same kind
            (dense or expert): every rank makes the same calls, so every rank derives the same layout."""
            if param in counted_over:
                return counted_over[param]
            alike = [a for _, a, e in calls if e == expert] or [a for _, a, _ in calls]
            return alike[0] if alike else ()

        return terms, axes_of

    def norm_calls(self, grad_norm: float) -> Optional[List[int]]:
        """The calls whose combination is the step's norm: one call's result, or ``√Σ`` over the
        first n calls (a ChainedOptimizer whose parts reduce over different groups), the first that
        reproduces it bitwise; None where none does."""
        norm = float(grad_norm)
        for n in range(1, len(self.calls) + 1):
            values = [v for v, _ in self.calls[:n]]
            if values[-1] == norm:
                return [n - 1]
            if math.sqrt(sum(x ** 2 for x in values)) == norm:
                return list(range(n))
        return None

    def explain(self, grad_norm: float) -> Tuple[Optional[float], float]:
        """(the fp64 twin of ``grad_norm``, a bound on its own round-off).

        The step's norm is one call's result, or ``√Σ`` over the calls of a ChainedOptimizer whose
        parts reduce over different groups; the first prefix of the calls that reproduces it
        bitwise says which, and the twin is the same combination of the twins. The round-off bound
        is Σ|result − twin| over every call: both combinations change by at most that much when
        their arguments do (each is 1-Lipschitz in every argument). Where no combination
        reproduces the norm (a step that combines its calls otherwise), there is no twin, and the
        bound still holds."""
        roundoff = sum(abs(value - exact) for value, exact in self.calls)
        chosen = self.norm_calls(grad_norm)
        if chosen is None:
            return None, roundoff
        return math.sqrt(sum(self.calls[i][1] ** 2 for i in chosen)), roundoff


@contextlib.contextmanager
def _observe_grad_norm(active: bool = True, attribute=None):
    """While the optimizer steps, twin each of megatron's grad-norm calls in fp64 (:class:`_GradNormTwin`).
    The original function runs first and unchanged; ``active`` must be the same on every rank.
    ``attribute``: () -> {grad tensor's identity: model parameter} (:meth:`Recorder._norm_grads`)."""
    from megatron.core.optimizer import optimizer as optimizer_module

    twin = _GradNormTwin(attribute)
    original = optimizer_module.get_grad_norm_fp32
    if not active:
        yield None
        return

    def observed(grads_for_norm, norm_type=2, grad_stats_parallel_group=None, *args, **kwargs):
        result = original(grads_for_norm, norm_type, grad_stats_parallel_group, *args, **kwargs)
        twin.observe(grads_for_norm, norm_type, grad_stats_parallel_group, result)
        return result

    optimizer_module.get_grad_norm_fp32 = observed
    try:
        yield twin
    finally:
        optimizer_module.get_grad_norm_fp32 = original


class _AuxLossTap:
    """Records the MoE aux losses (load balancing, sequence and global load balancing, z-loss) of
    each router forward, per microbatch, as the value megatron attaches to the graph.

    The router hands each loss to megatron's logging divided by its coefficient; the tap
    (``compat.tap_router_loss_log``, while attached: ``remove`` takes it out) multiplies the
    coefficient back. The z-loss's coefficient is divided by the TP×CP size, as the router does, so
    every recorded value is a sum over this rank's tokens (:func:`layouts.router_loss_layout`).
    megatron's own logging always runs, unchanged.
    """

    def __init__(self, recorder: "Recorder"):
        self.recorder = recorder
        self.remove = compat.tap_router_loss_log(self._logged)

    def _logged(self, name, loss) -> None:
        rec = self.recorder
        if rec.router is None or not isinstance(loss, torch.Tensor):
            return
        mname, router = rec.router
        key, record, _ = rec.tap_key(mname, name, router)
        if not record:
            return
        if name == "z_loss":
            coeff = router.config.moe_z_loss_coeff / router.tp_cp_group.size()
        elif name in ("load_balancing_loss", "seq_load_balancing_loss"):
            coeff = router.get_aux_loss_coeff(name.replace("load_balancing_loss", "aux_loss"))
        else:
            return  # global_load_balancing_loss averages token counts over DP and microbatches: no per-microbatch twin
        value = (loss.detach().to(torch.float64) * coeff).reshape(1)
        rec._add(key, value, Site(mname, router))


class _MTPLossTap:
    """Records the per-token loss of each multi-token prediction depth.

    megatron-core's ``GPTModel._postprocess`` computes them with ``compute_language_model_loss``,
    depth by depth, before the decoder's own loss (which the model returns, ``_loss_hook``); it
    adds them to the backward through ``MTPLossAutoScaler``, where no hook sees them. The tap is
    the model's own method, called through: it returns megatron's tensor untouched.
    """

    def __init__(self, recorder: "Recorder", model: torch.nn.Module):
        self.recorder = recorder
        self.model = model
        self.depths = mtp_layers([model])
        self._calls = {}  # microbatch -> losses computed so far, in iteration self._iteration
        self._iteration = None
        original = model.compute_language_model_loss

        def tapped(labels, logits):
            loss = original(labels, logits)
            rec = recorder
            if rec.clock.in_iteration and isinstance(loss, torch.Tensor):
                if self._iteration != rec.clock.iteration:
                    self._iteration, self._calls = rec.clock.iteration, {}
                depth = self._calls.get(rec.clock.microbatch, 0)
                self._calls[rec.clock.microbatch] = depth + 1
                if depth < self.depths:
                    rec.record_loss(loss, mtp_loss_name(depth))
            return loss

        model.compute_language_model_loss = tapped

    def remove(self) -> None:
        self.model.__dict__.pop("compute_language_model_loss", None)


class _FP8AmaxTap:
    """Records the amax of each operand an emulated FP8 GEMM quantized (``fp8_emulation``): the
    input's and weight's in forward, the output-grad's in backward, per microbatch.

    The amax is that of the logical operand, so every TP rank must hold the same value: a replica
    over the module's TP axis. A rank that reduced it over the wrong group shows as replicas that
    differ, at the module and phase that quantized with it. Like every backward tensor, the
    output-grad's amax is dp times a DP=1 run's and is scaled like one. An amax is a statistic of
    its operand (``input``, ``weight``, ``grad_output``): it moves as far as that operand's
    largest element, so compare judges it with the operand's tolerance too.
    """

    def __init__(self, recorder: "Recorder", site: Site):
        self.recorder = recorder
        self.site = site
        self.emulated = site.module._ttrace_fp8
        self.emulated.observer = self

    def __call__(self, phase: str, operand: str, amax: torch.Tensor) -> None:
        rec = self.recorder
        mb = rec.clock.microbatch if phase == keys.FORWARD else rec.clock.backward_microbatch
        if not rec._wants(self.site.module_name, mb):
            return
        rec._add(TensorKey(rec.clock.iteration, mb, self.site.module_name, phase, keys.amax(operand)),
                 amax.detach().clone(), self.site, statistic_of=operand)

    def remove(self) -> None:
        if self.emulated.observer is self:
            self.emulated.observer = None
