"""Heterogeneous-layer recipes: a GPT whose layers differ, as Llama-Nemotron's NAS models do.

A recipe names one by the fields of megatron-core's ``HeterogeneousTransformerConfig`` under
``model:``: ``heterogeneous_layers_config_path`` (a JSON file, relative to the recipe, Megatron-LM's
``--heterogeneous-layers-config-path``) or ``heterogeneous_layers_config_encoded_json`` (its text,
or the same content as a YAML mapping). Its ``block_configs`` list gives each layer's attention and
MLP (the Hugging Face format of nvidia/Llama-3_3-Nemotron-Super-49B-v1's config.json):

* attention: full (with its own ``num_query_groups``, or ``n_heads_in_group``), a single
  column-parallel linear whose TP output is gathered (``replace_with_linear``), or nothing (``no_op``);
* MLP: dense (with its own ``ffn_hidden_size``, or ``ffn_mult``), a linear, or nothing.

The file is read once, when the recipe is validated, and travels as its text, so the reference,
the candidate and their traces all see the same blocks. Each layer's blocks are read here apart
from megatron's parser (:func:`blocks`), and the built model is checked against that reading
(``structure``): a layer megatron builds with another width, another group count or another kind
of sublayer is a finding, not a different model silently compared.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

from ...errors import RecipeError

PATH_KEY = "heterogeneous_layers_config_path"
JSON_KEY = "heterogeneous_layers_config_encoded_json"
KEYS = (PATH_KEY, JSON_KEY)
BLOCKS = "block_configs"

# a sublayer's kind
FULL, LINEAR, NONE = "full", "linear", "none"

# fields megatron's heterogeneous layer spec does not combine with the block configs, and why
_REFUSED_WITH = {
    "num_moe_experts": "Megatron-LM's GPT builder takes the MoE decoder spec before the heterogeneous one "
                       "(gpt_builders.py, gpt_builder), so the blocks' no_op and replace_with_linear would be "
                       "accepted and not honoured",
    "multi_latent_attention": "Megatron-LM asserts 'Multi latent attention with heterogeneous layers is not "
                              "supported' (megatron/training/arguments.py, core_transformer_config_from_args)",
    "mtp_num_layers": "a multi-token prediction layer is built from the decoder's last layer spec and numbered "
                      "past the block configs (get_config_for_layer raises for it): not supported by ttrace yet",
    "heterogeneous_block_specs": "megatron sets it from the block configs (HeterogeneousTransformerConfig."
                                 "__post_init__)",
    "hybrid_layer_pattern": "megatron's heterogeneous layers are a GPTModel's",
}


@dataclasses.dataclass(frozen=True)
class Block:
    """One layer as the block configs describe it: each sublayer's kind and, for a full one, the
    width it overrides (None: the model's own)."""

    attention: str
    mlp: str
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None


def is_heterogeneous(model: Dict[str, Any]) -> bool:
    return any(model.get(k) for k in KEYS)


def ffn_from_mult(ffn_mult: float, hidden_size: int) -> int:
    """Hugging Face's Nemotron-NAS rule for ``ffn_mult``: 2/3 of mult × hidden, rounded up to a
    multiple of 256."""
    size = int(2 * ffn_mult * hidden_size / 3)
    return -(-size // 256) * 256


def _kind(part: Dict[str, Any]) -> str:
    return NONE if part.get("no_op") else LINEAR if part.get("replace_with_linear") else FULL


def blocks(model: Dict[str, Any], where: str = "<recipe>") -> Optional[List[Block]]:
    """Each layer's :class:`Block`, from the recipe's encoded JSON (None: not heterogeneous)."""
    text = model.get(JSON_KEY)
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecipeError(f"{where}: model: '{JSON_KEY}' is not valid JSON ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get(BLOCKS), list):
        raise RecipeError(f"{where}: model: the heterogeneous-layers JSON needs a '{BLOCKS}' list, one entry a layer")
    out = []
    heads, hidden = int(model.get("num_attention_heads", 1)), int(model.get("hidden_size", 0))
    for i, block in enumerate(raw[BLOCKS]):
        attn, mlp = (block or {}).get("attention"), (block or {}).get("ffn", (block or {}).get("mlp"))
        if not isinstance(attn, dict) or not isinstance(mlp, dict):
            raise RecipeError(f"{where}: model: {BLOCKS}[{i}] needs an 'attention' and an 'ffn' (or 'mlp') mapping")
        for part, keys in ((attn, ("num_query_groups", "n_heads_in_group")), (mlp, ("ffn_hidden_size", "ffn_mult"))):
            if not any(k in part for k in keys):  # megatron pops the second and raises KeyError without it
                raise RecipeError(f"{where}: model: {BLOCKS}[{i}] needs '{keys[0]}' or '{keys[1]}' in each of its "
                                  f"{'attention' if part is attn else 'ffn'} (null: the model's own), as "
                                  f"megatron's heterogeneous_config.py build_config_from_dict reads it")
        groups = attn.get("num_query_groups")
        if groups is None and attn.get("n_heads_in_group"):
            if heads % int(attn["n_heads_in_group"]):
                raise RecipeError(f"{where}: model: {BLOCKS}[{i}].attention.n_heads_in_group "
                                  f"{attn['n_heads_in_group']} does not divide num_attention_heads {heads}")
            groups = heads // int(attn["n_heads_in_group"])
        ffn = mlp.get("ffn_hidden_size")
        if ffn is None and mlp.get("ffn_mult") is not None:
            ffn = ffn_from_mult(float(mlp["ffn_mult"]), hidden)
        out.append(Block(_kind(attn), _kind(mlp), None if groups is None else int(groups),
                         None if ffn is None else int(ffn)))
    return out


def normalize(model: Dict[str, Any], source: str) -> None:
    """Read the path's JSON (relative to the recipe) into the encoded-JSON field, and a YAML
    mapping given there into its text, so the blocks travel with the recipe."""
    if model.get(PATH_KEY) and model.get(JSON_KEY):
        raise RecipeError(f"{source}: model: give '{PATH_KEY}' or '{JSON_KEY}', not both")
    if isinstance(model.get(JSON_KEY), dict):
        model[JSON_KEY] = json.dumps(model[JSON_KEY])
    path = model.pop(PATH_KEY, None)
    if not path:
        return
    if not os.path.isabs(path) and os.path.exists(source):
        path = os.path.join(os.path.dirname(os.path.abspath(source)), path)
    try:
        with open(path) as f:
            model[JSON_KEY] = f.read()
    except OSError as e:
        raise RecipeError(f"{source}: model: '{PATH_KEY}' {path}: cannot read it ({e.strerror})") from None


# megatron's linear replacement pads the sequence dimension where it means the hidden one under
# sequence parallelism (F.pad's pad list starts at the last dimension): its output never matches the
# residual, and the layer raises in the bias-dropout-add
LINEAR_WITH_SP = ("megatron-core's gathered linear (replace_with_linear) pads dimension 0 (the sequence) instead of "
                  "the hidden dimension before its reduce-scatter (megatron/core/transformer/heterogeneous/"
                  "linear_replacements.py:37, 0.16.1 and 0.19.2: F.pad's list starts at the last dimension), so with "
                  "sequence parallelism and TP > 1 the layer's output is [(s + h - h/TP)/TP, b, h/TP] and the "
                  "residual add raises; turn sequence_parallel off for this model")


def check(model: Dict[str, Any], parallel: Dict[str, Any], where: str) -> None:
    """Refuse what megatron's heterogeneous layers cannot honour, naming the field."""
    if not is_heterogeneous(model):
        return
    layers = blocks(model, where)
    for key, why in _REFUSED_WITH.items():
        if model.get(key):
            raise RecipeError(f"{where}: model: '{key}' cannot be set with '{JSON_KEY}': {why}")
    num_layers = model.get("num_layers")
    if num_layers != len(layers):
        raise RecipeError(f"{where}: model: the heterogeneous-layers JSON has {len(layers)} block configs for "
                          f"num_layers {num_layers}: megatron reads one per layer and ignores the rest "
                          f"(HeterogeneousTransformerConfig.get_config_for_layer)")
    replaced = [i for i, b in enumerate(layers) if LINEAR in (b.attention, b.mlp)]
    if replaced and parallel.get("sequence_parallel") and int(parallel.get("tensor_model_parallel_size", 1)) > 1:
        raise RecipeError(f"{where}: parallel: 'sequence_parallel' is not supported by ttrace with {BLOCKS}[{replaced[0]}]'s "
                          f"replace_with_linear: {LINEAR_WITH_SP}")
    for i, block in enumerate(layers):
        if block.num_query_groups is not None and block.attention != FULL:
            raise RecipeError(f"{where}: model: {BLOCKS}[{i}] gives num_query_groups to an attention that is "
                              f"{block.attention} (megatron asserts it, heterogeneous_config.py get_config_for_layer)")
        if block.ffn_hidden_size is not None and block.mlp != FULL:
            raise RecipeError(f"{where}: model: {BLOCKS}[{i}] gives ffn_hidden_size to an MLP that is {block.mlp} "
                              f"(megatron asserts it, heterogeneous_config.py get_config_for_layer)")


def config_class():
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

    return HeterogeneousTransformerConfig


def layer_spec(config, vp_stage):
    """megatron's heterogeneous spec for the local implementation (Megatron-LM's GPT builder with
    ``--heterogeneous-layers-config-path``), this stage's and virtual chunk's layers."""
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec

    return get_gpt_heterogeneous_layer_spec(config, use_te=False, vp_stage=vp_stage)


def is_gathered_linear(module) -> bool:
    """A ``replace_with_linear`` sublayer: a column-parallel linear that gathers its TP output (with
    sequence parallelism: reduce-scatters it over the sequence), so its output is whole in h."""
    return type(module).__name__ in ("ColumnParallelLinearGathered", "TELayerNormColumnParallelLinearGathered")
