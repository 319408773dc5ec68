"""Bugs injected at run time into a candidate, for tests and the bug zoo. Never edits files.

Each bug is a function ``(chunks, module_pattern) -> None`` that patches module instances of the
already-built model. A bug is named on the command line as ``NAME`` or ``NAME:MODULE_PATTERN``.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Callable, Dict, List

import torch

from .naming import canonical_module_names


def _modules(chunks, pattern: str, cls):
    found = []
    for chunk in chunks:
        for module, name in canonical_module_names(chunk).items():
            if isinstance(module, cls) and fnmatch.fnmatchcase(name, pattern):
                found.append((name, module))
    if not found:
        raise ValueError(f"bug injection: no {cls.__name__} matches {pattern!r}")
    return found


def _during_forward(module, layers_attr: str, replacement):
    """Swap a function in megatron's layers module while this module's forward runs."""
    from megatron.core.tensor_parallel import layers as tp_layers

    original_forward = module.forward

    @functools.wraps(original_forward)
    def forward(*args, **kwargs):
        saved = getattr(tp_layers, layers_attr)
        setattr(tp_layers, layers_attr, replacement)
        try:
            return original_forward(*args, **kwargs)
        finally:
            setattr(tp_layers, layers_attr, saved)

    module.forward = forward


def row_allreduce_dropped(chunks, pattern: str = "*linear_fc2") -> None:
    """RowParallelLinear forgets to sum its partial outputs over TP (forward)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.tensor_parallel.mappings import _split_along_first_dim

    for _, module in _modules(chunks, pattern, RowParallelLinear):
        if module.sequence_parallel:
            _during_forward(module, "reduce_scatter_to_sequence_parallel_region",
                            lambda x, group=None, **kw: _split_along_first_dim(x, group=group))
        else:
            _during_forward(module, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)


def column_dgrad_allreduce_dropped(chunks, pattern: str = "*linear_qkv") -> None:
    """ColumnParallelLinear skips the all-reduce of its input grad over TP (backward): each rank
    keeps the dgrad of its own output columns. Without sequence parallelism only (with SP the
    dgrad is reduce-scattered instead)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    for name, module in _modules(chunks, pattern, ColumnParallelLinear):
        if module.sequence_parallel:
            raise ValueError(f"bug injection: {name} runs with sequence parallelism; its dgrad is not all-reduced")
        # megatron all-reduces the dgrad either inside the linear's autograd function or, when
        # that is off, in the backward of copy_to_tensor_model_parallel_region: drop both
        module.allreduce_dgrad = False
        _during_forward(module, "copy_to_tensor_model_parallel_region", lambda x, group=None: x)


def sp_norm_grad_not_reduced(chunks, pattern: str = "*layernorm") -> None:
    """Under SP, norm weights lose their ``sequence_parallel`` tag, so finalize_model_grads does
    not sum their grads over TP (each rank keeps the grad of its own sequence shard)."""
    found = 0
    for chunk in chunks:
        for module, name in canonical_module_names(chunk).items():
            if fnmatch.fnmatchcase(name, pattern):
                for p in module.parameters(recurse=False):
                    if getattr(p, "sequence_parallel", False):
                        p.sequence_parallel = False
                        found += 1
    if not found:
        raise ValueError(f"bug injection: no sequence-parallel parameter under {pattern!r}")


def embedding_mask_missing(chunks, pattern: str = "*word_embeddings") -> None:
    """VocabParallelEmbedding forgets to zero the rows of tokens another TP rank owns."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    for _, module in _modules(chunks, pattern, VocabParallelEmbedding):
        if module.tp_group.size() == 1:
            continue
        original = module.forward

        def forward(input_, _module=module, _original=original):
            clamped = (input_ - _module.vocab_start_index).clamp(0, _module.num_embeddings_per_partition - 1)
            shifted = clamped + _module.vocab_start_index
            return _original(shifted)

        module.forward = forward


BUGS: Dict[str, Callable] = {
    "row_allreduce_dropped": row_allreduce_dropped,
    "column_dgrad_allreduce_dropped": column_dgrad_allreduce_dropped,
    "sp_norm_grad_not_reduced": sp_norm_grad_not_reduced,
    "embedding_mask_missing": embedding_mask_missing,
}


def inject(chunks: List[torch.nn.Module], spec: str) -> None:
    name, _, pattern = spec.partition(":")
    if name not in BUGS:
        raise ValueError(f"unknown bug {name!r}; known: {', '.join(sorted(BUGS))}")
    if pattern:
        BUGS[name](chunks, pattern)
    else:
        BUGS[name](chunks)
