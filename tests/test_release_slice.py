"""The release slice: the demo, and a TP+SP, a PP, an MoE and a distributed-optimizer recipe, each
clean and with one injected bug (and the HybridModel recipes where the release has HybridModel), on
whichever megatron-core release is installed. The whole suite
runs on one release; CI runs this slice on the oldest and the newest supported release too
(``.ci/run``, ``adapter.recipe.compat.SUPPORTED``)."""

import json
import os

import pytest

from ttrace_megatron.adapter.recipe import compat
from ttrace_megatron.compare import compare_traces
from ttrace_megatron.recipe import load_recipe

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")

# (recipe, injected bug, the end-to-end first mismatch's module and phase)
SLICE = [
    ("gpt_tp2_sp", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc2",
     "forward"),
    ("gpt_pp2", "tied_embedding_grads_not_synced", "embedding.word_embeddings", "main_grad"),
    ("moe_tp2_sp_ep2", "moe_aux_loss_scaled_by_tp", "decoder.layers.0.mlp.router", "forward"),
    ("gpt_dp2_distopt", "distopt_grad_shard_offset", "embedding.word_embeddings", "optimizer"),
] + [pytest.param(*case, marks=pytest.mark.skipif(not compat.has_hybrid_model(), reason="the installed megatron-core "
                                                 "has no HybridModel (0.18 added it)"), id=case[0]) for case in [
    # HybridModel (tests/test_hybrid.py): '*-*-', '*-|*-' with tied embeddings, '*E*E'
    ("hybrid_tp2_sp", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc2",
     "forward"),
    ("hybrid_pp2", "tied_embedding_grads_not_synced", "embedding.word_embeddings", "main_grad"),
    ("hybrid_moe_tp2_sp_ep2", "moe_aux_loss_scaled_by_tp", "decoder.layers.1.mlp.router", "forward"),
]]


@pytest.mark.release_slice
@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe_name,bug,module,phase", SLICE,
                         ids=[s[0] if isinstance(s, tuple) else s.id for s in SLICE])
def test_recipe_clean_and_its_bug_caught(runs, recipe_name, bug, module, phase):
    recipe = load_recipe(os.path.join(RECIPES, recipe_name + ".yaml"))
    ref, clean = runs.candidate(recipe)
    c = compare_traces(ref, clean)
    assert c.verdict == "pass", f"clean {recipe_name}: first mismatch {c.first_mismatch}"
    _, buggy = runs.candidate(recipe, inject=[bug])
    fm = compare_traces(ref, buggy).first_mismatch
    assert fm is not None, f"{bug} not detected"
    assert (fm.key.module, fm.key.phase) == (module, phase), f"{bug}: first mismatch {fm.key}"


@pytest.mark.release_slice
@pytest.mark.multiprocess
def test_demo_passes(tmp_path):
    """The README's first command: the embedded demo, reference vs TP=2 + SP."""
    from ttrace_megatron.cli import main

    assert main(["run", "--out", str(tmp_path / "out"), "--json", str(tmp_path / "report.json")]) == 0
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "pass"


def _has_field(name: str) -> bool:
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    return name in {f.name for f in dataclasses.fields(TransformerConfig)}


@pytest.mark.release_slice
@pytest.mark.multiprocess
@pytest.mark.skipif(not _has_field("use_mup"), reason="the installed megatron-core has no μP (0.19 added use_mup)")
def test_mup_clean_with_its_optimizer_groups_and_its_bug_caught(runs):
    """μP at TP2+SP (width 4× its base): megatron's per-class lr and Adam ε reach both sides as
    megatron.training sets them, each hidden matrix's update is judged with its group's ε, and a
    logit multiplier taken from the partition's width is caught at the loss."""
    import yaml

    from ttrace_megatron.recipe import recipe_from_dict

    with open(os.path.join(RECIPES, "gpt_tp2_sp.yaml")) as f:
        raw = yaml.safe_load(f)
    raw["model"].update(use_mup=True, mup_base_hidden_size=16, mup_embedding_mult=2.0)
    recipe = recipe_from_dict(raw, "gpt_tp2_sp_mup")
    ref, clean = runs.candidate(recipe)
    c = compare_traces(ref, clean)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    hidden = [r for r in c.results if "the group's ε=2.5e-09" in r.tolerance_source]
    first = [r for r in hidden if r.key.iteration == 1]
    assert first and all("lr=0.00025" in r.tolerance_source for r in first)  # the peak lr / 4, ε / 4
    _, buggy = runs.candidate(recipe, inject=["mup_output_mult_from_partition_width"])
    fm = compare_traces(ref, buggy).first_mismatch
    assert fm is not None and (fm.key.module, fm.key.tensor) == ("loss", "per_token_loss"), fm



@pytest.mark.release_slice
@pytest.mark.multiprocess
@pytest.mark.skipif(not _has_field("mtp_detach_heads"), reason="the installed megatron-core has no mtp_detach_heads "
                                                                 "(0.19 added it)")
def test_mtp_with_detached_heads_clean_and_its_bug_caught(runs):
    """DeepSeek-V3-like MTP with detached heads (0.19): the heads train on their own loss and are
    clipped by a norm of their own; clean at TP2+SP, and the MTP projection's gather bug is caught
    and localized at the projection."""
    import yaml

    from ttrace_megatron.recipe import recipe_from_dict

    with open(os.path.join(RECIPES, "deepseek_mtp_tp2_sp.yaml")) as f:
        raw = yaml.safe_load(f)
    raw["model"]["mtp_detach_heads"] = True
    recipe = recipe_from_dict(raw, "deepseek_mtp_detached_tp2_sp")
    ref, clean = runs.candidate(recipe)
    c = compare_traces(ref, clean)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    _, buggy = runs.candidate(recipe, inject=["mtp_projection_gather_reduces_grad"])
    fm = compare_traces(ref, buggy).first_mismatch
    assert fm is not None and fm.key.module == "mtp.layers.0.eh_proj", fm


