"""The seed checkpoint: logical weights written by the reference, sliced by every candidate rank.

Equal seeds do not give equal logical weights once PP or EP change the order the RNG is drawn in,
so candidate and reference start from one state instead. The reference merges its parameters to
logical tensors and saves them (safetensors, keyed by canonical parameter name); each run, the
reference included, loads its own shard of each through the same placements. Padding (the
vocabulary padded per TP size) is not part of the logical tensor and loads as zeros.
"""

from __future__ import annotations

import os
from typing import Dict, List

import torch
from safetensors.torch import load_file, save_file

from ..errors import TraceError
from ..placement import Coords, merge_shards, slice_logical
from . import layouts
from .naming import all_parameters, full_param_name


def save_seed_checkpoint(chunks: List[torch.nn.Module], facts: layouts.ModelFacts, coords: Coords,
                         path: str) -> None:
    """Write the logical weights of a model that holds them whole (world size 1)."""
    state: Dict[str, torch.Tensor] = {}
    for mname, pname, module, param in all_parameters(chunks):
        layout = layouts.param_layout(mname, pname, module, param, facts)
        merged = merge_shards([(coords, param.detach().cpu())], layout)
        state[full_param_name(mname, pname)] = merged.tensor.contiguous()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(state, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def load_seed_checkpoint(chunks: List[torch.nn.Module], facts: layouts.ModelFacts, coords: Coords,
                         path: str, rank: int) -> None:
    try:
        state = load_file(path)
    except Exception as e:
        raise TraceError(f"cannot read the seed checkpoint ({e})", path=path, rank=rank) from None
    seen = set()
    for mname, pname, module, param in all_parameters(chunks):
        name = full_param_name(mname, pname)
        if name not in state:
            raise TraceError("the seed checkpoint has no such parameter: reference and candidate models differ",
                             path=path, rank=rank, tensor=name)
        layout = layouts.param_layout(mname, pname, module, param, facts)
        full = state[name]
        if tuple(full.shape) != layout.logical_shape:
            raise TraceError(f"seed checkpoint shape {tuple(full.shape)} != logical shape {layout.logical_shape}",
                             path=path, rank=rank, tensor=name)
        param.copy_(slice_logical(full.to(param.dtype), layout, coords, param.shape))
        seen.add(name)
    # a pipeline stage holds only its own layers, an expert-parallel rank only its own experts
    extra = sorted(n for n in set(state) - seen if ".local_experts." not in n)
    if extra and facts.pp_size == 1:
        raise TraceError(f"the seed checkpoint has parameters this model lacks: {extra[:5]}", path=path, rank=rank)
