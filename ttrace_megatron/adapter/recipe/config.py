"""Recipe sections -> megatron-core's own config dataclasses, with unknown keys named."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

import torch

from ...errors import RecipeError
from ...recipe import Recipe
from . import compat, heterogeneous, hybrid, model_fields

# GPTModel constructor arguments (not TransformerConfig fields) a recipe may set under `model:`.
GPT_MODEL_KEYS = {
    "position_embedding_type": "rope",
    "share_embeddings_and_output_weights": False,
    "rotary_percent": 1.0,
    "rotary_base": 10000,
    # megatron.training pads the vocabulary to a multiple of this times TP
    "make_vocab_size_divisible_by": 128,
    # False: the output layer gathers the logits over TP (gather_output) before the loss
    "parallel_output": True,
}
# GPTModel.forward's arguments a recipe may name (the training loop passes them; none is passed by
# ttrace's runner unless a recipe can be traced with it)
GPT_FORWARD_KEYS = {
    "runtime_gather_output": None,  # True: gather the logits over TP in this forward (parallel_output false)
}


def activations() -> Dict[str, Any]:
    """``activation_func`` by name: the functions Megatron-LM's arguments select (``--swiglu`` is
    ``gated_linear_unit`` with ``silu``, ``--squared-relu``, ``--quick-geglu``; gelu is the default).
    A recipe is YAML, so it names the function; the name is what the model signature records."""
    import torch.nn.functional as F
    from megatron.core.activations import quick_gelu, squared_relu

    return {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "squared_relu": squared_relu, "quick_gelu": quick_gelu}


def _fields(cls) -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def parallel_fields():
    from megatron.core.model_parallel_config import ModelParallelConfig

    return _fields(ModelParallelConfig)


def _section_fields() -> Dict[str, Tuple[str, Dict[str, dataclasses.Field]]]:
    """Each megatron section of a recipe: the dataclass its fields belong to, and those fields."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel = parallel_fields()
    model = {k: f for k, f in _fields(TransformerConfig).items() if k not in parallel}  # parallel: its own section
    return {"model": ("TransformerConfig", {**model, **dict.fromkeys(GPT_MODEL_KEYS), **dict.fromkeys(GPT_FORWARD_KEYS)}),
            "parallel": ("ModelParallelConfig", parallel),
            "optimizer": ("OptimizerConfig", _fields(OptimizerConfig)),
            "ddp": ("DistributedDataParallelConfig", ddp_fields())}


def _elsewhere(key: str, section: str) -> str:
    """Where an unknown key of ``section`` belongs instead: the sections whose megatron dataclass
    has it (a Megatron-LM user's ``--overlap-grad-reduce`` is DistributedDataParallelConfig's,
    ``ddp:``), with a flag's spelling (dashes) read as the field's; "" where none has it."""
    field = key.lstrip("-").replace("-", "_")
    homes = [f"'{name}:' ({cls})" for name, (cls, fields) in _section_fields().items()
             if field in fields and (name != section or field != key)]
    if not homes:
        return ""
    spelled = f"the field '{field}'" if field != key else "it"
    return f"; {spelled} belongs under " + " or ".join(homes)


