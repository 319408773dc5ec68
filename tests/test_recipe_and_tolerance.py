import math
import os

import pytest
import torch

from ttrace_megatron.errors import RecipeError
from ttrace_megatron.recipe import DEFAULT_RECIPE, load_recipe, recipe_from_dict
from ttrace_megatron.tolerance import local_error, tolerance_for

from conftest import RECIPES


@pytest.mark.parametrize("name", sorted(n[:-5] for n in os.listdir(RECIPES) if n.endswith(".yaml")))
def test_shipped_recipes_validate(name):
    from ttrace_megatron.adapter.recipe import compat
    from ttrace_megatron.adapter.recipe.config import validate_recipe

    recipe = load_recipe(os.path.join(RECIPES, name + ".yaml"))
    if "hybrid_layer_pattern" in recipe.model and not compat.has_hybrid_model():
        with pytest.raises(RecipeError, match="needs HybridModel"):  # tests/test_hybrid.py
            validate_recipe(recipe)
        return
    validate_recipe(recipe)


@pytest.mark.parametrize("section,key,message", [
    (None, "modle", "unknown key 'modle'"),
    ("model", "hiden_size", "model: unknown key 'hiden_size'"),
    ("model", "tensor_model_parallel_size", "put it under 'parallel:'"),
    ("parallel", "tensor_parallel", "parallel: unknown key 'tensor_parallel'"),
    ("optimizer", "learning_rate", "optimizer: unknown key 'learning_rate'"),
    ("data", "batch", "data: unknown key 'batch'"),
])
def test_unknown_keys_are_named(section, key, message):
    from ttrace_megatron.adapter.recipe.config import validate_recipe

    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULT_RECIPE.items()}
    (raw if section is None else raw[section])[key] = 1
    with pytest.raises(RecipeError, match=message):
        validate_recipe(recipe_from_dict(raw))


@pytest.mark.parametrize("data,message", [
    ({"masked_share": 0.5}, "'masked_share' must be a number in \\[0, 0.5\\)"),
    ({"masked_share": True}, "'masked_share' must be a number"),
    ({"masked_share": 0.2, "source": "megatron_mock"}, "megatron_mock's mask is megatron's own"),
    ({"eod_mask_loss": "yes"}, "'eod_mask_loss' must be true or false"),
])
def test_loss_mask_fields_are_checked(data, message):
    raw = dict(DEFAULT_RECIPE, data=dict(DEFAULT_RECIPE["data"], **data))
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(raw)


@pytest.mark.parametrize("model,field", [({"parallel_output": False}, "parallel_output"),
                                         ({"runtime_gather_output": True}, "runtime_gather_output")])
def test_gathered_logits_are_refused_naming_megatrons_lines(model, field):
    """Gathered logits (issue #34): megatron-core's training loss cannot take them (measured on 0.16.1:
    the backward fails at any TP size), so a recipe asking for them is refused before it runs."""
    from ttrace_megatron.adapter.recipe.config import validate_recipe

    raw = dict(DEFAULT_RECIPE, model=dict(DEFAULT_RECIPE["model"], **model))
    with pytest.raises(RecipeError, match=f"'{field}' is not supported by ttrace: .*cross_entropy.py:196"):
        validate_recipe(recipe_from_dict(raw))


@pytest.mark.parametrize("model,parallel,line", [
    ({"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"}, {}, "router.py:542"),
    ({"num_layers": 4}, {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 1,
                         "pipeline_model_parallel_size": 2}, "moe_utils.py:795"),
])
def test_padding_megatron_cannot_run_is_refused(model, parallel, line):
    """A padding mask megatron-core fails on (measured on 0.16.1): with the router's expert bias (a
    [tokens] mask against a [tokens, experts] map), and with MoE + PP + SP (the mask scattered on the
    first stage only)."""
    import yaml

    from ttrace_megatron.adapter.recipe.config import validate_recipe

    with open(os.path.join(RECIPES, "padded_moe_ep2_distopt.yaml")) as f:
        raw = yaml.safe_load(f)
    raw["model"].update(model)
    raw["parallel"].update(parallel)
    raw["world_size"] = 4 if parallel.get("pipeline_model_parallel_size") else raw["world_size"]
    with pytest.raises(RecipeError, match=f"'padded_share' is not supported by ttrace: .*{line}"):
        validate_recipe(recipe_from_dict(raw))


