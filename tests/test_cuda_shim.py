"""The CPU shims megatron-core needs under gloo (ttrace_megatron/adapter/cpu/cuda_shim.py)."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ttrace_megatron.adapter.run.launch import free_port


def _gather_uneven(rank, port, results):
    from ttrace_megatron.adapter.cpu import cuda_shim

    cuda_shim.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = [3, 5]  # megatron's expert-TP token gathers send pieces of different sizes
    mine = torch.full((rows[rank], 2), float(rank + 1))
    out = [torch.empty(r, 2) for r in rows]
    dist.all_gather(out, mine)
    results[rank] = [t.tolist() for t in out]
    dist.destroy_process_group()


def test_all_gather_of_pieces_of_different_sizes_on_gloo():
    results = mp.Manager().dict()
    mp.spawn(_gather_uneven, args=(free_port(), results), nprocs=2)
    for rank in (0, 1):
        assert results[rank] == [[[1.0, 1.0]] * 3, [[2.0, 2.0]] * 5]