def validate_recipe(recipe: Recipe) -> None:
    """Check the megatron sections of a recipe; raise RecipeError naming the first bad key."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    where = recipe.source
    tc = _fields(TransformerConfig)
    pc = parallel_fields()
    own = sorted(GPT_MODEL_KEYS) + sorted(GPT_FORWARD_KEYS) + [hybrid.PATTERN_KEY] + list(heterogeneous.KEYS)
    for key in recipe.model:
        if key in pc and key not in ("params_dtype",):
            raise RecipeError(f"{where}: model: '{key}' is a parallel setting; put it under 'parallel:'")
        if key not in tc and key not in own:
            raise RecipeError(f"{where}: model: unknown key '{key}' (not a TransformerConfig field nor one of {own})"
                              + _elsewhere(key, "model"))
    hybrid.check(recipe.model, recipe.parallel, where)  # before the fields: it names the pattern's own refusals
    heterogeneous.normalize(recipe.model, where)  # the blocks travel with the recipe, as text
    heterogeneous.check(recipe.model, recipe.parallel, where)
    model_fields.check_fields(recipe.model, where)
    if "activation_func" in recipe.model and recipe.model["activation_func"] not in activations():
        raise RecipeError(f"{where}: model: 'activation_func' must name one of {sorted(activations())}, "
                          f"got {recipe.model['activation_func']!r}")
    for key in recipe.parallel:
        if key not in pc:
            raise RecipeError(f"{where}: parallel: unknown key '{key}' (not a ModelParallelConfig field)"
                              + _elsewhere(key, "parallel"))
        if key in PRECISION_FIELDS:
            raise RecipeError(f"{where}: parallel: '{key}' is not supported by ttrace: {PRECISION_FIELDS[key]}")
        if key in PARALLEL_REFUSED and recipe.parallel[key] != pc[key].default:
            raise RecipeError(f"{where}: parallel: '{key}' is not supported by ttrace: {PARALLEL_REFUSED[key]}")
    for key in recipe.optimizer:
        if key not in _fields(OptimizerConfig):
            raise RecipeError(f"{where}: optimizer: unknown key '{key}' (not an OptimizerConfig field)"
                              + _elsewhere(key, "optimizer"))
    check_ddp_fields(recipe)
    for key in ("hidden_dropout", "attention_dropout"):
        if recipe.model.get(key, 0.0) != 0.0:
            raise RecipeError(f"{where}: model: '{key}' must be 0: dropout makes runs incomparable")
    sizes = parallel_sizes(recipe.parallel)
    model_parallel = sizes["tp"] * sizes["pp"] * sizes["cp"]
    if recipe.world_size % model_parallel:
        raise RecipeError(f"{where}: world_size {recipe.world_size} is not a multiple of TP×PP×CP = {model_parallel}")
    dp = recipe.world_size // model_parallel
    if recipe.data.global_batch_size % (recipe.data.micro_batch_size * dp):
        raise RecipeError(f"{where}: data: global_batch_size must be a multiple of micro_batch_size × DP "
                          f"({recipe.data.micro_batch_size} × {dp})")
    experts = sizes["ep"] * sizes["etp"]
    if recipe.model.get("num_moe_experts") and (recipe.world_size // sizes["pp"]) % experts:
        raise RecipeError(f"{where}: parallel: expert_model_parallel_size × expert_tensor_parallel_size = "
                          f"{sizes['ep']} × {sizes['etp']} does not divide world_size / PP = "
                          f"{recipe.world_size // sizes['pp']} (expert_tensor_parallel_size defaults to the TP size, "
                          f"as in megatron)")
    for section, key, why in megatron_cannot_run(recipe):
        raise RecipeError(f"{where}: {section}: '{key}' is not supported by ttrace: {why}")
    mtp = mtp_refused(recipe)
    if mtp:
        key = ("mtp_detach_heads" if mtp.startswith(MTP_DETACHED_WITH_PP) else
               "mtp_use_repeated_layer" if mtp.startswith(MTP_REPEATED_RECOMPUTED) else "mtp_num_layers")
        raise RecipeError(f"{where}: model: '{key}' is not supported by ttrace {mtp}")
    chunks = mlp_chunks_refused(recipe)
    if chunks:
        raise RecipeError(f"{where}: model: 'mlp_chunks_for_training' is not supported by ttrace {chunks}")


_CHUNKED_MLP = "megatron/core/transformer/transformer_layer.py:901-919 in 0.19.2"


def mlp_chunks_refused(recipe: Recipe) -> Optional[str]:
    """Why ttrace cannot trace this recipe's chunked MLP (None: it can). Megatron runs the MLP once per
    chunk of the rank's sequence; each call is recorded as one (``naming.call_name``: ``#k``) and
    compared with the reference's k-th, which holds the same tokens when the rank holds the whole
    sequence."""
    model = recipe.model
    if int(model.get("mlp_chunks_for_training") or 1) <= 1:
        return None
    sizes = parallel_sizes(recipe.parallel)
    if recipe.parallel.get("sequence_parallel") and sizes["tp"] > 1:
        return ("with sequence parallelism yet: each chunk's call gathers the k-th piece of every TP rank's "
                f"sequence shard ({_CHUNKED_MLP}), tokens no call of the one-rank reference holds together, and "
                "ttrace compares a module's calls one by one; without sequence parallelism they match")
    if model.get("mtp_use_repeated_layer") and model.get("mtp_num_layers"):
        return ("with a repeated MTP layer yet: its MLP's calls are counted over the depths and the chunks "
                "together, and ttrace names a repeated MTP layer's calls by depth alone (naming.call_name)")
    if recipe.dtype == "fp8":
        return ("with dtype fp8 yet: the backward's amaxes of a module run more than once a microbatch are not "
                "told apart by call")
    inside = {"mlp", "moe", "moe_act", "shared_experts"} & set(model.get("recompute_modules") or ())
    if inside and model.get("recompute_granularity") == "selective":
        return (f"with {', '.join(sorted(inside))} recomputed: megatron skips the chunks where it recomputes a dense "
                f"MLP ({_CHUNKED_MLP}, the branch before), and recomputes an MoE layer's chunks last first in the "
                "backward, while ttrace names a recomputed call by its order")
    if model.get("num_moe_experts") and recipe.data.padded_share:
        return ("with a padding mask on an MoE model: megatron calls each chunk's MoE layer without the padding "
                f"mask ({_CHUNKED_MLP}: the chunked call passes the chunk alone, line 915), so the router counts "
                "padding tokens in its balancing loss; the model trained is not the one the recipe describes "
                "(reproduced on 0.19.2: benchmarks/megatron_findings/mlp_chunks_drop_padding_mask.py)")
    return None


MTP_DETACHED_WITH_PP = "with detached heads and pipeline parallelism yet"
MTP_REPEATED_RECOMPUTED = "with a repeated MTP layer and recomputed weights yet"


def mtp_refused(recipe: Recipe) -> Optional[str]:
    """Why ttrace cannot trace this recipe's multi-token prediction (None: it can)."""
    model = recipe.model
    if not model.get("mtp_num_layers"):
        return None
    if recipe.dtype == "fp8":
        return ("with dtype fp8 yet: ttrace emulates TE's FP8 GEMMs in the decoder's layers only, and TE runs the "
                "MTP layers' GEMMs in FP8 too (megatron/core/transformer/multi_token_prediction.py, "
                "_proj_and_transformer_layer)")
    if (model.get("recompute_granularity") == "full" and model.get("recompute_method") == "uniform"
            and model.get("recompute_num_layers", 1) != 1):
        return ("with uniform recomputation of more than one layer a checkpoint: megatron-core asserts "
                "recompute_num_layers 1 for the MTP layers when they first run "
                "(megatron/core/transformer/multi_token_prediction.py:846, _checkpointed_forward)")
    if hybrid.pattern_of(model) is not None:
        return "in a HybridModel yet (its MTP block takes its own pattern): " + model_fields.UNVERIFIED
    if model.get("no_rope_freq") and compat.mtp_layers_numbered_after_the_decoder():  # an int becomes a list too
        return ("with a NoPE pattern on this megatron-core: attention reads no_rope_freq[layer_number - 1] "
                "(megatron/core/transformer/attention.py:918 at 0.16.1) and an MTP depth's layer is numbered after "
                "the decoder's, past the pattern's end (an IndexError in the reference); found by the configuration "
                "sweep")
    granularity = model.get("recompute_granularity")
    recomputed = set(model.get("recompute_modules") or ("core_attn",)) if granularity == "selective" else set()
    weights_recomputed = granularity == "full" or bool(recomputed - {"core_attn", "moe_act"})  # those two hold none
    if model.get("mtp_use_repeated_layer") and weights_recomputed:
        return (MTP_REPEATED_RECOMPUTED + ": megatron checkpoints the one MTP layer (or the recomputed modules in "
                "it) once per depth, so the grads of the weights inside arrive in one backward per depth "
                "(multi_token_prediction.py, _checkpointed_forward), and ttrace records a parameter's grad once per "
                "microbatch (recomputing core_attn or moe_act, which hold no weights, is traced); found by the "
                "configuration sweep")
    if model.get("mtp_detach_heads") and parallel_sizes(recipe.parallel)["pp"] > 1:
        return (MTP_DETACHED_WITH_PP + ": the last stage's copy of the word embeddings, "
                "which only the detached MTP depths use, gets no grad (megatron/core/transformer/"
                "multi_token_prediction.py:818-822), and ttrace expects its piece of the embedding grad the "
                "pipeline stages sum (found by the configuration sweep on 0.19.2)")
    return None


