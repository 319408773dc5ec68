"""Recording hooks on megatron-core modules, the loss, grad finalization and the optimizer.

What is recorded, each with its placement (see :mod:`.layouts`):

* forward: the first input and output of every ColumnParallelLinear, RowParallelLinear and
  VocabParallelEmbedding (the output layer included), and the per-token loss (the GPTModel's
  output when it is given labels);
* backward: the grads w.r.t. those inputs and outputs, and each parameter's grad per microbatch;
* main_grad: ``param.main_grad`` when ``optimizer.step()`` starts (``finalize_model_grads`` has
  reduced them by then, whoever set ``config.finalize_model_grads_func``);
* optimizer: the grad norm, the clip coefficient and the updated parameters after ``optimizer.step()``;
* MoE routers: their aux losses (load balancing, z-loss) per microbatch (``_AuxLossTap``).

Tensors go to *sinks*: a :class:`~ttrace_megatron.trace_store.TraceWriter` (offline compare) and/or
an :class:`~ttrace_megatron.online.OnlineComparer` (verdicts only). Nothing is recorded outside
``begin_iteration`` … ``end_iteration``, so evaluation passes between steps are ignored.
Microbatches are counted by a forward pre-hook on each model chunk: every schedule (no pipelining,
1F1B, interleaved) calls each chunk once per microbatch, in megatron's data order. Pipeline
schedules run a microbatch's backward after later forwards, so a hook on each chunk's output grad
marks which microbatch the parameter grads that follow belong to.

Neutrality: hooks copy tensors and never write to the run's tensors. To capture the grad w.r.t.
a module's own input (not the sum over all consumers of that tensor) the input is passed to the
module through ``view_as``, an identity in forward and backward. No hook issues a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from typing import List, Optional, Sequence, Tuple

import torch

from ..placement import Layout
from ..trace_store import TensorKey
from . import layouts
from .naming import all_parameters, canonical_module_names, unwrap


@dataclasses.dataclass
class RecordFilter:
    """Selective recording. ``None`` means everything."""

    iterations: Optional[Sequence[int]] = None
    modules: Sequence[str] = ("*",)  # fnmatch patterns of canonical module names
    microbatches: Optional[Sequence[int]] = None  # global microbatch ids
    ranks: Optional[Sequence[int]] = None

    def wants_module(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.modules)


class Recorder:
    def __init__(self, sinks: Sequence, chunks: List[torch.nn.Module], facts: layouts.ModelFacts,
                 rank: int, dp_rank: int, dp_size: int, record_filter: RecordFilter = RecordFilter(),
                 main_grad_ranges: Optional[dict] = None):
        self.sinks = list(sinks)
        self.chunks = chunks
        self.facts = facts
        self.rank = rank
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.filter = record_filter
        # distributed optimizer: param -> (the flat ranges of its main_grad each DP rank owns, this rank)
        self.main_grad_ranges = main_grad_ranges or {}
        self.iteration = 0
        self.in_iteration = False
        self._local_microbatch = [0] * len(chunks)
        self.microbatch = -1  # global id of the microbatch whose forward runs now
        self.backward_microbatch = -1
        self._handles = []
        self.before_step: List = []  # called after main grads are recorded, before the optimizer steps
        self.router: Optional[Tuple[str, torch.nn.Module, Layout]] = None  # the router whose forward runs now
        self._params: List[Tuple[str, str, torch.nn.Module, torch.nn.Parameter]] = list(all_parameters(chunks))
        self._compute_dtype = next((p.dtype for *_, p in self._params if p.is_floating_point()), torch.float32)

    # ---- selection
    @property
    def recording(self) -> bool:
        f = self.filter
        return (self.in_iteration and any(s.active for s in self.sinks)
                and (f.iterations is None or self.iteration in f.iterations)
                and (f.ranks is None or self.rank in f.ranks))

    def _wants(self, module_name: str, microbatch: int) -> bool:
        f = self.filter
        return (self.recording and f.wants_module(module_name)
                and (microbatch < 0 or f.microbatches is None or microbatch in f.microbatches))

    # ---- training-loop calls
    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.in_iteration = True
        self._local_microbatch = [0] * len(self.chunks)

    def begin_microbatch(self, local_microbatch: int) -> None:
        """Megatron's data order: DP rank r's j-th microbatch is global microbatch j·dp + r.

        Without pipelining each microbatch's backward follows its forward, so parameter grads
        that arrive next belong to it (grad hooks of recorded modules also set it, from the id
        captured at forward time).
        """
        self.microbatch = local_microbatch * self.dp_size + self.dp_rank
        self.backward_microbatch = self.microbatch

    def end_iteration(self, iteration: int) -> None:
        self.in_iteration = False
        for sink in self.sinks:
            sink.flush(iteration)

    def close(self) -> None:
        """Remove the hooks and finish the sinks; a run that stops inside an iteration (an
        exception, then the atexit flush) leaves its trace marked incomplete, not complete."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for sink in self.sinks:
            if self.in_iteration:
                sink.abandon(f"the run stopped during iteration {self.iteration}")
            else:
                sink.close()

    # ---- module hooks
    def attach(self) -> "Recorder":
        recorded = layouts.recorded_module_types()
        for index, chunk in enumerate(self.chunks):
            self._handles.append(chunk.register_forward_pre_hook(self._count_microbatch(index)))
            self._handles.append(chunk.register_forward_hook(self._mark_backward_microbatch))
            self._handles.append(unwrap(chunk).register_forward_hook(self._loss_hook, with_kwargs=True))
            for module, name in canonical_module_names(chunk).items():
                if isinstance(module, recorded) and not self._skip_per_microbatch(module):
                    self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
                    self._handles.append(module.register_forward_hook(self._post_hook(name), with_kwargs=True))
                if hasattr(module, "_ttrace_fp8"):
                    self._handles.append(_FP8AmaxTap(self, name, module))
        for mname, pname, module, param in self._params:
            if param.requires_grad and not self._skip_per_microbatch(module):
                self._handles.append(param.register_hook(self._param_grad_hook(mname, pname, module, param)))
        if any(layouts.is_router(m) for chunk in self.chunks for m in chunk.modules()):
            self._handles.append(_AuxLossTap(self))
        return self

    def _skip_per_microbatch(self, module) -> bool:
        """Experts whose tokens mix several DP ranks' microbatches: only main grads and parameters."""
        return self.facts.experts_mix_microbatches and layouts.is_expert(module)

    def _add(self, key: TensorKey, tensor: torch.Tensor, layout: Layout, module: Optional[torch.nn.Module] = None,
             arrival: bool = False, statistic_of: str = ""):
        depth = layouts.layer_depth(key.module, self.facts.num_layers)
        reduction = layouts.reduction_length(key.module, module, statistic_of or key.tensor, self.facts)
        scale = self.scale_for(key.phase)
        for sink in self.sinks:
            sink.add(key, tensor, layout, depth=depth, compute_dtype=self._compute_dtype, reduction=reduction,
                     scale=scale, arrival=arrival, statistic_of=statistic_of)

    def scale_for(self, phase: str) -> float:
        """How much larger this run's tensors of ``phase`` are than a DP=1 run's.

        megatron scales each microbatch's loss by 1/num_microbatches of this DP rank, so
        per-microbatch grads are dp times those of a run with DP=1; DDP divides by dp again when it
        reduces main grads.
        """
        return float(self.dp_size) if phase == "backward" else 1.0

    def _count_microbatch(self, index: int):
        """Each chunk runs its microbatches in data order, under every schedule (with virtual
        pipelining too, per chunk)."""
        def hook(module, args):
            if self.in_iteration:
                self.begin_microbatch(self._local_microbatch[index])
                self._local_microbatch[index] += 1
        return hook

    def _mark_backward_microbatch(self, module, args, output):
        """Pipeline schedules run the backward of microbatch j after later forwards (1F1B): the
        grad of a chunk's output is the first thing each microbatch's backward computes on this
        stage, so it says which microbatch the parameter grads that follow belong to."""
        out = output[0] if isinstance(output, (tuple, list)) else output
        if self.recording and isinstance(out, torch.Tensor) and out.requires_grad:
            mb = self.microbatch

            def hook(grad):
                self.backward_microbatch = mb

            out.register_hook(hook)
        return None

    def _loss_hook(self, module, args, kwargs, output):
        """GPTModel returns the per-token loss [b, s] when it is given labels (on the last stage)."""
        if (kwargs.get("labels") is not None and isinstance(output, torch.Tensor)
                and getattr(module, "post_process", True)):
            self.record_loss(output)

    def _layouts(self, name, module, inp, out):
        return layouts.activation_layouts(name, module, self.facts, tuple(inp.shape),
                                          None if out is None else tuple(out.shape))

    def _pre_hook(self, name: str):
        def hook(module, args, kwargs):
            mb = self.microbatch
            if layouts.is_router(module):
                self.router = None  # set below only if this router is recorded (_AuxLossTap)
            if not args or not isinstance(args[0], torch.Tensor) or not self._wants(name, mb):
                return None
            inp = args[0]
            it = self.iteration
            in_layout, _ = self._layouts(name, module, inp, None)
            if layouts.is_router(module):
                self.router = (name, module, in_layout)  # for the aux losses its forward logs (_AuxLossTap)
            self._add(TensorKey(it, mb, name, "forward", "input"), inp, in_layout, module)
            if not inp.requires_grad:
                return None
            private = inp.view_as(inp)

            def grad_hook(grad):
                self.backward_microbatch = mb
                self._add(TensorKey(it, mb, name, "backward", "grad_input"), grad,
                          layouts.grad_layout(in_layout, module), module)

            private.register_hook(grad_hook)
            return (private,) + tuple(args[1:]), kwargs
        return hook

    def _post_hook(self, name: str):
        def hook(module, args, kwargs, output):
            mb = self.microbatch
            if not self._wants(name, mb):
                return None
            out = output[0] if isinstance(output, tuple) else output
            if not isinstance(out, torch.Tensor):
                return None
            it = self.iteration
            _, out_layout = self._layouts(name, module, args[0], out)
            self._add(TensorKey(it, mb, name, "forward", "output"), out, out_layout, module)
            if out.requires_grad:
                def grad_hook(grad):
                    self.backward_microbatch = mb
                    self._add(TensorKey(it, mb, name, "backward", "grad_output"), grad,
                              layouts.grad_layout(out_layout, module), module)

                out.register_hook(grad_hook)
            return None
        return hook

    def _param_grad_hook(self, mname: str, pname: str, module: torch.nn.Module, param: torch.nn.Parameter):
        def hook(grad):
            mb = self.backward_microbatch
            if self._wants(mname, mb):
                layout = layouts.param_layout(mname, pname, module, param, self.facts, with_dp=False,
                                              microbatch_grad=True)
                self._add(TensorKey(self.iteration, mb, mname, "backward", f"{pname}.grad"), grad, layout,
                          arrival=layouts.grad_computed_outside(module, pname))
            return None
        return hook

    # ---- loss, grad finalization, optimizer
    def record_loss(self, per_token_loss: torch.Tensor) -> None:
        mb = self.microbatch
        if self._wants("loss", mb):
            layout = layouts.replicated_layout(per_token_loss.shape)
            self._add(TensorKey(self.iteration, mb, "loss", "forward", "per_token_loss"), per_token_loss, layout)

    def record_main_grads(self) -> None:
        """The reduced grads. Under the distributed optimizer only this rank's range of each is
        reduced (the rest of the buffer holds unreduced local grads), so only that range is recorded."""
        for mname, pname, module, param in self._params:
            main_grad = getattr(param, "main_grad", None)
            if main_grad is None or not param.requires_grad or not self._wants(mname, -1):
                continue
            bounds, me = self.main_grad_ranges.get(param, (None, 0))
            layout = layouts.param_layout(mname, pname, module, param, self.facts, dp_ranges=bounds)
            if bounds is not None:
                main_grad = main_grad.view(-1)[bounds[me]:bounds[me + 1]]
            self._add(TensorKey(self.iteration, -1, mname, "main_grad", f"{pname}.main_grad"), main_grad, layout)

    def record_optimizer_step(self, grad_norm: Optional[float], clip_coefficient: Optional[float] = None) -> None:
        """The step's scalars — grad norm and the clip coefficient it applied — and the updated
        parameters. The scalars are the same on every rank of a stage (reduced over the
        model-parallel group), so replicas.

        The number of zeros in the grads (``--log-num-zeros-in-grad``) is not recorded: it is a
        count, not a rounded value, and two correct runs differ in it (measured: by 1 to 3 of
        ~6000 between the reference and TP2×DP2, and between the reference and its perturbation
        run, as sums cancel to exactly 0 in one order and not the other). The grads it counts are
        compared element by element as main grads."""
        if not self.recording:
            return
        if self._wants("optimizer", -1):
            layout = layouts.stage_replicated_layout((1,), self.facts)
            for name, value in (("grad_norm", grad_norm), ("clip_coefficient", clip_coefficient)):
                if value is not None:
                    self._add(TensorKey(self.iteration, -1, "optimizer", "optimizer", name),
                              torch.tensor([float(value)], dtype=torch.float64), layout)
        for mname, pname, module, param in self._params:
            if param.requires_grad and self._wants(mname, -1):
                layout = layouts.param_layout(mname, pname, module, param, self.facts)
                self._add(TensorKey(self.iteration, -1, mname, "optimizer", pname), param, layout)

    def wrap_optimizer(self, optimizer) -> None:
        """Record main grads as ``optimizer.step()`` starts, grad norm and parameters after it.

        The wrapper is an instance attribute, so megatron's ``train_step`` (which calls
        ``optimizer.step()``) goes through it; :meth:`unwrap_optimizer` restores the method.
        """
        original = optimizer.step

        def step(*args, **kwargs):
            self.record_main_grads()
            for callback in self.before_step:
                callback()
            with _observe_clipping() as clipping:
                result = original(*args, **kwargs)
            result_tuple = result if isinstance(result, tuple) else ()
            grad_norm = result_tuple[1] if len(result_tuple) >= 2 else None
            self.record_optimizer_step(grad_norm, clipping.coefficient)
            return result

        step.ttrace_original = original
        optimizer.step = step

    @staticmethod
    def unwrap_optimizer(optimizer) -> None:
        original = getattr(optimizer.step, "ttrace_original", None)
        if original is not None:
            optimizer.step = original


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


