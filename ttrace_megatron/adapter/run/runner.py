"""One rank of a reference or candidate run: real megatron-core, real schedules and optimizer.

The model and optimizer come from :mod:`..recipe.build` (megatron-core's GPTModel, Float16Module, DDP,
``get_megatron_optimizer``); every step goes through ``get_forward_backward_func()`` with
``finalize_model_grads``: the code paths a Megatron-LM user trains with. Tracing attaches through
:func:`.session.start`, where ``pretrain_gpt.py --ttrace``'s ``ttrace.attach`` ends too.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import time
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ...recipe import Recipe, recipe_from_dict
from ...trace_store import CANDIDATE, REFERENCE  # noqa: F401  (REFERENCE: re-exported for callers)
from ..recipe import build
from ..recipe import config as cfg
from ..recipe import data, hybrid, model_fields
from ..recipe.naming import unwrap
from ..record import layouts
from .session import TraceOptions

# the runs a check makes again of its sides, as their lines and errors name them (``RunSpec.side``)
REPLAY, PERTURBATION = "replay", "perturbation"


@dataclasses.dataclass
class RunSpec:
    """One run of a recipe: which side, what to trace, which bugs to inject."""

    recipe: dict  # Recipe.to_json()
    role: str  # REFERENCE or CANDIDATE
    trace: TraceOptions  # dir, seed_checkpoint, selective recording, online compare, replay, perturbation
    inject: List[str] = dataclasses.field(default_factory=list)
    cpu: bool = True
    master_port: int = 0
    megatron: Optional[str] = None  # a megatron-core source tree to run on (side.py); None: the installed one
    # a HybridModel candidate traced as its GPTModel equivalent, against a GPT reference (hybrid.py)
    as_gpt: bool = False
    # a line per iteration on global rank 0 (``ttrace run``, unless --quiet): a check at a realistic
    # size runs for minutes between the side's first line and its verdict
    progress: bool = False
    # started beside its reference (``launch.launch_beside``): the reference's trace directory, written
    # one iteration at a time; the ranks wait for its first iteration before anything else
    await_reference: Optional[str] = None

    @property
    def side(self) -> str:
        """What this run is, as its lines and errors name it: the localization replay and the
        perturbation run are a candidate's and a reference's runs again."""
        return REPLAY if self.trace.replay else PERTURBATION if self.trace.perturb else self.role

    @property
    def last_iteration(self) -> Optional[int]:
        """Where this run may stop: a localization replay records one failing iteration, and what it
        would train after it is never looked at; so does the reference run again for it
        (``TraceOptions.until``). None: the recipe's every iteration. (The learning-rate schedule
        is the recipe's either way: a run stopped early trains its iterations as the whole run does.)"""
        if self.trace.until is not None:
            return self.trace.until
        if self.trace.replay and self.trace.iterations:
            return max(self.trace.iterations)
        return None

    def get_recipe(self) -> Recipe:
        """The recipe this side runs: the reference without the candidate's activation recomputation
        (it keeps its activations, so the check judges the recomputation), and under fp16 at the
        loss scale whose backward carries the candidate's values (``config.reference_optimizer``)."""
        if self.role == CANDIDATE:
            return recipe_from_dict(self.recipe)
        return recipe_from_dict(dict(self.recipe, model=model_fields.for_reference(self.recipe["model"]),
                                     optimizer=cfg.reference_optimizer(self.recipe)))

    @property
    def parallel(self) -> Dict:
        if self.role != CANDIDATE:
            return {}
        return hybrid.with_pattern_layout(self.recipe["model"], dict(self.recipe["parallel"]))

    @property
    def world_size(self) -> int:
        return int(self.recipe["world_size"]) if self.role == CANDIDATE else 1


@dataclasses.dataclass
class Probes:
    """What tests and benchmarks measure about a run, beside its trace."""

    trace: bool = True  # False: run without attaching the tracer (bitwise-neutrality checks)
    dump_state: bool = False  # write losses and final parameters (bitwise-neutrality checks)
    timings: bool = False  # write per-iteration step and flush times (cost benchmarks)
    alternate_idle: bool = False  # attach the tracer on even iterations only (interleaved overhead benchmark)


def trace_options(dir: str, seed_checkpoint: str, **kwargs) -> TraceOptions:
    """The trace options of a ``ttrace run`` side (recording on)."""
    return TraceOptions(enabled=True, dir=dir, seed_checkpoint=seed_checkpoint, **kwargs)