@pytest.mark.release_slice
@pytest.mark.multiprocess
@pytest.mark.skipif(not _has_field("mtp_use_repeated_layer"), reason="the installed megatron-core has no "
                                                                       "mtp_use_repeated_layer (0.17 added it)")
def test_repeated_mtp_layer_clean_and_its_bug_caught(runs):
    """One MTP layer run at both depths (``mtp_use_repeated_layer``): the model holds one MTP layer,
    its second call is recorded as depth 2's (``mtp.layers.1``) on both sides; clean at TP2+SP, and
    the projection's gather bug is caught at depth 1's projection, whose grad the bug breaks."""
    import yaml

    from ttrace_megatron.compare import compare_traces as judge
    from ttrace_megatron.recipe import recipe_from_dict

    with open(os.path.join(RECIPES, "deepseek_mtp_tp2_sp.yaml")) as f:
        raw = yaml.safe_load(f)
    raw["model"].update(mtp_num_layers=2, mtp_use_repeated_layer=True)
    recipe = recipe_from_dict(raw, "deepseek_mtp_repeated_tp2_sp")
    ref, clean = runs.candidate(recipe)
    c = judge(ref, clean)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    judged = {r.key.module for r in c.results}
    assert {"mtp.layers.0.eh_proj", "mtp.layers.1.eh_proj"} <= judged and not c.missing_in_candidate, sorted(judged)
    _, buggy = runs.candidate(recipe, inject=["mtp_projection_gather_reduces_grad"])
    fm = judge(ref, buggy).first_mismatch
    assert fm is not None and fm.key.module.startswith("mtp.layers.") and fm.key.module.endswith(".eh_proj"), fm
    # the one layer checkpointed once per depth: its weights' grads arrive once per depth (found by the sweep)
    from ttrace_megatron.adapter.recipe.config import validate_recipe
    from ttrace_megatron.errors import RecipeError

    raw["model"].update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    with pytest.raises(RecipeError, match="'mtp_use_repeated_layer' is not supported by ttrace with a repeated MTP "
                                          "layer and recomputed weights yet"):
        validate_recipe(recipe_from_dict(raw, "deepseek_mtp_repeated_recomputed"))


@pytest.mark.release_slice
@pytest.mark.multiprocess
@pytest.mark.skipif(not _has_field("mlp_chunks_for_training"), reason="the installed megatron-core has no "
                                                                        "mlp_chunks_for_training (0.19 added it)")
def test_chunked_mlp_clean_and_its_bug_caught(runs):
    """The MLP run on each half of the sequence (``mlp_chunks_for_training``) at TP2: each call is
    recorded as one (``#1`` the second) and judged against the reference's; clean, and a dropped
    all-reduce in the second layer's fc2 is caught at that module; with sequence parallelism the
    recipe is refused, naming why."""
    from ttrace_megatron.adapter.recipe.config import validate_recipe
    from ttrace_megatron.compare import compare_traces as judge
    from ttrace_megatron.errors import RecipeError

    recipe = load_recipe(os.path.join(RECIPES, "gpt_tp2.yaml"))
    recipe.model["mlp_chunks_for_training"] = 2
    ref, clean = runs.candidate(recipe)
    c = judge(ref, clean)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    judged = {r.key.module for r in c.results}
    assert {"decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc2#1"} <= judged, sorted(judged)
    _, buggy = runs.candidate(recipe, inject=["row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2"])
    fm = judge(ref, buggy).first_mismatch
    assert fm is not None and fm.key.module == "decoder.layers.1.mlp.linear_fc2", fm
    sp = load_recipe(os.path.join(RECIPES, "gpt_tp2_sp.yaml"))
    sp.model["mlp_chunks_for_training"] = 2
    with pytest.raises(RecipeError, match="'mlp_chunks_for_training' is not supported by ttrace with sequence "
                                          "parallelism yet"):
        validate_recipe(sp)


@pytest.mark.release_slice
@pytest.mark.multiprocess
@pytest.mark.skipif(not _has_field("moe_router_quantile_balancing_ema"), reason="the installed megatron-core has no "
                                                                                  "quantile balancing (0.19 added it)")
def test_quantile_balancing_clean_and_its_bug_caught(runs):
    """Quantile balancing (0.19) at EP2 over DP2: the routers' choice, made from the logits minus
    qb_beta and handed to megatron's top-k as indices, is recorded and judged with those scores;
    clean, and a qb_beta update that skips its average over DP is caught at the router's scores in
    iteration 2, the first to route by the updated bias."""
    from ttrace_megatron.compare import compare_traces as judge

    recipe = load_recipe(os.path.join(RECIPES, "moe_ep2.yaml"))
    recipe.model.pop("moe_aux_loss_coeff")
    recipe.model.update(moe_router_load_balancing_type="quantile_balancing", moe_router_quantile_balancing_ema=0.5)
    ref, clean = runs.candidate(recipe)
    c = judge(ref, clean)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert not c.unjudged and any(r.key.tensor == "topk_choice" for r in c.results)
    _, buggy = runs.candidate(recipe, inject=["qb_beta_not_averaged_over_dp"])
    fm = judge(ref, buggy).first_mismatch
    assert fm is not None and (fm.key.module, fm.key.tensor, fm.key.iteration) == (
        "decoder.layers.0.mlp.router", "topk_scores", 2), fm
