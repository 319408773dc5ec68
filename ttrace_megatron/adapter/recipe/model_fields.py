"""Every field of megatron-core's TransformerConfig, and what ttrace does with it.

A recipe's ``model:`` section is a TransformerConfig (plus GPTModel's own arguments). A field ttrace
accepts and then does not build is the worst kind of bug: the user believes the feature was
checked. So every field of the installed megatron-core's TransformerConfig has one role here
(``tests/test_model_fields.py`` fails on a field this table does not name, so a new megatron
release forces a decision):

* ``STRUCTURE``: changes the module tree or the parameter set. Honoured, and checked on the built
  model before any run starts (``structure.check_built_as_described``).
* ``NUMERICS``: changes what the model computes, through megatron's own code, in reference and
  candidate alike; nothing to build.
* ``LAYOUT``: how the candidate splits the model over ranks (uneven pipeline stages): kept for the
  candidate, removed for the one-rank reference.
* ``RECOMPUTE``: the candidate's activation recomputation: kept for the candidate, removed for the
  reference, which keeps its activations, so the check judges the recomputed run against one
  that did not recompute (a recomputation bug on both sides would cancel out).
* ``NEUTRAL``: kernels, fusions, logging, memory: no effect on the math on CPU.
* ``REFUSED``: not supported by ttrace; a recipe that sets it to anything but megatron's default is
  refused before any run starts, with the reason.

The ParallelConfig fields of TransformerConfig belong under ``parallel:`` and are not listed here.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Optional, Tuple

from ...errors import RecipeError


class Role(enum.Enum):
    STRUCTURE = "structure"
    NUMERICS = "numerics"
    LAYOUT = "layout"
    RECOMPUTE = "recompute"
    NEUTRAL = "neutral"
    REFUSED = "refused"


STRUCTURE = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
    "add_bias_linear", "add_qkv_bias", "gated_linear_unit", "normalization", "qk_layernorm", "num_moe_experts",
    "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq",
    "mtp_num_layers",  # multi-token prediction (DeepSeek-V3): the MTP block's layers, built after the decoder
    # 0.17 on: one MTP layer run at every depth; its k-th call is recorded as depth k's (naming.call_name)
    "mtp_use_repeated_layer",
    "qk_l2_norm",  # Llama 4's parameter-free L2 norm of queries and keys (MoE models: config.megatron_cannot_run)
    "attention_output_gate",  # a sigmoid gate per head on attention's output, its projection inside each query group of linear_qkv
)

NUMERICS = (
    "moe_apply_probs_on_input",  # the router's probability scales an expert's input, not its output (top-1)
    "mtp_loss_scaling_factor",  # the weight of the MTP depths' losses in the backward
    "softmax_type",  # attention sinks (gpt-oss): off-by-one, or a learnable offset per head, sharded over TP
    "no_rope_freq",  # NoPE layers (Llama 4): which layers skip RoPE, by the global layer number
    "hidden_dropout", "attention_dropout",  # must be 0: refused otherwise by validate_recipe
    "softmax_scale", "fp32_residual_connection", "apply_residual_connection_post_layernorm", "layernorm_epsilon",
    "layernorm_zero_centered_gamma", "glu_linear_offset", "activation_func_clamp_value", "rotary_interleaved",
    "window_size", "window_attn_skip_freq", "calculate_per_token_loss", "init_method_std",
    "embedding_init_method_std", "apply_query_key_layer_scaling", "attention_softmax_in_fp32",
    "bias_activation_fusion",  # megatron's fused bias-GeLU is the tanh approximation: both runs use it
    "moe_router_load_balancing_type", "moe_router_topk", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_score_function", "moe_router_dtype",
    "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_token_dropping", "moe_token_dispatcher_type", "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity", "moe_token_drop_policy", "moe_enable_routing_replay",
    "activation_func",  # by name, as Megatron-LM's --swiglu / --squared-relu / --quick-geglu set it (config.ACTIVATIONS)
    # μP (0.19 on): init, attention scale, embedding and logit multipliers from the global config, and the
    # optimizer's per-class lr and Adam ε as megatron.training sets them (compat.optimizer_config_overrides)
    # 0.19: the MTP heads train on their own loss only (their inputs detached), their grads clipped by a
    # norm of their own (megatron/core/optimizer/optimizer.py:362-420); ttrace records the main norm, and the
    # MTP parameters' clipped steps are judged through their moments and updates
    "mtp_detach_heads",
    # 0.19: the MLP run once per chunk of the rank's sequence; each call recorded and judged as one
    # (naming.call_name's ``#k``); refused where the calls cannot match the reference's (config.mlp_chunks_refused)
    "mlp_chunks_for_training",
    # 0.19's quantile balancing: the EMA of qb_beta, the per-expert bias the routers choose by; the choice is
    # recorded, judged and followed with its scores (the logits minus qb_beta: routing.balances_by_quantile)
    "moe_router_quantile_balancing_ema",
    "use_mup", "mup_base_hidden_size", "mup_base_head_dim", "mup_embedding_mult", "mup_output_mult",
    "mup_attn_scale_power",
)

LAYOUT = (
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
)

RECOMPUTE = (
    "recompute_granularity", "recompute_method", "recompute_num_layers", "distribute_saved_activations",
    "recompute_modules",
    "moe_layer_recompute",  # each MoE layer checkpointed on its own (its router's aux losses exist only recomputed)
)

NEUTRAL = (
    "masked_softmax_fusion", "persist_layer_norm", "memory_efficient_layer_norm", "bias_dropout_fusion",
    "disable_bf16_reduced_precision_matmul", "clone_scatter_output_in_embedding", "disable_parameter_transpose_cache",
    "config_logger_dir", "moe_per_layer_logging", "transformer_impl",
    "init_model_with_meta_device",  # initialization only: ttrace's seed checkpoint gives both sides the same weights
    "hetereogenous_dist_checkpoint",  # the checkpoint's key layout only (transformer_block.py sharded_state_dict)
)

UNVERIFIED = "not verified by ttrace yet: no test shows reference and candidate agree with it"
_TE = "needs TransformerEngine or a CUDA kernel (ttrace runs megatron's local layers)"
_RNG = "draws random numbers during training: reference and candidate could not be compared"
CALLABLE = "a Python callable: a YAML recipe cannot set it (megatron's default is used)"
_FP8 = "TransformerEngine FP8/FP4: use `dtype: fp8`, ttrace's emulation of TE's FP8 GEMMs, on CPU"
_GROUPED = "grouped GEMM needs TransformerEngine or the grouped_gemm package; ttrace builds SequentialMLP experts"
_MAMBA = "configures Mamba layers (M in hybrid_layer_pattern), which need the mamba_ssm CUDA kernels: not " \
         "supported by ttrace yet"
_DSA = "DeepSeek sparse attention needs the fast_hadamard_transform CUDA package " \
       "(megatron/core/transformer/experimental_attention_variant/dsa.py:44)"
_GDN = "gated delta net (linear attention) needs the flash-linear-attention (fla) Triton kernels and causal_conv1d, " \
       "CUDA packages (megatron/core/ssm/gated_delta_net.py:103)"
_HETEROGENEOUS = ("set by megatron from the per-layer block configs: give model: heterogeneous_layers_config_path "
                  "or heterogeneous_layers_config_encoded_json (HeterogeneousTransformerConfig, Megatron-LM's "
                  "--heterogeneous-layers-config-path; adapter/recipe/heterogeneous.py)")
_QK_CLIP = ("QK-clip (MuonClip) reads the max attention logit that only TransformerEngine's attention records "
            "(megatron/core/extensions/transformer_engine.py:1308) and clips multi-latent attention's weights "
            "(megatron/core/transformer/multi_latent_attention.py:984), which needs TransformerEngine too")
_CUDA_OFFLOAD = "activation offloading to the host needs CUDA streams and pinned memory"
_OFFLOAD = _CUDA_OFFLOAD

REFUSED: Dict[str, str] = {
    "attention_backend": _TE,
    "activation_func_fp8_input_store": _FP8,
    "qk_clip": _QK_CLIP, "qk_clip_alpha": _QK_CLIP, "qk_clip_threshold": _QK_CLIP,
    "log_max_attention_logit": _QK_CLIP,
    "test_mode": "megatron's internal test switch",
    "multi_latent_attention": "multi-latent attention needs TransformerEngine's attention: megatron-core's local "
                              "MLA spec builds DotProductAttention, which takes no k_channels "
                              "(megatron/core/transformer/multi_latent_attention.py:162 passes it; the build fails "
                              "in spec_utils.py:119, 0.16.1 and 0.19.2 alike)",
    "experimental_attention_variant": "its variants need CUDA packages: 'dsa' " + _DSA.split(" needs ")[1]
                                      + "; 'gated_delta_net' " + _GDN.split(" needs ")[1],
    "dsa_indexer_n_heads": _DSA, "dsa_indexer_head_dim": _DSA, "dsa_indexer_topk": _DSA,
    "dsa_indexer_loss_coeff": _DSA, "dsa_indexer_use_sparse_loss": _DSA,
    "linear_attention_freq": _GDN, "linear_conv_kernel_dim": _GDN,
    "linear_key_head_dim": _GDN, "linear_value_head_dim": _GDN,
    "linear_num_key_heads": _GDN, "linear_num_value_heads": _GDN,
    "init_method": CALLABLE, "output_layer_init_method": CALLABLE, "embedding_init_method": CALLABLE,
    "apply_rope_fusion": _TE, "use_fused_weighted_squared_relu": _TE, "fused_single_qkv_rope": _TE,
    "fp8": _FP8, "fp8_recipe": _FP8, "fp8_param": _FP8, "fp8_quantizer_factory": _FP8, "fp8_margin": _FP8,
    "fp8_interval": _FP8, "fp8_amax_history_len": _FP8, "fp8_amax_compute_algo": _FP8, "fp8_wgrad": _FP8,
    "fp8_dot_product_attention": _FP8, "fp8_multi_head_attention": _FP8, "tp_only_amax_red": _FP8,
    "first_last_layers_bf16": _FP8, "num_layers_at_start_in_bf16": _FP8, "num_layers_at_end_in_bf16": _FP8,
    "fp4": _FP8, "fp4_recipe": _FP8, "fp4_param": _FP8, "fp4_quantizer_factory": _FP8,
    "use_kitchen": _TE, "use_kitchen_attention": _TE, "kitchen_attention_backend": _TE,
    "moe_shared_expert_overlap": "overlaps the shared expert on a CUDA stream (megatron/core/transformer/moe/"
                                 "shared_experts.py:123, torch.cuda.Stream)",
    "moe_router_topk_limited_devices": "device-limited routing groups the experts by the EP ranks that hold them "
                                       "(megatron/core/transformer/transformer_config.py:1668, moe_router_num_groups = "
                                       "expert_model_parallel_size), so a one-rank reference routes otherwise; use "
                                       "moe_router_num_groups and moe_router_group_topk",
    "moe_router_padding_for_quantization": _FP8, "moe_router_padding_for_fp8": _FP8,
    "moe_router_force_load_balancing": _RNG + " (random router logits)",
    "moe_grouped_gemm": "grouped GEMM experts need TransformerEngine or the grouped_gemm package; "
                        "ttrace builds SequentialMLP experts",
    "moe_use_legacy_grouped_gemm": "grouped GEMM experts: see moe_grouped_gemm",
    "moe_input_jitter_eps": _RNG + " (router input jitter)",
    "moe_enable_deepep": _TE, "moe_flex_dispatcher_backend": _TE, "moe_deepep_num_sms": _TE,
    "moe_hybridep_num_sms": _TE,
    "moe_permute_fusion": _TE, "moe_router_fusion": _TE,
    "moe_latent_size": "MoE latent projections need TransformerEngine (megatron/core/transformer/moe/moe_layer.py:171)",
    "cp_comm_type": "context parallelism needs TransformerEngine's attention: megatron-core's local "
                    "DotProductAttention asserts context_parallel_size == 1 (megatron/core/transformer/"
                    "dot_product_attention.py:57-59 in 0.16.1 and 0.19.2)",
    "enable_cuda_graph": _TE, "cuda_graph_use_single_mempool": _TE, "cuda_graph_retain_backward_graph": _TE,
    "cuda_graph_warmup_steps": _TE, "external_cuda_graph": _TE, "cuda_graph_impl": _TE, "cuda_graph_scope": _TE,
    "flash_decode": "inference only", "batch_invariant_mode": _TE,
    "use_te_activation_func": _TE, "inference_rng_tracker": "inference only",
    "inference_sampling_seed": "inference only", "symmetric_ar_type": _TE,
    "use_inference_optimized_layers": "inference only", "inference_fuse_tp_communication": "inference only",
    "mrope_section": "multimodal rotary embedding: its 3-D position ids come with image and video inputs, which a "
                     "GPT recipe's token data does not have",
    "is_hybrid_model": "set from model: hybrid_layer_pattern (a HybridModel), as Megatron-LM's "
                       "--hybrid-layer-pattern sets it",
    "mamba_state_dim": _MAMBA,
    "mamba_head_dim": _MAMBA,
    "mamba_num_groups": _MAMBA,
    "mamba_num_heads": _MAMBA,
    "use_mamba_mem_eff_path": _MAMBA,
    "mlp_chunks_for_prefill": "inference only",
    "heterogeneous_block_specs": _HETEROGENEOUS,
    "quant_recipe": _FP8,
    "fine_grained_activation_offloading": _CUDA_OFFLOAD, "offload_modules": _CUDA_OFFLOAD,
    "min_offloaded_tensor_size": _CUDA_OFFLOAD,
    # fields of later releases (0.17-0.19; tests/test_model_fields.py checks every installed field has a role)
    "mup_width_mult": "derived by megatron from hidden_size / mup_base_hidden_size (megatron/core/transformer/"
                      "transformer_config.py:2203), which overwrites any value given: set mup_base_hidden_size",
    "mtp_hybrid_override_pattern": "deprecated, read by no megatron-core module (megatron/core/transformer/"
                                   "transformer_config.py:90): Megatron-LM's arguments turn it into "
                                   "hybrid_layer_pattern for old checkpoints; give hybrid_layer_pattern",
    "experimental_attention_variant_loss_scale_func": CALLABLE,
    "fused_residual_rmsnorm": _TE, "flash_attention_version": _TE, "use_transformer_engine_op_fuser": _TE,
    "cuda_graph_modules": _TE, "high_priority_a2a_comm_stream": _TE, "fp8_output_proj": _FP8,
    "moe_hybridep_num_blocks_permute": _TE, "moe_hybridep_num_blocks_unpermute": _TE,
    "moe_hybridep_num_sms_preprocessing": _TE, "moe_hybridep_pad_uneven_dispatch_inputs": _TE,
    "moe_permute_fusion_into_hybridep": _TE, "moe_flex_dispatcher_num_sms": _TE, "moe_ncclep_static_shape": _TE,
    "moe_ncclep_zero_copy": _TE, "moe_paged_stash": _TE, "moe_paged_stash_page_size": _TE,
    "moe_paged_stash_buffer_size_factor_cpu": _TE, "moe_paged_stash_buffer_size_factor_cuda": _TE,
    "moe_single_grouped_weight": _GROUPED, "moe_single_grouped_bias": _GROUPED,
    "use_grouped_gemm_for_dense_mlp": _GROUPED, "use_grouped_gemm_for_shared_expert": _GROUPED,
    # read only by kernels ttrace cannot build: accepting them would train a model without them
    "moe_mlp_glu_interleave_size": "read only by TEGroupedMLP (megatron/core/transformer/moe/experts.py:292-296), "
                                   "which needs TransformerEngine's grouped linears; the SequentialMLP experts "
                                   "ttrace builds ignore it",
    "moe_shared_expert_glu_interleave_size": "read only by FusedSharedExpertMLP (megatron/core/transformer/moe/"
                                             "shared_experts.py:370, 414-419), which needs TransformerEngine; the "
                                             "SharedExpertMLP ttrace builds ignores it",
    "moe_expert_rank_capacity_factor": "needs moe_flex_dispatcher_backend hybridep or ncclep (megatron/core/"
                                       "transformer/transformer_config.py:1692-1705), CUDA dispatchers",
    "moe_router_force_biased": "replaces the router's logits with random numbers drawn per expert-parallel rank "
                               "(megatron/core/transformer/moe/moe_utils.py:1280-1291): " + _RNG,
    "fine_grained_offloading_max_inflight_offloads": _OFFLOAD,
    "activation_offload_fraction": _OFFLOAD, "delay_offload_until_cuda_graph": _OFFLOAD,
    "delta_offload_bytes_across_pp_ranks": _OFFLOAD,
    "inference_disable_triton_nvls_kernels": "inference only", "inference_grouped_gemm_backend": "inference only",
    "inference_moe_disable_fused_quant_kernels": "inference only", "inference_cuda_graph_scope": "inference only",
    "inference_moe_token_dispatcher_type": "inference only", "moe_pad_experts_for_cuda_graph_inference": "inference only",
    "nccl_all_reduce_for_prefill": "inference only",
    "dsa_indexer_k_norm_epsilon": _DSA, "dsa_indexer_k_norm_fp32": _DSA, "dsa_indexer_rope_interleaved": _DSA,
    "dsa_indexer_rotate_activation": _DSA, "dsa_indexer_scoring_relu": _DSA, "dsa_indexer_skip_topk_offset": _DSA,
    "dsa_indexer_topk_freq": _DSA, "dsa_kernel_backend": _DSA,
    "mamba_training_ssm_states_dtype": _MAMBA,
}


# the fields of some supported releases only (the rest are in all four: 0.16.1, 0.17.1, 0.18.2,
# 0.19.2); a role for a name that is neither installed nor here is a misspelling or a stale role
NOT_IN_EVERY_RELEASE = frozenset((
    "activation_offload_fraction", "cuda_graph_modules", "delay_offload_until_cuda_graph",
    "delta_offload_bytes_across_pp_ranks", "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32",
    "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu",
    "dsa_indexer_skip_topk_offset", "dsa_indexer_topk_freq", "dsa_kernel_backend",
    "experimental_attention_variant_loss_scale_func", "fine_grained_offloading_max_inflight_offloads",
    "flash_attention_version", "fp8_output_proj", "fused_residual_rmsnorm", "high_priority_a2a_comm_stream",
    "inference_cuda_graph_scope", "inference_disable_triton_nvls_kernels", "inference_grouped_gemm_backend",
    "inference_moe_disable_fused_quant_kernels", "inference_moe_token_dispatcher_type",
    "mamba_training_ssm_states_dtype", "mlp_chunks_for_training", "moe_expert_rank_capacity_factor",
    "moe_flex_dispatcher_num_sms", "moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute",
    "moe_hybridep_num_sms_preprocessing", "moe_hybridep_pad_uneven_dispatch_inputs", "moe_mlp_glu_interleave_size",
    "moe_ncclep_static_shape", "moe_ncclep_zero_copy", "moe_pad_experts_for_cuda_graph_inference",
    "moe_paged_stash", "moe_paged_stash_buffer_size_factor_cpu", "moe_paged_stash_buffer_size_factor_cuda",
    "moe_paged_stash_page_size", "moe_permute_fusion_into_hybridep", "moe_router_force_biased",
    "moe_router_quantile_balancing_ema", "moe_shared_expert_glu_interleave_size", "moe_single_grouped_bias",
    "moe_single_grouped_weight", "moe_use_legacy_grouped_gemm", "mtp_detach_heads", "mtp_hybrid_override_pattern",
    "mtp_use_repeated_layer", "mup_attn_scale_power", "mup_base_head_dim", "mup_base_hidden_size",
    "mup_embedding_mult", "mup_output_mult", "mup_width_mult", "nccl_all_reduce_for_prefill",
    "use_grouped_gemm_for_dense_mlp", "use_grouped_gemm_for_shared_expert", "use_mup",
    "use_transformer_engine_op_fuser",
))


def by_role() -> Tuple[Tuple[Role, Tuple[str, ...]], ...]:
    """Every role with its fields, in the order docs/model_fields.md lists them."""
    return ((Role.STRUCTURE, STRUCTURE), (Role.NUMERICS, NUMERICS), (Role.LAYOUT, LAYOUT),
            (Role.RECOMPUTE, RECOMPUTE), (Role.NEUTRAL, NEUTRAL), (Role.REFUSED, tuple(REFUSED)))


def role_of(name: str) -> Role:
    for role, names in by_role():
        if name in names:
            return role
    raise KeyError(name)


def transformer_fields() -> Dict[str, dataclasses.Field]:
    """The installed megatron-core's TransformerConfig fields that are not parallel settings."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel = {f.name for f in dataclasses.fields(ModelParallelConfig)}
    return {f.name: f for f in dataclasses.fields(TransformerConfig) if f.name not in parallel}


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def refusals(model: Dict[str, Any]) -> List[Tuple[str, str]]:
    """(field, why) for every field of a recipe's ``model:`` section ttrace cannot honour: a
    refused field set to anything but megatron's default."""
    fields = transformer_fields()
    out = []
    for name, value in model.items():
        if name not in fields:
            continue
        try:
            role = role_of(name)
        except KeyError:
            out.append((name, "a field of this megatron-core that ttrace does not know yet"))
            continue
        if role is Role.REFUSED and value != _default(fields[name]):
            out.append((name, REFUSED[name]))
    return out


