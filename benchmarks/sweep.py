"""The configuration sweep: megatron-core GPT configurations nobody tuned ttrace to.

A seeded generator draws recipes from megatron-core's own config space: every structure and
numerics field of TransformerConfig (``adapter.recipe.model_fields``) that has a domain in ``FIELDS``
below (the rest are listed in ``NOT_DRAWN`` with why; ``tests/test_sweep.py`` fails on a field in
neither), GPTModel's arguments, the layouts (TP 1/2/4, SP, PP even and uneven, VPP, DP, the
distributed optimizer, EP, expert-TP), the optimizer and the dtype. Each configuration ends in one
of:

* ``pass``: reference and candidate agree (the model built was checked against the recipe's
  fields before the run: ``structure.check_built_as_described``);
* ``refused``: ttrace refused it before any run started, naming the field (a ``RecipeError``);
* ``megatron rejects``: megatron-core refuses to build it (its checks in the model's constructors;
  the configs its TransformerConfig rules reject are redrawn, counted apart);
* ``megatron fails``: megatron-core accepts it and then fails inside its own code (named with
  file and line by the launcher); each is read and either refused up front or fixed;
* ``megatron bug detected`` / ``missed``: the configuration hits a real megatron-core bug
  (``MEGATRON_BUGS``, each read in megatron's code): a failing verdict there is a detection, a pass
  a miss;
* ``not as described``: megatron built a model other than the recipe describes;
* ``false positive``: a clean run judged different;
* ``crash``: anything else (a traceback, an internal error).

The last three are failures of the sweep, to be fixed.

    python benchmarks/sweep.py --n 200 --seed 0 [--jsonl out.jsonl] > sweep.md
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PASS, REFUSED, MEGATRON_REJECTS, MEGATRON_FAILS, NOT_AS_DESCRIBED, FALSE_POSITIVE, CRASH = (
    "pass", "refused", "megatron rejects", "megatron fails", "not as described", "false positive", "crash")
BUG_DETECTED, BUG_MISSED = "megatron bug detected", "megatron bug missed"
OUTCOMES = (PASS, REFUSED, MEGATRON_REJECTS, MEGATRON_FAILS, BUG_DETECTED, NOT_AS_DESCRIBED, FALSE_POSITIVE, CRASH,
            BUG_MISSED)
FAILURES = (NOT_AS_DESCRIBED, FALSE_POSITIVE, CRASH, BUG_MISSED)

Draw = Callable[[random.Random, Dict[str, Any]], Any]


def _choice(*values) -> Draw:
    return lambda rng, model: rng.choice(values)


def _sometimes(p: float, value: Any, otherwise: Any = None) -> Draw:
    return lambda rng, model: value if rng.random() < p else otherwise


def _installed_fields() -> set:
    from megatron.core.transformer import TransformerConfig

    return {f.name for f in dataclasses.fields(TransformerConfig)}


def _later(field: str, draw: Draw) -> Draw:
    """A field of a later release (μP, 0.19's MTP variants): drawn where the installed megatron-core
    has it, and not drawn at all (no random number taken) where it does not, so the sweep on an older
    release draws the configurations it always drew."""
    return lambda rng, model: draw(rng, model) if field in _installed_fields() else None


def _mup(draw: Draw) -> Draw:
    return lambda rng, model: draw(rng, model) if model.get("use_mup") else None


def _moe(draw: Draw) -> Draw:
    """A draw that only applies to MoE models (None: the field is left out)."""
    return lambda rng, model: draw(rng, model) if model.get("num_moe_experts") else None


def _quantile_balancing(rng, model):
    """0.19's quantile balancing on one MoE model in five: it replaces the load-balancing type drawn
    before (and its aux-loss coefficient); its bias's EMA at megatron's default or 0.5."""
    if not model.get("num_moe_experts") or rng.random() >= 0.2:
        return None
    model["moe_router_load_balancing_type"] = "quantile_balancing"
    model.pop("moe_aux_loss_coeff", None)
    return rng.choice([None, 0.5])


def _query_groups(rng, model):
    heads = model["num_attention_heads"]
    return rng.choice([None, heads // 2, 2, 1])  # MHA, GQA, GQA (often < TP), MQA


def _experts(rng, model):
    return rng.choice([None, None, 4, 8])


def _router_bias(rng, model):
    # megatron: expert bias needs a sigmoid (or softmax) router and aux-loss-free balancing works with it
    return rng.random() < 0.5 if model.get("num_moe_experts") else None


def _no_rope(rng, model):
    # NoPE layers (issue #33): with RoPE, sometimes one layer without it, picked by its global number
    if model.get("position_embedding_type", "rope") != "rope" or rng.random() >= 0.3:
        return None
    pattern = [0] * model["num_layers"]
    pattern[rng.randrange(model["num_layers"])] = 1
    return pattern


def _recompute(rng, model):
    # activation recomputation (issue #33), the candidate's only (MoE layers too)
    return rng.choice([None, None, None, None, "full", "selective"])


def _recompute_modules(rng, model):
    # selective recomputation's modules (issue #33), drawn only where the granularity is selective
    # (no draw otherwise, so the rest of a configuration is what it was): megatron's default core_attn,
    # the traced mlp (biasless; with biases megatron-core hangs and ttrace refuses it), moe and
    # shared_experts, and layernorm, which needs TransformerEngine and is refused up front
    if model.get("recompute_granularity") != "selective":
        return None
    if rng.random() < 0.1:
        return ["layernorm"]  # refused up front (TransformerEngine): one draw in ten checks the refusal
    options = [["core_attn"]]
    if model.get("add_bias_linear") is False:  # the MLP's recomputation is traced without biases only
        options += [["mlp"], ["core_attn", "mlp"]]
    if model.get("num_moe_experts"):
        options += [["moe"], ["core_attn", "moe"]]
        if model.get("moe_shared_expert_intermediate_size"):
            options.append(["shared_experts"])
    return rng.choice(options)


def _recompute_full(field: str, value: Any) -> Draw:
    return lambda rng, model: value if model.get("recompute_granularity") == "full" else None


def _mtp(rng, model):
    # multi-token prediction (issue #33; DeepSeek-V3): one or two depths; ttrace refuses it with PP and
    # tied embeddings, which the layout then leaves out
    return rng.choice([None, None, None, None, 1, 2])


def _capacity(rng, model):
    return rng.choice([None, None, 1.0, 1.5]) if model.get("num_moe_experts") else None


# TransformerConfig fields (model_fields.STRUCTURE and NUMERICS) and GPTModel arguments the sweep
# draws, in this order (later draws may read earlier ones); None means "megatron's default"
FIELDS: Dict[str, Draw] = {
    "num_layers": _choice(2, 3, 4),
    "hidden_size": _choice(64),
    "num_attention_heads": _choice(4, 8),
    "num_query_groups": _query_groups,
    "kv_channels": _choice(None, None, 8),
    "ffn_hidden_size": _choice(96, 128),
    "normalization": _choice("LayerNorm", "RMSNorm"),
    "layernorm_epsilon": _choice(1e-5, 1e-6),
    "layernorm_zero_centered_gamma": _sometimes(0.2, True),
    "gated_linear_unit": _choice(False, True),
    "activation_func": _choice(None, "gelu", "silu", "squared_relu"),
    "add_bias_linear": _choice(True, False),
    "add_qkv_bias": _sometimes(0.3, True),
    "qk_layernorm": _sometimes(0.3, True),
    # Qwen3-Next's gated attention output (its gate projection inside each query group of linear_qkv)
    "attention_output_gate": _sometimes(0.15, True),
    "apply_residual_connection_post_layernorm": _sometimes(0.15, True),
    "fp32_residual_connection": _sometimes(0.15, True),
    "apply_query_key_layer_scaling": _sometimes(0.15, True),
    "attention_softmax_in_fp32": _choice(None, False),
    "softmax_scale": _sometimes(0.1, 0.2),
    "rotary_interleaved": _sometimes(0.15, True),
    "calculate_per_token_loss": _sometimes(0.2, True),
    "init_method_std": _choice(0.02, 0.05),
    "embedding_init_method_std": _sometimes(0.1, 0.01),
    "glu_linear_offset": _sometimes(0.1, 1.0),
    "activation_func_clamp_value": _sometimes(0.1, 7.0),
    "bias_activation_fusion": _sometimes(0.2, True),
    "num_moe_experts": _experts,
    "moe_ffn_hidden_size": _moe(_choice(32, 64)),
    "moe_router_topk": _moe(_choice(1, 2)),
    "moe_shared_expert_intermediate_size": _moe(_choice(None, None, 64)),
    "moe_shared_expert_gate": _moe(_sometimes(0.3, True)),
    "moe_layer_freq": _moe(_choice(1, 1, "[0,1]", "[1,0,1,1]")),
    "moe_router_score_function": _moe(_choice("softmax", "sigmoid")),
    "moe_router_pre_softmax": _moe(_sometimes(0.2, True)),
    # the router's probability on the expert's input (top-1 only, which megatron gives pre-softmax)
    "moe_apply_probs_on_input": lambda rng, model: True if (model.get("moe_router_topk") == 1 and model.get(
        "moe_router_pre_softmax") and rng.random() < 0.5) else None,
    # Llama 4's L2 norm of queries and keys: ttrace refuses it without experts (Megatron-LM drops it there)
    "qk_l2_norm": _moe(_sometimes(0.2, True)),
    "moe_router_topk_scaling_factor": _moe(_sometimes(0.2, 2.5)),
    "moe_router_dtype": _moe(_choice(None, "fp32")),
    "moe_router_enable_expert_bias": _router_bias,
    "moe_router_bias_update_rate": _moe(_choice(None, 0.01)),
    "moe_router_load_balancing_type": _moe(_choice("aux_loss", "seq_aux_loss", "global_aux_loss", "none")),
    "moe_aux_loss_coeff": _moe(_choice(0.0, 0.01)),
    "moe_z_loss_coeff": _moe(_choice(None, 0.001)),
    "moe_token_dispatcher_type": _moe(_choice("allgather", "alltoall")),
    "moe_expert_capacity_factor": _capacity,
    "moe_pad_expert_input_to_capacity": _moe(_sometimes(0.3, True)),
    "moe_token_drop_policy": _moe(_choice("probs", "position")),
    "position_embedding_type": _choice("rope", "learned_absolute"),
    "no_rope_freq": _no_rope,
    "softmax_type": _choice(None, None, None, None, "off-by-one", "learnable"),
    # sliding-window attention (gpt-oss), on every layer or every other: megatron-core's local
    # DotProductAttention masks it (fused_softmax.get_sliding_window_causal_mask)
    "window_size": _sometimes(0.15, [8, 0]),
    "window_attn_skip_freq": lambda rng, model: rng.choice([None, 2]) if model.get("window_size") else None,
    "recompute_granularity": _recompute,
    "recompute_modules": _recompute_modules,
    "recompute_method": _recompute_full("recompute_method", "uniform"),
    "recompute_num_layers": _recompute_full("recompute_num_layers", 1),
    "mtp_num_layers": _mtp,
    "mtp_loss_scaling_factor": lambda rng, model: rng.choice([None, 0.3]) if model.get("mtp_num_layers") else None,
    "mtp_detach_heads": _later("mtp_detach_heads", lambda rng, model: (True if rng.random() < 0.3 else None)
                               if model.get("mtp_num_layers") else None),
    # μP (0.19 on): widths 2-4× a base of the model's own hidden size / 2 or / 4
    "use_mup": _later("use_mup", _sometimes(0.15, True)),
    "mup_base_hidden_size": _later("use_mup", _mup(lambda rng, model: model["hidden_size"] // rng.choice([2, 4]))),
    "mup_embedding_mult": _later("use_mup", _mup(_choice(None, 2.0))),
    "mup_output_mult": _later("use_mup", _mup(_choice(None, 0.5))),
    "mup_base_head_dim": _later("use_mup", _mup(_choice(None, 8))),
    "mup_attn_scale_power": _later("use_mup", _mup(_choice(None, 0.5))),
    "share_embeddings_and_output_weights": _choice(True, False),
    "rotary_percent": _sometimes(0.15, 0.5),
    "rotary_base": _sometimes(0.15, 500000),
    "make_vocab_size_divisible_by": _choice(128, 1, 8),
    # 0.17-0.19 (issue #33): one MTP layer at every depth, the MLP run per chunk of the sequence, and
    # quantile balancing with its bias's EMA (last: it replaces the load-balancing type drawn above)
    "mtp_use_repeated_layer": _later("mtp_use_repeated_layer", lambda rng, model: (True if rng.random() < 0.3 else None)
                                     if model.get("mtp_num_layers") else None),
    "mlp_chunks_for_training": _later("mlp_chunks_for_training", _sometimes(0.1, 2)),
    "moe_router_quantile_balancing_ema": _later("moe_router_quantile_balancing_ema",
                                                lambda rng, model: _quantile_balancing(rng, model)),
}

# structure / numerics fields the sweep leaves at megatron's default, and why
NOT_DRAWN = {
    "hidden_dropout": "must be 0 (dropout draws random numbers; refused otherwise)",
    "attention_dropout": "must be 0 (dropout draws random numbers; refused otherwise)",
    "moe_router_num_groups": "group-limited routing: its choice is not judged (listed as unjudged)",
    "moe_router_group_topk": "group-limited routing: see moe_router_num_groups",
    "moe_token_dropping": "megatron-core marks it not implemented (capacity factor drops tokens)",
    "moe_enable_routing_replay": "ttrace's own router replay slot is used for routing; a user's is chained",
}


def _sizes(raw: Dict[str, Any]) -> Dict[str, int]:
    p = raw["parallel"]
    tp = p.get("tensor_model_parallel_size", 1)
    return {"tp": tp, "pp": p.get("pipeline_model_parallel_size", 1), "ep": p.get("expert_model_parallel_size", 1),
            "etp": p.get("expert_tensor_parallel_size") or tp, "sp": bool(p.get("sequence_parallel"))}


# Configurations megatron-core 0.16.1 accepts and then trains wrongly, each read in its code: the
# sweep expects ttrace to fail them (a detection), and counts a pass as a miss.
MEGATRON_BUGS = {
    "expert grads reduced over the dense DP group (EP 1, expert-TP ≠ TP)": (
        # tensor_parallel/layers.py sets an expert weight's `allreduce` to `not (is_expert and
        # expert_model_parallel_size > 1)`: with EP 1, DDP reduces expert grads over the dense DP
        # group. With expert-TP < TP and SP that group leaves out the TP peers whose sequence shards
        # sent the expert other tokens; with expert-TP > TP it adds up different expert-TP shards
        # (fixed by Megatron-LM PR #5916, which 0.19 has: `use_expert_pgs` tags them by the expert groups)
        lambda raw: bool(raw["model"].get("num_moe_experts")) and _sizes(raw)["ep"] == 1 and not _expert_tags_fixed()
        and (_sizes(raw)["etp"] > _sizes(raw)["tp"] or (_sizes(raw)["etp"] < _sizes(raw)["tp"] and _sizes(raw)["sp"]))),
    "learnable softmax offset counted on TP rank 0 only in the grad norm (TP > 1)": (
        # transformer/dot_product_attention.py:126-138 registers softmax_offset (one per head of the
        # rank) untagged, so param_is_not_tensor_parallel_duplicate counts it on TP rank 0 only
        # (benchmarks/upstream_bugs softmax_offset_counted_on_tp_rank0_only; unfixed upstream)
        lambda raw: raw["model"].get("softmax_type") == "learnable" and _sizes(raw)["tp"] > 1),
    "MTP stage's copy of learned position embeddings never synced (MTP, PP > 1)": (
        # the MTP stage builds its own embedding, position embeddings included (models/gpt/gpt_model.py,
        # `pre_process or mtp_process`); they are all-reduced over a group of the first stage alone
        # (parallel_state.default_position_embedding_ranks), so each copy steps on its own share
        # (tests/test_end_to_end.py::test_mtp_stage_copy_of_learned_position_embeddings_never_synced_is_caught)
        lambda raw: bool(raw["model"].get("mtp_num_layers")) and _sizes(raw)["pp"] > 1
        and raw["model"].get("position_embedding_type", "learned_absolute") == "learned_absolute"),
    "MoE z-loss with a padding mask: the mean of each sequence shard's mean (TP > 1 with SP)": (
        # transformer/moe/router.py:486 divides the coefficient by the TP×CP size and moe_utils.py:160
        # averages over the rank's own valid tokens (benchmarks/upstream_bugs
        # moe_z_loss_padding_mean_per_sequence_shard; unfixed upstream)
        lambda raw: bool(raw["model"].get("num_moe_experts")) and raw["model"].get("moe_z_loss_coeff") is not None
        and bool(raw.get("data", {}).get("padded_share")) and _sizes(raw)["tp"] > 1 and _sizes(raw)["sp"]),
    "MTP loss of a microbatch without loss tokens divided by their zero count (MTP, megatron-core < 0.17)": (
        # models/gpt/gpt_model.py:660 (0.16.1) scales the MTP loss by `mtp_loss / num_tokens`, the rolled
        # loss mask's sum, unclamped: a microbatch whose tokens all carry no loss (a prompt or padding to
        # its end) gives 0/0, NaN grads on every rank, where the main loss is divided by
        # `torch.clamp(num_tokens, min=1)` (pipeline_parallel/schedules.py:262). Fixed upstream by
        # Megatron-LM d7500d4d2a, "Fix nan loss caused by zero token in MTP (#3396)", in 0.17 on. (A
        # per-token loss is summed, not divided there: not hit)
        lambda raw: bool(raw["model"].get("mtp_num_layers")) and not raw["model"].get("calculate_per_token_loss")
        and not _mtp_zero_tokens_fixed() and _microbatch_without_loss(raw)),
}


def _mtp_zero_tokens_fixed() -> bool:
    """Whether the installed megatron-core clamps the MTP loss's token count (Megatron-LM #3396, from
    0.17 on: read in its source)."""
    import inspect

    from megatron.core.transformer import multi_token_prediction

    return "clamp(min=1)" in inspect.getsource(multi_token_prediction)


def _microbatch_without_loss(raw: Dict[str, Any]) -> bool:
    """Whether a microbatch of the run has no loss token at MTP's last depth, whose loss mask megatron
    rolls one token on per depth (``roll_tensor``: at depth d the sum of all but each row's first d
    positions, the fewest of any depth): the recipe's data, as its ranks read it. (No context
    parallelism: ttrace refuses it, and under it each CP rank would divide by its own chunks' sum.)"""
    from ttrace_megatron.adapter.recipe.data import microbatches, sampler
    from ttrace_megatron.errors import RecipeError
    from ttrace_megatron.recipe import recipe_from_dict

    try:
        recipe = recipe_from_dict(raw, source=raw["name"])
    except RecipeError:
        return False
    sizes, samples, depths = _sizes(raw), sampler(recipe), int(raw["model"]["mtp_num_layers"])
    dp = raw["world_size"] // (sizes["tp"] * sizes["pp"])
    return any(float(mb.loss_mask[..., depths:].sum()) == 0.0 for it in range(recipe.train.iterations)
               for rank in range(dp) for _, mb in microbatches(recipe, samples, it, rank, dp))


