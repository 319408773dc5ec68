"""The model under test is the model the recipe describes (issue #23).

Every TransformerConfig field of the installed megatron-core has a role in
``adapter/recipe/model_fields.py``; refused fields are refused naming the field; each structure field is
built (its parameters exist in the built model) and the structure check sees it: the same variant
built with the layer spec ttrace used to build, which dropped spec-level fields, is caught.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")
from ttrace_megatron.adapter.recipe import model_fields  # noqa: E402
from ttrace_megatron.adapter.recipe.config import validate_recipe  # noqa: E402
from ttrace_megatron.errors import RecipeError  # noqa: E402
from ttrace_megatron.recipe import recipe_from_dict  # noqa: E402

BASE = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64}


def test_every_transformer_config_field_has_exactly_one_role():
    tables = tuple(names for _, names in model_fields.by_role())
    for name in model_fields.transformer_fields():
        assert sum(name in t for t in tables) == 1, f"TransformerConfig.{name}: decide its role in model_fields.py"
    # the table covers every supported release (a field another release has may be absent here), once each
    names = [name for t in tables for name in t]
    assert len(names) == len(set(names)), "a field with two roles"
    installed = model_fields.transformer_fields()
    stale = [n for n in names if n not in installed and n not in model_fields.NOT_IN_EVERY_RELEASE]
    assert not stale, f"roles for fields no supported megatron-core has: {stale}"


@pytest.mark.parametrize("field,value", [("heterogeneous_block_specs", True), ("qk_clip", True),
                                         ("multi_latent_attention", True), ("moe_grouped_gemm", True),
                                         ("moe_input_jitter_eps", 0.01)])
def test_refused_field_is_refused_naming_it(field, value):
    recipe = recipe_from_dict({"model": dict(BASE, **{field: value}), "world_size": 1})
    with pytest.raises(RecipeError, match=f"'{field}' is not supported by ttrace"):
        validate_recipe(recipe)


def test_context_parallelism_is_refused_before_any_rank_starts():
    """megatron's local attention asserts CP = 1 in the build; the recipe is refused first, naming the
    field and what it needs."""
    recipe = recipe_from_dict({"model": BASE, "parallel": {"context_parallel_size": 2}, "world_size": 2})
    with pytest.raises(RecipeError, match="'context_parallel_size' is not supported by ttrace: context parallelism "
                                          "needs TransformerEngine's attention"):
        validate_recipe(recipe)


def test_a_repeated_mtp_layers_calls_are_named_by_depth():
    """``mtp_use_repeated_layer``: the one MTP layer's k-th call is depth k's, as separate layers are named;
    the word embeddings and the output layer keep their MTP names, other repeats their ``#`` suffix."""
    from ttrace_megatron.adapter.recipe.naming import call_name

    assert call_name("mtp.layers.0.eh_proj", 1, 2, mtp_repeated=True) == "mtp.layers.1.eh_proj"
    assert call_name("mtp.layers.0", 1, 2, mtp_repeated=True) == "mtp.layers.1"
    assert call_name("mtp.layers.0.eh_proj", 0, 2, mtp_repeated=True) == "mtp.layers.0.eh_proj"
    assert call_name("mtp.layers.0.eh_proj", 1, 2) == "mtp.layers.0.eh_proj#1"  # separate layers: never repeated
    assert call_name("mtp.layers.0.eh_proj", 2, 2, mtp_repeated=True) == "mtp.layers.0.eh_proj#2"  # beyond the depths
    assert call_name("mtp.layers.00.x", 1, 2, mtp_repeated=True) == "mtp.layers.00.x#1"
    assert call_name("output_layer", 0, 2, mtp_repeated=True) == "mtp.layers.0.output_layer"
    assert call_name("embedding.word_embeddings", 2, 2, mtp_repeated=True) == "mtp.layers.1.embedding.word_embeddings"


def test_refused_field_at_megatrons_default_is_accepted():
    validate_recipe(recipe_from_dict({"model": dict(BASE, mtp_num_layers=None, recompute_granularity=None),
                                      "world_size": 1}))


