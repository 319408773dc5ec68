"""Heterogeneous-layer recipes (Llama-Nemotron NAS: megatron-core's HeterogeneousTransformerConfig):
the block configs read apart from megatron's parser, their refusals, and the real runs (TP 2, a
full, an attention-free, a linear-replaced and an MLP-free layer): clean, an injected bug in the
linear replacement localized, and a wrong per-layer build a localized FAIL."""

import json
import os

import pytest

from ttrace_megatron.adapter.recipe import heterogeneous
from ttrace_megatron.compare import compare_traces
from ttrace_megatron.errors import RecipeError
from ttrace_megatron.recipe import load_recipe

from conftest import RECIPES

RECIPE = os.path.join(RECIPES, "nemotron_nas_tp2.yaml")


def _model(blocks, **fields):
    model = dict(num_layers=len(blocks), hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
    model[heterogeneous.JSON_KEY] = json.dumps({heterogeneous.BLOCKS: blocks})
    model.update(fields)
    return model


FULL = {"attention": {"no_op": False, "replace_with_linear": False, "num_query_groups": None},
        "ffn": {"ffn_hidden_size": 192}}
LINEAR = {"attention": {"replace_with_linear": True, "n_heads_in_group": None},
          "ffn": {"replace_with_linear": True, "ffn_mult": None}}


def test_blocks_read_as_the_hugging_face_config_gives_them():
    """n_heads_in_group and ffn_mult (the Hugging Face keys) as megatron turns them into widths."""
    model = _model([{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.625}},
                    {"attention": {"no_op": True, "n_heads_in_group": None}, "mlp": {"no_op": True, "ffn_mult": None}},
                    LINEAR], hidden_size=512)
    assert heterogeneous.blocks(model) == [
        heterogeneous.Block("full", "full", 2, 1024),  # 2·2.625·512/3 = 896, up to a multiple of 256
        heterogeneous.Block("none", "none"), heterogeneous.Block("linear", "linear")]


@pytest.mark.parametrize("model,parallel,message", [
    (_model([FULL, LINEAR]), {"tensor_model_parallel_size": 2, "sequence_parallel": True},
     "'sequence_parallel' .*/linear_replacements.py:37"),
    (_model([FULL, FULL], num_layers=3), {}, "2 block configs for num_layers 3"),
    (_model([FULL], num_moe_experts=4), {}, "'num_moe_experts' cannot be set"),
    (_model([FULL], mtp_num_layers=1), {}, "'mtp_num_layers' cannot be set"),
    (_model([FULL], hybrid_layer_pattern="*-"), {}, "'hybrid_layer_pattern' cannot be set"),
    (_model([{"attention": {"no_op": True, "num_query_groups": 2}, "ffn": {"ffn_mult": None}}]), {},
     "gives num_query_groups"),
    (_model([{"attention": {"num_query_groups": None}, "ffn": {"replace_with_linear": True, "ffn_hidden_size": 64}}]),
     {}, "gives ffn_hidden_size"),
    (_model([{"attention": {"n_heads_in_group": 3}, "ffn": {"ffn_mult": None}}]), {},
     "does not divide num_attention_heads 4"),
    (_model([{"attention": {"no_op": True}, "ffn": {"ffn_mult": None}}]), {}, "needs 'num_query_groups' or"),
])
def test_what_megatron_cannot_honour_is_refused_naming_the_field(model, parallel, message):
    with pytest.raises(RecipeError, match=message):
        heterogeneous.check(model, parallel, "r.yaml")


def test_the_json_file_is_read_relative_to_the_recipe_and_travels_as_text(tmp_path):
    from ttrace_megatron.adapter.recipe.config import validate_recipe

    (tmp_path / "blocks.json").write_text(json.dumps({heterogeneous.BLOCKS: [FULL, LINEAR]}))
    recipe = load_recipe(RECIPE)
    recipe.model.pop(heterogeneous.JSON_KEY)
    recipe.model.update(num_layers=2, **{heterogeneous.PATH_KEY: "blocks.json"})
    recipe.source = str(tmp_path / "r.yaml")
    (tmp_path / "r.yaml").write_text("")
    validate_recipe(recipe)
    assert heterogeneous.PATH_KEY not in recipe.model
    assert json.loads(recipe.model[heterogeneous.JSON_KEY])[heterogeneous.BLOCKS][1] == LINEAR


@pytest.mark.release_slice
@pytest.mark.multiprocess
def test_heterogeneous_layers_pass_clean_and_a_reversed_gather_is_localized(runs):
    recipe = load_recipe(RECIPE)
    ref, clean = runs.candidate(recipe)
    c = compare_traces(ref, clean)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    names = {p["param"] for p in json.load(open(os.path.join(clean, "run.json")))["parameters"]}
    assert "decoder.layers.2.self_attention.weight" in names and "decoder.layers.2.mlp.weight" in names
    assert not any(n.startswith(("decoder.layers.1.self_attention", "decoder.layers.3.mlp")) for n in names)
    _, buggy = runs.candidate(recipe, name="reversed", inject=["gathered_linear_pieces_reversed"])
    c = compare_traces(ref, buggy)
    assert c.verdict == "fail"
    first = c.first_mismatch.key
    assert (first.module, first.phase, first.tensor) == ("decoder.layers.2.self_attention", "forward", "output")


@pytest.mark.multiprocess
def test_a_layer_built_with_another_layers_block_is_a_localized_fail(tmp_path):
    """megatron reading each layer's block config one layer late builds a valid recipe as another
    model: the build check names the layer and the width, a FAIL (exit 1), not a usage error."""
    from ttrace_megatron.cli import main

    assert main(["run", RECIPE, "--out", str(tmp_path / "a"), "--json", str(tmp_path / "a.json"),
                 "--inject", "heterogeneous_block_config_off_by_one"]) == 1
    report = json.loads((tmp_path / "a.json").read_text())
    first = report["first_mismatch"]
    assert report["verdict"] == "fail" and first["phase"] == "build" and report["build"]["side"] == "candidate"
    assert first["module"].startswith("decoder.layers.0.mlp.linear_fc1"), first


def test_megatron_lm_translation_refuses_the_blocks_with_megatron_lms_own_rule():
    from ttrace_megatron.adapter.megatron_lm import checkout

    with pytest.raises(RecipeError, match="arguments.py:125"):
        checkout.training_args(load_recipe(RECIPE), "candidate", {"tensor_model_parallel_size": 2}, release="0.16")