# DistributedDataParallelConfig: the fields megatron's DDP honours on CPU with the same math
# (bucketing, overlap, checks and where the division by the DP size happens), and the refused ones
DDP_HONOURED = (
    "grad_reduce_in_fp32",  # ttrace's default is true, as Megatron-LM forces it for bf16
    "overlap_grad_reduce", "check_for_nan_in_grad",
    "check_for_large_grads", "bucket_size", "pad_buckets_for_high_nccl_busbw", "average_in_collective",
    "gradient_reduce_div_fusion", "reduce_scatter_with_fp32_accumulation",
    # the distributed optimizer's param all-gather in the next forward's module pre-hooks: each rank's
    # updated parameter is recorded as its owned range (layouts.KeyLayouts.params_gathered_late)
    "overlap_param_gather", "align_param_gather",
)
_FSDP = "Megatron FSDP is not supported by ttrace yet (its parameters are sharded by another scheme)"
DDP_REFUSED = {
    "use_distributed_optimizer": "set it under optimizer: (OptimizerConfig.use_distributed_optimizer); ttrace "
                                 "passes it to DDP",
    "num_distributed_optimizer_instances": "several distributed-optimizer instances are not supported by ttrace yet",
    "fp8_param_gather": "FP8 parameters need TransformerEngine", "reuse_grad_buf_for_mxfp8_param_ag": "MXFP8 needs "
    "TransformerEngine", "keep_fp8_transpose_cache": "FP8 parameters need TransformerEngine",
    "use_megatron_fsdp": _FSDP, "use_custom_fsdp": _FSDP, "data_parallel_sharding_strategy": _FSDP,
    "outer_dp_sharding_strategy": _FSDP, "suggested_communication_unit_size": _FSDP,
    "preserve_fp32_weights": _FSDP, "fsdp_double_buffer": _FSDP, "fsdp_manual_registration": _FSDP,
    "nccl_ub": "NCCL user buffers need CUDA", "disable_symmetric_registration": "NCCL symmetric memory needs CUDA",
    "delay_wgrad_compute": "delayed weight-grad computation needs TransformerEngine",
    # fields of later releases (0.17-0.19)
    "fp4_param_gather": "FP4 parameters need TransformerEngine",
    "fsdp_all_gather_in_start_param_sync": _FSDP, "fsdp_db_use_persist_buf_on_alloc_fail": _FSDP,
    "megatron_fsdp_grad_comm_dtype": _FSDP, "megatron_fsdp_main_grads_dtype": _FSDP,
    "megatron_fsdp_main_params_dtype": _FSDP, "megatron_fsdp_cuda_graph_mode": _FSDP,
    "megatron_fsdp_enable_fine_grained_param_gather": _FSDP, "megatron_fsdp_use_decoupled_grad": _FSDP,
    "megatron_fsdp_max_pool_double_buffer": _FSDP,
    "param_name_patterns_for_fp32_local_accumulation": model_fields.UNVERIFIED + " (it changes the precision "
                                                       "some parameters' grads accumulate in)",
    "num_buckets": model_fields.UNVERIFIED + " (the distributed optimizer's shard ranges follow the buckets)",
}


