"""The seed checkpoint: logical weights written by the reference, sliced by every candidate rank.

Equal seeds do not give equal logical weights once PP or EP change the order the RNG is drawn in,
so candidate and reference start from one state instead. The reference merges its parameters to
logical tensors and saves them (safetensors, keyed by canonical parameter name); each run, the
reference included, loads its own shard of each through the same placements. A vocabulary's
padding rows are part of the logical tensor: both sides pad to one size (the model signature holds
it), and the candidate's padding starts as the reference's.
"""

from __future__ import annotations

import os
from typing import Dict, List

import torch
from safetensors.torch import load_file, save_file

from ...errors import RecipeError, TraceError
from ...placement import Coords, merge_shards, slice_logical
from ...trace_store import REFERENCE
from ..record import layouts
from ..record.layouts import Site
from ..recipe.naming import all_parameters, full_param_name
from ...recipe import SEED_INIT_MEGATRON as MEGATRON, SEED_INIT_SENSITIZED as SENSITIZED, SEED_INITS
from .sensitize import sensitize


def share_initial_weights(path: str, chunks: List[torch.nn.Module], key_layouts: layouts.KeyLayouts,
                          coords: Coords, rank: int, role: str, world: int, optimizer=None,
                          init: str = MEGATRON) -> None:
    """The one way a run gets its initial weights (``ttrace run`` and ``--ttrace`` alike): the
    reference (world size 1) writes its logical weights to ``path`` if the file is absent (``init``
    SENSITIZED: redrawn so that a layout's bugs show, :mod:`.sensitize`); then every run, the
    reference included, loads its shard of each weight from it, a vocabulary's padding rows
    included. Given the ``optimizer`` (a run that loads after it was built), its main copies of the
    weights are refreshed with ``reload_model_params``."""
    if init not in SEED_INITS:
        raise RecipeError(f"seed_init must be one of {SEED_INITS}, got {init!r}")
    if not os.path.exists(path):
        if role != REFERENCE or world != 1:
            raise RecipeError(f"seed checkpoint {path} does not exist: run the reference (world size 1) first")
        if rank == 0:
            save_seed_checkpoint(chunks, key_layouts, coords, path, init)
    drawn = seed_init_of(path, rank)
    if drawn != init:
        # a kept file from another check: every side must start where the recipe says
        raise RecipeError(f"seed checkpoint {path} holds {drawn} initial weights, and this run asks for {init} "
                          f"(seed_init): remove the file, and the reference writes it anew")
    load_seed_checkpoint(chunks, key_layouts, coords, path, rank)
    if optimizer is not None:
        optimizer.reload_model_params()


def save_seed_checkpoint(chunks: List[torch.nn.Module], key_layouts: layouts.KeyLayouts, coords: Coords,
                         path: str, init: str = MEGATRON) -> None:
    """Write the logical weights of a model that holds them whole (world size 1): as megatron drew
    them, or redrawn by :func:`.sensitize.sensitize`."""
    state: Dict[str, torch.Tensor] = {}
    sites: Dict[str, tuple] = {}
    for mname, pname, module, param in all_parameters(chunks):
        layout = key_layouts.param_value(Site(mname, module, pname, param))
        merged = merge_shards([(coords, param.detach().cpu())], layout)
        name = full_param_name(mname, pname)
        state[name] = merged.tensor.contiguous()
        sites[name] = (mname, type(module).__name__, pname)
    if init == SENSITIZED:
        config = getattr(chunks[0], "config", None)
        kept = sensitize(state, sites, hidden=key_layouts.facts.hidden_size,
                         zero_centered_gamma=bool(getattr(config, "layernorm_zero_centered_gamma", False)))
        print(f"[ttrace] sensitized seed checkpoint: {len(state) - len(kept)} of {len(state)} parameters redrawn"
              + (f"; megatron's initialization kept for {len(kept)} ({', '.join(kept[:4])}"
                 f"{', …' if len(kept) > 4 else ''}): no sensitizing rule for them" if kept else ""), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(state, tmp, metadata={SEED_INIT_KEY: init})
    os.replace(tmp, path)


SEED_INIT_KEY = "seed_init"  # the safetensors metadata that says how the weights were drawn


def seed_init_of(path: str, rank: int) -> str:
    """How the seed checkpoint at ``path`` was drawn (a file written before ttrace recorded it:
    megatron's initialization, the only one there was)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return (f.metadata() or {}).get(SEED_INIT_KEY, MEGATRON)
    except Exception as e:
        raise TraceError(f"cannot read the seed checkpoint ({e})", path=path, rank=rank) from None


@torch.no_grad()
def load_seed_checkpoint(chunks: List[torch.nn.Module], key_layouts: layouts.KeyLayouts, coords: Coords,
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
        layout = key_layouts.param_value(Site(mname, module, pname, param))
        full = state[name]
        if tuple(full.shape) != layout.logical_shape:
            raise TraceError(f"seed checkpoint shape {tuple(full.shape)} != logical shape {layout.logical_shape}",
                             path=path, rank=rank, tensor=name)
        param.copy_(slice_logical(full.to(param.dtype), layout, coords, param.shape))
        seen.add(name)
    # a pipeline stage holds only its own layers, an expert-parallel rank only its own experts
    extra = sorted(n for n in set(state) - seen if ".local_experts." not in n)
    if extra and key_layouts.facts.pp_size == 1:
        raise TraceError(f"the seed checkpoint has parameters this model lacks: {extra[:5]}", path=path, rank=rank)
