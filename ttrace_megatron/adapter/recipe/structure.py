"""Is the built model the model the recipe describes?

Checked on the built chunks of every rank before the first iteration, field by field for the
``STRUCTURE`` fields of ``model_fields`` and the GPTModel arguments: what each field implies for the
module tree and the parameter set (a q/k layernorm with parameters, a bias on every linear, the MoE
layer pattern, a shared expert, the fused QKV's width), and which layers each pipeline stage and
virtual chunk built (:func:`layer_split`). A model built other than described is never compared:
its problems (the field, the module and what was found) make the check a FAIL localized to the
build, since the recipe itself passed validation.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import compat, heterogeneous
from .naming import unwrap


def moe_layer_pattern(config) -> List[bool]:
    """Which of the model's layers are MoE, as megatron reads ``moe_layer_freq``: an int N makes
    every N-th layer MoE starting with the first, a list gives one 0/1 per layer."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(x) for x in freq]


def _has_params(module: Optional[torch.nn.Module]) -> bool:
    return module is not None and any(True for _ in module.parameters(recurse=True))


def _bias(module: Optional[torch.nn.Module]) -> bool:
    return getattr(module, "bias", None) is not None


def _expect(problems: List[str], where: str, field: str, expected, found) -> None:
    if expected != found:
        problems.append(f"{where}: {field} asks for {expected!r}, the built model has {found!r}")


def _check_linears(problems: List[str], where: str, mlp: torch.nn.Module, config, ffn: int) -> None:
    fc1, fc2 = getattr(mlp, "linear_fc1", None), getattr(mlp, "linear_fc2", None)
    if fc1 is None or fc2 is None:
        problems.append(f"{where}: no linear_fc1/linear_fc2 (an MLP megatron's local spec would build)")
        return
    _expect(problems, f"{where}.linear_fc1", "add_bias_linear", bool(config.add_bias_linear), _bias(fc1))
    _expect(problems, f"{where}.linear_fc2", "add_bias_linear", bool(config.add_bias_linear), _bias(fc2))
    width = ffn * (2 if config.gated_linear_unit else 1)
    _expect(problems, f"{where}.linear_fc1 output size", "ffn size × (2 if gated_linear_unit)", width,
            int(fc1.output_size))


def decoder_modules(chunk: torch.nn.Module):
    """The modules of a chunk's decoder (not its multi-token prediction block, whose transformer
    layers are numbered after the decoder's)."""
    return unwrap(chunk).decoder.modules()


# a sublayer a layer has in place of attention or an MLP: one column-parallel linear whose TP output
# is gathered (a heterogeneous model's ``replace_with_linear``)
LINEAR = "linear"
HYBRID_FIELD = "hybrid_layer_pattern"


@dataclasses.dataclass(frozen=True)
class LayerContent:
    """What one layer holds: attention (True, False or :data:`LINEAR`), its MLP ("dense", "moe",
    :data:`LINEAR` or None), the widths a heterogeneous layer overrides (None: the model's own) and
    the recipe field that decides which sublayers there are (named in a problem)."""

    attention: Any
    mlp: Optional[str]
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    field: str = HYBRID_FIELD


def layer_contents(config, pattern: Optional[str] = None) -> List[LayerContent]:
    """Each of the model's layers: a GPTModel's layers all have both sublayers (MoE as
    ``moe_layer_freq`` says), or what its heterogeneous block configs give, read apart from megatron's
    parser (``heterogeneous.blocks``); a HybridModel's have one each, by the symbol of its pattern
    (``*`` attention, ``-`` dense MLP, ``E`` MoE)."""
    if pattern is None:
        hetero = _heterogeneous_blocks(config)
        if hetero is not None:
            kind = {heterogeneous.FULL: True, heterogeneous.LINEAR: LINEAR, heterogeneous.NONE: False}
            mlp = {heterogeneous.FULL: "dense", heterogeneous.LINEAR: LINEAR, heterogeneous.NONE: None}
            return [LayerContent(kind[b.attention], mlp[b.mlp], b.num_query_groups, b.ffn_hidden_size,
                                 heterogeneous.BLOCKS) for b in hetero]
        moe = moe_layer_pattern(config) if config.num_moe_experts else [False] * config.num_layers
        return [LayerContent(True, "moe" if m else "dense") for m in moe]
    from .hybrid import ATTENTION, MOE, layers

    return [LayerContent(True, None) if s == ATTENTION else LayerContent(False, "moe" if s == MOE else "dense")
            for s in layers(pattern)]