# the DistributedDataParallelConfig fields of some supported releases only (the rest are in all four);
# a role for a name that is neither installed nor here is a misspelling or a stale role
DDP_NOT_IN_EVERY_RELEASE = frozenset((
    "fp4_param_gather", "fsdp_all_gather_in_start_param_sync", "fsdp_db_use_persist_buf_on_alloc_fail",
    "megatron_fsdp_cuda_graph_mode", "megatron_fsdp_enable_fine_grained_param_gather",
    "megatron_fsdp_grad_comm_dtype", "megatron_fsdp_main_grads_dtype", "megatron_fsdp_main_params_dtype",
    "megatron_fsdp_max_pool_double_buffer", "megatron_fsdp_use_decoupled_grad", "num_buckets",
    "param_name_patterns_for_fp32_local_accumulation", "preserve_fp32_weights",
))


def ddp_fields() -> Dict[str, dataclasses.Field]:
    from megatron.core.distributed import DistributedDataParallelConfig

    return _fields(DistributedDataParallelConfig)


def check_ddp_fields(recipe: Recipe) -> None:
    """A recipe's ``ddp:`` section: megatron's DistributedDataParallelConfig fields, each honoured or
    refused with the reason (never an unknown key for a field megatron has)."""
    fields = ddp_fields()
    for key, value in recipe.ddp.items():
        if key not in fields:
            raise RecipeError(f"{recipe.source}: ddp: unknown key '{key}' (not a DistributedDataParallelConfig field)"
                              + _elsewhere(key, "ddp"))
        if key in DDP_REFUSED and value != fields[key].default:
            raise RecipeError(f"{recipe.source}: ddp: '{key}' is not supported by ttrace: {DDP_REFUSED[key]}")
        if key not in DDP_HONOURED and key not in DDP_REFUSED:
            raise RecipeError(f"{recipe.source}: ddp: '{key}' is a field of this megatron-core that ttrace does not "
                              f"know yet")


