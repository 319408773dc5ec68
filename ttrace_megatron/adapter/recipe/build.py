"""Build a recipe's model and optimizer the way megatron.training builds them.

The model is a megatron-core GPTModel with the layer spec Megatron-LM's ``pretrain_gpt.py`` builds
for the local implementation (:func:`layer_spec`), or, for a recipe with a hybrid layer pattern, a
HybridModel of the same local layers (:mod:`.hybrid`), checked against the recipe's fields before
anything runs (``structure``), one chunk per virtual pipeline stage, wrapped
as megatron.training wraps it (Float16Module for bf16, DistributedDataParallel); its optimizer
comes from ``get_megatron_optimizer``. :func:`model_signature` describes what was built, from the
built objects, for ``ttrace run`` and ``--ttrace`` alike, so traces of either compare.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Dict, List, Sequence

import torch

from ...errors import BuiltOtherwise, RecipeError
from ...recipe import Recipe
from . import compat, heterogeneous, hybrid
from . import config as cfg
from .model_fields import STRUCTURE
from .structure import check_built_as_described, check_layer_placement
from .naming import NAME_MAP_ATTR, all_parameters, full_param_name, unwrap


def gpt_chunks(recipe: Recipe, parallel: Dict[str, Any], *, cpu: bool = True, as_gpt: bool = False):
    """(model chunks, TransformerConfig) of one rank, after ``initialize_model_parallel``.

    The weights are megatron's own initialization; a run then loads the seed checkpoint over them.
    Parameters the recipe freezes stop requiring grads. ``as_gpt``: a HybridModel of
    attention/MLP pairs names its tensors as its GPTModel equivalent's (``hybrid.gpt_name``).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    sizes = cfg.parallel_sizes(parallel)  # a hybrid pattern's virtual stages included (RunSpec.parallel)
    vpp = sizes["vpp"]
    torch.manual_seed(recipe.data.seed)
    model_parallel_cuda_manual_seed(recipe.data.seed)
    config = cfg.transformer_config(recipe, parallel)
    pattern = hybrid.pattern_of(recipe.model)
    if as_gpt:
        hybrid.gpt_equivalent(recipe.to_json())  # refuses a pattern without a GPT equivalent
    # one chunk per virtual stage, as megatron.training's get_model builds them
    stages = [None] if vpp == 1 else list(range(vpp))
    chunks = []
    for vp_stage in stages:
        where = dict(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                     post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                     vp_stage=vp_stage)
        try:
            if pattern is None:
                chunk = _gpt_model(recipe, config, where)
            else:
                chunk = _hybrid_model(recipe, config, hybrid.side_pattern(pattern, sizes["pp"], vpp), where)
        except (AssertionError, ValueError, TypeError, NotImplementedError) as e:
            raise RecipeError(f"{recipe.source}: megatron-core refuses to build this model: {megatron_frame(e)}: "
                              f"{e}") from None
        if as_gpt:
            setattr(chunk, NAME_MAP_ATTR, hybrid.gpt_name)
        if not cpu:
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    problems = check_built_as_described(chunks, config, cfg.gpt_model_kwargs(recipe), pattern)
    # a HybridModel's stages are its pattern's segments (hybrid.side_pattern)
    check_layer_placement(problems, chunks, config, parallel_state.get_pipeline_model_parallel_rank(), sizes["pp"],
                          vpp, None if pattern is None else hybrid.side_pattern(pattern, sizes["pp"], vpp))
    if problems:  # the recipe passed validation: megatron built something else, a finding
        raise BuiltOtherwise(problems, rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
    for mname, pname, _, param in all_parameters(chunks):
        if any(fnmatch.fnmatchcase(full_param_name(mname, pname), p) for p in recipe.train.frozen):
            param.requires_grad_(False)
    return chunks, config


def _gpt_model(recipe: Recipe, config, where: Dict[str, Any]):
    from megatron.core.models.gpt import GPTModel

    spec = layer_spec(config, where["vp_stage"])
    return GPTModel(config=config, transformer_layer_spec=spec, mtp_block_spec=mtp_block_spec(config, spec, where),
                    vocab_size=cfg.padded_vocab_size(recipe), max_sequence_length=recipe.data.seq_length,
                    **where, **cfg.gpt_model_kwargs(recipe))


def mtp_block_spec(config, decoder_spec, where: Dict[str, Any]):
    """The multi-token prediction block of a model with ``mtp_num_layers``, as Megatron-LM's GPT
    builder makes it for the local implementation: each MTP layer's transformer layer is the
    decoder's last layer spec (an MoE layer if the decoder ends with one), local norms and
    projection; megatron builds it on the stage that holds the MTP layers (None elsewhere)."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, decoder_spec, use_transformer_engine=False, vp_stage=where["vp_stage"])


def _hybrid_model(recipe: Recipe, config, pattern: str, where: Dict[str, Any]):
    """megatron's HybridModel of local layers (``hybrid.stack_spec``), built as Megatron-LM's
    ``pretrain_hybrid.py`` builds it: the pattern, this stage's segment chosen by megatron."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    kwargs = cfg.gpt_model_kwargs(recipe)
    with compat.hybrid_final_norm(hybrid.final_norm_class(config)):
        model = HybridModel(config=config, hybrid_stack_spec=hybrid.stack_spec(config),
                            vocab_size=cfg.padded_vocab_size(recipe), max_sequence_length=recipe.data.seq_length,
                            hybrid_layer_pattern=pattern, **where, **kwargs)
    # GPTModel keeps these arguments as attributes (the model signature reads them); HybridModel
    # hands them to its RotaryEmbedding only
    for name in ("rotary_percent", "rotary_base"):
        if not hasattr(model, name):
            setattr(model, name, kwargs[name])
    return model


def megatron_frame(error: BaseException) -> str:
    """Where in megatron-core an exception was raised (its innermost megatron frame), for a message
    that tells the user which of megatron's checks the recipe failed."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "/megatron/core/" in f.filename.replace("\\", "/")]
    if not frames:
        return "(not inside megatron-core)"
    f = frames[-1]
    path = f.filename.replace("\\", "/")
    return f"{path[path.rfind('/megatron/core/') + 1:]}:{f.lineno}"


def layer_spec(config, vp_stage):
    """The decoder spec Megatron-LM's ``pretrain_gpt.py`` builds for ``--transformer-impl local``
    (its ``gpt_builder``): with experts, megatron's decoder block spec (the MoE layer pattern of
    ``moe_layer_freq``, this stage's layers); without, the local layer spec with the spec-level
    choices (q/k layernorm, normalization) read from the config, so no field is dropped here; with
    per-layer block configs, megatron's heterogeneous spec (:mod:`.heterogeneous`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if getattr(config, "heterogeneous_block_specs", False):
        return heterogeneous.layer_spec(config, vp_stage)
    if config.num_moe_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization,
                                          qk_l2_norm=config.qk_l2_norm, vp_stage=vp_stage)
    return compat.local_layer_spec(config)