def _heterogeneous_blocks(config) -> Optional[List["heterogeneous.Block"]]:
    if not getattr(config, "heterogeneous_block_specs", False):
        return None
    return heterogeneous.blocks({"num_attention_heads": config.num_attention_heads,
                                 "hidden_size": config.hidden_size,
                                 heterogeneous.JSON_KEY: getattr(config, heterogeneous.JSON_KEY, "")})


def check_built_as_described(chunks: Sequence[torch.nn.Module], config, gpt_kwargs: Dict[str, Any],
                             pattern: Optional[str] = None) -> List[str]:
    """What differs between the built chunks of this rank and the recipe's fields ("" list: none);
    ``pattern``: the recipe's hybrid layer pattern (a HybridModel)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    problems: List[str] = []
    contents = layer_contents(config, pattern)
    norm_kind = "RMSNorm" if config.normalization == "RMSNorm" else "LayerNorm"
    for chunk in chunks:
        model = unwrap(chunk)
        _check_model(problems, model, gpt_kwargs, pattern, norm_kind)
        for layer in (m for m in decoder_modules(model) if isinstance(m, TransformerLayer)):
            n = layer.layer_number  # global, 1-based
            where = f"decoder.layers.{n - 1}"
            if not 1 <= n <= config.num_layers:
                problems.append(f"{where}: layer number {n} outside num_layers {config.num_layers}")
                continue
            _check_layer(problems, where, layer, contents[n - 1], config, pattern, norm_kind)
        _check_mtp(problems, model, config, contents, pattern, norm_kind)
    return problems


def _check_layer(problems: List[str], where: str, layer, content: LayerContent, config,
                 pattern: Optional[str], norm_kind: str) -> None:
    for norm, present in (("input_layernorm", content.attention is not False),
                          ("pre_mlp_layernorm", content.mlp is not None)):
        found = type(getattr(layer, norm)).__name__
        if present and norm_kind not in found:
            problems.append(f"{where}.{norm}: normalization asks for {norm_kind}, the built model has {found}")
        if not present:
            _expect(problems, f"{where}.{norm}", f"{content.field} (no such sublayer)", False,
                    _has_params(getattr(layer, norm)))
    _check_attention(problems, f"{where}.self_attention", layer.self_attention, content, config)
    _check_mlp(problems, f"{where}.mlp", layer.mlp, content, config, pattern)


def _check_gathered_linear(problems: List[str], where: str, module, content: LayerContent, config) -> None:
    """A sublayer replaced by one linear: a column-parallel [h → h] whose output is gathered."""
    if not heterogeneous.is_gathered_linear(module):
        problems.append(f"{where}: {content.field} (replace_with_linear) asks for a gathered column-parallel linear, "
                        f"the built model has {type(module).__name__}")
        return
    _expect(problems, where, f"{content.field} (replace_with_linear: [hidden_size → hidden_size])",
            (config.hidden_size, config.hidden_size), (int(module.input_size), int(module.output_size)))
    _expect(problems, where, "add_bias_linear", bool(config.add_bias_linear), _bias(module))


def _check_mtp(problems: List[str], model, config, contents, pattern: Optional[str], norm_kind: str) -> None:
    """``mtp_num_layers``: the last stage holds that many MTP layers (megatron-core puts them all
    there without a custom pipeline layout), or one run at every depth with
    ``mtp_use_repeated_layer``, each with its norms, its [2h → h] projection and a transformer layer
    built like the decoder's last, numbered after the decoder; no other stage holds one."""
    depths = int(getattr(config, "mtp_num_layers", None) or 0)
    repeated = bool(getattr(config, "mtp_use_repeated_layer", False))
    block = getattr(model, "mtp", None)
    built = len(block.layers) if block is not None else 0
    expected = (min(depths, 1) if repeated else depths) if getattr(model, "post_process", False) else 0
    _expect(problems, "mtp.layers", "one layer for every depth (mtp_use_repeated_layer, on the last pipeline stage)"
            if repeated else "mtp_num_layers (on the last pipeline stage)", expected, built)
    for k in range(min(expected, built)):
        layer, where = block.layers[k], f"mtp.layers.{k}"
        for norm in ("enorm", "hnorm", "final_layernorm"):
            found = type(getattr(layer, norm, None)).__name__
            if norm_kind not in found:
                problems.append(f"{where}.{norm}: normalization asks for {norm_kind}, the built model has {found}")
        proj = getattr(layer, "eh_proj", None)
        _expect(problems, f"{where}.eh_proj", "[2·hidden_size → hidden_size] without bias",
                (2 * config.hidden_size, config.hidden_size, False),
                (int(getattr(proj, "input_size", 0)), int(getattr(proj, "output_size", 0)), _bias(proj)))
        inner = compat.mtp_transformer_layer(layer)
        numbered, expected = compat.mtp_layer_number(layer, config.num_layers, k)
        _expect(problems, f"{where}.transformer_layer", f"layer number ({numbered})", expected, inner.layer_number)
        _check_layer(problems, f"{where}.transformer_layer", inner, contents[-1], config, pattern, norm_kind)


