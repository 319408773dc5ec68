"""HybridModel recipes: megatron-core's layer pattern in place of GPTModel's uniform layers.

A recipe names a HybridModel by ``model: hybrid_layer_pattern`` (Megatron-LM's
``--hybrid-layer-pattern``): one symbol per layer (``*`` attention, ``-`` dense MLP, ``E`` MoE),
``|`` between pipeline segments. As in Megatron-LM's arguments, the pattern gives ``num_layers``
and sets ``is_hybrid_model``, and its segments give the virtual pipeline size (segments / PP).
The one-rank reference runs the same layers in one segment.

Layers are built from megatron's local layer spec (the one GPTModel's ``--transformer-impl local``
uses): an attention layer is a TransformerLayer with the spec's norm, attention and
bias-dropout-add; a ``-`` layer is megatron's MLPLayer; an ``E`` layer its MoETransformerLayer.
Layer ``i`` of the pattern is canonical ``decoder.layers.{i}`` (its global layer number), so the
seed checkpoint and the traces are keyed by hybrid layer numbers.

The migration check: a pattern of attention/MLP pairs (``*-*-``, ``*E*E``, ``*-*E``) computes
what a GPTModel with one layer per pair computes. :func:`gpt_equivalent` gives that GPT recipe,
and :func:`gpt_name` names the hybrid model's tensors as that GPT's, so a GPT reference and a
hybrid candidate compare tensor by tensor (``ttrace run --reference-model gpt``).
"""

from __future__ import annotations

import copy
import re
from typing import Any, Dict, List, Optional

from ...errors import RecipeError

PATTERN_KEY = "hybrid_layer_pattern"
ATTENTION, MLP, MOE, PIPE = "*", "-", "E", "|"
LAYER_SYMBOLS = (ATTENTION, MLP, MOE)

# symbols of megatron's pattern ttrace does not record, and why (refused before anything runs)
_KERNELS = ("needs its CUDA kernels, which this CPU machine does not have; on a GPU it is not verified by "
            "ttrace yet (no test shows reference and candidate agree with it)")
REFUSED_SYMBOLS = {
    "M": "a Mamba layer (mamba_ssm and causal-conv1d) " + _KERNELS,
    "G": "a Gated DeltaNet layer (flash-linear-attention's Triton kernels) " + _KERNELS,
    "D": "a DeepSeek sparse attention layer (TransformerEngine) " + _KERNELS,
    "+": "a multi-latent attention layer: multi-latent attention is not supported by ttrace yet",
    "/": "multi-token prediction layers: multi-token prediction is not supported by ttrace yet",
}
# fields a pattern replaces (Megatron-LM asserts the same for --hybrid-layer-pattern)
_REPLACED = {
    "moe_layer_freq": "the pattern's E symbols place the MoE layers",
    "is_hybrid_model": "the pattern sets it, as Megatron-LM's --hybrid-layer-pattern does",
}


def pattern_of(model: Dict[str, Any]) -> Optional[str]:
    """The recipe's hybrid layer pattern, or None for a GPTModel recipe."""
    return model.get(PATTERN_KEY)


def segments(pattern: str) -> List[str]:
    return pattern.split(PIPE)


def layers(pattern: str) -> str:
    """The pattern's layer symbols, one per layer, without the pipeline separators."""
    return pattern.replace(PIPE, "")


def check(model: Dict[str, Any], parallel: Dict[str, Any], where: str) -> None:
    """Refuse, before anything runs, a hybrid recipe ttrace cannot build as described (the
    installed release last: what is wrong with the recipe itself is said on every release)."""
    from . import compat

    pattern = pattern_of(model)
    if pattern is None:
        return
    if not isinstance(pattern, str) or not layers(pattern):
        raise RecipeError(f"{where}: model: '{PATTERN_KEY}' must be a non-empty string of layer symbols, "
                          f"got {pattern!r}")
    for symbol, why in REFUSED_SYMBOLS.items():
        if symbol in pattern:
            raise RecipeError(f"{where}: model: '{PATTERN_KEY}' {pattern!r} has '{symbol}', {why}")
    unknown = sorted(set(layers(pattern)) - set(LAYER_SYMBOLS))
    if unknown:
        raise RecipeError(f"{where}: model: '{PATTERN_KEY}' {pattern!r} has unknown symbols {unknown} "
                          f"(layers are {'/'.join(LAYER_SYMBOLS)}, '{PIPE}' separates pipeline segments)")
    if any(not s for s in segments(pattern)):
        raise RecipeError(f"{where}: model: '{PATTERN_KEY}' {pattern!r} has an empty pipeline segment")
    for key, why in _REPLACED.items():
        if key in model:
            raise RecipeError(f"{where}: model: '{key}' cannot be set with '{PATTERN_KEY}': {why}")
    if "num_layers" in model and model["num_layers"] != len(layers(pattern)):
        raise RecipeError(f"{where}: model: 'num_layers' is {model['num_layers']} but '{PATTERN_KEY}' {pattern!r} "
                          f"has {len(layers(pattern))} layers (leave num_layers out: the pattern gives it)")
    if MOE in pattern and not model.get("num_moe_experts"):
        raise RecipeError(f"{where}: model: '{PATTERN_KEY}' {pattern!r} has MoE layers (E) but "
                          f"'num_moe_experts' is not set")
    pp = int(parallel.get("pipeline_model_parallel_size", 1))
    count = len(segments(pattern))
    if count > 1 and count % pp:
        raise RecipeError(f"{where}: model: '{PATTERN_KEY}' {pattern!r} has {count} pipeline segments, not a "
                          f"multiple of pipeline_model_parallel_size {pp}")
    vpp = parallel.get("virtual_pipeline_model_parallel_size")
    if vpp is not None and count > 1 and vpp != count // pp:
        raise RecipeError(f"{where}: parallel: 'virtual_pipeline_model_parallel_size' is {vpp} but '{PATTERN_KEY}' "
                          f"{pattern!r} has {count} segments over {pp} pipeline stages (leave it out: the "
                          f"pattern gives it, as in Megatron-LM)")
    if vpp not in (None, 1) and count == 1:
        raise RecipeError(f"{where}: parallel: 'virtual_pipeline_model_parallel_size' needs '{PIPE}' segments in "
                          f"'{PATTERN_KEY}' (megatron splits a pattern without them over PP stages only)")
    if not compat.has_hybrid_model():
        import megatron.core

        raise RecipeError(f"{where}: model: '{PATTERN_KEY}' needs HybridModel, which megatron-core 0.18 added; "
                          f"the installed megatron-core is {megatron.core.__version__}")