def ddp_config(recipe: Recipe):
    """megatron's DistributedDataParallelConfig for the recipe: its ``ddp:`` fields over ttrace's
    defaults (fp32 grad reduction, as Megatron-LM forces for bf16; the distributed optimizer as the
    optimizer section says)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    kwargs = dict(grad_reduce_in_fp32=True)
    kwargs.update(recipe.ddp)
    kwargs["use_distributed_optimizer"] = bool(recipe.optimizer.get("use_distributed_optimizer"))
    try:
        return DistributedDataParallelConfig(**kwargs)
    except (TypeError, ValueError, AssertionError) as e:
        raise RecipeError(f"{recipe.source}: megatron-core rejects the ddp config: {e}") from None


# selective recomputation's modules (recompute_modules): the ones checked on CPU, and why the others
# are refused
RECOMPUTE_MODULES_CHECKED = ("core_attn", "moe", "mlp", "shared_experts")
RECOMPUTE_MLP_WITH_BIAS = (
    "recompute_modules 'mlp' with add_bias_linear: megatron-core's recomputed MLP hangs. The layer "
    "checkpoints the MLP with tensor_parallel.checkpoint (megatron/core/transformer/transformer_layer.py:733 "
    "in 0.16.1, unchanged on main of 2026-08-22), and the MLP returns linear_fc2's bias Parameter itself "
    "(skip_bias_add). A Parameter returned from an autograd Function's forward becomes a non-leaf whose grad_fn "
    "is that Function's backward, so CheckpointFunction.backward (tensor_parallel/random.py:566) backpropagates "
    "into itself without end: measured, a TP2 candidate stuck with 100 re-entrant backward threads per rank. "
    "Biasless MLPs (add_bias_linear false, as Llama-like models have) are traced")
RECOMPUTE_MODULES_REFUSED = {
    "layernorm": "megatron-core recomputes the norms through CheckpointWithoutOutputFunction, which reads "
                 "TransformerEngine's FP8GlobalStateManager (megatron/core/tensor_parallel/random.py:589): needs "
                 "TransformerEngine",
    "moe_act": "megatron-core accepts it only with moe_grouped_gemm (megatron/core/transformer/transformer_config.py:1215), "
               "whose grouped experts need TransformerEngine or the CUDA grouped_gemm package",
    "mla_up_proj": "multi-latent attention is not supported by ttrace yet",
}


def recompute_refused(granularity: Optional[str], modules, add_bias_linear: bool = True) -> Optional[str]:
    """Why ttrace cannot trace this activation recomputation (None: it can), from the fields of a
    recipe or of a TransformerConfig alike (``ttrace run`` and ``--ttrace`` refuse by one rule).
    ``modules`` None: megatron's default, core attention."""
    if not granularity:
        return None
    if granularity == "selective":
        for module in modules or ("core_attn",):
            if module == "mlp" and add_bias_linear:
                return RECOMPUTE_MLP_WITH_BIAS
            if module not in RECOMPUTE_MODULES_CHECKED:
                return f"recompute_modules {module!r}: " + RECOMPUTE_MODULES_REFUSED.get(module, "not verified by "
                                                                                         "ttrace yet")
    return None