def _check_model(problems: List[str], model, gpt_kwargs: Dict[str, Any], pattern: Optional[str],
                 norm_kind: str) -> None:
    """The GPTModel arguments, the position embedding (first stage) and the final norm (last stage)."""
    for a in ("share_embeddings_and_output_weights", "position_embedding_type", "parallel_output"):
        if a in gpt_kwargs:
            _expect(problems, "model", a, gpt_kwargs[a], getattr(model, a, None))
    if getattr(model, "pre_process", False):
        learned = gpt_kwargs.get("position_embedding_type") == "learned_absolute"
        _expect(problems, "embedding", "position_embedding_type learned_absolute (position_embeddings)", learned,
                _has_params(getattr(model.embedding, "position_embeddings", None)))
    if getattr(model, "post_process", False):
        final = "final_layernorm" if pattern is None else "final_norm"
        found = type(getattr(model.decoder, final, None)).__name__
        if norm_kind not in found:
            problems.append(f"decoder.{final}: normalization asks for {norm_kind}, the built model has {found}")


def _check_attention(problems: List[str], where: str, attn, content: LayerContent, config) -> None:
    """A layer's attention: present where the pattern or block config asks for it, its qk norms,
    biases and the width of linear_qkv (query, key and value heads, the layer's own query groups)."""
    if content.attention == LINEAR:
        _check_gathered_linear(problems, where, attn, content, config)
        return
    if not content.attention:
        absent = "an MLP layer, no attention" if content.field == HYBRID_FIELD else "no attention"
        _expect(problems, where, f"{content.field} ({absent})", False, _has_params(attn))
        return
    if not hasattr(attn, "linear_qkv"):
        asks = f"{HYBRID_FIELD} (*)" if content.field == HYBRID_FIELD else content.field
        problems.append(f"{where}: {asks} asks for attention, the built model has {type(attn).__name__}")
        return
    kv = config.kv_channels or config.hidden_size // config.num_attention_heads
    groups = content.num_query_groups or config.num_query_groups or config.num_attention_heads
    for qk in ("q_layernorm", "k_layernorm"):
        if getattr(config, "qk_l2_norm", False):  # parameter-free: the norm's kind is what there is to check
            _expect(problems, f"{where}.{qk}", "qk_l2_norm", "L2Norm", type(getattr(attn, qk, None)).__name__)
            continue
        _expect(problems, f"{where}.{qk}", "qk_layernorm", bool(config.qk_layernorm),
                _has_params(getattr(attn, qk, None)))
    _expect(problems, f"{where}.linear_qkv", "add_bias_linear or add_qkv_bias",
            bool(config.add_bias_linear or config.add_qkv_bias), _bias(attn.linear_qkv))
    _expect(problems, f"{where}.linear_proj", "add_bias_linear", bool(config.add_bias_linear), _bias(attn.linear_proj))
    gate = config.num_attention_heads if getattr(config, "attention_output_gate", False) else 0
    _expect(problems, f"{where}.linear_qkv output size", "kv_channels × (num_attention_heads + 2·num_query_groups "
            "+ num_attention_heads with attention_output_gate)"
            + (f" ({content.field}: this layer's num_query_groups)" if content.num_query_groups else ""),
            kv * (config.num_attention_heads + 2 * groups + gate), int(attn.linear_qkv.output_size))


