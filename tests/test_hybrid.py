"""HybridModel recipes: the pattern's refusals and the GPT equivalence on every release; the real
runs (TP+SP, PP, virtual PP, MoE; clean and with an injected bug; a GPT reference against its
HybridModel) on releases that have HybridModel (megatron-core 0.18 on: CI's release slice)."""

import json
import os

import pytest

from ttrace_megatron.adapter.recipe import compat, hybrid
from ttrace_megatron.compare import compare_traces
from ttrace_megatron.errors import RecipeError
from ttrace_megatron.recipe import load_recipe

from conftest import RECIPES

needs_hybrid = pytest.mark.skipif(not compat.has_hybrid_model(),
                                  reason="the installed megatron-core has no HybridModel (0.18 added it)")

BASE = {"hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128}


@pytest.mark.parametrize("model,parallel,message", [
    ({"hybrid_layer_pattern": "*M*-"}, {}, "'M', a Mamba layer"),
    ({"hybrid_layer_pattern": "*G-"}, {}, "'G', a Gated DeltaNet layer"),
    ({"hybrid_layer_pattern": "D-"}, {}, "'D', a DeepSeek sparse attention layer"),
    ({"hybrid_layer_pattern": "+-"}, {}, "'\\+', a multi-latent attention layer"),
    ({"hybrid_layer_pattern": "*-/*-"}, {}, "'/', multi-token prediction"),
    ({"hybrid_layer_pattern": "*x-"}, {}, "unknown symbols \\['x'\\]"),
    ({"hybrid_layer_pattern": "*-||*-"}, {"pipeline_model_parallel_size": 2}, "empty pipeline segment"),
    ({"hybrid_layer_pattern": ""}, {}, "non-empty string"),
    ({"hybrid_layer_pattern": "*-*-", "num_layers": 2}, {}, "'num_layers' is 2 but .* has 4 layers"),
    ({"hybrid_layer_pattern": "*E", "num_moe_experts": 4, "moe_layer_freq": 1}, {}, "'moe_layer_freq' cannot"),
    ({"hybrid_layer_pattern": "*-", "is_hybrid_model": True}, {}, "'is_hybrid_model' cannot"),
    ({"hybrid_layer_pattern": "*E*E"}, {}, "'num_moe_experts' is not set"),
    ({"hybrid_layer_pattern": "*-|*-|*-"}, {"pipeline_model_parallel_size": 2}, "3 pipeline segments"),
    ({"hybrid_layer_pattern": "*-|*-|*-|*-"},
     {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 4}, "leave it out"),
    ({"hybrid_layer_pattern": "*-*-"},
     {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, "needs '\\|' segments"),
])
def test_patterns_ttrace_cannot_build_are_refused_with_the_reason(model, parallel, message):
    with pytest.raises(RecipeError, match=message):
        hybrid.check(dict(BASE, **model), parallel, "r.yaml")


def test_the_pattern_gives_num_layers_and_the_virtual_pipeline_size():
    model = dict(BASE, hybrid_layer_pattern="*-|*E|*-|*E", num_moe_experts=4)
    assert hybrid.config_fields(model) == {"num_layers": 8, "is_hybrid_model": True}
    assert hybrid.with_pattern_layout(model, {"pipeline_model_parallel_size": 2}) == {
        "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    # one segment per stage: no virtual stages; no pipeline (the reference): one segment
    assert hybrid.with_pattern_layout(model, {"pipeline_model_parallel_size": 4}) == {
        "pipeline_model_parallel_size": 4}
    assert hybrid.with_pattern_layout(model, {}) == {}
    assert hybrid.side_pattern("*-|*E", pp=1, vpp=1) == "*-*E"
    assert hybrid.side_pattern("*-|*E", pp=2, vpp=1) == "*-|*E"


def test_gpt_equivalent_of_a_pattern_of_pairs():
    recipe = {"name": "h", "model": dict(BASE, hybrid_layer_pattern="*-|*E*E", num_moe_experts=4)}
    gpt = hybrid.gpt_equivalent(recipe)
    assert gpt["model"] == dict(BASE, num_layers=3, num_moe_experts=4, moe_layer_freq=[0, 1, 1])
    assert recipe["model"]["hybrid_layer_pattern"] == "*-|*E*E"  # the hybrid recipe is untouched
    dense = hybrid.gpt_equivalent({"name": "d", "model": dict(BASE, hybrid_layer_pattern="*-*-")})["model"]
    assert dense == dict(BASE, num_layers=2)
    for pattern in ("-*-*", "**--", "*-*", "*--"):
        with pytest.raises(RecipeError, match="no GPTModel equivalent"):
            hybrid.gpt_equivalent({"name": "x", "model": dict(BASE, hybrid_layer_pattern=pattern)})
    with pytest.raises(RecipeError, match="needs a HybridModel candidate"):
        hybrid.gpt_equivalent({"name": "g", "model": dict(BASE, num_layers=2)})


def test_hybrid_names_map_to_their_gpt_layer():
    assert hybrid.gpt_name("decoder.layers.0.self_attention.linear_qkv") == "decoder.layers.0.self_attention.linear_qkv"
    assert hybrid.gpt_name("decoder.layers.1.mlp.linear_fc1") == "decoder.layers.0.mlp.linear_fc1"
    assert hybrid.gpt_name("decoder.layers.2.input_layernorm") == "decoder.layers.1.input_layernorm"
    assert hybrid.gpt_name("decoder.layers.11.mlp.router") == "decoder.layers.5.mlp.router"
    assert hybrid.gpt_name("decoder.final_norm") == "decoder.final_layernorm"
    assert hybrid.gpt_name("embedding.word_embeddings") == "embedding.word_embeddings"
    assert hybrid.gpt_name("output_layer") == "output_layer"


HYBRID_RECIPES = sorted(n[:-5] for n in os.listdir(RECIPES) if n.startswith("hybrid_") and n.endswith(".yaml"))


@pytest.mark.skipif(compat.has_hybrid_model(), reason="the installed megatron-core has HybridModel")
@pytest.mark.parametrize("name", HYBRID_RECIPES)
def test_hybrid_recipes_are_refused_on_a_release_without_hybrid_model(name):
    from ttrace_megatron.adapter.recipe.config import validate_recipe

    with pytest.raises(RecipeError, match="needs HybridModel, which megatron-core 0.18 added; the installed"):
        validate_recipe(load_recipe(os.path.join(RECIPES, name + ".yaml")))


# the hybrid recipes clean and with a bug each: tests/test_release_slice.py (SLICE)


@needs_hybrid
@pytest.mark.release_slice
@pytest.mark.multiprocess
def test_hybrid_traces_are_keyed_by_hybrid_layer_numbers(runs):
    ref = runs.reference(load_recipe(os.path.join(RECIPES, "hybrid_tp2_sp.yaml")))
    names = {p["param"] for p in json.load(open(os.path.join(ref, "reference", "run.json")))["parameters"]}
    # 4 layers ('*-*-'), the final norm under HybridStack's name, the seed checkpoint keyed alike
    assert "decoder.final_norm.weight" in names and "decoder.layers.3.mlp.linear_fc2.weight" in names
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in names
    from safetensors import safe_open

    with safe_open(os.path.join(ref, "seed.safetensors"), "pt") as f:
        assert set(f.keys()) == names


@needs_hybrid
@pytest.mark.release_slice
@pytest.mark.multiprocess
def test_hybrid_virtual_pipeline_from_the_pattern_passes_clean(runs):
    recipe = load_recipe(os.path.join(RECIPES, "hybrid_pp2_vpp.yaml"))
    ref, clean = runs.candidate(recipe)
    c = compare_traces(ref, clean)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    run = json.load(open(os.path.join(clean, "run.json")))
    assert run["parallel"]["virtual_pipeline_model_parallel_size"] == 2


@needs_hybrid
@pytest.mark.release_slice
@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe_name,bug,culprit", [
    ("hybrid_moe_tp2_sp_ep2", None, None),
    ("hybrid_tp2_sp", "row_allreduce_dropped:decoder.layers.0.mlp.linear_fc2", "decoder.layers.0.mlp.linear_fc2"),
])
def test_gpt_reference_against_its_hybrid_model(tmp_path, recipe_name, bug, culprit):
    """The migration check: a GPTModel reference and the HybridModel candidate of the same layers,
    tensor by tensor under GPT names; clean it passes, a bug in the hybrid side is localized."""
    from ttrace_megatron.cli import main

    argv = ["run", os.path.join(RECIPES, recipe_name + ".yaml"), "--reference-model", "gpt",
            "--out", str(tmp_path / "out"), "--json", str(tmp_path / "report.json"),
            "--reference-in", "disk"]  # (its run.json is read below: a passing check's is removed if held in memory)
    rc = main(argv + (["--inject", bug] if bug else []))
    report = json.loads((tmp_path / "report.json").read_text())
    reference = json.load(open(tmp_path / "out" / "reference" / "run.json"))
    assert "hybrid_layer_pattern" not in reference["recipe"]["model"]  # the reference is a GPTModel
    if bug is None:
        assert (rc, report["verdict"]) == (0, "pass"), report.get("first_mismatch")
        total = report["coverage"]["total"]
        assert total["params_judged"] == total["params"] and not report["missing_in_candidate"] \
            and not report["missing_in_reference"]
    else:
        assert report["verdict"] == "fail"
        assert report["culprits"][0]["module"] == culprit


@needs_hybrid
@pytest.mark.release_slice
@pytest.mark.multiprocess
def test_structure_check_reads_each_hybrid_layer_by_its_symbol():
    """The built HybridModel matches its own pattern, and the structure check tells it from the
    same layers in another order (the pattern rotated by one layer)."""
    import subprocess
    import sys

    variants = {"dense": dict(BASE, hybrid_layer_pattern="*-*-"),
                "moe": dict(BASE, hybrid_layer_pattern="*E*-", num_moe_experts=4, add_bias_linear=False)}
    worker = os.path.join(os.path.dirname(__file__), "structure_worker.py")
    proc = subprocess.run([sys.executable, worker, json.dumps(variants)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for name in variants:
        assert "refused" not in out[name], out[name]
        assert any(n.startswith("decoder.layers.3.") for n in out[name]["params"])
        problems = out[name]["rotated_problems"]
        assert any("an MLP layer, no attention" in p for p in problems), problems
        assert any("an attention layer, no MLP" in p for p in problems), problems
    assert any("hybrid_layer_pattern (E)" in p for p in out["moe"]["rotated_problems"])


@needs_hybrid
def test_a_hybrid_segment_numbered_as_another_stages_is_a_build_failure(tmp_path):
    """A HybridModel's layers are checked against its pattern's segments, as megatron's
    select_pipeline_segment assigns them (structure.hybrid_layer_split): a chunk that builds its own
    segment under another stage's layer numbers is megatron's bug, found before any iteration runs."""
    import json

    from ttrace_megatron.cli import main

    recipe = os.path.join(RECIPES, "hybrid_pp2_vpp.yaml")
    assert main(["run", recipe, "--out", str(tmp_path / "a"), "--json", str(tmp_path / "a.json"),
                 "--inject", "hybrid_segment_offset_from_next_stage"]) == 1
    report = json.loads((tmp_path / "a.json").read_text())
    first = report["first_mismatch"]
    assert report["verdict"] == "fail" and first["phase"] == "build"
    assert "the pipeline split (hybrid_layer_pattern '*-|*-|*-|*-') puts it on" in first["reason"]
