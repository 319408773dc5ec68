"""A stand-in for Megatron-LM's ``megatron/training`` (not on PyPI), for integration tests.

It keeps what ttrace relies on from ``megatron/training/training.py`` at ``core_v0.16.1``:

* ``pretrain(..., extra_args_provider=...)`` parses the arguments with the provider chained in
  and exposes them through ``get_args()``;
* ``pretrain`` calls ``setup_model_and_optimizer`` and ``train`` calls ``train_step(...,
  iteration=iteration)`` as **module globals**, so ``ttrace.install()`` can wrap them by name;
  ``iteration`` is the number of finished steps, ``args.curr_iteration`` is set before each;
* ``train`` sets ``config.grad_scale_func`` and ``config.finalize_model_grads_func`` itself.

All numerics are real megatron-core: GPTModel (local spec), Float16Module, DistributedDataParallel,
``get_megatron_optimizer`` (a ChainedOptimizer), ``get_forward_backward_func``,
``finalize_model_grads``. Runs on CPU with gloo (``ttrace_megatron.adapter.cpu.cuda_shim``).
"""

import argparse
import math
import os

import torch
import torch.distributed as dist

_ARGS = None


def get_args():
    assert _ARGS is not None, "args is not initialized"
    return _ARGS


def parse_args(extra_args_provider=None):
    p = argparse.ArgumentParser(description="mini Megatron-LM")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=4)
    p.add_argument("--train-iters", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=250)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--losses-out", help="write this rank's losses and final parameters here (tests)")
    if extra_args_provider is not None:
        p = extra_args_provider(p)
    args = p.parse_args()
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = int(math.ceil(args.vocab_size / multiple) * multiple)
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    args.curr_iteration = 0
    return args


def core_transformer_config_from_args(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                             num_attention_heads=args.num_attention_heads, hidden_dropout=0.0, attention_dropout=0.0,
                             tensor_model_parallel_size=args.tensor_model_parallel_size,
                             sequence_parallel=args.sequence_parallel, use_cpu_initialization=True,
                             params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16)


def initialize_megatron(extra_args_provider=None):
    global _ARGS
    _ARGS = parse_args(extra_args_provider)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ttrace_megatron.adapter.cpu import cuda_shim

    cuda_shim.install()
    dist.init_process_group("gloo", rank=_ARGS.rank, world_size=_ARGS.world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=_ARGS.tensor_model_parallel_size)
    torch.manual_seed(_ARGS.seed)
    model_parallel_cuda_manual_seed(_ARGS.seed)


def get_model(model_provider):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    args = get_args()
    model = model_provider(pre_process=True, post_process=True)
    config = model.config
    if args.bf16:
        model = Float16Module(config, model)
    return [DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)]


def setup_model_and_optimizer(model_provider, model_type=None, checkpointing_context=None):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    args = get_args()
    model = get_model(model_provider)
    config = OptimizerConfig(optimizer=args.optimizer, lr=args.lr, bf16=args.bf16,
                             params_dtype=torch.bfloat16 if args.bf16 else torch.float32)
    return model, get_megatron_optimizer(config, model), None


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
               forward_backward_func, iteration=None):
    args = get_args()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dist.get_world_size()
                                                  // args.tensor_model_parallel_size)
    losses = forward_backward_func(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                                   num_microbatches=num_microbatches, seq_length=args.seq_length,
                                   micro_batch_size=args.micro_batch_size, forward_only=False)
    update_successful, grad_norm, num_zeros = optimizer.step()
    return losses, not update_successful, grad_norm


def train(forward_step_func, model, optimizer, config, train_data_iterator):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args = get_args()
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward_func = get_forward_backward_func()
    iteration = 0
    history = []
    while iteration < args.train_iters:
        args.curr_iteration = iteration
        losses, skipped_iter, grad_norm = train_step(forward_step_func, train_data_iterator, model, optimizer, None,
                                                     config, forward_backward_func, iteration=iteration)
        history.append([float(x["lm loss"]) for x in losses])
        iteration += 1
    return history


def pretrain(train_data_iterator_provider, model_provider, model_type, forward_step_func, extra_args_provider=None):
    from megatron.core.utils import get_model_config

    initialize_megatron(extra_args_provider)
    model, optimizer, _ = setup_model_and_optimizer(model_provider, model_type)
    config = get_model_config(model[0])
    history = train(forward_step_func, model, optimizer, config, train_data_iterator_provider())
    args = get_args()
    if args.losses_out:
        from safetensors.torch import save_file

        state = {n: p.detach().contiguous() for n, p in model[0].named_parameters()}
        state["losses"] = torch.tensor(history, dtype=torch.float64)
        save_file(state, f"{args.losses_out}-rank{dist.get_rank()}.safetensors")
    dist.barrier()
    dist.destroy_process_group()


def install_as_megatron_training():
    """Make ``megatron.training`` and ``megatron.training.training`` resolve to this stand-in."""
    import sys
    import types

    this = sys.modules[__name__]
    package = types.ModuleType("megatron.training")
    package.get_args = get_args
    package.pretrain = pretrain
    package.training = this
    package.__path__ = []
    sys.modules["megatron.training"] = package
    sys.modules["megatron.training.training"] = this