def test_fp16_is_set_by_the_dtype_not_by_the_parallel_field():
    recipe = recipe_from_dict({"model": BASE, "parallel": {"fp16": True}, "world_size": 1})
    with pytest.raises(RecipeError, match="'fp16' is not supported by ttrace: set by the recipe's dtype \\(fp16"):
        validate_recipe(recipe)
    validate_recipe(recipe_from_dict({"model": BASE, "world_size": 1, "dtype": "fp16"}))


def test_every_ddp_config_field_is_honoured_or_refused():
    from ttrace_megatron.adapter.recipe import config

    fields = set(config.ddp_fields())
    known = set(config.DDP_HONOURED) | set(config.DDP_REFUSED)
    # the roles cover every supported release: the installed one's fields are among them
    assert fields <= known, f"DistributedDataParallelConfig fields without a role: {sorted(fields - known)}"
    stale = sorted(known - fields - config.DDP_NOT_IN_EVERY_RELEASE)
    assert not stale, f"roles for fields no supported megatron-core has: {stale}"
    assert not set(config.DDP_HONOURED) & set(config.DDP_REFUSED)


def test_ddp_section_accepts_megatrons_fields_and_refuses_with_the_reason():
    from ttrace_megatron.adapter.recipe import config

    recipe = recipe_from_dict({"model": BASE, "world_size": 1, "ddp": {"overlap_grad_reduce": True, "bucket_size": 1000}})
    validate_recipe(recipe)
    assert config.ddp_config(recipe).overlap_grad_reduce and config.ddp_config(recipe).grad_reduce_in_fp32
    with pytest.raises(RecipeError, match="'use_megatron_fsdp' is not supported by ttrace: Megatron FSDP"):
        validate_recipe(recipe_from_dict({"model": BASE, "world_size": 1, "ddp": {"use_megatron_fsdp": True}}))
    with pytest.raises(RecipeError, match="unknown key 'overlap_everything'"):
        validate_recipe(recipe_from_dict({"model": BASE, "world_size": 1, "ddp": {"overlap_everything": True}}))


def test_megatron_limits_are_refused_up_front_naming_the_field():
    cases = [({"optimizer": {"optimizer": "sgd", "use_distributed_optimizer": True}, "world_size": 2},
              "'use_distributed_optimizer' is not supported"),
             ({"model": dict(BASE, num_moe_experts=4)}, "'add_bias_linear' is not supported"),
             ({"model": dict(BASE, num_moe_experts=4, add_bias_linear=False, moe_aux_loss_coeff=0.01,
                             moe_router_load_balancing_type="global_aux_loss"), "world_size": 2},
              "'moe_router_load_balancing_type' is not supported by ttrace: global_aux_loss with data parallelism"),
             ({"model": dict(BASE, activation_func="silu", bias_activation_fusion=True)},
              "'bias_activation_fusion' is not supported"),
             ({"model": dict(BASE, fp32_residual_connection=True), "dtype": "bf16"},
              "'fp32_residual_connection' is not supported"),
             ({"model": dict(BASE, num_moe_experts=4, add_bias_linear=False, moe_expert_capacity_factor=1.0),
               "parallel": {"tensor_model_parallel_size": 2, "sequence_parallel": True}, "world_size": 2},
              "'moe_expert_capacity_factor' is not supported by ttrace: with sequence parallelism"),
             ({"model": dict(BASE, num_moe_experts=4, add_bias_linear=False),
               "parallel": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2}, "world_size": 2},
              "expert_model_parallel_size × expert_tensor_parallel_size = 2 × 2 does not divide")]
    for raw, message in cases:
        raw = dict({"model": BASE, "world_size": 1}, **raw)
        with pytest.raises(RecipeError, match=message):
            validate_recipe(recipe_from_dict(raw))


