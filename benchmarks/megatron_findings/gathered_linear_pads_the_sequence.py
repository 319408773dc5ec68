"""A megatron-core bug that crashes (not silent): a heterogeneous layer's linear replacement
(``replace_with_linear``, ``ColumnParallelLinearGathered``) under sequence parallelism pads the
wrong dimension (megatron/core/transformer/heterogeneous/linear_replacements.py:37, 0.16.1 and
0.19.2: ``pad_shape = [0] * (x.ndim - 1) * 2 + [pad_before, pad_after]``, while ``F.pad``'s list
starts at the LAST dimension, so the padding lands on dimension 0, the sequence). The reduce-scatter
that follows then hands each rank [(s + h - h/TP)/TP, b, h/TP] instead of [s/TP, b, h], and the
layer's residual add raises. ttrace refuses sequence parallelism with a replaced sublayer
(``heterogeneous.LINEAR_WITH_SP``).

Two ranks, gloo, CPU (ttrace's CUDA shim): prints the replacement's output shape against the
[s/TP, b, h] the residual has.

    python benchmarks/megatron_findings/gathered_linear_pads_the_sequence.py
"""
import os
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_main(rank: int, world: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    sys.path.insert(0, ROOT)
    from ttrace_megatron.adapter.cpu import cuda_shim

    cuda_shim.install()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.heterogeneous.linear_replacements import ColumnParallelLinearGathered
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    s, b, h = 16, 2, 32
    config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=4, tensor_model_parallel_size=world,
                               sequence_parallel=True, add_bias_linear=False, use_cpu_initialization=True)
    linear = ColumnParallelLinearGathered(config)
    out, _ = linear(torch.randn(s // world, b, h))  # this rank's sequence shard, as the residual stream holds it
    if rank == 0:
        print(f"megatron-core's gathered linear at TP={world} with sequence parallelism: output {list(out.shape)}; "
              f"the residual it is added to: {[s // world, b, h]}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(rank_main, args=(2,), nprocs=2)
