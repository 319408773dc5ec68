"""Canonical names: no wrapper prefixes (DDP, Float16Module), global layer numbers."""

from __future__ import annotations

import fnmatch
import re
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Type, Union

import torch

from ...keys import LOSS_MODULE

# a model may carry a function of its canonical names to the names it is traced under (a HybridModel
# traced as its GPTModel equivalent: ``hybrid.gpt_name``); every canonical name goes through it
NAME_MAP_ATTR = "_ttrace_name_map"

_LOCAL_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)(\.|$)")
_EXPERT_RE = re.compile(r"^(.*\.local_experts\.\d+)(\.|$)")


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def canonical_module_names(chunk: torch.nn.Module) -> Dict[torch.nn.Module, str]:
    """module -> canonical name for every module of one (unwrapped) model chunk.

    ``decoder.layers.{i}`` uses the chunk-local index ``i``; the canonical name uses the layer's
    global number (``TransformerLayer.layer_number - 1``), which is the same whatever the
    pipeline split. Likewise ``experts.local_experts.{i}`` becomes the global expert id. A model
    carrying ``NAME_MAP_ATTR`` maps every name through it last.
    """
    model = unwrap(chunk)
    rename = getattr(model, NAME_MAP_ATTR, None)
    names: Dict[torch.nn.Module, str] = {}
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    experts = {}  # "<...>.local_experts.<local>" -> "<...>.local_experts.<global>"
    for name, module in model.named_modules():
        if hasattr(module, "local_experts") and hasattr(module, "ep_group"):
            # expert parallelism: EP rank r holds experts r·n … r·n + n − 1 as local_experts.0 … n − 1
            offset = module.ep_group.rank() * module.num_local_experts
            for i in range(len(module.local_experts)):
                experts[f"{name}.local_experts.{i}"] = f"{name}.local_experts.{offset + i}"
    for name, module in model.named_modules():
        m = _EXPERT_RE.match(name)
        if m and m.group(1) in experts:
            name = experts[m.group(1)] + name[m.end(1):]
        m = _LOCAL_LAYER_RE.match(name)
        if m and layers is not None:
            local = int(m.group(1))
            global_index = layers[local].layer_number - 1
            name = f"decoder.layers.{global_index}" + name[m.end(1):]
        names[module] = rename(name) if rename is not None else name
    return names


TIED_EMBEDDING = "embedding.word_embeddings"
OUTPUT_LAYER = "output_layer"
MTP_LAYERS = "mtp.layers"  # the MultiTokenPredictionBlock's layers: ``mtp.layers.{depth - 1}``


def mtp_layers(chunks: Sequence[torch.nn.Module]) -> int:
    """The model's multi-token prediction depths (``mtp_num_layers``; 0 without)."""
    for chunk in chunks:
        config = getattr(unwrap(chunk), "config", None)
        if config is not None:
            return int(getattr(config, "mtp_num_layers", None) or 0)
    return 0