def megatron_cannot_run(recipe: Recipe):
    """(section, field, why) for configurations megatron-core 0.16.1's config rules accept and its
    code then cannot run, or runs with semantics that depend on the layout so that no one-rank
    reference can reproduce them (found by the configuration sweep, benchmarks/sweep.py): refused
    before any run starts, naming megatron's file and line and what to change."""
    model, opt = recipe.model, recipe.optimizer
    sizes = parallel_sizes(recipe.parallel)
    dp = recipe.world_size // (sizes["tp"] * sizes["pp"] * sizes["cp"])
    recompute = recompute_refused(model.get("recompute_granularity"), model.get("recompute_modules"),
                                  model.get("add_bias_linear", True))
    if recompute:
        yield ("model", "recompute_granularity", recompute)
    if (model.get("num_moe_experts") and model.get("moe_expert_capacity_factor") is not None
            and sizes["tp"] > 1 and recipe.parallel.get("sequence_parallel")):
        yield ("model", "moe_expert_capacity_factor",
               "with sequence parallelism megatron drops tokens by a capacity computed over the tokens each router "
               "sees, here one rank's sequence shard (megatron/core/transformer/moe/moe_utils.py, "
               "topk_routing_with_score_function), so which tokens are dropped depends on the TP size and no one-rank "
               "reference trains the same model; compare without sequence_parallel or without the capacity factor")
    balancing = model.get("moe_router_load_balancing_type", "aux_loss")
    if (model.get("num_moe_experts") and "global_aux_loss" in (balancing if isinstance(balancing, list) else [balancing])
            and model.get("moe_aux_loss_coeff", 0.0) and dp > 1):
        yield ("model", "moe_router_load_balancing_type",
               "global_aux_loss with data parallelism: megatron counts the tokens per expert over the TP×DP group and "
               "over the microbatches a rank has run so far (megatron/core/transformer/moe/router.py, "
               "_apply_global_aux_loss), so the loss depends on the DP size and no one-rank reference trains the same "
               "model; compare at DP 1 or with aux_loss / seq_aux_loss")
    yield from loss_path_cannot_run(recipe)
    if opt.get("use_distributed_optimizer") and opt.get("optimizer", "adam") != "adam":
        yield ("optimizer", "use_distributed_optimizer",
               "megatron-core's DistributedOptimizer supports only Adam (megatron/core/optimizer/distrib_optimizer.py "
               "asserts it); use optimizer: adam or drop the distributed optimizer")
    if model.get("num_moe_experts") and model.get("add_bias_linear", True):
        yield ("model", "add_bias_linear",
               "MoE experts with biases: megatron-core adds an expert's bias in place to its fc2 output "
               "(megatron/core/transformer/mlp.py, `output += output_bias ...`), which at expert-parallel 1 and "
               "expert-TP 1 (the one-rank reference) is a view autograd refuses to modify; set add_bias_linear: "
               "false for MoE models")
    if model.get("bias_activation_fusion"):
        act, glu = model.get("activation_func", "gelu"), bool(model.get("gated_linear_unit"))
        fusable = act == "gelu" or (act == "silu" and glu) or act == "quick_gelu"
        if model.get("num_moe_experts"):  # the experts' fused path takes per-token scales
            fusable = (act == "silu" and glu) or act == "quick_gelu"
        if not fusable:
            yield ("model", "bias_activation_fusion",
                   f"megatron-core fuses the bias with gelu or SwiGLU only (with experts: SwiGLU or quick-GeGLU); its "
                   f"config accepts activation_func {act!r}{' gated' if glu else ''} and its MLP then raises "
                   f"(megatron/core/transformer/mlp.py, 'Only support fusion of ...'); drop bias_activation_fusion")
    groups = model.get("num_query_groups") or model.get("num_attention_heads", 1)
    if model.get("attention_output_gate") and groups < sizes["tp"]:
        yield ("model", "attention_output_gate",
               f"with fewer query groups ({groups}) than TP ranks ({sizes['tp']}) megatron-core's output gate does not "
               f"fit the heads each rank holds (megatron/core/transformer/attention.py:1200, _apply_output_gate: a "
               f"view of the wrong size); use num_query_groups ≥ tensor_model_parallel_size")
    if model.get("qk_l2_norm") and not model.get("num_moe_experts"):
        yield ("model", "qk_l2_norm",
               "Megatron-LM's GPT builder hands qk_l2_norm to the TransformerEngine layer spec but not to the local one "
               "of a model without experts (gpt_builders.py:148, _get_transformer_layer_spec, core_v0.16.1 and "
               "core_v0.19.0): with --transformer-impl local the model it trains has no L2 norm. megatron-core's MoE "
               "decoder block spec takes it: set it on MoE models")
    if model.get("fp32_residual_connection") and recipe.dtype != "fp32":
        yield ("model", "fp32_residual_connection",
               f"with dtype {recipe.dtype}, megatron-core's local layers hand the fp32 residual stream through "
               "torch's norms (which keep fp32) to bf16 GEMMs that refuse it (megatron/core/tensor_parallel/"
               "layers.py); TransformerEngine's layers cast it. Use dtype: fp32 or drop the field")


# ModelParallelConfig fields that set the precision: the recipe's ``dtype`` sets them
PRECISION_FIELDS = {
    "fp16": "set by the recipe's dtype (fp16, with megatron's dynamic loss scaler)",
    "bf16": "set by the recipe's dtype (bf16 or fp8)",
    "params_dtype": "set by the recipe's dtype",
    "pipeline_dtype": "set by the recipe's dtype",
}


# ModelParallelConfig fields of later releases (0.17-0.19) ttrace does not honour: refused unless at
# megatron's default
_GTP = "generalized tensor parallelism (weight shards) is not supported by ttrace yet"
PARALLEL_REFUSED = {
    "tensor_parallel_num_weight_shards": _GTP, "expert_tensor_parallel_num_weight_shards": _GTP,
    "gtp_weight_remat_size": _GTP, "expert_gtp_weight_remat_size": _GTP,
    "mtp_grad_scale_func": model_fields.CALLABLE, "moe_grad_scale_func": model_fields.CALLABLE,
    "overlap_dispatch_backward_with_experts_wgrad": "overlaps the dispatcher on CUDA streams; "
                                                    + model_fields.UNVERIFIED,
    "cpu_offloading_retain_pinned_cpu_buffers": "activation offloading to the host: " + model_fields.UNVERIFIED,
    # refused here, before any rank starts, rather than by megatron's assertion in the build
    "context_parallel_size": model_fields.REFUSED["cp_comm_type"],
}