def test_synthetic_masks_are_uneven_and_leave_a_token():
    """masked_share: each sample masks a prompt prefix of its own length; eod_mask_loss masks the
    tokenizer's last token where it is an input."""
    from ttrace_megatron.adapter.recipe import data

    recipe = recipe_from_dict(dict(DEFAULT_RECIPE, data=dict(DEFAULT_RECIPE["data"], masked_share=0.4,
                                                             eod_mask_loss=True)))
    samples = [data.sampler(recipe)(i) for i in range(32)]
    valid = [int(s.loss_mask.sum()) for s in samples]
    assert len(set(valid)) > 8 and min(valid) >= 1 and 0.25 < 1 - sum(valid) / (32 * 32) < 0.55  # mean 0.4
    eod = data.eod_token(recipe.data.vocab_size)
    assert all(bool((s.loss_mask[s.tokens == eod] == 0).all()) for s in samples)
    plain = recipe_from_dict(DEFAULT_RECIPE)
    assert all(bool(s.loss_mask.all()) for s in (data.sampler(plain)(i) for i in range(4)))


def test_dropout_is_refused():
    from ttrace_megatron.adapter.recipe.config import validate_recipe

    raw = dict(DEFAULT_RECIPE, model=dict(DEFAULT_RECIPE["model"], hidden_dropout=0.1))
    with pytest.raises(RecipeError, match="dropout"):
        validate_recipe(recipe_from_dict(raw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 1024])