def check_fields(model: Dict[str, Any], where: str) -> None:
    """Refuse a recipe whose ``model:`` sets a field ttrace cannot honour, naming the field."""
    refused = refusals(model)
    if refused:
        name, why = refused[0]
        more = f" (and {', '.join(n for n, _ in refused[1:])})" if len(refused) > 1 else ""
        raise RecipeError(f"{where}: model: '{name}' is not supported by ttrace: {why}{more}")


def for_reference(model: Dict[str, Any]) -> Dict[str, Any]:
    """A candidate's ``model:`` fields as the reference takes them: without the candidate's
    activation recomputation."""
    return {k: v for k, v in model.items() if k not in RECOMPUTE}


# honoured fields refused in some combinations: where, for docs/model_fields.md (the refusal itself
# names megatron's file and line)
LIMITS = {
    "mlp_chunks_for_training": "each chunk's call judged against the reference's; refused with sequence "
                               "parallelism (a call gathers every rank's k-th piece), a repeated MTP layer, fp8, "
                               "recomputed MLP modules and a padded MoE model (megatron drops the padding mask in "
                               "the chunked call: config.mlp_chunks_refused)",
    "heterogeneous_block_specs": "honoured from model: heterogeneous_layers_config_path or _encoded_json: each "
                                 "layer's attention (full with its own query groups, a gathered linear, none) and "
                                 "MLP (dense with its own width, a linear, none) checked on the built model; refused "
                                 "with MoE, MTP, multi-latent attention and a hybrid pattern (heterogeneous.check)",
    "mtp_use_repeated_layer": "the one layer's k-th call recorded as depth k's (mtp.layers.{k}); refused with "
                              "recomputed weights, whose grads megatron's per-depth checkpoints hand in once per "
                              "depth (config.mtp_refused)",
}