def _check_mlp(problems: List[str], where: str, module, content: LayerContent, config,
               pattern: Optional[str]) -> None:
    """A layer's MLP: absent, dense (of the layer's own width), a gathered linear or MoE as the
    recipe asks, its linears, the experts and a shared expert with its gate."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = content.mlp
    if mlp == LINEAR:
        _check_gathered_linear(problems, where, module, content, config)
        return
    if mlp is None:
        absent = "an attention layer, no MLP" if content.field == HYBRID_FIELD else "no MLP"
        _expect(problems, where, f"{content.field} ({absent})", False, _has_params(module))
        return
    is_moe = isinstance(module, MoELayer)
    moe_field = "num_moe_experts / moe_layer_freq (MoE layer)" if pattern is None else "hybrid_layer_pattern (E)"
    _expect(problems, where, moe_field, mlp == "moe", is_moe)
    if not is_moe:
        _check_linears(problems, where, module, config, content.ffn_hidden_size or config.ffn_hidden_size)
        return
    experts = getattr(module.experts, "local_experts", None) or []
    for i, expert in enumerate(experts):
        _check_linears(problems, f"{where}.experts.local_experts.{i}", expert, config, config.moe_ffn_hidden_size)
    shared = getattr(module, "shared_experts", None)
    _expect(problems, f"{where}.shared_experts", "moe_shared_expert_intermediate_size (a shared expert)",
            bool(config.moe_shared_expert_intermediate_size), shared is not None)
    if shared is not None:
        _check_linears(problems, f"{where}.shared_experts", shared, config, config.moe_shared_expert_intermediate_size)
        _expect(problems, f"{where}.shared_experts", "moe_shared_expert_gate (a gate weight)",
                bool(config.moe_shared_expert_gate), getattr(shared, "gate_weight", None) is not None)


# ---- which layers each pipeline stage and virtual chunk builds


def layer_split(config, pp: int, vpp: int) -> Dict[Tuple[int, int], List[int]]:
    """{(pipeline rank, virtual chunk): the global 0-based numbers of the decoder layers it builds},
    by Megatron-LM's documented split, written here apart from megatron's own offset code so that
    a wrong offset there is caught: an explicit ``pipeline_model_parallel_layout`` (segments listed
    chunk-major: chunk 0 of every stage, then chunk 1, ...), or uneven first and last stages
    (``num_layers_in_first/last_pipeline_stage``, the other stages sharing the rest evenly), or the
    embedding and the loss counted as a layer each (``account_for_*_in_pipeline_split``), or an even
    split. A stage's layers are shared evenly by its chunks, and layers are numbered chunk-major."""
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        counts = _layout_counts(getattr(layout, "input_data", layout), pp, vpp)
    else:
        counts = {}
        per_chunk = _even_chunk_sizes(config, pp, vpp)
        for v in range(vpp):
            for p in range(pp):
                counts[(p, v)] = per_chunk(p, v)
    split, first = {}, 0
    for v in range(vpp):
        for p in range(pp):
            split[(p, v)] = list(range(first, first + counts[(p, v)]))
            first += counts[(p, v)]
    return split


def _even_chunk_sizes(config, pp: int, vpp: int):
    num_layers = config.num_layers
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        given = [n for n in (first, last) if n is not None]
        rest = pp - len(given)
        middle = (num_layers - sum(given)) // rest if rest > 0 else 0
        stage = [middle] * pp
        if first is not None:
            stage[0] = first
        if last is not None:
            stage[-1] = last
        return lambda p, v: stage[p] // vpp
    embedding = int(bool(config.account_for_embedding_in_pipeline_split))
    loss = int(bool(config.account_for_loss_in_pipeline_split))
    slots = (num_layers + embedding + loss) // (pp * vpp)
    return lambda p, v: slots - (embedding if (p, v) == (0, 0) else 0) - (loss if (p, v) == (pp - 1, vpp - 1) else 0)