# OptimizerConfig fields that set fp16's loss scale (megatron's defaults where a recipe leaves them out)
LOSS_SCALE_FIELDS = {"loss_scale": None, "initial_loss_scale": 2.0 ** 32, "min_loss_scale": 1.0}



def loss_path_cannot_run(recipe: Recipe):
    """(section, field, why) for the data and loss paths megatron-core cannot train (issue #34):
    gathered logits, a padding mask megatron scatters on the first stage only."""
    model = recipe.model
    sizes = parallel_sizes(recipe.parallel)
    if model.get("runtime_gather_output"):
        yield ("model", "runtime_gather_output",
               "true in training gathers the logits before the loss as parallel_output false does: megatron-core "
               "computes the vocab-parallel cross entropy on them as if they were one rank's vocabulary shard "
               "(megatron/core/models/common/language_module/language_module.py:167) and its backward fails "
               "(megatron/core/tensor_parallel/cross_entropy.py:196)")
    if model.get("parallel_output", True) is False:
        yield ("model", "parallel_output",
               "false in training: the output layer gathers the logits over TP and megatron-core computes the "
               "vocab-parallel cross entropy on them as if they were this rank's vocabulary shard "
               "(megatron/core/models/common/language_module/language_module.py:167; at TP > 1 its forward counts "
               "the other ranks' vocabulary twice), and its backward fails at any TP size, the gathered logits being "
               "a view it changed in place (megatron/core/tensor_parallel/cross_entropy.py:196, measured on 0.16.1); "
               "Megatron-LM trains with parallel_output true")
    if recipe.data.padded_share and model.get("num_moe_experts") and "quantile_balancing" in (
            model.get("moe_router_load_balancing_type") if isinstance(model.get("moe_router_load_balancing_type"), list)
            else [model.get("moe_router_load_balancing_type")]):
        yield ("data", "padded_share",
               "a padding mask with quantile balancing: megatron-core asserts the router gets none "
               "(\"Quantile balancing routing does not support padding masks yet\", megatron/core/transformer/moe/"
               "router.py:769-771 at 0.19.2); found by the configuration sweep")
    if recipe.data.padded_share and model.get("num_moe_experts") and model.get("moe_router_enable_expert_bias"):
        yield ("data", "padded_share",
               "a padding mask with the router's expert bias: megatron-core masks the [tokens, experts] routing map "
               "with the [tokens] padding mask without unsqueezing it (megatron/core/transformer/moe/router.py:542 "
               "at 0.16.1, :738 at 0.19.0, _apply_expert_bias) and fails on any layout, a one-rank run included "
               "(measured on 0.16.1); compare without the padding or without moe_router_enable_expert_bias")
    if (recipe.data.padded_share and model.get("num_moe_experts") and sizes["pp"] > 1
            and recipe.parallel.get("sequence_parallel")):
        yield ("data", "padded_share",
               "a padding mask with MoE, pipeline and sequence parallelism: megatron-core scatters the mask along "
               "the sequence on the first stage only (megatron/core/models/gpt/gpt_model.py:307-320, under "
               "pre_process), so a later stage's routers get the whole microbatch's mask for their sequence shard "
               "and fail (megatron/core/transformer/moe/moe_utils.py:795, a size mismatch); compare without "
               "sequence_parallel or without pipeline parallelism")


def loss_scale_multiplier(dp: int, per_token_loss: bool) -> int:
    """How much larger a one-rank run's loss scale must be than a run at data-parallel size ``dp``
    for their backward tensors to be the same numbers.

    megatron divides each microbatch's loss by the microbatches of its DP rank (not with
    ``calculate_per_token_loss``) and DDP averages over DP after the backward, so at DP = dp every
    per-microbatch grad is dp times the one-rank run's at the same loss scale: in fp16 the candidate
    would overflow where the reference does not. At dp times the scale the one-rank run's backward
    carries the same values (its unscaled main grads are the same either way), and overflows where
    the candidate does."""
    return 1 if per_token_loss else int(dp)