def test_local_term_covers_a_split_reduction(dtype, k):
    """A GEMM whose reduction is split into two partial sums (a row-parallel all-reduce) differs
    from the unsplit GEMM by less than the local term, in ≥ 99.9% of random draws."""
    g = torch.Generator().manual_seed(k)
    bound = local_error(k, str(dtype).replace("torch.", ""))
    draws, within = 400, 0
    for _ in range(draws):
        a = torch.randn(8, k, generator=g).to(dtype)
        b = torch.randn(k, 8, generator=g).to(dtype)
        whole = (a @ b).double()
        split = ((a[:, : k // 2] @ b[: k // 2]).float() + (a[:, k // 2:] @ b[k // 2:]).float()).to(dtype).double()
        err = float((whole - split).norm() / whole.norm())
        within += err <= bound
    assert within >= math.ceil(0.999 * draws)


def test_tolerance_grows_with_depth_and_is_in_eps():
    t1 = tolerance_for("backward", depth=2, num_layers=2, storage_dtype="bfloat16", reduction=64)
    t2 = tolerance_for("backward", depth=1, num_layers=2, storage_dtype="bfloat16", reduction=64)
    assert t1.eps == 2 ** -7 and t2.tolerance_eps > t1.tolerance_eps
    assert "K=64" in t1.source


def test_backward_depth_counts_the_forward_pass():
    """The last layer's weight grad multiplies activations that carry every forward layer's
    round-off: it is never bounded as if it had no history (the scale ladder's depth finding)."""
    from ttrace_megatron.keys import FORWARD
    from ttrace_megatron.tolerance import propagation_depth

    layers = 32
    assert propagation_depth("backward", layers, layers) == layers + 2
    assert propagation_depth("backward", layers, layers) > propagation_depth(FORWARD, layers, layers)
    assert propagation_depth("backward", 0, layers) == 2 * (layers + 1)  # the embedding's grads
    assert propagation_depth("backward", layers + 1, layers) == propagation_depth(FORWARD, layers + 1, layers)


def test_perturbation_estimate_only_raises_the_bound():
    from ttrace_megatron.tolerance import ToleranceConfig, tolerance_for, with_perturbation

    base = tolerance_for("forward", 1, 2, "bfloat16", 64)
    cfg = ToleranceConfig()
    quiet = with_perturbation(base, 0.1 * base.eps, cfg)  # the noise barely moved the tensor
    assert quiet.tolerance_eps == base.tolerance_eps and "perturbation observed" in quiet.source
    loud = with_perturbation(base, 10 * base.tolerance_eps * base.eps, cfg)
    assert loud.tolerance_eps == cfg.perturbation_k * 10 * base.tolerance_eps
    assert loud.source.startswith("perturbation k_p·observed")
    unusable = with_perturbation(base, float("inf"), cfg)  # the noise changed the tensor's shape
    assert unusable.tolerance_eps == base.tolerance_eps and "not used" in unusable.source


def test_recipe_tolerance_section():
    assert recipe_from_dict(dict(DEFAULT_RECIPE, tolerance={"perturbation": True})).tolerance.perturbation
    assert not recipe_from_dict(DEFAULT_RECIPE).tolerance.perturbation
    # FP8 quantization amplifies round-off beyond the analytic bound: the estimate is on unless refused
    assert recipe_from_dict(dict(DEFAULT_RECIPE, dtype="fp8")).tolerance.perturbation
    assert not recipe_from_dict(dict(DEFAULT_RECIPE, dtype="fp8", tolerance={"perturbation": False})).tolerance.perturbation
    with pytest.raises(RecipeError, match="perturbation"):
        recipe_from_dict(dict(DEFAULT_RECIPE, tolerance={"perturbation": "yes"}))
    with pytest.raises(RecipeError, match="unknown key 'k'"):
        recipe_from_dict(dict(DEFAULT_RECIPE, tolerance={"k": 3}))


def test_difference_norms_reads_views_without_copying_them_whole():
    """The reference sliced to a rank's shard along its last dim is a strided view; the norms are
    computed piecewise from it and equal those of dense copies."""
    import torch

    from ttrace_megatron.tolerance import difference_norms

    g = torch.Generator().manual_seed(0)
    full = torch.randn(64, 3, 96, generator=g)
    cand = full[..., 48:].contiguous() + 1e-3 * torch.randn(64, 3, 48, generator=g)
    view = full[..., 48:]
    assert not view.is_contiguous()
    for chunk in (7, 100, 1 << 16):
        got = difference_norms(cand, view, chunk=chunk)
        want = (float((cand.double() - view.double()).norm()), float(view.double().norm()))
        assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("section,key,home", [
    ("parallel", "overlap_grad_reduce", "'ddp:' (DistributedDataParallelConfig)"),  # a Megatron-LM user's flag
    ("parallel", "--overlap-grad-reduce", "the field 'overlap_grad_reduce' belongs under 'ddp:'"),
    ("optimizer", "num_layers", "'model:' (TransformerConfig)"),
    ("ddp", "sequence_parallel", "'parallel:' (ModelParallelConfig)"),
    ("model", "clip_grad", "'optimizer:' (OptimizerConfig)"),
])
def test_a_field_in_the_wrong_section_is_refused_naming_its_section(section, key, home):
    """A megatron field put under another section than its dataclass's is refused with the section
    it belongs in (never a bare 'unknown key' for a field megatron has)."""
    pytest.importorskip("megatron.core")
    from ttrace_megatron.adapter.recipe.config import validate_recipe
    from ttrace_megatron.recipe import recipe_from_dict

    raw = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}, "parallel": {}, "world_size": 1}
    raw.setdefault(section, {})[key] = True
    with pytest.raises(RecipeError) as e:
        validate_recipe(recipe_from_dict(raw))
    assert f"{section}: unknown key '{key}'" in str(e.value) and home in str(e.value), str(e.value)