def mtp_repeated(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether one MTP layer runs at every depth (``mtp_use_repeated_layer``, 0.17 on)."""
    for chunk in chunks:
        config = getattr(unwrap(chunk), "config", None)
        if config is not None:
            return bool(getattr(config, "mtp_use_repeated_layer", False))
    return False


def calls_made_elsewhere(chunks: Sequence[torch.nn.Module]) -> Dict[torch.nn.Module, int]:
    """module -> how many of its calls per microbatch (:func:`call_name`'s occurrences) run on another
    pipeline stage: the last stage's copy of the word embeddings (multi-token prediction with PP)
    embeds only the MTP depths' tokens, the decoder's run on the first stage."""
    out: Dict[torch.nn.Module, int] = {}
    for chunk in chunks:
        model = unwrap(chunk)
        if getattr(model, "mtp_process", False) and not getattr(model, "pre_process", True):
            out[model.embedding.word_embeddings] = 1
    return out


def mtp_loss_name(depth_index: int) -> str:
    """The module name the per-token loss of MTP depth ``depth_index + 1`` is recorded under."""
    return f"{MTP_LAYERS}.{depth_index}.{LOSS_MODULE}"


def call_name(module_name: str, occurrence: int, mtp_depths: int, mtp_repeated: bool = False) -> str:
    """What the ``occurrence``-th call (0-based) of a module within one microbatch's forward is
    recorded under.

    A module runs once per microbatch, except with multi-token prediction (megatron-core's
    ``GPTModel._postprocess`` and ``MultiTokenPredictionLayer._get_embeddings``): the word
    embeddings run first for the decoder's tokens, then once per MTP depth k on the tokens shifted
    k places (``mtp.layers.{k-1}.embedding.word_embeddings``); the output layer runs first for each
    depth's hidden states (``mtp.layers.{k-1}.output_layer``), then for the decoder's. With
    ``mtp_repeated`` (``mtp_use_repeated_layer``) megatron builds one MTP layer, ``mtp.layers.0``,
    and runs it at every depth: its k-th call is recorded as depth k's, ``mtp.layers.{k}``, as the
    layers of a run without it are named. Named by what they compute, the calls of a run with MTP
    compare one by one with the reference's. Any other repeated call is ``{module}#{occurrence}``."""
    if mtp_depths:
        if module_name == OUTPUT_LAYER and occurrence <= mtp_depths:
            return module_name if occurrence == mtp_depths else f"{MTP_LAYERS}.{occurrence}.{module_name}"
        if module_name == TIED_EMBEDDING and 1 <= occurrence <= mtp_depths:
            return f"{MTP_LAYERS}.{occurrence - 1}.{module_name}"
        first = f"{MTP_LAYERS}.0"
        if mtp_repeated and occurrence < mtp_depths and (module_name == first or module_name.startswith(first + ".")):
            return f"{MTP_LAYERS}.{occurrence}{module_name[len(first):]}"
    return module_name if occurrence == 0 else f"{module_name}#{occurrence}"


def canonical_parameters(chunk: torch.nn.Module) -> Iterator[Tuple[str, str, torch.nn.Module, torch.nn.Parameter]]:
    """(module name, param name, module, param) for every parameter, in canonical names.

    With tied embeddings and PP > 1 the last stage holds its own copy of the word embeddings as
    ``output_layer.weight`` (megatron tags both copies ``shared_embedding``); a single-stage model
    has only ``embedding.word_embeddings.weight``. The copy is named after the embedding, so the
    two stages' copies are replicas of one logical parameter.
    """
    names = canonical_module_names(chunk)
    unused = unused_output_weight(chunk)
    for module, mname in names.items():
        for pname, param in module.named_parameters(recurse=False):
            if param is unused:
                continue  # a parameter megatron allocates and never uses: no logical tensor of the model
            if mname == OUTPUT_LAYER and pname == "weight" and getattr(param, "shared_embedding", False):
                mname = TIED_EMBEDDING
            yield mname, pname, module, param


UNUSED_OUTPUT_WEIGHT = (
    "allocated by megatron-core and never used: with tied embeddings and multi-token prediction the last "
    "pipeline stage projects with its copy of the word embeddings (gpt_model.py, shared_embedding_or_output_weight), "
    "yet its output layer allocates a weight of its own, since skip_weight_param_allocation is pre_process and "
    "tied (gpt_model.py:249 at 0.16.1); no output depends on it, so there is nothing to judge")


def unused_output_weight(chunk: torch.nn.Module) -> Optional[torch.nn.Parameter]:
    """The output layer's weight of a last pipeline stage that runs multi-token prediction with tied
    embeddings: megatron allocates it and projects with the embedding copy instead (UNUSED_OUTPUT_WEIGHT)."""
    model = unwrap(chunk)
    if (getattr(model, "share_embeddings_and_output_weights", False) and getattr(model, "mtp_process", False)
            and getattr(model, "post_process", False) and not getattr(model, "pre_process", True)):
        layer = getattr(model, "output_layer", None)
        return getattr(layer, "weight", None)
    return None


def full_param_name(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


def all_parameters(chunks: List[torch.nn.Module]):
    for chunk in chunks:
        yield from canonical_parameters(chunk)


def named_modules(chunks: Sequence[torch.nn.Module], pattern: str = "*",
                  cls: Optional[Union[Type, Tuple[Type, ...]]] = None) -> List[Tuple[str, torch.nn.Module]]:
    """(canonical name, module) of every module of ``chunks`` whose name matches the fnmatch
    ``pattern`` (and that is an instance of ``cls``): the one way features, FP8 emulation and bug
    injection choose the modules they act on."""
    return [(name, module) for chunk in chunks for module, name in canonical_module_names(chunk).items()
            if fnmatch.fnmatchcase(name, pattern) and (cls is None or isinstance(module, cls))]