def run_rank(rank: int, spec: RunSpec, probes: Probes = Probes()) -> None:
    """Entry point of a worker process: run one rank of ``spec`` and write its trace."""
    if spec.await_reference:
        from ...trace_store import wait_for_iteration

        wait_for_iteration(spec.await_reference, 1)  # its seed checkpoint is written by then too
    if spec.cpu:
        from ..cpu import cuda_shim

        cuda_shim.install()
        backend = "gloo"
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(spec.master_port)
    dist.init_process_group(backend, rank=rank, world_size=spec.world_size)
    try:
        _run(rank, spec, probes)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _run(rank: int, spec: RunSpec, probes: Probes) -> None:
    from megatron.core import parallel_state

    from ..zoo import bugs
    from ..cpu import fp8_emulation
    from . import session
    from .seed_checkpoint import share_initial_weights

    recipe = spec.get_recipe()
    sizes = cfg.parallel_sizes(spec.parallel)
    vpp = sizes["vpp"]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=sizes["tp"],
                                             pipeline_model_parallel_size=sizes["pp"],
                                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                             expert_model_parallel_size=sizes["ep"],
                                             expert_tensor_parallel_size=sizes["etp"])
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    coords = layouts.rank_coordinates()

    for bug in spec.inject if spec.role == CANDIDATE else []:
        bugs.inject_before_build(bug)  # a bug in how megatron builds the model
    chunks, config = build.gpt_chunks(recipe, spec.parallel, cpu=spec.cpu, as_gpt=spec.as_gpt)
    # traced as its GPT equivalent, the model is described (depths, signature) by that GPT's config
    described = cfg.transformer_config(recipe_from_dict(hybrid.gpt_equivalent(spec.recipe)), {}) if spec.as_gpt \
        else config
    facts = layouts.model_facts(chunks, config, vocab_size=recipe.data.vocab_size,
                                tokens_per_microbatch=recipe.data.micro_batch_size * recipe.data.seq_length,
                                tokens_per_iteration=recipe.data.global_batch_size * recipe.data.seq_length,
                                seq_length=recipe.data.seq_length)
    facts = dataclasses.replace(facts, num_layers=described.num_layers)
    if recipe.dtype == "fp8":  # TE's FP8 recipe (hybrid formats, current scaling), emulated on CPU
        fp8_emulation.install(chunks, fp8_emulation.FP8Settings(), facts)
    # before the optimizer copies the weights into its main params: no reload needed
    share_initial_weights(spec.trace.seed_checkpoint, chunks, layouts.KeyLayouts(facts), coords, rank, spec.role,
                          spec.world_size, init=recipe.train.seed_init)
    # the model as the recipe describes it, before a bug patches anything
    signature = build.model_signature(chunks, described, cfg.optimizer_config(recipe), facts, {
        "seed": recipe.data.seed, "seq_length": recipe.data.seq_length,
        "micro_batch_size": recipe.data.micro_batch_size, "global_batch_size": recipe.data.global_batch_size,
        "iterations": recipe.train.iterations, "lr_decay_style": recipe.train.lr_decay_style,
        "data_source": data.source_signature(recipe), "eod_mask_loss": recipe.data.eod_mask_loss,
        "masked_share": recipe.data.masked_share, "reset_position_ids": recipe.data.reset_position_ids,
        "reset_attention_mask": recipe.data.reset_attention_mask, "document_length": recipe.data.document_length,
        "padded_share": recipe.data.padded_share, "distinct_tokens": recipe.data.distinct_tokens,
        "seed_init": recipe.train.seed_init,
        "lr_warmup_iters": recipe.train.lr_warmup_iters,
        "lr_decay_iters": recipe.train.lr_decay_iters or recipe.train.iterations})
    model = build.wrap_for_training(chunks, config, recipe)
    for bug in spec.inject if spec.role == CANDIDATE else []:
        bugs.inject(model, bug)  # before the optimizer copies the weights into its main params
    optimizer = build.optimizer(recipe, model, config)
    scheduler = build.scheduler(recipe, optimizer, cfg.optimizer_config(recipe))

    def attach_tracer():
        options = dataclasses.replace(spec.trace, role=spec.role, seed_checkpoint=None)  # weights are shared above
        session.start(model, optimizer, config, options, facts, signature, run_info={
            "recipe": recipe.to_json(), "parallel": spec.parallel,
            "injected_bugs": spec.inject if spec.role == CANDIDATE else []})

    if probes.trace and not probes.alternate_idle:
        attach_tracer()

    samples = data.sampler(recipe)  # every rank alike (megatron's dataset builder synchronizes them)
    # each side's lines name what it is: the replay and the perturbation run are a candidate's and a
    # reference's runs again
    progress = spec.side if spec.progress and rank == 0 else None
    losses, timings, close_s = _train(recipe, model, optimizer, scheduler, spec.cpu, dp_rank, dp_size, probes,
                                      attach_tracer, samples, progress, spec.last_iteration)
    if probes.dump_state:
        _dump_state(spec, rank, model, losses)
    if probes.timings:
        os.makedirs(spec.trace.dir, exist_ok=True)
        with open(os.path.join(spec.trace.dir, f"timings-rank{rank:05d}.json"), "w") as f:
            json.dump({"iterations": timings, "close_s": close_s}, f)