def without_layout(model: Dict[str, Any]) -> Dict[str, Any]:
    """A candidate's ``model:`` fields as the one-rank reference takes them: without the fields that
    only say how the candidate's pipeline splits the layers."""
    return {k: v for k, v in model.items() if k not in LAYOUT}


def markdown() -> str:
    """docs/model_fields.md: every TransformerConfig field of the supported megatron-core releases
    (``compat.SUPPORTED``), its role and, for refused fields, why
    (``python -m ttrace_megatron.adapter.recipe.model_fields``). Generated from this table alone, so it is
    the same whichever release is installed; the tests check that every installed field is in it."""
    from .compat import SUPPORTED

    what = {Role.STRUCTURE: "honoured; checked on the built model before any run starts",
            Role.NUMERICS: "honoured by megatron's own code in reference and candidate",
            Role.LAYOUT: "the candidate's pipeline split; removed for the one-rank reference",
            Role.RECOMPUTE: "the candidate's activation recomputation (values recorded at the first run, a "
                            "recomputed module's output again as recomputed_output, judged against the "
                            "reference's output; grads from the recomputed graph); removed for the reference, "
                            "which keeps its activations",
            Role.NEUTRAL: "no effect on the math on CPU"}
    lines = [f"# TransformerConfig fields in ttrace (megatron-core {SUPPORTED[0]} to {SUPPORTED[-1]})", "",
             "Generated by `python -m ttrace_megatron.adapter.recipe.model_fields`; `tests/test_model_fields.py` checks "
             "that it is current and that every field of the installed release is in it (a field one release "
             "lacks is simply absent from its TransformerConfig). A refused field is refused only when a recipe "
             "sets it to something other than megatron's default.", "", "| field | role | what ttrace does |",
             "|---|---|---|"]
    for role, names in by_role():
        for name in names:
            text = REFUSED[name] if role is Role.REFUSED else what[role]
            lines.append(f"| `{name}` | {role.value} | {text}{'; ' + LIMITS[name] if name in LIMITS else ''} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print(markdown(), end="")