def with_pattern_layout(model: Dict[str, Any], parallel: Dict[str, Any]) -> Dict[str, Any]:
    """``parallel`` with the virtual pipeline size the pattern's segments give (segments / PP when
    there are more segments than stages), as Megatron-LM's arguments derive it. Without pipeline
    stages (the one-rank reference) the segments are one (:func:`side_pattern`)."""
    pattern = pattern_of(model)
    if pattern is None:
        return parallel
    count = len(segments(pattern))
    pp = int(parallel.get("pipeline_model_parallel_size", 1))
    out = dict(parallel)
    if pp > 1 and count > pp:
        out["virtual_pipeline_model_parallel_size"] = count // pp
    return out


def side_pattern(pattern: str, pp: int, vpp: int) -> str:
    """The pattern one side builds: the candidate's own, or for a run without pipeline stages (the
    one-rank reference) the same layers as one segment (megatron reads several segments without
    PP as virtual stages and would build only the first)."""
    return pattern if pp * vpp > 1 else layers(pattern)


def config_fields(model: Dict[str, Any]) -> Dict[str, Any]:
    """The TransformerConfig fields the pattern sets (Megatron-LM: num_layers from the pattern,
    ``is_hybrid_model`` on)."""
    pattern = pattern_of(model)
    if pattern is None:
        return {}
    return {"num_layers": len(layers(pattern)), "is_hybrid_model": True}


def stack_spec(config):
    """The HybridStack spec of megatron's local layers (see the module docstring)."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                             TransformerLayerSubmodules)

    from . import compat

    dense = compat.local_layer_spec(config, moe=False).submodules
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=dense.input_layernorm, self_attention=dense.self_attention,
        self_attn_bda=dense.self_attn_bda))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda))
    moe = None
    if config.num_moe_experts:
        experts = compat.local_layer_spec(config, moe=True).submodules
        moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=experts.pre_mlp_layernorm, mlp=experts.mlp, mlp_bda=experts.mlp_bda))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=attention, mlp_layer=mlp, moe_layer=moe))


def final_norm_class(config):
    """The norm class the local spec builds norms with (GPTModel's final_layernorm is one)."""
    from . import compat

    return compat.local_layer_spec(config, moe=False).submodules.input_layernorm


# --- the migration check: a hybrid pattern of attention/MLP pairs against its GPTModel ---

_PAIRS = re.compile(r"^(?:\*[-E])+$")


def gpt_equivalent(recipe: Dict[str, Any]) -> Dict[str, Any]:
    """The GPTModel recipe (``Recipe.to_json`` form) a hybrid recipe of attention/MLP pairs equals:
    one GPT layer per pair, MoE where the pair's second layer is ``E`` (``moe_layer_freq``); the
    other fields as they are. Raises RecipeError for a pattern without that form."""
    model = recipe["model"]
    pattern = pattern_of(model)
    where = f"recipe {recipe.get('name', '')}".strip()
    if pattern is None:
        raise RecipeError(f"{where}: a GPT reference needs a HybridModel candidate ('{PATTERN_KEY}' under model:)")
    flat = layers(pattern)
    if not _PAIRS.match(flat):
        raise RecipeError(f"{where}: model: '{PATTERN_KEY}' {pattern!r} has no GPTModel equivalent: a GPT layer is "
                          f"an attention layer followed by an MLP or MoE layer ('*-' or '*E' pairs)")
    out = copy.deepcopy(recipe)
    gpt = {k: v for k, v in model.items() if k != PATTERN_KEY}
    gpt["num_layers"] = len(flat) // 2
    if MOE in flat:
        gpt["moe_layer_freq"] = [int(flat[2 * i + 1] == MOE) for i in range(len(flat) // 2)]
    out["model"] = gpt
    return out


_LAYER = re.compile(r"^decoder\.layers\.(\d+)(\.|$)")
FINAL_NORM, GPT_FINAL_NORM = "decoder.final_norm", "decoder.final_layernorm"


def gpt_name(name: str) -> str:
    """A hybrid model's canonical module name as the equivalent GPTModel's (pattern of pairs):
    hybrid layers ``2k`` (attention) and ``2k + 1`` (MLP/MoE) are GPT layer ``k``, whose
    submodule names (input_layernorm, self_attention, pre_mlp_layernorm, mlp) they already use."""
    if name == FINAL_NORM or name.startswith(FINAL_NORM + "."):
        return GPT_FINAL_NORM + name[len(FINAL_NORM):]
    m = _LAYER.match(name)
    if m is None:
        return name
    return f"decoder.layers.{int(m.group(1)) // 2}" + name[m.end(1):]