class _AuxLossTap:
    """Records the MoE aux losses (load balancing, sequence and global load balancing, z-loss) of
    each router forward, per microbatch, as the value megatron attaches to the graph.

    The router hands each loss to ``save_to_aux_losses_tracker`` (for logging) divided by its
    coefficient; the tap wraps that name in megatron's router module while attached (``remove``
    restores it) and multiplies the coefficient back. The z-loss's coefficient is divided by the
    TP×CP size, as the router does, so every recorded value is a sum over this rank's tokens
    (:func:`layouts.router_loss_layout`). The original function always runs, unchanged.
    """

    def __init__(self, recorder: "Recorder"):
        from megatron.core.transformer.moe import router as router_module

        self.recorder = recorder
        self.module = router_module
        self.original = router_module.save_to_aux_losses_tracker
        router_module.save_to_aux_losses_tracker = self

    def __call__(self, name, loss, *args, **kwargs):
        self.original(name, loss, *args, **kwargs)
        rec = self.recorder
        if rec.router is None or not isinstance(loss, torch.Tensor):
            return
        mname, router, in_layout = rec.router
        if not rec._wants(mname, rec.microbatch):
            return
        if name == "z_loss":
            coeff = router.config.moe_z_loss_coeff / router.tp_cp_group.size()
        elif name in ("load_balancing_loss", "seq_load_balancing_loss"):
            coeff = router.get_aux_loss_coeff(name.replace("load_balancing_loss", "aux_loss"))
        else:
            return  # global_load_balancing_loss averages token counts over DP and microbatches: no per-microbatch twin
        value = (loss.detach().to(torch.float64) * coeff).reshape(1)
        rec._add(TensorKey(rec.iteration, rec.microbatch, mname, "forward", name), value,
                 layouts.router_loss_layout(in_layout), router)

    def remove(self) -> None:
        if self.module.save_to_aux_losses_tracker is self:
            self.module.save_to_aux_losses_tracker = self.original


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

    def __init__(self, recorder: "Recorder", name: str, module: torch.nn.Module):
        self.recorder = recorder
        self.name = name
        self.module = module
        self.emulated = module._ttrace_fp8
        self.emulated.observer = self

    def __call__(self, phase: str, tensor: str, amax: torch.Tensor) -> None:
        rec = self.recorder
        mb = rec.microbatch if phase == "forward" else rec.backward_microbatch
        if not rec._wants(self.name, mb):
            return
        tp_axis, _, _ = layouts.tensor_parallel_axis(self.module, rec.facts)
        rec._add(TensorKey(rec.iteration, mb, self.name, phase, tensor), amax.detach().clone(),
                 layouts.replicated_layout((1,), (tp_axis,)), self.module, statistic_of=tensor[:-len("_amax")])

    def remove(self) -> None:
        if self.emulated.observer is self:
            self.emulated.observer = None