def reference_optimizer(recipe_json: Dict[str, Any]) -> Dict[str, Any]:
    """The candidate's ``optimizer:`` fields as its one-rank reference takes them: under fp16, each
    loss-scale field times :func:`loss_scale_multiplier` of the candidate's DP size."""
    optimizer = dict(recipe_json.get("optimizer") or {})
    if recipe_json.get("dtype") != "fp16":
        return optimizer
    sizes = parallel_sizes(recipe_json.get("parallel") or {})
    dp = int(recipe_json.get("world_size", 1)) // (sizes["tp"] * sizes["pp"] * sizes["cp"])
    times = loss_scale_multiplier(dp, bool((recipe_json.get("model") or {}).get("calculate_per_token_loss")))
    for name, default in LOSS_SCALE_FIELDS.items():
        value = optimizer.get(name, default)
        if value is not None and times != 1:
            optimizer[name] = float(value) * times
    return optimizer


def parallel_sizes(parallel: Dict[str, Any]) -> Dict[str, int]:
    return {
        "tp": int(parallel.get("tensor_model_parallel_size", 1)),
        "pp": int(parallel.get("pipeline_model_parallel_size", 1)),
        "cp": int(parallel.get("context_parallel_size", 1)),
        "ep": int(parallel.get("expert_model_parallel_size", 1)),
        "vpp": int(parallel.get("virtual_pipeline_model_parallel_size") or 1),
        # megatron's rule (TransformerConfig and Megatron-LM's arguments): unset means the TP size
        "etp": int(parallel.get("expert_tensor_parallel_size") or parallel.get("tensor_model_parallel_size", 1)),
    }


def torch_dtype(dtype: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[dtype]


def padded_vocab_size(recipe: Recipe) -> int:
    """The vocabulary as megatron.training pads it for the candidate's TP size.

    The reference uses the same padded size: logits over padding take part in the softmax, so a
    reference padded differently would be a different model.
    """
    divisible_by = int(recipe.model.get("make_vocab_size_divisible_by", GPT_MODEL_KEYS["make_vocab_size_divisible_by"]))
    multiple = divisible_by * parallel_sizes(recipe.parallel)["tp"]
    return int(math.ceil(recipe.data.vocab_size / multiple) * multiple)


def transformer_config(recipe: Recipe, parallel: Dict[str, Any]):
    """TransformerConfig for a run with the given parallel settings (candidate or reference)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch_dtype(recipe.dtype)
    model = recipe.model
    if parallel_sizes(parallel)["pp"] == 1:  # e.g. the one-rank reference: no pipeline split to describe
        model = model_fields.without_layout(model)
    model = dict(model)
    heterogeneous.normalize(model, recipe.source)  # done at validation already, but a recipe may come unvalidated
    kwargs = {k: v for k, v in model.items()
              if k not in GPT_MODEL_KEYS and k not in GPT_FORWARD_KEYS and k != hybrid.PATTERN_KEY}
    config_class = heterogeneous.config_class() if heterogeneous.is_heterogeneous(model) else TransformerConfig
    kwargs.update(hybrid.config_fields(model))
    if "activation_func" in kwargs:
        if kwargs["activation_func"] not in activations():
            raise RecipeError(f"{recipe.source}: model: 'activation_func' must name one of {sorted(activations())}, "
                              f"got {kwargs['activation_func']!r}")
        kwargs["activation_func"] = activations()[kwargs["activation_func"]]
    kwargs.setdefault("hidden_dropout", 0.0)
    kwargs.setdefault("attention_dropout", 0.0)
    kwargs.update(parallel)
    kwargs.update(
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=recipe.dtype in ("bf16", "fp8"),
        fp16=recipe.dtype == "fp16",
    )
    try:
        return config_class(**kwargs)
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        raise RecipeError(f"{recipe.source}: megatron-core rejects the model/parallel config: {e}") from None


def optimizer_config(recipe: Recipe):
    from megatron.core.optimizer import OptimizerConfig

    kwargs = dict(recipe.optimizer)
    kwargs.setdefault("lr", 1e-3)  # megatron has no default lr (OptimizerConfig.lr is None); the rest is its own
    kwargs.setdefault("min_lr", 0.0)  # megatron.training's --min-lr default (the config's is None)
    kwargs.update(bf16=recipe.dtype in ("bf16", "fp8"), fp16=recipe.dtype == "fp16", params_dtype=torch_dtype(recipe.dtype))
    try:
        return OptimizerConfig(**kwargs)
    except (TypeError, ValueError, AssertionError) as e:
        raise RecipeError(f"{recipe.source}: megatron-core rejects the optimizer config: {e}") from None


def gpt_model_kwargs(recipe: Recipe) -> Dict[str, Any]:
    out = {k: recipe.model.get(k, v) for k, v in GPT_MODEL_KEYS.items() if k != "make_vocab_size_divisible_by"}
    return out