def test_activation_func_by_name():
    from ttrace_megatron.adapter.recipe import config

    recipe = recipe_from_dict({"model": dict(BASE, gated_linear_unit=True, activation_func="silu"), "world_size": 1})
    validate_recipe(recipe)
    assert config.transformer_config(recipe, {}).activation_func.__name__ == "silu"
    with pytest.raises(RecipeError, match="'activation_func' must name one of"):
        validate_recipe(recipe_from_dict({"model": dict(BASE, activation_func="swish2"), "world_size": 1}))


def test_the_reference_drops_only_the_pipeline_layout_fields():
    model = dict(BASE, num_layers=3, num_layers_in_last_pipeline_stage=1, qk_layernorm=True)
    assert model_fields.without_layout(model) == dict(BASE, num_layers=3, qk_layernorm=True)


MOE = dict(BASE, num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2)
VARIANTS = {
    "qk_layernorm": dict(BASE, qk_layernorm=True),
    "biases": dict(BASE, add_bias_linear=True),
    "qkv_bias_only": dict(BASE, add_bias_linear=False, add_qkv_bias=True),
    "swiglu_rmsnorm_gqa": dict(BASE, gated_linear_unit=True, normalization="RMSNorm", num_query_groups=2,
                               add_bias_linear=False),
    "mqa_kv_channels": dict(BASE, num_query_groups=1, kv_channels=16),
    "learned_positions_tied": dict(BASE, position_embedding_type="learned_absolute",
                                   share_embeddings_and_output_weights=True),
    "moe_layer_freq": dict(MOE, moe_layer_freq=[0, 1]),
    "moe_shared_expert": dict(MOE, moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                              qk_layernorm=True, add_bias_linear=False),
    "moe_shared_expert_with_bias": dict(MOE, moe_shared_expert_intermediate_size=16),
}
# what each variant must have built (and must not)
EXPECTED = {
    "qk_layernorm": (["decoder.layers.0.self_attention.q_layernorm.weight",
                      "decoder.layers.1.self_attention.k_layernorm.weight"], []),
    "biases": (["decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.0.mlp.linear_fc2.bias"], []),
    "qkv_bias_only": (["decoder.layers.0.self_attention.linear_qkv.bias"],
                      ["decoder.layers.0.self_attention.linear_proj.bias", "decoder.layers.0.mlp.linear_fc1.bias"]),
    "swiglu_rmsnorm_gqa": ([], ["decoder.layers.0.input_layernorm.bias"]),
    "mqa_kv_channels": ([], []),
    "learned_positions_tied": (["embedding.position_embeddings.weight"], ["output_layer.weight"]),
    "moe_layer_freq": (["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.router.weight"],
                       ["decoder.layers.0.mlp.router.weight"]),
    "moe_shared_expert": (["decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
                           "decoder.layers.0.mlp.shared_experts.gate_weight",
                           "decoder.layers.1.self_attention.q_layernorm.weight"], []),
}
SHAPES = {
    "swiglu_rmsnorm_gqa": {"decoder.layers.0.mlp.linear_fc1.weight": [128, 32],
                           "decoder.layers.0.self_attention.linear_qkv.weight": [64, 32]},
    "mqa_kv_channels": {"decoder.layers.0.self_attention.linear_qkv.weight": [96, 32]},
}
# the layer spec ttrace used to build dropped these: the structure check must say so
OLD_SPEC_DROPPED = {"qk_layernorm": "qk_layernorm", "moe_layer_freq": "moe_layer_freq",
                    "moe_shared_expert": "qk_layernorm"}