def _expert_tags_fixed() -> bool:
    """Whether the installed megatron-core tags expert weights by the expert groups whenever expert-TP
    differs from TP (PR #5916's ``use_expert_pgs`` in ColumnParallelLinear; read in its source)."""
    import inspect

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return "use_expert_pgs" in inspect.getsource(ColumnParallelLinear.__init__)


def megatron_bug(raw: Dict[str, Any]) -> Optional[str]:
    return next((name for name, hits in MEGATRON_BUGS.items() if hits(raw)), None)


def _layout(rng: random.Random, model: Dict[str, Any]) -> Tuple[int, Dict[str, Any], Dict[str, Any]]:
    """(world size, parallel section, the model fields a layout adds: uneven pipeline stages)."""
    world = rng.choice([2, 4])
    tp = rng.choice([t for t in (1, 2, 4) if t <= world])
    # multi-token prediction with PP and tied embeddings: traced since this stop (tests/test_end_to_end.py),
    # kept at PP 1 here so that the population and its CI slice draw what they drew (sweep0003 is one)
    mtp_tied = model.get("mtp_num_layers") and model.get("share_embeddings_and_output_weights")
    pp = 1 if mtp_tied else rng.choice([p for p in (1, 2) if tp * p <= world])
    parallel: Dict[str, Any] = {}
    extra: Dict[str, Any] = {}
    if tp > 1:
        parallel["tensor_model_parallel_size"] = tp
        if rng.random() < 0.5 or model.get("num_moe_experts"):
            parallel["sequence_parallel"] = True
    if pp > 1:
        parallel["pipeline_model_parallel_size"] = pp
        layers = model["num_layers"]
        shape = rng.choice(["even", "uneven", "vpp"])
        if shape == "vpp":
            model["num_layers"] = 4
            parallel["virtual_pipeline_model_parallel_size"] = 2
            # Megatron-LM's arguments with virtual pipelining (--overlap-p2p-communication is on by
            # default there); megatron-core's own defaults hit its batched-p2p bug at PP = 2
            # (bug vpp_batched_p2p_at_pp2, detected: BENCHMARKS.md)
            parallel.update(overlap_p2p_comm=True, batch_p2p_comm=False)
        elif shape == "uneven" or layers % pp:
            model["num_layers"] = 3
            extra[rng.choice(["num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"])] = 1
        elif layers == 2 and rng.random() < 0.3:
            model["num_layers"] = 2
    if model.get("num_moe_experts"):
        rest = world // pp
        ep = rng.choice([e for e in (1, 2, 4) if rest % e == 0 and model["num_moe_experts"] % e == 0])
        etp = rng.choice([e for e in (1, 2, tp) if (rest // ep) % e == 0])
        if ep > 1:
            parallel["expert_model_parallel_size"] = ep
        if etp != tp:
            parallel["expert_tensor_parallel_size"] = etp
    return world, parallel, extra


def draw(rng: random.Random, index: int) -> Dict[str, Any]:
    """One raw recipe (the YAML mapping a user would write)."""
    model: Dict[str, Any] = {}
    for name, field_draw in FIELDS.items():
        value = field_draw(rng, model)
        if value is not None:
            model[name] = value
    if isinstance(model.get("moe_layer_freq"), str):
        pattern = json.loads(model["moe_layer_freq"])
        model["num_layers"] = len(pattern)
        model["moe_layer_freq"] = pattern
    if model.get("num_moe_experts") and model.get("moe_router_load_balancing_type") == "none":
        model.pop("moe_aux_loss_coeff", None)
    world, parallel, extra = _layout(rng, model)
    if isinstance(model.get("moe_layer_freq"), list) and len(model["moe_layer_freq"]) != model["num_layers"]:
        model["moe_layer_freq"] = 1
    model.update(extra)
    tp = parallel.get("tensor_model_parallel_size", 1)
    pp = parallel.get("pipeline_model_parallel_size", 1)
    dp = world // (tp * pp)
    optimizer: Dict[str, Any] = {"optimizer": rng.choice(["adam", "adam", "sgd"]), "lr": rng.choice([1e-3, 1e-2])}
    dtype = rng.choice(["fp32", "fp32", "bf16", "bf16", "fp16"])
    if dtype == "fp16":  # megatron's default 2**32 skips every step of a 2-iteration run
        optimizer["initial_loss_scale"] = rng.choice([4096, 65536])
    ddp: Dict[str, Any] = {}
    if dp > 1 and rng.random() < 0.4:
        optimizer["use_distributed_optimizer"] = True
        if rng.random() < 0.5:  # Megatron-LM's large recipes overlap both (issue #33)
            ddp.update(overlap_grad_reduce=True, overlap_param_gather=True)
    micro = rng.choice([1, 2])
    nmicro = rng.choice([1, 2]) * (pp if parallel.get("virtual_pipeline_model_parallel_size") else 1)
    # the loss masks (issue #34) from a generator of their own: the configurations drawn before them
    # stay what they were
    masks = random.Random(f"masks{index}")
    data_masks = {**({"masked_share": masks.choice([0.2, 0.4])} if masks.random() < 0.4 else {}),
                  **({"eod_mask_loss": True} if masks.random() < 0.3 else {})}
    if masks.random() < 0.25:  # padded tails, handed to the model as its padding mask
        data_masks["padded_share"] = masks.choice([0.2, 0.4])
    if masks.random() < 0.05:  # gathered logits (refused: megatron-core cannot train on them)
        model["parallel_output"] = False
    if masks.random() < 0.25:  # packed documents
        data_masks.update(document_length=masks.choice([4, 8, 16]), reset_attention_mask=True,
                          reset_position_ids=masks.random() < 0.7)
    _heterogeneous_blocks(random.Random(f"blocks{index}"), model, tp)
    return {
        "name": f"sweep{index:04d}",
        "model": model,
        "parallel": parallel,
        "world_size": world,
        "optimizer": optimizer,
        "data": {"seed": rng.randrange(1, 10_000), "vocab_size": rng.choice([250, 256, 300, 1000]),
                 "seq_length": rng.choice([16, 32]), "micro_batch_size": micro,
                 "global_batch_size": micro * dp * nmicro, **data_masks},
        "train": {"iterations": 2},
        "dtype": dtype,
        **({"ddp": ddp} if ddp else {}),
    }


HETEROGENEOUS_KEY = "heterogeneous_layers_config_encoded_json"


def _heterogeneous_blocks(rng: random.Random, model: Dict[str, Any], tp: int) -> None:
    """Llama-Nemotron NAS's per-layer blocks (issue #33), one configuration in six of those without
    experts or MTP, from a generator of its own so the configurations drawn before stay what they
    were: each layer's attention full (its own query groups, at least TP of them), absent or one
    gathered linear, its MLP full (its own width), absent or a linear."""
    if rng.random() >= 1 / 6 or model.get("num_moe_experts") or model.get("mtp_num_layers"):
        return
    heads = model["num_attention_heads"]
    groups = [g for g in range(1, heads + 1) if heads % g == 0 and g >= tp]
    blocks = []
    for _ in range(model["num_layers"]):
        attention, mlp = rng.choice(["full", "full", "none", "linear"]), rng.choice(["full", "full", "none", "linear"])
        blocks.append({
            "attention": {"no_op": attention == "none", "replace_with_linear": attention == "linear",
                          "num_query_groups": rng.choice([None] + groups) if attention == "full" else None},
            "ffn": {"no_op": mlp == "none", "replace_with_linear": mlp == "linear",
                    "ffn_hidden_size": rng.choice([None, 64, 192]) if mlp == "full" else None}})
    model[HETEROGENEOUS_KEY] = json.dumps({"block_configs": blocks})


def features(raw: Dict[str, Any]) -> List[str]:
    """The tags the sweep's table is grouped by."""
    m, p = raw["model"], raw["parallel"]
    tp = p.get("tensor_model_parallel_size", 1)
    heads = m["num_attention_heads"]
    groups = m.get("num_query_groups") or heads
    tags = [m.get("normalization", "LayerNorm"),
            "SwiGLU/GLU" if m.get("gated_linear_unit") else "plain MLP",
            "biases" if m.get("add_bias_linear", True) else "no biases",
            m.get("position_embedding_type", "rope"),
            "tied" if m.get("share_embeddings_and_output_weights") else "untied",
            f"TP{tp}", raw["dtype"], raw["optimizer"]["optimizer"]]
    if m.get("add_qkv_bias"):
        tags.append("qkv bias")
    if m.get("qk_layernorm"):
        tags.append("qk_layernorm")
    if m.get("attention_output_gate"):
        tags.append("output gate")
    if m.get("no_rope_freq"):
        tags.append("NoPE")
    if m.get(HETEROGENEOUS_KEY):
        tags.append("heterogeneous layers")
    if m.get("softmax_type"):
        tags.append(f"sinks {m['softmax_type']}")
    if raw["data"].get("masked_share") or raw["data"].get("eod_mask_loss"):
        tags.append("loss mask")
    if raw["data"].get("reset_attention_mask") or raw["data"].get("reset_position_ids"):
        tags.append("packed documents")
    if raw["data"].get("padded_share"):
        tags.append("padding mask")
    if m.get("parallel_output") is False:
        tags.append("gathered logits")
    if m.get("calculate_per_token_loss"):
        tags.append("per-token loss")
    if m.get("window_size"):
        tags.append("sliding window")
    if m.get("recompute_granularity"):
        tags.append(f"recompute {m['recompute_granularity']}")
    if m.get("recompute_modules"):
        tags.append("recompute " + "+".join(m["recompute_modules"]))
    if m.get("mtp_num_layers"):
        tags.append("MTP")
    if groups == 1:
        tags.append("MQA")
    elif groups < heads:
        tags.append("GQA")
    if groups < tp:
        tags.append("query groups < TP")
    if m.get("make_vocab_size_divisible_by", 128) * tp and raw["data"]["vocab_size"] % (m.get(
            "make_vocab_size_divisible_by", 128) * tp):
        tags.append("padded vocab")
    if p.get("sequence_parallel"):
        tags.append("SP")
    if p.get("pipeline_model_parallel_size", 1) > 1:
        tags.append("PP")
    if any(k.startswith("num_layers_in_") for k in m):
        tags.append("PP uneven")
    if p.get("virtual_pipeline_model_parallel_size"):
        tags.append("VPP")
    dp = raw["world_size"] // (tp * p.get("pipeline_model_parallel_size", 1))
    if dp > 1:
        tags.append("DP")
    if raw["optimizer"].get("use_distributed_optimizer"):
        tags.append("distributed optimizer")
    if (raw.get("ddp") or {}).get("overlap_param_gather"):
        tags.append("overlap param gather")
    if m.get("num_moe_experts"):
        tags += ["MoE", f"dispatcher {m.get('moe_token_dispatcher_type', 'allgather')}",
                 f"router {m.get('moe_router_score_function', 'softmax')}",
                 f"balancing {m.get('moe_router_load_balancing_type', 'aux_loss')}"]
        if m.get("moe_shared_expert_intermediate_size"):
            tags.append("shared expert")
        if m.get("moe_router_enable_expert_bias"):
            tags.append("expert bias")
        if m.get("moe_z_loss_coeff"):
            tags.append("z-loss")
        if m.get("moe_expert_capacity_factor"):
            tags.append("capacity factor")
        if m.get("moe_layer_freq", 1) != 1:
            tags.append("MoE layer pattern")
        if p.get("expert_model_parallel_size", 1) > 1:
            tags.append("EP")
        if p.get("expert_tensor_parallel_size", tp) != tp:
            tags.append("expert-TP ≠ TP")
    return tags


@dataclasses.dataclass
class Outcome:
    kind: str
    detail: str = ""
    seconds: float = 0.0
    worst_ratio: float = 0.0
    twin_worst_ratio: Optional[float] = None  # --twin: the fp32 twin's, for a bf16 or fp16 configuration


def _megatron_accepts(recipe) -> Optional[str]:
    """None, or megatron-core's reason for rejecting the candidate's config."""
    from ttrace_megatron.adapter.recipe import config as cfg
    from ttrace_megatron.errors import RecipeError

    try:
        cfg.transformer_config(recipe, recipe.parallel)
        cfg.optimizer_config(recipe)
    except RecipeError as e:
        return str(e)
    return None


def run_one(raw: Dict[str, Any], tmp: str, twin: bool = False) -> Outcome:
    """Classify one configuration: validate, run reference and candidate (lock-step), compare.
    ``twin``: a bf16 or fp16 configuration's fp32 twin as well, from the same seed checkpoint, as
    ``ttrace run`` adds it; either verdict failing on a clean configuration is a false positive."""
    from ttrace_megatron.adapter.recipe.config import validate_recipe
    from ttrace_megatron.adapter.run.launch import launch
    from ttrace_megatron.adapter.run.runner import CANDIDATE, REFERENCE, RunSpec, trace_options
    from ttrace_megatron.compare import compare_traces
    from ttrace_megatron.errors import RecipeError, RunFailed
    from ttrace_megatron.recipe import fp32_twin, recipe_from_dict

    start = time.perf_counter()
    try:
        recipe = recipe_from_dict(raw, source=raw["name"])
    except RecipeError as e:
        return Outcome(REFUSED, str(e))
    rejected = _megatron_accepts(recipe)
    if rejected:
        return Outcome(MEGATRON_REJECTS, rejected)
    try:
        validate_recipe(recipe)
    except RecipeError as e:
        return Outcome(REFUSED, str(e))
    seed = os.path.join(tmp, "seed.safetensors")  # the twin's too: the low-precision run's start

    def check(r, where):
        ref, cand, pert = (os.path.join(where, d) for d in ("ref", "cand", "pert"))

        def spec(role, trace_dir, **trace):
            return RunSpec(recipe=r.to_json(), role=role, trace=trace_options(trace_dir, seed, **trace))

        launch(spec(REFERENCE, ref), timeout_s=600)
        launch(spec(CANDIDATE, cand, lockstep=ref), timeout_s=600)
        if r.tolerance.perturbation:
            launch(spec(REFERENCE, pert, perturb=1, lockstep=ref), timeout_s=600)
        return compare_traces(ref, cand, perturbed=pert if r.tolerance.perturbation else None)

    twin_recipe = fp32_twin(recipe) if twin else None
    twin_result = None
    try:
        result = check(recipe, tmp)
        if twin_recipe is not None:
            os.makedirs(os.path.join(tmp, "fp32_twin"))
            twin_result = check(twin_recipe, os.path.join(tmp, "fp32_twin"))
    except RecipeError as e:
        text = str(e)
        kind = (NOT_AS_DESCRIBED if "not the model the recipe describes" in text
                else MEGATRON_REJECTS if "megatron-core refuses to build" in text else REFUSED)
        return Outcome(kind, text, time.perf_counter() - start)
    except RunFailed as e:
        text = str(e)
        kind = MEGATRON_FAILS if "megatron-core fails on this configuration" in text else CRASH
        return Outcome(kind, _first_line(text.split("\n", 1)[-1]) + " || " + _tail(text), time.perf_counter() - start)
    except Exception:
        return Outcome(CRASH, _tail(traceback.format_exc()), time.perf_counter() - start)
    worst = max((r.ratio for r in result.results), default=0.0)
    twin_worst = max((r.ratio for r in twin_result.results), default=0.0) if twin_result is not None else None
    seconds = time.perf_counter() - start
    bug = megatron_bug(raw)
    if bug:
        caught = result.verdict == "fail" or (twin_result is not None and twin_result.verdict == "fail")
        return Outcome(BUG_DETECTED if caught else BUG_MISSED, bug, seconds, worst, twin_worst)
    for label, judged in (("", result), ("fp32 twin: ", twin_result)):
        if judged is not None and judged.failures:
            f = judged.failures[0]
            return Outcome(FALSE_POSITIVE, f"{label}{len(judged.failures)} failures; first {f.key.module} {f.key.phase} "
                           f"{f.key.tensor} it{f.key.iteration}: {f.error_eps:.3g} ε vs {f.tolerance_eps:.3g}",
                           seconds, worst, twin_worst)
    return Outcome(PASS, "", seconds, worst, twin_worst)


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else text


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def population(n: int, seed: int) -> Tuple[List[Dict[str, Any]], int]:
    """The first ``n`` draws megatron-core's TransformerConfig and OptimizerConfig accept (its
    ``__post_init__`` rules), and how many draws they rejected."""
    from ttrace_megatron.errors import RecipeError
    from ttrace_megatron.recipe import recipe_from_dict

    rng = random.Random(seed)
    out, rejected, index = [], 0, 0
    while len(out) < n:
        raw = draw(rng, index)
        index += 1
        try:
            accepted = _megatron_accepts(recipe_from_dict(raw, source=raw["name"])) is None
        except RecipeError:
            accepted = True  # ttrace refuses it: part of the population
        if accepted:
            out.append(raw)
        else:
            rejected += 1
    return out, rejected


def table(rows: List[Tuple[Dict[str, Any], Outcome]]) -> str:
    """Per feature: how many configurations with it ended in each outcome."""
    counts: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for raw, out in rows:
        counts["(all)"][out.kind] += 1
        for tag in features(raw):
            counts[tag][out.kind] += 1
    kinds = OUTCOMES
    lines = ["| feature | configs | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
    for tag in ["(all)"] + sorted(t for t in counts if t != "(all)"):
        c = counts[tag]
        lines.append(f"| {tag} | {sum(c.values())} | " + " | ".join(str(c[k]) for k in kinds) + " |")
    return "\n".join(lines)


def main():
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, nargs="*", help="only these configuration indices")
    parser.add_argument("--jsonl", help="append each configuration and its outcome here")
    parser.add_argument("--shard", default="0/1", help="K/N: only the configurations whose index is K mod N (run N "
                                                       "shards side by side, then --table on their JSONL files)")
    parser.add_argument("--table", nargs="*", help="print the table of these JSONL files and exit")
    parser.add_argument("--twin", action="store_true", help="a bf16 or fp16 configuration's fp32 twin as well, as "
                                                            "`ttrace run` adds it (both verdicts judged)")
    parser.add_argument("--dtypes", nargs="*", help="only the configurations drawn in these dtypes")
    parser.add_argument("--refusals", action="store_true",
                        help="run nothing: the share of the population ttrace refuses before any run, by field")
    args = parser.parse_args()
    if args.refusals:
        refusals(args.n, args.seed)
        return
    if args.table:
        rows = []
        for path in args.table:
            with open(path) as f:
                rows += [(e["recipe"], Outcome(**e["outcome"])) for e in map(json.loads, f)]
        for raw, out in rows:  # MEGATRON_BUGS as of this commit: a failing verdict there is a detection
            if megatron_bug(raw) and out.kind == FALSE_POSITIVE:
                out.kind, out.detail = BUG_DETECTED, megatron_bug(raw) + " — " + out.detail
            elif megatron_bug(raw) and out.kind == PASS:
                out.kind = BUG_MISSED
        rows.sort(key=lambda r: r[0]["name"])
        report(rows)
        return
    shard, shards = (int(x) for x in args.shard.split("/"))
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit}; sweep seed {args.seed}, {args.n} configurations; machine: {os.cpu_count()} CPU cores, "
          f"gloo, torch {__import__('torch').__version__}, megatron-core {__import__('megatron.core').core.__version__}\n",
          flush=True)
    rows = []
    configs, rejected = population(args.n, args.seed)
    print(f"{len(configs)} configurations megatron-core's config rules accept, of {len(configs) + rejected} drawn\n")
    for i, raw in enumerate(configs):
        if (args.only and i not in args.only) or i % shards != shard or (args.dtypes and raw["dtype"] not in args.dtypes):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = run_one(raw, tmp, twin=args.twin)
        rows.append((raw, out))
        print(f"<!-- {raw['name']} {out.kind} {out.seconds:.0f}s ratio {out.worst_ratio:.2f} "
              f"{' '.join(features(raw))} :: {out.detail[:400]} -->", flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps({"recipe": raw, "outcome": dataclasses.asdict(out)}) + "\n")
    report(rows)


def refusals(n: int, seed: int) -> None:
    """The share of ``n`` configurations that ``validate_recipe`` refuses before any run (the
    up-front refusals; the run's own, at rank start, are not counted), and by which field: what
    the domain leaves unchecked, measured without running anything."""
    from ttrace_megatron.adapter.recipe.config import validate_recipe
    from ttrace_megatron.errors import RecipeError
    from ttrace_megatron.recipe import recipe_from_dict

    configs, rejected = population(n, seed)
    by_field: Dict[str, int] = {}
    for raw in configs:
        try:
            validate_recipe(recipe_from_dict(raw, source=raw["name"]))
        except RecipeError as e:
            field = re.search(r"'([a-z0-9_]+)'", str(e))
            key = field.group(1) if field else str(e)[:60]
            by_field[key] = by_field.get(key, 0) + 1
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    refused = sum(by_field.values())
    print(f"commit {commit}; sweep seed {seed}: {len(configs)} configurations megatron-core accepts ({rejected} "
          f"more rejected by its config rules); refused before any run: {refused} / {len(configs)} "
          f"({100 * refused / len(configs):.0f} %)")
    for field, count in sorted(by_field.items(), key=lambda kv: -kv[1]):
        print(f"  {field}: {count}")


def report(rows: List[Tuple[Dict[str, Any], Outcome]]) -> None:
    print()
    print(table(rows))
    print()
    seconds = sum(o.seconds for _, o in rows)
    twins = [o.twin_worst_ratio for _, o in rows if o.kind == PASS and o.twin_worst_ratio is not None]
    print(f"{len(rows)} configurations, {seconds / 60:.0f} min of runs; worst clean ratio "
          f"{max((o.worst_ratio for _, o in rows if o.kind == PASS), default=0):.2f}"
          + (f"; {len(twins)} clean ones with an fp32 twin, its worst ratio {max(twins):.2f}" if twins else "") + "\n")
    for raw, out in rows:
        if out.kind not in (PASS, MEGATRON_REJECTS):
            print(f"- {raw['name']} **{out.kind}**: {out.detail[:300]}")


if __name__ == "__main__":
    main()
