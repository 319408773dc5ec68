"""A user's pretrain_gpt.py on the mini Megatron-LM, with ttrace in the zero-edit way.

Only two lines mention ttrace: ``ttrace.install()`` and the ``extra_args_provider``.
Run with torchrun, e.g. ``torchrun --nproc-per-node 2 pretrain_gpt.py --tensor-model-parallel-size 2
--sequence-parallel --ttrace --ttrace-dir cand --ttrace-seed-checkpoint seed.safetensors``.
"""

import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training  # noqa: E402  (the stand-in for megatron/training)

training.install_as_megatron_training()

import ttrace_megatron as ttrace  # noqa: E402
from megatron.training import get_args, pretrain  # noqa: E402  (bound early, as in the real script)


def model_provider(pre_process=True, post_process=True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    args = get_args()
    config = training.core_transformer_config_from_args(args)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.seq_length,
                    pre_process=pre_process, post_process=post_process)


def train_data_iterator():
    """Sample ``i`` of the run is fixed by ``i``; DP rank r takes global microbatch j·dp + r."""
    from megatron.core import parallel_state

    args = get_args()
    dp, r = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = args.global_batch_size // (args.micro_batch_size * dp)
    for it in range(args.train_iters):
        for j in range(per_rank):
            first = it * args.global_batch_size + (j * dp + r) * args.micro_batch_size
            rows = [torch.randint(0, args.vocab_size, (args.seq_length + 1,),
                                  generator=torch.Generator().manual_seed(args.seed + first + s))
                    for s in range(args.micro_batch_size)]
            batch = torch.stack(rows)
            yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def loss_func(output_tensor):
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(tokens, position_ids, None, labels=labels), partial(loss_func)


if __name__ == "__main__":
    ttrace.install()
    pretrain(train_data_iterator, model_provider, None, forward_step,
             extra_args_provider=ttrace.extra_args_provider(None))