@pytest.fixture(scope="module")
def built():
    worker = os.path.join(os.path.dirname(__file__), "structure_worker.py")
    proc = subprocess.run([sys.executable, worker, json.dumps(VARIANTS)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_megatrons_own_refusal_is_named(built):
    refused = built["moe_shared_expert_with_bias"].get("refused", "")
    assert "megatron-core refuses to build this model: megatron/core/transformer/moe/shared_experts.py:" in refused
    assert "bias is not supported in the shared experts" in refused


BUILT = sorted(v for v in VARIANTS if v != "moe_shared_expert_with_bias")


@pytest.mark.parametrize("variant", BUILT)
def test_structure_field_is_built(built, variant):
    entry = built[variant]
    assert "refused" not in entry, entry.get("refused")
    params = entry["params"]
    present, absent = EXPECTED[variant]
    for name in present:
        assert name in params, f"{variant}: {name} not built ({sorted(params)})"
    for name in absent:
        assert name not in params, f"{variant}: {name} built"
    for name, shape in SHAPES.get(variant, {}).items():
        assert params[name] == shape, f"{variant}: {name} {params[name]} != {shape}"


@pytest.mark.parametrize("variant", BUILT)
def test_structure_check_catches_the_old_spec(built, variant):
    problems = built[variant]["old_problems"]
    if variant in OLD_SPEC_DROPPED:
        assert any(OLD_SPEC_DROPPED[variant] in p for p in problems), problems
    else:
        assert problems == [], problems


def test_the_field_table_in_docs_is_current():
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "model_fields.md")
    with open(path) as f:
        assert f.read() == model_fields.markdown(), "regenerate: python -m ttrace_megatron.adapter.recipe.model_fields"


@pytest.mark.parametrize("field", sorted(__import__("ttrace_megatron.adapter.recipe.config", fromlist=["x"]).PARALLEL_REFUSED))
def test_later_releases_parallel_fields_are_refused_not_passed_through(field):
    """A ModelParallelConfig field of a later release that ttrace does not honour is refused with the
    reason when set; on a release without it, it is an unknown key. Never accepted."""
    from ttrace_megatron.adapter.recipe import config

    recipe = recipe_from_dict({"model": BASE, "world_size": 1, "parallel": {field: 2}})
    with pytest.raises(RecipeError) as e:
        validate_recipe(recipe)
    if field in config.parallel_fields():
        assert config.PARALLEL_REFUSED[field] in str(e.value)
    else:
        assert "unknown key" in str(e.value)


def test_qk_l2_norm_is_refused_where_megatron_lm_drops_it():
    """Megatron-LM's GPT builder passes qk_l2_norm to the local layer spec only with experts
    (gpt_builders.py, _get_transformer_layer_spec): a dense model would train without the norm."""
    with pytest.raises(RecipeError, match="'qk_l2_norm' is not supported by ttrace: Megatron-LM's GPT builder.*"
                                          "gpt_builders.py:148"):
        validate_recipe(recipe_from_dict({"model": dict(BASE, qk_l2_norm=True), "world_size": 1}))
    validate_recipe(recipe_from_dict({"model": dict(BASE, qk_l2_norm=True, num_moe_experts=4, add_bias_linear=False),
                                      "world_size": 1}))


def test_layout_dependent_routing_is_refused_with_megatrons_line():
    recipe = recipe_from_dict({"model": dict(BASE, num_moe_experts=4, add_bias_linear=False,
                                             moe_router_topk_limited_devices=1), "world_size": 1})
    with pytest.raises(RecipeError, match="transformer_config.py:1668"):
        validate_recipe(recipe)


def test_routing_outside_the_top_k_hook_is_listed_as_unjudged_and_quantile_balancing_is_observed():
    """Sinkhorn chooses experts outside the top-k hook ttrace records, judges and follows routing by:
    the run says so instead of judging nothing silently. Quantile balancing (0.19) hands its choice to
    megatron's top-k function as indices: the tap takes it there (``routing.TOPK_FUNCTION``)."""
    from types import SimpleNamespace

    from ttrace_megatron.adapter.record.routing import QUANTILE_BALANCING, unobserved_routing

    def config(balancing):
        return SimpleNamespace(num_moe_experts=4, moe_router_load_balancing_type=balancing, moe_router_fusion=False,
                               moe_router_group_topk=None, moe_expert_capacity_factor=None)

    assert unobserved_routing(config(QUANTILE_BALANCING)) is None
    assert unobserved_routing(config(["aux_loss", QUANTILE_BALANCING])) is None
    assert "sinkhorn" in unobserved_routing(config("sinkhorn"))
    assert unobserved_routing(SimpleNamespace(num_moe_experts=None)) is None