def wrap_for_training(chunks: List[torch.nn.Module], config, recipe: Recipe) -> List[torch.nn.Module]:
    """Float16Module for bf16 and fp16, then megatron's DistributedDataParallel (the recipe's ``ddp:``
    fields), as megatron.training does."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    if config.bf16 or config.fp16:
        chunks = [Float16Module(config, c) for c in chunks]
    ddp_config = cfg.ddp_config(recipe)
    # megatron.training: only the first chunk's buckets are the first to be reduced
    return [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]


def optimizer(recipe: Recipe, model: List[torch.nn.Module], config):
    """megatron's optimizer for ``model``, and the config hooks megatron.training sets with it."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    opt_config = cfg.optimizer_config(recipe)
    overrides = compat.optimizer_config_overrides(opt_config, config)
    opt = get_megatron_optimizer(opt_config, model, **({} if overrides is None else {"config_overrides": overrides}))
    if recipe.ddp.get("overlap_grad_reduce"):
        # megatron.training: the schedule holds back each chunk's grad reduction until the last
        # microbatch's backward (no_sync), then starts it per chunk (--align-grad-reduce, its default)
        no_sync = [chunk.no_sync for chunk in model]
        start = [chunk.start_grad_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        config.grad_sync_func = start[0] if len(model) == 1 else start
    if recipe.ddp.get("overlap_param_gather") and recipe.ddp.get("align_param_gather"):
        # megatron.training: the schedule dispatches each chunk's param all-gather itself
        sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = sync[0] if len(model) == 1 else sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    return opt


def scheduler(recipe: Recipe, opt, optimizer_config):
    """megatron's OptimizerParamScheduler as megatron.training sets it up, in iterations (it counts
    samples; the lr and weight decay of every step are the same). Its first ``step`` sets each
    param group's lr and weight decay, the latter times the group's ``wd_mult``: megatron's
    default groups decay no biases and no 1-D parameters (norms)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = recipe.train
    wd = optimizer_config.weight_decay
    start_wd = wd if t.start_weight_decay is None else t.start_weight_decay
    end_wd = wd if t.end_weight_decay is None else t.end_weight_decay
    return OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=optimizer_config.lr, min_lr=optimizer_config.min_lr or 0.0,
        lr_warmup_steps=t.lr_warmup_iters, lr_decay_steps=t.lr_decay_iters or t.iterations,
        lr_decay_style=t.lr_decay_style, start_wd=start_wd, end_wd=end_wd, wd_incr_steps=t.iterations,
        wd_incr_style=t.weight_decay_incr_style)


# TransformerConfig fields that define the computation (parallel layout and performance knobs are
# left out: they are what reference and candidate legitimately differ in)
MODEL_FIELDS = tuple(dict.fromkeys(("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "normalization", "layernorm_epsilon", "layernorm_zero_centered_gamma",
                "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "hidden_dropout",
                "attention_dropout", "apply_residual_connection_post_layernorm", "init_method_std",
                "bf16", "fp16", "params_dtype", "fp8", "num_moe_experts", "moe_router_topk",
                "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                "moe_router_score_function", "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
                "calculate_per_token_loss", "apply_query_key_layer_scaling", "attention_softmax_in_fp32")
                                 + STRUCTURE))  # every structure field (model_fields) is part of it
GPT_MODEL_ATTRIBUTES = ("vocab_size", "max_sequence_length", "position_embedding_type",
                        "share_embeddings_and_output_weights", "rotary_percent", "rotary_base")
OPTIMIZER_FIELDS = ("optimizer", "lr", "min_lr", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps",
                    "sgd_momentum", "decoupled_weight_decay", "loss_scale", "initial_loss_scale", "min_loss_scale",
                    "loss_scale_window", "hysteresis")


def _plain(value):
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def model_signature(chunks: Sequence[torch.nn.Module], config, optimizer_config, facts,
                    training: Dict[str, Any]) -> Dict[str, Any]:
    """What must be equal between reference and candidate for a comparison to make sense, read
    from what was built: the model's config, the GPTModel's own arguments, the optimizer's config
    and whether the GEMMs are FP8-emulated; and from the caller's loop (``training``: data seed,
    sequence length, micro and global batch size, iterations), which the built objects do not
    hold. Frozen parameters are not part of it: one side's frozen parameter has no grads, which
    the comparison reports as missing tensors."""
    models = [unwrap(c) for c in chunks]
    sig: Dict[str, Any] = {"model": {f: _plain(getattr(config, f, None)) for f in MODEL_FIELDS}}
    sig["model"]["activation_func"] = getattr(getattr(config, "activation_func", None), "__name__", None)
    # megatron builds the QKV bias for either field; Megatron-LM sets add_qkv_bias with add_bias_linear
    sig["model"]["add_qkv_bias"] = bool(config.add_qkv_bias or config.add_bias_linear)
    sig["gpt_model"] = {a: _plain(getattr(models[0], a, None)) for a in GPT_MODEL_ATTRIBUTES}
    sig["logical_vocab_size"] = facts.vocab_size
    sig["tokens_per_iteration"] = facts.tokens_per_iteration
    sig["optimizer"] = {f: _plain(getattr(optimizer_config, f, None)) for f in OPTIMIZER_FIELDS}
    from megatron.core import parallel_state

    times = cfg.loss_scale_multiplier(parallel_state.get_data_parallel_world_size(),
                                      bool(getattr(config, "calculate_per_token_loss", False))) if config.fp16 else 1
    for f in cfg.LOSS_SCALE_FIELDS:  # as a one-rank run of the same batch takes it (config.reference_optimizer)
        if isinstance(sig["optimizer"].get(f), (int, float)) and times != 1:
            sig["optimizer"][f] = float(sig["optimizer"][f]) * times
    if getattr(config, "heterogeneous_block_specs", False):  # each layer's blocks, as megatron parsed them
        sig["model"]["heterogeneous_blocks"] = [_plain(dataclasses.asdict(b)) for b in config.per_block_parameters]
    sig["fp8_emulation"] = any(hasattr(m, "_ttrace_fp8") for model in models for m in model.modules())
    sig["training"] = {k: _plain(v) for k, v in sorted(training.items())}
    return sig