_LAYOUT_REPEAT = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))


def _layout_counts(layout, pp: int, vpp: int) -> Dict[Tuple[int, int], int]:
    """Decoder layers per (pipeline rank, virtual chunk) of an explicit layout: a list of segments
    or its string form ("Ett|(tt|)*2,L": ``|`` ends a segment, ``(x)*n`` and ``x*n`` repeat, ``t`` is a
    decoder layer; ``E``, ``L``, ``m`` are the embedding, loss and MTP)."""
    if isinstance(layout, str):
        text = layout.replace(",", "")
        for pattern in _LAYOUT_REPEAT:
            text = pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)
        segments = [list(s) for s in text.split("|")]
    else:
        segments = [list(s) for s in layout]
    if len(segments) != pp * vpp:
        raise ValueError(f"pipeline_model_parallel_layout has {len(segments)} segments for PP {pp} × VPP {vpp}")
    decoder = ("t", "decoder")
    return {(s % pp, s // pp): sum(str(x).strip().lower() in decoder for x in seg) for s, seg in enumerate(segments)}


def check_layer_placement(problems: List[str], chunks: Sequence[torch.nn.Module], config, pp_rank: int, pp: int,
                          vpp: int, pattern: Optional[str] = None) -> None:
    """Every chunk of this rank built exactly the layers the split assigns it (a HybridModel's: its
    pattern's segments, :func:`hybrid_layer_split`). Each rank checks its own chunks against the
    same split, and the split hands every layer to one chunk of one stage, so all ranks passing
    means every layer is built once, where it belongs."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if pattern is None:
        expected, fields = layer_split(config, pp, vpp), _split_fields(config)
    else:
        expected, fields = hybrid_layer_split(pattern, pp, vpp), f"hybrid_layer_pattern {pattern!r}"
        if expected is None:
            return  # one segment over several stages: megatron's own split of a pattern, not restated here
    owner = {n: stage for stage, layers in expected.items() for n in layers}
    for v, chunk in enumerate(chunks):
        built = sorted(m.layer_number - 1 for m in decoder_modules(chunk) if isinstance(m, TransformerLayer))
        want = expected[(pp_rank, v)]
        here = _stage(pp_rank, v, vpp)
        for n in (n for n in built if n not in want):
            belongs = f"puts it on {_stage(*owner[n], vpp)}" if n in owner else "has no such layer"
            problems.append(f"decoder.layers.{n}: built on {here}; the pipeline split ({fields}) {belongs}")
        for n in (n for n in want if n not in built):
            problems.append(f"decoder.layers.{n}: not built on {here}, where the pipeline split ({fields}) puts it")


def hybrid_layer_split(pattern: str, pp: int, vpp: int) -> Optional[Dict[Tuple[int, int], List[int]]]:
    """(pipeline rank, virtual chunk) -> the 0-based global layers a HybridModel builds there, as
    megatron's ``select_pipeline_segment`` reads a pattern: '|'-separated segment i goes to virtual
    chunk i // PP of rank i % PP, its layers numbered after every earlier segment's. A pattern of one
    segment is all on one stage (None where PP > 1: megatron then splits it by its own rule)."""
    segments = pattern.split("|")
    if len(segments) == 1:
        return {(0, 0): list(range(len(pattern)))} if pp * vpp == 1 else None
    split, offset = {}, 0
    for index, segment in enumerate(segments):
        split[(index % pp, index // pp)] = list(range(offset, offset + len(segment)))
        offset += len(segment)
    return split


def _stage(pp_rank: int, vp: int, vpp: int) -> str:
    return f"pipeline stage {pp_rank}" + (f", virtual chunk {vp}" if vpp > 1 else "")


def _split_fields(config) -> str:
    fields = ("num_layers", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
              "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
              "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
              "pipeline_model_parallel_layout")
    return ", ".join(f"{f}={getattr(config, f)}" for f in fields if getattr(config, f, None) not in (None, False))
