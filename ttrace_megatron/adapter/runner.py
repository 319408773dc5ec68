"""One rank of a reference or candidate run: real megatron-core, real schedules and optimizer.

The model is a megatron-core GPTModel (local spec) wrapped as megatron.training wraps it
(Float16Module for bf16, DistributedDataParallel), its optimizer comes from
``get_megatron_optimizer``, and every step goes through ``get_forward_backward_func()`` with
``finalize_model_grads``: the code paths a Megatron-LM user trains with.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import time
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..recipe import Recipe, recipe_from_dict
from . import config as cfg
from . import layouts
from .naming import all_parameters, full_param_name

REFERENCE = "reference"
CANDIDATE = "candidate"


@dataclasses.dataclass
class RunSpec:
    recipe: dict  # Recipe.to_json()
    role: str  # REFERENCE or CANDIDATE
    trace_dir: str
    seed_checkpoint: str
    master_port: int
    inject: List[str] = dataclasses.field(default_factory=list)
    cpu: bool = True
    record_iterations: Optional[List[int]] = None
    record_modules: List[str] = dataclasses.field(default_factory=lambda: ["*"])
    record_microbatches: Optional[List[int]] = None
    record_ranks: Optional[List[int]] = None
    trace: bool = True  # False: run without attaching the recorder (bitwise-neutrality checks)
    online_reference: Optional[str] = None  # candidate: judge shards against this reference during the run
    keep_tensors: bool = True  # with online_reference: also write the tensors (online vs offline checks)
    dump_state: bool = False  # write losses and final parameters (bitwise-neutrality checks)
    timings: bool = False  # write per-iteration step and flush times (cost benchmarks)
    replay_reference: Optional[str] = None  # candidate: localization replay against this reference trace
    perturb_seed: int = 0  # > 0: the perturbation-estimate run (adapter.perturb), normally of the reference
    alternate_idle: bool = False  # attach the tracer on even iterations only (interleaved overhead benchmark)

    def get_recipe(self) -> Recipe:
        return recipe_from_dict(self.recipe)

    @property
    def parallel(self) -> Dict:
        return dict(self.recipe["parallel"]) if self.role == CANDIDATE else {}

    @property
    def world_size(self) -> int:
        return int(self.recipe["world_size"]) if self.role == CANDIDATE else 1


def _sample(seed: int, index: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randint(0, vocab_size, (seq_length + 1,), generator=g)


def microbatches(recipe: Recipe, iteration: int, dp_rank: int, dp_size: int):
    """This DP rank's microbatches of one iteration, in megatron's data order.

    The global batch of iteration ``i`` is samples ``[i·gbs, (i+1)·gbs)``; global microbatch ``g``
    is samples ``[g·mbs, (g+1)·mbs)`` of it, and DP rank ``r`` takes ``g = j·dp + r`` for its
    ``j``-th microbatch (megatron's MegatronPretrainingSampler).
    """
    d = recipe.data
    per_rank = d.global_batch_size // (d.micro_batch_size * dp_size)
    for j in range(per_rank):
        g = j * dp_size + dp_rank
        first = iteration * d.global_batch_size + g * d.micro_batch_size
        tokens = torch.stack([_sample(d.seed, first + s, d.seq_length, d.vocab_size) for s in range(d.micro_batch_size)])
        yield j, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def run_rank(rank: int, spec: RunSpec) -> None:
    """Entry point of a worker process: run one rank of ``spec`` and write its trace."""
    if spec.cpu:
        from . import cuda_shim

        cuda_shim.install()
        backend = "gloo"
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(spec.master_port)
    dist.init_process_group(backend, rank=rank, world_size=spec.world_size)
    try:
        _run(rank, spec)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _run(rank: int, spec: RunSpec) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from . import bugs, fp8_emulation, integration
    from .seed_checkpoint import load_seed_checkpoint, save_seed_checkpoint

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

    torch.manual_seed(recipe.data.seed)
    model_parallel_cuda_manual_seed(recipe.data.seed)
    config = cfg.transformer_config(recipe, spec.parallel)
    spec_module = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                           normalization=config.normalization)
    # one chunk per virtual stage, as megatron.training's get_model builds them
    stages = [None] if vpp == 1 else list(range(vpp))
    chunks = []
    for vp_stage in stages:
        chunk = GPTModel(config=config, transformer_layer_spec=spec_module, vocab_size=cfg.padded_vocab_size(recipe),
                         max_sequence_length=recipe.data.seq_length,
                         pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                         post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                         vp_stage=vp_stage, **cfg.gpt_model_kwargs(recipe))
        if not spec.cpu:
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    for mname, pname, _, param in all_parameters(chunks):
        if any(fnmatch.fnmatchcase(full_param_name(mname, pname), p) for p in recipe.train.frozen):
            param.requires_grad_(False)

    facts = layouts.ModelFacts(num_layers=config.num_layers, vocab_size=recipe.data.vocab_size,
                               sequence_parallel=config.sequence_parallel,
                               gated_linear_unit=config.gated_linear_unit, tp_size=sizes["tp"],
                               hidden_size=config.hidden_size,
                               tokens_per_microbatch=recipe.data.micro_batch_size * recipe.data.seq_length,
                               tokens_per_iteration=recipe.data.global_batch_size * recipe.data.seq_length,
                               pp_size=sizes["pp"], experts_mix_microbatches=sizes["ep"] * sizes["etp"] > sizes["tp"])
    if recipe.dtype == "fp8":  # TE's FP8 recipe (hybrid formats, current scaling), emulated on CPU
        fp8_emulation.install(chunks, fp8_emulation.FP8Settings(), facts)
    if spec.role == REFERENCE and rank == 0:
        save_seed_checkpoint(chunks, facts, coords, spec.seed_checkpoint)
    load_seed_checkpoint(chunks, facts, coords, spec.seed_checkpoint, rank)

    if config.bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=bool(recipe.optimizer.get("use_distributed_optimizer")))
    # megatron.training: only the first chunk's buckets are the first to be reduced
    model = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    for bug in spec.inject if spec.role == CANDIDATE else []:
        bugs.inject(model, bug)  # before the optimizer copies the weights into its main params
    optimizer = get_megatron_optimizer(cfg.optimizer_config(recipe), model)

    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    def attach_tracer():
        options = integration.TraceOptions(
            enabled=True, dir=spec.trace_dir, iterations=spec.record_iterations, modules=tuple(spec.record_modules),
            ranks=spec.record_ranks, microbatches=spec.record_microbatches, reference=spec.online_reference,
            keep_tensors=spec.keep_tensors, role=spec.role, replay=spec.replay_reference, perturb=spec.perturb_seed)
        integration.attach(model, optimizer, config, options=options, facts=facts, run_info={
            "recipe": recipe.to_json(), "parallel": spec.parallel, "model_config": _model_signature(recipe),
            "injected_bugs": spec.inject if spec.role == CANDIDATE else []})

    if spec.trace and not spec.alternate_idle:
        attach_tracer()

    forward_backward = get_forward_backward_func()
    seq = recipe.data.seq_length
    mbs = recipe.data.micro_batch_size
    position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, -1)
    if not spec.cpu:
        position_ids = position_ids.cuda()

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    def forward_step(data_iterator, model):
        _, tokens, labels = next(data_iterator)
        if not spec.cpu:
            tokens, labels = tokens.cuda(), labels.cuda()
        output = model(tokens, position_ids, None, labels=labels)
        return output, partial(loss_func)

    losses = []
    timings = []
    for iteration in range(1, recipe.train.iterations + 1):
        attached_now = spec.alternate_idle and iteration % 2 == 0
        if attached_now:
            attach_tracer()
        start = time.perf_counter()
        integration.begin_iteration(iteration)
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        batches = list(microbatches(recipe, iteration - 1, dp_rank, dp_size))
        # every chunk's forward_step reads the next microbatch (only the first and last stage use it)
        data = iter(batches) if len(model) == 1 else [iter(batches) for _ in model]
        reduced = forward_backward(forward_step_func=forward_step, data_iterator=data, model=model,
                                   num_microbatches=len(batches), seq_length=seq, micro_batch_size=mbs,
                                   forward_only=False)
        optimizer.step()
        stepped = time.perf_counter()
        integration.end_iteration(iteration)
        timings.append({"iteration": iteration, "step_s": stepped - start, "flush_s": time.perf_counter() - stepped,
                        "attached": attached_now or (spec.trace and not spec.alternate_idle)})
        if attached_now:
            integration.flush()
        losses.append([float(r["lm loss"]) for r in reduced])
    closing = time.perf_counter()
    integration.flush()  # waits for the trace's background writes
    close_s = time.perf_counter() - closing
    if spec.dump_state:
        _dump_state(spec, rank, model, losses)
    if spec.timings:
        os.makedirs(spec.trace_dir, exist_ok=True)
        with open(os.path.join(spec.trace_dir, f"timings-rank{rank:05d}.json"), "w") as f:
            json.dump({"iterations": timings, "close_s": close_s}, f)


def _model_signature(recipe: Recipe) -> Dict:
    """What must be equal between reference and candidate for a comparison to make sense."""
    return {"model": recipe.model, "data": dataclasses.asdict(recipe.data), "dtype": recipe.dtype,
            "optimizer": recipe.optimizer, "iterations": recipe.train.iterations, "frozen": recipe.train.frozen}


def _dump_state(spec: RunSpec, rank: int, model, losses) -> None:
    """Losses and parameters after training, for the bitwise-neutrality check."""
    from safetensors.torch import save_file

    state = {f"param/{i}/{n}": p.detach().cpu().contiguous()
             for i, chunk in enumerate(model) for n, p in chunk.named_parameters()}
    state["losses"] = torch.tensor(losses, dtype=torch.float64)
    os.makedirs(spec.trace_dir, exist_ok=True)
    save_file(state, os.path.join(spec.trace_dir, f"state-rank{rank:05d}.safetensors"))