def _train(recipe: Recipe, model, optimizer, scheduler, cpu: bool, dp_rank: int, dp_size: int, probes: Probes,
           attach_tracer, samples, progress: Optional[str] = None, last_iteration: Optional[int] = None):
    """The training loop of megatron.training's ``train``: zero the grad buffers, one
    ``forward_backward`` over this DP rank's microbatches, ``optimizer.step()``, the lr schedule's
    step after a successful update; the trace calls
    around it. Returns the losses per iteration and microbatch, the timings and the final flush time.
    ``progress``: this side's name, printed with each finished iteration. ``last_iteration``: stop
    after it (the recipe's schedule unchanged: the lr of an iteration is the recipe's)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from . import session

    forward_backward = get_forward_backward_func()
    seq = recipe.data.seq_length
    mbs = recipe.data.micro_batch_size

    def loss_func(loss_mask, output_tensor):
        # Megatron-LM's pretrain_gpt loss: the sum over the microbatch's unmasked tokens and their
        # count; megatron's schedule divides by the count unless calculate_per_token_loss, in which
        # case finalize_model_grads divides the grads by the valid tokens of the whole batch
        losses = output_tensor.float().reshape(-1)
        loss = torch.sum(losses * loss_mask.reshape(-1).float())
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

    # the mask goes to the model too, as Megatron-LM's pretrain_gpt passes it (multi-token prediction
    # masks its losses with it); a hybrid model takes none (pretrain_mamba passes none)
    takes = inspect.signature(unwrap(model[0]).forward).parameters
    takes_mask = "loss_mask" in takes

    def forward_step(data_iterator, model):
        _, batch = next(data_iterator)
        if not cpu:
            batch = data.Sample(*(None if t is None else t.cuda() for t in batch))
        extra = {"loss_mask": batch.loss_mask} if takes_mask else {}
        if batch.padding_mask is not None:  # validate_recipe: the model takes one
            extra["padding_mask"] = batch.padding_mask
        output = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels, **extra)
        return output, partial(loss_func, batch.loss_mask)

    losses = []
    timings = []
    for iteration in range(1, min(recipe.train.iterations, last_iteration or recipe.train.iterations) + 1):
        attached_now = probes.alternate_idle and iteration % 2 == 0
        if attached_now:
            attach_tracer()
        start = time.perf_counter()
        session.begin_iteration(iteration)
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        batches = list(data.microbatches(recipe, samples, iteration - 1, dp_rank, dp_size))
        # every chunk's forward_step reads the next microbatch (only the first and last stage use it)
        iterators = iter(batches) if len(model) == 1 else [iter(batches) for _ in model]
        reduced = forward_backward(forward_step_func=forward_step, data_iterator=iterators, model=model,
                                   num_microbatches=len(batches), seq_length=seq, micro_batch_size=mbs,
                                   forward_only=False)
        update_successful, _, _ = optimizer.step()
        if update_successful:
            scheduler.step(increment=1)
        stepped = time.perf_counter()
        session.end_iteration(iteration)
        timings.append({"iteration": iteration, "step_s": stepped - start, "flush_s": time.perf_counter() - stepped,
                        "attached": attached_now or (probes.trace and not probes.alternate_idle)})
        if attached_now:
            session.flush()
        losses.append([float(r["lm loss"][0] / r["lm loss"][1]) for r in reduced])
        if progress:
            print(f"[ttrace] {progress}: iteration {iteration}/{recipe.train.iterations} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    closing = time.perf_counter()
    session.flush()  # waits for the trace's background writes
    return losses, timings, time.perf_counter() - closing


def _dump_state(spec: RunSpec, rank: int, model, losses) -> None:
    """Losses and parameters after training, for the bitwise-neutrality check."""
    from safetensors.torch import save_file

    state = {f"param/{i}/{n}": p.detach().cpu().contiguous()
             for i, chunk in enumerate(model) for n, p in chunk.named_parameters()}
    state["losses"] = torch.tensor(losses, dtype=torch.float64)
    os.makedirs(spec.trace.dir, exist_ok=True)
    save_file(state, os.path.join(spec.trace.dir, f"state-rank{rank:05d}.safetensors"))
