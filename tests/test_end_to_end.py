"""Real megatron-core, real multi-process gloo: clean recipes pass, injected bugs fail and are named."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ttrace_megatron import keys
from ttrace_megatron.compare import compare_traces

from conftest import RECIPES, load
from trace_files import read_manifest

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gpt_tp2", "gpt_tp2_sp", "qwen3_tp2"])
def test_clean_recipe_passes(runs, name, dtype):
    ref, cand = runs.candidate(load(name, dtype=dtype))
    c = compare_traces(ref, cand)
    worst = max(c.results, key=lambda r: r.ratio)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    phases = {r.key.phase for r in c.results}
    assert phases == {"forward", "backward", "main_grad", "optimizer"}
    cov = c.coverage  # every parameter judged (the q/k layernorms of qwen3 included)
    assert cov["total"]["params"] > 10 and cov["total"]["params_judged"] == cov["total"]["params"], cov["not_judged"]
    # round-off is really there (the check is not comparing a run with itself) and within bound
    assert 0 < worst.error_eps <= worst.tolerance_eps


@pytest.mark.parametrize("name", ["gpt_tp4_sp", "gpt_tp2_sp_dp2", "gpt_tp2_dp2"])
def test_clean_world_size_4_passes(runs, name):
    ref, cand = runs.candidate(load(name))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    if name.endswith("dp2"):  # both DP ranks' microbatches are there, merged with the reference's ids
        assert {r.key.microbatch for r in c.results} == {-1, 0, 1} | ({2, 3} if name == "gpt_tp2_dp2" else set())


@pytest.mark.parametrize("name", ["gpt_pp2", "gpt_pp2_vpp", "gpt_tp2_sp_pp2"])
def test_pipeline_parallel_with_tied_embeddings(runs, name):
    """PP=2 through the real 1F1B schedule, and with two virtual stages per rank through the
    interleaved one: every layer is compared under its global number, and the tied word
    embeddings, one parameter held by the first and the last stage, are merged as such
    (per-microbatch grads summed over stages, main grads and values checked as replicas)."""
    ref, cand = runs.candidate(load(name))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    modules = {r.key.module for r in c.results}
    assert {f"decoder.layers.{i}.mlp.linear_fc2" for i in range(4)} <= modules
    assert {r.key.microbatch for r in c.results} == {-1, 0, 1, 2, 3}
    tied = {(r.key.phase, r.key.tensor) for r in c.results if r.key.module == "embedding.word_embeddings"}
    assert {("backward", "weight.grad"), ("main_grad", "weight.main_grad"), ("optimizer", "weight")} <= tied
    assert "output_layer" not in {r.key.module for r in c.results if r.key.tensor.startswith("weight")
                                  and r.key.phase != "forward"}


def test_data_parallel_replicas_and_global_microbatches(runs):
    """Pure DP=2 over 3 iterations: each rank runs one microbatch per iteration, compared under its
    global id; main grads, grad norm and parameters are replicas that must agree on both ranks."""
    ref, cand = runs.candidate(load("gpt_dp2"))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert {r.key.microbatch for r in c.results} == {-1, 0, 1}
    assert {r.key.iteration for r in c.results} == {1, 2, 3}
    assert not any("replicas differ" in r.reason for r in c.results)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_adam_in_lockstep_is_judged_element_by_element(runs, dtype):
    """TP2×DP2 with Adam (megatron's defaults): Adam's first update is about lr·sign(g), so a bias
    element whose grad is within round-off of zero moves by ±lr in a correct run. Under the analytic
    bound the candidate failed there (before issue #38); on its own weights it now passes, every
    update judged element by element from each side's own previous parameter and what the diverged
    weights compute listed as not judged. In lock-step (ttrace run's default) everything is judged,
    and the clean run passes without a perturbation run; a wrong step and a forward bug still fail."""
    recipe = load("gpt_tp2_dp2_adam", dtype=dtype)
    ref, free = runs.candidate(recipe, lockstep=False)
    free_running = compare_traces(ref, free)
    assert free_running.verdict == "pass", f"first mismatch {free_running.first_mismatch}"
    assert free_running.diverged and all(k.iteration > 1 for k in free_running.diverged)
    _, cand = runs.candidate(recipe)
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    updated = [r for r in c.results if r.key.phase == "optimizer" and r.key.kind.name == "PARAM"]
    assert updated and all(r.tolerance_source.startswith("Adam update, element-wise") for r in updated)
    assert {r.key.iteration for r in updated} == {1, 2, 3}
    tensors = {r.key.tensor for r in c.results if r.key.module == "optimizer"}
    assert {"grad_norm", "clip_coefficient", "step_count"} <= tensors
    assert any(t.endswith(".weight_decay") for t in tensors) and any(t.endswith(".lr") for t in tensors)
    # the element-wise check accepts flips, not wrong steps
    _, wrong = runs.candidate(recipe, inject=["weight_decay_ignores_param_groups"])
    first = compare_traces(ref, wrong).first_mismatch
    assert (first.key.module, first.key.phase) == ("optimizer", "optimizer") and first.key.tensor.endswith(
        ".weight_decay")
    _, buggy = runs.candidate(recipe, inject=["row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2"])
    first = compare_traces(ref, buggy).first_mismatch
    assert (first.key.module, first.key.phase, first.key.tensor) == ("decoder.layers.1.mlp.linear_fc2", "forward",
                                                                     "output")


def test_distributed_optimizer_main_grads_merge_by_owned_ranges(runs):
    """DP=2 with the distributed optimizer and Adam: each rank records only its owned flat range of
    each main grad; merged by those ranges they equal the reference's main grads."""
    ref, cand = runs.candidate(load("gpt_dp2_distopt"))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    main_grads = [r for r in c.results if r.key.phase == "main_grad"]
    assert len(main_grads) > 10
    # the reference adds its two microbatches' grads in fp32, the candidate adds one from each DP
    # rank: the same single addition, so main grads may be bitwise equal; what shows the candidate
    # is not the reference is that each main grad comes in two owned ranges, one per rank
    from ttrace_megatron.trace_store import TraceReader
    records = [(rt.rank, rec) for rt, rec in TraceReader(cand).records() if rec.key.phase == "main_grad"]
    assert {type(rec.layout.placements[-1]).__name__ for _, rec in records} == {"RangeShard"}
    assert {rank for rank, _ in records} == {0, 1}


@pytest.mark.parametrize("name", ["moe_tp2_sp_ep2", "moe_ep2", "moe_etp2"])
def test_moe_router_and_experts(runs, name):
    """MoE with the experts split over EP (inside the TP group, or over DP ranks) or over expert-TP:
    the router per microbatch, every expert under its global id. Where EP spans DP ranks an
    expert's tokens come from several microbatches: its per-microbatch tensors are declared not
    recorded (skipped, not missing) and its main grads and weights are compared."""
    ref, cand = runs.candidate(load(name))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    judged = {(r.key.module, r.key.phase) for r in c.results}
    for expert in range(4):
        assert (f"decoder.layers.1.mlp.experts.local_experts.{expert}.linear_fc2", "main_grad") in judged
    assert ("decoder.layers.0.mlp.router", "forward") in judged and ("decoder.layers.0.mlp.router", "backward") in judged
    aux = {r.key.tensor for r in c.results if r.key.module == "decoder.layers.0.mlp.router" and r.key.phase == "forward"}
    assert "load_balancing_loss" in aux and ("z_loss" in aux) == (name == "moe_tp2_sp_ep2")
    per_microbatch_experts = any("local_experts" in m and p == "forward" for m, p in judged)
    assert per_microbatch_experts == (name != "moe_ep2")
    assert bool(c.skipped) == (name == "moe_ep2")


@pytest.mark.parametrize("name,bug,module,phase,tensor", [
    # the aux loss as megatron attaches it to the graph is TP times too large from the first router on
    ("moe_tp2_sp_ep2", "moe_aux_loss_scaled_by_tp", "decoder.layers.0.mlp.router", "forward", "load_balancing_loss"),
    ("moe_ep2", "expert_grads_scaled_by_edp", "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1", "main_grad",
     "weight.main_grad"),
    ("moe_etp2", "expert_tp_partials_not_reduced", "decoder.layers.0.mlp", "forward", "output"),
    # q/k layernorms (qk_layernorm) built, recorded, and their TP-partial grads left unsummed
    ("qwen3_tp2", "qk_layernorm_grads_not_reduced", "decoder.layers.0.self_attention.q_layernorm", "main_grad",
     "weight.main_grad"),
    # a top-k that skips each token's best expert: the choice is not the top k of its scores
    ("moe_tp2_sp_ep2", "router_topk_skips_best", "decoder.layers.0.mlp.router", "forward", "topk_choice"),
    ("gpt_tp2_sp_pp2", "row_allreduce_dropped:decoder.layers.3.mlp.linear_fc2", "decoder.layers.3.mlp.linear_fc2",
     "forward", "output"),
    ("gpt_pp2", "tied_embedding_grads_not_synced", "embedding.word_embeddings", "main_grad", "weight.main_grad"),
    ("gpt_dp2_distopt", "distopt_grad_shard_offset", "embedding.word_embeddings", "optimizer", "weight.exp_avg"),
    # the optimizer: stale copies after a missing param all-gather
    ("gpt_dp2_distopt", "param_allgather_skipped", "embedding.word_embeddings", "optimizer", "weight"),
    ("gpt_dp2", "dp_grad_not_averaged", "embedding.word_embeddings", "main_grad", "weight.main_grad"),
    # megatron-core's own silent bug class (Megatron-LM #750, #1450): batched p2p at PP=2 with VPP
    # swaps an activation and a grad; end to end it first shows in the backward of layer 1, whose
    # output-grad crosses the pipeline boundary
    ("gpt_pp2_vpp", "vpp_batched_p2p_at_pp2", "decoder.layers.1.mlp.linear_fc2", "backward", "bias.grad"),
    ("gpt_tp2_sp", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2",
     "decoder.layers.1.mlp.linear_fc2", "forward", "output"),
    ("gpt_tp2", "row_allreduce_dropped:decoder.layers.0.self_attention.linear_proj",
     "decoder.layers.0.self_attention.linear_proj", "forward", "output"),
    ("gpt_tp2", "column_dgrad_allreduce_dropped:decoder.layers.1.self_attention.linear_qkv",
     "decoder.layers.1.self_attention.linear_qkv", "backward", "grad_input"),
    ("gpt_tp2", "embedding_mask_missing", "embedding.word_embeddings", "forward", "output"),
    ("gpt_tp2_sp", "sp_norm_grad_not_reduced:decoder.layers.0.input_layernorm",
     "decoder.layers.0.input_layernorm", "main_grad", "weight.main_grad"),
])
def test_injected_bug_fails_naming_the_module(runs, name, bug, module, phase, tensor):
    ref, cand = runs.candidate(load(name), inject=[bug])
    c = compare_traces(ref, cand)
    assert c.verdict == "fail"
    first = c.first_mismatch
    assert (first.key.module, first.key.phase, first.key.tensor) == (module, phase, tensor)
    assert first.key.iteration == 1
    assert first.error_eps > 10 * first.tolerance_eps


CAPACITY = {"moe_expert_capacity_factor": 1.0, "moe_token_drop_policy": "probs"}


def test_capacity_drop_is_judged_by_its_probabilities(runs):
    """Which tokens an expert keeps at capacity is a top-k over its column of probabilities: judged
    like the router's top-k. Clean, it passes; keeping the least probable tokens fails there."""
    recipe = load("moe_ep2", model=CAPACITY)
    ref, clean = runs.candidate(recipe)
    c = compare_traces(ref, clean)
    assert c.verdict == "pass", c.first_mismatch
    # the capacity drop, and the load-balancing loss's own top-k, each judged by its scores
    for tensor in ("capacity_choice", "balancing_choice"):
        choices = [r for r in c.results if r.key.tensor == tensor]
        assert choices and all("top-k choice judged by its scores" in r.tolerance_source for r in choices), tensor
    _, buggy = runs.candidate(recipe, name="capacity-bug", inject=["capacity_keeps_least_probable"])
    first = compare_traces(ref, buggy).first_mismatch
    assert (first.key.module, first.key.phase, first.key.tensor) == (
        "decoder.layers.0.mlp.router", "forward", "capacity_choice")
    assert "not the top" in first.reason and "of its own scores" in first.reason


def test_bf16_bug_is_detected(runs):
    ref, cand = runs.candidate(load("gpt_tp2_sp", dtype="bf16"),
                               inject=["row_allreduce_dropped:decoder.layers.0.mlp.linear_fc2"])
    first = compare_traces(ref, cand).first_mismatch
    assert first.key.module == "decoder.layers.0.mlp.linear_fc2" and first.key.phase == "forward"


@pytest.mark.parametrize("name,dtype", [("gpt_tp2", "fp32"), ("gpt_tp2_sp", "fp32"), ("gpt_tp2_sp", "bf16"),
                                        ("gpt_tp4_sp", "fp32"), ("gpt_tp2_sp_dp2", "bf16"), ("gpt_pp2", "bf16"),
                                        ("gpt_dp2_distopt", "bf16"), ("moe_tp2_sp_ep2", "bf16"),
                                        ("gpt_tp2_sp_fp8", "fp8")])
def test_tracing_is_bitwise_neutral(runs, name, dtype):
    """Losses and updated parameters are bitwise identical with and without tracing."""
    _assert_tracing_is_neutral(runs, load(name, dtype=dtype))


@pytest.mark.parametrize("name,dtype", [("gpt_tp2_sp", "bf16"), ("moe_tp2_sp_ep2", "fp32")])
def test_tracing_is_bitwise_neutral_from_a_sensitized_seed_checkpoint(runs, name, dtype):
    """The sensitized starting point (issue #36) changes where the run starts, nothing after: with
    and without tracing, from the same sensitized seed checkpoint, losses and parameters are bitwise
    identical."""
    _assert_tracing_is_neutral(runs, load(name, dtype=dtype, train={"seed_init": "sensitized"}))


def _assert_tracing_is_neutral(runs, recipe):
    from ttrace_megatron.adapter.run.runner import Probes

    _, traced = runs.candidate(recipe, name="neutral-traced", probes=Probes(dump_state=True), lockstep=False)
    _, untraced = runs.candidate(recipe, name="neutral-untraced", probes=Probes(trace=False, dump_state=True),
                                 lockstep=False)
    for rank in range(recipe.world_size):
        a = load_file(os.path.join(traced, f"state-rank{rank:05d}.safetensors"))
        b = load_file(os.path.join(untraced, f"state-rank{rank:05d}.safetensors"))
        assert a.keys() == b.keys() and len(a) > 10
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_cli_run_json_and_exit_codes(tmp_path):
    from ttrace_megatron.cli import main

    out = tmp_path / "out"
    rc = main(["run", os.path.join(RECIPES, "gpt_tp2.yaml"), "--out", str(out), "--json", str(tmp_path / "r.json"),
               "--inject", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2"])
    assert rc == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "fail"
    fm = report["first_mismatch"]
    assert fm["module"] == "decoder.layers.1.mlp.linear_fc2" and fm["phase"] == "forward"
    assert set(fm) >= {"module", "phase", "tensor", "iteration", "microbatch", "error_eps", "tolerance_eps"}
    assert len(report["tensors"]) == report["summary"]["compared"] > 100
    assert main(["report", str(out)]) == 1
    # comparing the reference with itself is equivalent
    assert main(["compare", str(out / "reference"), str(out / "reference")]) == 0
    # a missing rank is bad input (the default check: each candidate rank's verdict sums)
    os.remove(out / "candidate" / "rank-00001" / "online.json")
    assert main(["compare", str(out / "reference"), str(out / "candidate")]) == 2


def test_cli_bad_recipe_is_exit_2(tmp_path, capsys):
    from ttrace_megatron.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layer: 2\n")
    assert main(["run", str(bad)]) == 2
    assert "unknown key 'num_layer'" in capsys.readouterr().err


def test_frozen_parameters_do_not_train(runs):
    """train.frozen: matching weights get no grads, and both runs agree on that."""
    recipe = load("gpt_tp2")
    recipe.train.frozen = ["decoder.layers.0.*"]
    ref, cand = runs.candidate(recipe)
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    layer0_grads = [r for r in c.results if r.key.module.startswith("decoder.layers.0.") and r.key.phase != "forward"
                    and r.key.tensor not in ("grad_input", "grad_output")]
    assert layer0_grads == []
    assert any(r.key.module.startswith("decoder.layers.1.") and r.key.phase == "main_grad" for r in c.results)
    not_judged = {e["param"]: e["why"] for e in c.coverage["not_judged"]}  # listed, with why
    assert not_judged and all(p.startswith("decoder.layers.0.") and "frozen" in why for p, why in not_judged.items())


def test_cli_selective_recording(tmp_path):
    from ttrace_megatron.cli import main
    from ttrace_megatron.online import combine_online
    from ttrace_megatron.trace_store import TraceReader

    out = tmp_path / "out"
    rc = main(["run", os.path.join(RECIPES, "gpt_tp2.yaml"), "--out", str(out), "--iters", "2",
               "--modules", "decoder.layers.1.*", "--microbatches", "1", "--reference-in", "disk"])
    assert rc == 0  # judged online (the default): what the selection left out is not missing
    keys = [r.key for r in combine_online(str(out / "candidate")).results]
    assert keys and {k.iteration for k in keys} == {2}
    assert all(k.module.startswith("decoder.layers.1.") for k in keys)
    assert {k.microbatch for k in keys} <= {-1, 1}
    # in lock-step the candidate takes the reference's weights after every step: it records them all
    assert {rec.key.iteration for _, rec in TraceReader(str(out / "reference")).records()} == {1, 2, 3}


def test_cli_runs_a_directory_of_recipes_with_junit(tmp_path):
    """`ttrace run DIR --junit`: every recipe, a summary, JUnit XML, non-zero if any fails."""
    import shutil
    from xml.etree import ElementTree as ET

    from ttrace_megatron.cli import main

    recipes = tmp_path / "recipes"
    recipes.mkdir()
    shutil.copy(os.path.join(RECIPES, "gpt_tp2.yaml"), recipes / "a_clean.yaml")
    (recipes / "b_bad.yaml").write_text("model:\n  num_layer: 2\n")
    rc = main(["run", str(recipes), "--junit", str(tmp_path / "junit.xml"), "--json", str(tmp_path / "s.json")])
    assert rc == 2  # one recipe is bad input
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert suite.get("tests") == "2" and suite.get("errors") == "1" and suite.get("failures") == "0"
    cases = {c.get("name"): c for c in suite}
    assert cases["a_clean"].find("failure") is None and cases["a_clean"].find("error") is None
    assert "num_layer" in cases["b_bad"].find("error").get("message")
    summary = json.loads((tmp_path / "s.json").read_text())
    assert [r["verdict"] for r in summary["recipes"]] == ["pass", "error"]


def test_aux_losses_follow_selective_recording(runs):
    """Recording one layer's modules: the aux losses of the other layer's router are not recorded,
    and not under the recorded router's name either; the recorded ones equal the reference's."""
    from ttrace_megatron.compare import group_records, logical_tensor
    from ttrace_megatron.trace_store import TraceReader

    recipe = load("moe_tp2_sp_ep2")
    ref, cand = runs.candidate(recipe, name="layer0-only", modules=("decoder.layers.0.*",))
    ref_reader, cand_reader = TraceReader(ref), TraceReader(cand)
    ref_groups, cand_groups = group_records(ref_reader), group_records(cand_reader)
    losses = {k: pieces for k, pieces in cand_groups.items() if k.tensor.endswith("_loss")}
    assert losses and {k.module for k in losses} == {"decoder.layers.0.mlp.router"}
    tp = 2
    assert all(len(pieces) == tp for pieces in losses.values())  # one partial sum per TP rank of the DP group
    for key, pieces in losses.items():
        got = logical_tensor(cand_reader, pieces).tensor
        want = logical_tensor(ref_reader, ref_groups[key]).tensor
        assert torch.allclose(got, want, rtol=1e-5), key


def test_loss_reduction_length_is_the_vocabulary():
    """The per-token loss is a log-sum-exp over the vocabulary, not a router aux loss (a regression:
    a name-suffix rule once gave it the token count)."""
    from ttrace_megatron.adapter.record.layouts import ModelFacts, reduction_length

    facts = ModelFacts(num_layers=2, vocab_size=256, sequence_parallel=False, gated_linear_unit=False, tp_size=1,
                       hidden_size=64, tokens_per_microbatch=64, tokens_per_iteration=128)
    from ttrace_megatron.keys import TensorKind

    assert reduction_length("loss", None, TensorKind.LOSS, facts) == 256  # log-sum-exp over the vocabulary


def test_reduction_lengths_are_never_less_than_the_operands():
    """K of a tensor covers the reductions that made its operands (docs/tolerance.md): a weight grad
    summed over few tokens, a position embedding's rows, a loss over a vocabulary smaller than the
    model is wide, and core attention's output over a long sequence."""
    from ttrace_megatron.adapter.record.layouts import ModelFacts, reduction_length
    from ttrace_megatron.keys import TensorKind

    facts = ModelFacts(num_layers=2, vocab_size=128, sequence_parallel=False, gated_linear_unit=False, tp_size=1,
                       hidden_size=2048, tokens_per_microbatch=256, tokens_per_iteration=512, seq_length=4096)
    assert reduction_length("embedding.position_embeddings", None, TensorKind.PARAM_GRAD, facts) == 2048
    assert reduction_length("decoder.layers.0.mlp.linear_fc2", None, TensorKind.PARAM_GRAD, facts) == 2048
    assert reduction_length("decoder.layers.0.self_attention.linear_proj", None, TensorKind.MAIN_GRAD, facts) == 4096
    assert reduction_length("decoder.layers.0.self_attention.linear_proj", None, TensorKind.INPUT, facts) == 4096
    assert reduction_length("decoder.layers.0.self_attention.linear_qkv", None, TensorKind.GRAD_OUTPUT, facts) == 4096
    assert reduction_length("loss", None, TensorKind.LOSS, facts) == 2048
    narrow = ModelFacts(num_layers=2, vocab_size=128, sequence_parallel=False, gated_linear_unit=False, tp_size=1,
                        hidden_size=64, tokens_per_microbatch=256, tokens_per_iteration=1024, seq_length=32)
    assert reduction_length("embedding.position_embeddings", None, TensorKind.MAIN_GRAD, narrow) == 64  # 32 sequences
    assert reduction_length("embedding.word_embeddings", None, TensorKind.MAIN_GRAD, narrow) == 1024


@pytest.mark.parametrize("model", [
    {},  # the recipe: full recomputation, uniform, one layer a checkpoint, inputs distributed over TP
    {"recompute_method": "block", "recompute_num_layers": 1, "distribute_saved_activations": False},
    {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None,
     "distribute_saved_activations": False},  # core attention, megatron's default recompute_modules
])
def test_activation_recomputation_is_judged_once_per_tensor(runs, model):
    """The candidate recomputes, the reference keeps its activations: a recomputed module's values
    are recorded once (the first run's), its grads from the recomputed graph, and every tensor of
    the run without recomputation is judged, no more and no fewer."""
    import yaml

    from ttrace_megatron.recipe import recipe_from_dict

    raw = yaml.safe_load(open(os.path.join(RECIPES, "gpt_tp2_recompute.yaml")))
    raw["model"] = {k: v for k, v in dict(raw["model"], **model).items() if v is not None}
    raw["name"] = "gpt_tp2_recompute" + "".join(f"_{k}" for k in model)
    ref, cand = runs.candidate(recipe_from_dict(raw))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert not c.missing_in_candidate and not c.missing_in_reference
    plain = compare_traces(*runs.candidate(load("gpt_tp2")))  # the same model without recomputation
    # core attention is no recorded module (its output is linear_proj's input): nothing recorded runs
    # inside its recomputation
    _recomputed_outputs_judged_besides(c, plain, None if model.get("recompute_granularity") == "selective"
                                       else "mlp.linear_fc2")
    assert "recompute_granularity" not in c.reference_run["recipe"]["model"]  # the reference keeps activations
    assert c.candidate_run["recipe"]["model"]["recompute_granularity"] == raw["model"]["recompute_granularity"]


def test_recomputation_of_unchecked_modules_is_refused_with_the_reason():
    from ttrace_megatron.adapter.recipe.config import validate_recipe
    from ttrace_megatron.errors import RecipeError
    from ttrace_megatron.recipe import recipe_from_dict

    recipe = recipe_from_dict({"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                         "recompute_granularity": "selective", "recompute_modules": ["layernorm"]},
                               "world_size": 1})
    with pytest.raises(RecipeError, match="'recompute_granularity' is not supported by ttrace: recompute_modules "
                                          "'layernorm'.*random.py:589"):
        validate_recipe(recipe)
    moe_act = recipe_from_dict({"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                          "num_moe_experts": 4, "add_bias_linear": False,
                                          "recompute_granularity": "selective", "recompute_modules": ["moe_act"]},
                                "world_size": 1})
    with pytest.raises(RecipeError, match="'recompute_granularity' is not supported by ttrace: recompute_modules "
                                          "'moe_act'.*moe_grouped_gemm"):
        validate_recipe(moe_act)  # before any run starts, not at the candidate's attach
    # megatron's own hang: the checkpointed MLP hands out linear_fc2's bias Parameter
    mlp_with_bias = recipe_from_dict({"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                                "recompute_granularity": "selective", "recompute_modules": ["mlp"]},
                                      "world_size": 1})
    with pytest.raises(RecipeError, match="'mlp' with add_bias_linear.*transformer_layer.py:733.*random.py:566"):
        validate_recipe(mlp_with_bias)


@pytest.mark.parametrize("name,model", [
    # (the MLP alone takes the same path as here: megatron checkpoints each module apart)
    ("gpt_tp2", {"add_bias_linear": False, "recompute_modules": ["core_attn", "mlp"]}),
    ("deepseek_tp2_sp_ep2", {"recompute_modules": ["shared_experts"]}),
])
def test_selective_recomputation_of_mlps(runs, name, model):
    """Selective recomputation of the MLP (biasless: megatron hangs with biases, refused above)
    and of the shared experts: judged tensor for tensor as the same model without recomputation."""
    plain_model = {k: v for k, v in model.items() if k != "recompute_modules"}
    ref, cand = runs.candidate(load(name, model=dict(model, recompute_granularity="selective")))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert not c.missing_in_candidate and not c.missing_in_reference
    assert c.candidate_run["recipe"]["model"]["recompute_modules"] == model["recompute_modules"]
    plain = compare_traces(*runs.candidate(load(name, model=plain_model)))
    _recomputed_outputs_judged_besides(c, plain, "shared_experts" if "shared_experts" in model["recompute_modules"]
                                       else "mlp.linear_fc2")


def _recomputed_outputs_judged_besides(c, plain, recomputed_module):
    """Every tensor of the run without recomputation is judged, no more and no fewer, and besides
    them the recomputed outputs (``recomputed_output``, against the reference's output): each
    recomputed module's, of every microbatch, passing."""
    from ttrace_megatron.keys import RECOMPUTED_OUTPUT

    again = [r for r in c.results if r.key.tensor == RECOMPUTED_OUTPUT]
    assert sorted(str(r.key) for r in c.results if r.key.tensor != RECOMPUTED_OUTPUT) == \
        sorted(str(r.key) for r in plain.results)
    if recomputed_module is None:
        assert again == []
        return
    assert any(recomputed_module in r.key.module for r in again), sorted({r.key.module for r in again})
    assert {r.key.microbatch for r in again} == {r.key.microbatch for r in plain.results if r.key.microbatch >= 0}
    assert all(r.verdict == "pass" for r in again)


@pytest.mark.parametrize("model", [
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    {"moe_layer_recompute": True},  # megatron: selective recomputation of the 'moe' module
])
def test_moe_recomputation(runs, model):
    """Recomputed MoE layers: megatron's router computes its aux losses only with grad, so under
    recomputation they exist only in the recomputed forward, and are recorded there; the routing
    is recorded once and, in lock-step, the recomputed router follows the reference again."""
    ref, cand = runs.candidate(load("moe_tp2_sp_ep2", model=model))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert not c.missing_in_candidate and not c.missing_in_reference
    plain = compare_traces(*runs.candidate(load("moe_tp2_sp_ep2")))
    _recomputed_outputs_judged_besides(c, plain, "mlp.experts")


def test_nope_layers_under_pipeline_parallelism(runs):
    """no_rope_freq (Llama 4's NoPE layers) is honoured by megatron's attention through the global
    layer number: a PP=2 candidate whose second stage holds the NoPE layer matches the reference."""
    ref, cand = runs.candidate(load("gpt_pp2_nope"))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert c.candidate_run["recipe"]["model"]["no_rope_freq"] == [0, 0, 1, 0]


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
def test_attention_sinks_under_tensor_parallelism(runs, softmax_type):
    """softmax_type (gpt-oss's attention sinks): off-by-one adds a zero logit per head; learnable
    adds a per-head parameter that each TP rank holds for its own heads, though megatron does not
    tag it tensor_model_parallel. ttrace places it by the module's heads: merged over TP, it is
    the reference's, and its grads, moments and updates are judged.

    Untagged, megatron's grad norm takes it for a TP replica and counts TP rank 0's heads only
    (benchmarks/upstream_bugs softmax_offset_counted_on_tp_rank0_only, unfixed upstream): on stock
    megatron-core each layer's term of the norm for it fails, and nothing else does."""
    ref, cand = runs.candidate(load("gpt_tp2_sinks", model={"softmax_type": softmax_type}))
    c = compare_traces(ref, cand)
    offsets = [r for r in c.results if r.key.tensor.startswith("softmax_offset")]
    assert bool(offsets) == (softmax_type == "learnable")
    if not offsets:
        assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
        return
    assert {r.key.phase for r in offsets} >= {"backward", "main_grad", "optimizer"}
    assert all(r.shape == (4,) for r in offsets if r.key.tensor == "softmax_offset.main_grad")
    terms = {r.key for r in offsets if r.key.kind is keys.TensorKind.GRAD_NORM_TERM}
    assert terms and {r.key for r in c.failures} == terms
    # the candidate's term is rank 0's two heads of four: short of the reference's by rank 1's share
    # (measured 1 % to 68 %), far outside round-off
    assert all(0 < r.error < 1 and r.ratio > 1e3 for r in c.failures)


@pytest.mark.parametrize("model,parallel", [
    ({"mtp_num_layers": 2}, None),  # two depths, TP=2 + SP
    # the decoder's layers and the MTP layer recomputed (megatron checkpoints the MTP layer by its own rule)
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, None),
    # PP 2: the MTP layer on the last stage with its own copy of the word embeddings, which embeds only
    # the MTP depths' tokens (naming.calls_made_elsewhere) and whose grads the embedding group adds up
    ({}, {"tensor_model_parallel_size": 1, "sequence_parallel": False, "pipeline_model_parallel_size": 2}),
    # DeepSeek-V3's layout: the MTP layer is an MoE layer like the decoder's last, experts over EP=2 at DP=2
    ({"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_layer_freq": [0, 1],
      "moe_token_dispatcher_type": "alltoall"},
     {"tensor_model_parallel_size": 1, "sequence_parallel": False, "expert_model_parallel_size": 2}),
])
def test_multi_token_prediction(runs, model, parallel):
    """mtp_num_layers (DeepSeek-V3): each MTP depth embeds the tokens shifted once more, projects
    them with the previous depth's hidden states through a transformer layer, and scores them with
    the shared output layer. The word embeddings and the output layer run once per depth and
    microbatch: each call is judged under its own name, and each depth's loss too."""
    overrides = {"model": model}
    if parallel:
        overrides["parallel"] = parallel
    ref, cand = runs.candidate(load("deepseek_mtp_tp2_sp", **overrides))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert not c.missing_in_candidate and not c.missing_in_reference
    modules = {r.key.module for r in c.results}
    depths = c.candidate_run["recipe"]["model"]["mtp_num_layers"]
    for k in range(depths):
        assert {f"mtp.layers.{k}.loss", f"mtp.layers.{k}.output_layer", f"mtp.layers.{k}.embedding.word_embeddings",
                f"mtp.layers.{k}.eh_proj"} <= modules
        # 0.16's transformer_layer is 0.19's mtp_model_layer
        assert {f"mtp.layers.{k}.{inner}.self_attention.linear_qkv" for inner in ("transformer_layer", "mtp_model_layer")
                } & modules
    assert f"mtp.layers.{depths}.loss" not in modules and "output_layer#1" not in modules
    losses = [r for r in c.results if r.key.tensor == "per_token_loss"]
    assert {r.key.module for r in losses} == {"loss"} | {f"mtp.layers.{k}.loss" for k in range(depths)}


def test_multi_token_prediction_with_pipeline_parallelism_and_tied_embeddings(runs):
    """MTP at PP 2 with tied embeddings: the last stage projects with its copy of the word embeddings,
    and megatron allocates an output-layer weight there that nothing uses. That weight is listed as
    not the model's (not judged, with why); everything else passes clean, and the embedding copies'
    grads left unsummed over the stages are caught at the embedding."""
    recipe = load("deepseek_mtp_tp2_sp", model={"share_embeddings_and_output_weights": True},
                  parallel={"tensor_model_parallel_size": 1, "sequence_parallel": False, "pipeline_model_parallel_size": 2})
    ref, cand = runs.candidate(recipe)
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert not c.missing_in_candidate and not c.missing_in_reference
    cov = c.coverage
    assert cov["total"]["params_judged"] == cov["total"]["params"]
    assert [e["param"] for e in cov["not_the_models"]] == ["output_layer.weight"]
    _, buggy = runs.candidate(recipe, inject=["tied_embedding_grads_not_synced"])
    fm = compare_traces(ref, buggy).first_mismatch
    assert fm is not None and (fm.key.module, fm.key.phase) == ("embedding.word_embeddings", "main_grad"), fm


def test_mtp_stage_copy_of_learned_position_embeddings_never_synced_is_caught(runs):
    """A megatron-core bug the sweep found (0.16.1 and 0.19.2): with multi-token prediction and PP > 1
    the MTP stage builds an embedding of its own, learned position embeddings included, but the
    position embeddings are all-reduced over a group of the first stage alone
    (parallel_state.default_position_embedding_ranks; Megatron-LM's pretrain_gpt.py adds the MTP
    stages to the word embeddings' group only). Each stage's copy steps on its own share of the grad:
    the copies are replicas that differ, at the main grad. With RoPE there is no copy, and it passes
    (test_multi_token_prediction)."""
    recipe = load("gpt_pp2", model={"mtp_num_layers": 1})
    ref, cand = runs.candidate(recipe)
    fm = compare_traces(ref, cand).first_mismatch
    assert fm is not None and (fm.key.module, fm.key.phase, fm.key.tensor) == (
        "embedding.position_embeddings", "main_grad", "weight.main_grad"), fm
    assert "candidate replicas differ" in fm.reason


@pytest.mark.parametrize("fields,why", [
    ({"dtype": "fp8"}, "with dtype fp8 yet"),
])
def test_multi_token_prediction_refusals_name_the_reason(fields, why):
    from ttrace_megatron.adapter.recipe.config import validate_recipe
    from ttrace_megatron.errors import RecipeError

    recipe = load("deepseek_mtp_tp2_sp", **{k: v for k, v in fields.items()})
    with pytest.raises(RecipeError, match=f"'mtp_num_layers' is not supported by ttrace {why}"):
        validate_recipe(recipe)


def test_multi_token_prediction_with_nope_is_refused_where_megatron_indexes_past_the_pattern():
    """megatron-core 0.16 numbers an MTP depth's layer after the decoder's and attention reads
    no_rope_freq[layer_number - 1], past the pattern's end (an IndexError the bf16 sweep hit); 0.19
    numbers MTP layers by depth and runs it."""
    from ttrace_megatron.adapter.recipe import compat
    from ttrace_megatron.adapter.recipe.config import validate_recipe
    from ttrace_megatron.errors import RecipeError

    recipe = load("deepseek_mtp_tp2_sp", model={"no_rope_freq": 2})
    if not compat.mtp_layers_numbered_after_the_decoder():
        validate_recipe(recipe)
        return
    with pytest.raises(RecipeError, match="'mtp_num_layers' is not supported by ttrace with a NoPE pattern"):
        validate_recipe(recipe)


def test_fp16_with_the_dynamic_loss_scaler(runs):
    """dtype fp16: megatron scales the loss before the backward and unscales the main grads before
    the step. Grads are judged unscaled (the layout's scale holds the loss scale), each step's
    loss scale and whether it was skipped exactly."""
    ref, cand = runs.candidate(load("gpt_tp2_sp_fp16"))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    decisions = {(r.key.iteration, r.key.tensor) for r in c.results if r.key.tensor in ("loss_scale", "step_skipped")}
    assert decisions == {(i, t) for i in (1, 2, 3) for t in ("loss_scale", "step_skipped")}


def test_fp16_overflowed_steps_are_skipped_alike(runs):
    """A loss scale so high that the first step's grads overflow: both runs skip it (no moments
    yet), halve the scale and step. The Inf/NaN grads of the skipped step are expected; its finite
    grads are judged. At DP 2 each microbatch's loss carries twice a one-rank run's share of the
    batch, so the reference trains at twice the loss scale and overflows where the candidate does."""
    recipe = load("gpt_tp2_sp_fp16", parallel={"tensor_model_parallel_size": 1, "sequence_parallel": False},
                  optimizer={"use_distributed_optimizer": True, "initial_loss_scale": 1800000, "hysteresis": 1})
    ref, cand = runs.candidate(recipe)
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    skipped = {r.key.iteration for r in c.results if r.key.tensor == "step_skipped"}
    assert skipped == {1, 2, 3}
    assert any("expected (the reference skipped this step" in r.tolerance_source for r in c.results)
    assert c.reference_run["recipe"]["optimizer"]["initial_loss_scale"] == 3600000.0
    assert c.candidate_run["recipe"]["optimizer"]["initial_loss_scale"] == 1800000
    assert not any(r.key.phase == "optimizer" and r.key.tensor.endswith("exp_avg") and r.key.iteration == 1
                   for r in c.results)  # the skipped first step created no moments, in either run


def test_overlapped_param_gather(runs):
    """overlap_param_gather: after the step each DP rank holds only its owned range of a parameter
    up to date; the updated parameters are recorded as those ranges (merged, the whole parameter)
    and the next forward runs on what the overlapped all-gather brought."""
    ref, cand = runs.candidate(load("gpt_dp2_distopt_overlap"))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert not c.missing_in_candidate and not c.missing_in_reference
    from ttrace_megatron.trace_store import TraceReader

    layouts = {rec.key.tensor: rec.layout for _, rec in TraceReader(cand).records()
               if rec.key.module == "embedding.word_embeddings" and rec.key.phase == "optimizer"
               and rec.key.iteration == 1}
    assert any(type(p).__name__ == "RangeShard" for p in layouts["weight"].placements)


def test_attention_output_gate(runs):
    """attention_output_gate (Qwen3-Next): a sigmoid gate per head on attention's output, its
    projection inside each query group of linear_qkv, so TP shards it with its group."""
    ref, cand = runs.candidate(load("gpt_tp2", model={"attention_output_gate": True}))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    qkv = next(r for r in c.results if r.key.module == "decoder.layers.0.self_attention.linear_qkv"
               and r.key.tensor == "weight.main_grad")
    assert qkv.shape[0] == 16 * (4 + 2 * 4 + 4)  # kv_channels × (heads + 2 groups + the gate's heads)


def test_qk_l2_norm_and_probs_on_expert_inputs(runs):
    """qk_l2_norm (Llama 4: a parameter-free L2 norm of queries and keys, built by megatron-core's
    MoE decoder block spec) and moe_apply_probs_on_input (the top-1 router's probability scales the
    expert's input): honoured in reference and candidate alike, TP 2 + SP with EP 2."""
    ref, cand = runs.candidate(load("moe_tp2_sp_ep2", model={"qk_l2_norm": True, "moe_router_topk": 1,
                                                              "moe_router_pre_softmax": True,
                                                              "moe_apply_probs_on_input": True}))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert not any(r.key.module.endswith(("q_layernorm", "k_layernorm")) for r in c.results)  # no parameters


@pytest.mark.parametrize("name", ["masked_tp2_sp", "masked_pp2", "masked_dp2_distopt"])
def test_loss_masks_with_uneven_valid_token_counts(runs, name):
    """Loss masks (issue #34): a prompt prefix of each sample's own length and the end-of-document
    tokens carry no loss. The valid-token counts differ between microbatches (and DP ranks), each
    microbatch's loss is its mean over its own valid tokens, or (calculate_per_token_loss) the grads
    are divided by the batch's valid tokens. The mask the model was handed is recorded and judged
    exactly, and the run passes at TP2+SP, PP2 with 4 microbatches and DP2 with the distributed
    optimizer."""
    from ttrace_megatron.compare import group_records, logical_tensor
    from ttrace_megatron.trace_store import TraceReader

    ref, cand = runs.candidate(load(name))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    masks = [r for r in c.results if r.key.tensor == keys.LOSS_MASK]
    assert len(masks) == 3 * 4 and all(r.error == 0.0 for r in masks)
    reader = TraceReader(ref)
    groups = group_records(reader)
    valid = [float(logical_tensor(reader, groups[r.key]).tensor.sum()) for r in masks if r.key.iteration == 1]
    assert len(set(valid)) > 1 and max(valid) < 2 * 32, valid  # uneven, and tokens are masked


@pytest.mark.parametrize("name", ["packed_tp2_sp", "packed_pp2", "packed_dp2_distopt"])
def test_packed_documents(runs, name):
    """Packed documents (issue #34): positions start again after each EOD token and a token attends
    only to its own document, with the [s, s] mask megatron's GPTDataset builds. The learned
    position embedding's grad (which rows the reset positions use) is judged, and the run passes."""
    from ttrace_megatron.adapter.recipe import data

    recipe = load(name)
    sample = data.sampler(recipe)(0)
    assert sample.attention_mask is not None and int(sample.position_ids.max()) < recipe.data.seq_length - 1
    ref, cand = runs.candidate(recipe)
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert any(r.key.module == "embedding.position_embeddings" and r.key.tensor == "weight.main_grad"
               for r in c.results)


@pytest.mark.parametrize("name", ["padded_moe_pp2", "padded_moe_ep2_distopt"])
def test_padded_samples_with_moe(runs, name):
    """The router's padding mask (issue #34): each sample ends in a padded tail that carries no loss
    and that the routers' aux loss, z-loss and expert-bias counts leave out. The mask the model was
    handed is recorded and judged exactly; the run passes at PP2 (4 microbatches) and at EP2 over
    DP2 with the distributed optimizer."""
    ref, cand = runs.candidate(load(name))
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    padding = [r for r in c.results if r.key.tensor == keys.PADDING_MASK]
    assert padding and all(r.error == 0.0 for r in padding)
    assert any(r.key.tensor == "z_loss" for r in c.results) and any(
        r.key.tensor == "load_balancing_loss" for r in c.results)


def test_padded_z_loss_under_sequence_parallelism_is_megatrons_bug(runs):
    """With a padding mask under TP + SP megatron-core's z-loss is the mean of each sequence shard's
    mean (benchmarks/upstream_bugs moe_z_loss_padding_mean_per_sequence_shard, unfixed): the recipe is
    an expected FAIL, first at layer 0's z_loss, and the load-balancing loss (counted over the group)
    still agrees. When megatron fixes it, this test fails: a change to look at."""
    ref, cand = runs.candidate(load("padded_moe_tp2_sp_ep2"))
    c = compare_traces(ref, cand)
    assert c.verdict == "fail"
    first = c.first_mismatch
    assert (first.key.module, first.key.phase, first.key.tensor) == ("decoder.layers.0.mlp.router", "forward", "z_loss")
    assert all(r.verdict == "pass" for r in c.results if r.key.tensor in ("load_balancing_loss", keys.PADDING_MASK))


CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")


@pytest.mark.parametrize("name", ["gpt_tp2_sp", "packed_pp2", "masked_dp2_distopt"])
def test_real_text_through_megatrons_gpt_dataset(runs, tmp_path, name):
    """Real data (issue #34): tests/data/corpus.txt written as a megatron indexed dataset by
    megatron-core's IndexedDatasetBuilder (bytes, each paragraph a document ended by EOD), read by
    megatron-core's GPTDataset as Megatron-LM's pretrain_gpt.py reads --data-path (no mock in the
    path): its documents shuffled, packed and masked by megatron's own indices and rules."""
    from ttrace_megatron.adapter.recipe import data

    prefix = data.write_text_dataset(CORPUS, str(tmp_path / "corpus"))
    recipe = load(name, data={"source": "megatron_indexed", "path": prefix, "vocab_size": data.BYTE_VOCAB,
                              "seq_length": 64, "eod_mask_loss": True, "reset_position_ids": True,
                              "reset_attention_mask": True, "masked_share": 0.0, "document_length": 0})
    first = data.sampler(recipe)(0)
    assert bytes(t for t in first.tokens.tolist() if t < 256).decode("utf-8", "replace").isprintable()
    ref, cand = runs.candidate(recipe)
    c = compare_traces(ref, cand)
    assert c.verdict == "pass", f"first mismatch {c.first_mismatch}"
    assert c.reference_run["model_config"]["training"]["data_source"] == "megatron_data:" + prefix


def _judged(report):
    """A report's verdict on each tensor, without where the traces were."""
    return report["verdict"], report["first_mismatch"], report["tensors"], report["summary"], report.get("culprits")


@pytest.mark.parametrize("inject", [None, "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2"])
def test_a_streamed_reference_gives_the_verdict_of_one_held_whole(tmp_path, inject):
    """``--reference-in stream``: the candidate judges each iteration as the reference finishes it,
    and the next overwrites what the verdict never reads again; every tensor's verdict, error and
    tolerance are those of the reference held whole, and a failing check runs the reference again
    whole for its replay, which names the same culprit."""
    from ttrace_megatron.cli import main

    reports = {}
    for mode in ("memory", "stream"):
        out, path = tmp_path / mode, tmp_path / f"{mode}.json"
        rc = main(["run", os.path.join(RECIPES, "gpt_tp2_sp.yaml"), "--out", str(out), "--json", str(path), "--quiet",
                   "--cpu", "--reference-in", mode] + (["--inject", inject] if inject else []))
        assert rc == (1 if inject else 0)
        reports[mode] = json.loads(path.read_text())
    assert _judged(reports["stream"]) == _judged(reports["memory"])
    assert len(reports["stream"]["tensors"]) > 100
    assert ("reference again" in reports["stream"]["timings_s"]) == bool(inject)
    if inject:
        assert reports["stream"]["culprits"][0]["module"] == "decoder.layers.1.mlp.linear_fc2"
        # again, in memory where held whole it fits (here), then moved under --out as a failing held one is
        assert reports["stream"]["reference"] == str(tmp_path / "stream" / "reference")
        manifest = read_manifest(tmp_path / "stream" / "reference" / "rank-00000")
        # up to the failing iteration, of the recipe's 3: the replay reads nothing after it
        assert manifest["complete"] and reports["stream"]["first_mismatch"]["iteration"] == 1
        assert max(r["key"]["iteration"] for r in manifest["records"]) == 1


def test_a_streamed_reference_is_streamed_again_to_the_perturbation_run(tmp_path):
    """A bf16 recipe's check runs a perturbation run (the reference again, with round-off-sized
    noise, judged online against it). Streamed, the reference runs again, streamed to it as to the
    candidate: every tensor's verdict, error and tolerance (the perturbation-observed ones too) are
    those of the check with the reference held whole."""
    import yaml

    from ttrace_megatron.cli import main

    raw = yaml.safe_load(open(os.path.join(RECIPES, "gpt_tp2_sp.yaml")))
    raw.update(dtype="bf16", name="gpt_tp2_sp")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    reports = {}
    for mode in ("memory", "stream"):
        path = tmp_path / f"{mode}.json"
        assert main(["run", str(recipe), "--out", str(tmp_path / mode), "--json", str(path), "--quiet", "--cpu",
                     "--no-fp32-twin", "--reference-in", mode]) == 0
        reports[mode] = json.loads(path.read_text())
    assert "perturbation" in reports["stream"]["timings_s"] and reports["stream"]["reference_in"] == "stream"
    assert any("perturbation" in (t.get("tolerance_source") or "") for t in reports["stream"]["tensors"])
    assert _judged(reports["stream"]) == _judged(reports["memory"])


def test_auto_streams_a_reference_that_held_whole_would_not_fit(tmp_path):
    """``--reference-in auto`` under a ``--reference-memory`` that the reference held whole exceeds
    and its streamed peak fits (the plan's figures): streamed, with the verdict of one held whole."""
    from ttrace_megatron.cli import main

    recipe = os.path.join(RECIPES, "gpt_tp2_sp.yaml")
    planned = {}
    for mode in ("memory", "stream"):
        proc = subprocess.run([sys.executable, "-m", "ttrace_megatron.cli", "plan", recipe, "--json", "-",
                               "--no-fp32-twin", "--reference-in", mode], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert proc.returncode == 0, proc.stderr[-2000:]
        planned[mode] = json.loads(proc.stdout)["memory_needed"]
    assert planned["stream"] < planned["memory"]
    reports = {}
    for mode, flags in (("memory", ["--reference-in", "memory"]),
                        ("auto", ["--reference-memory", str((planned["stream"] + planned["memory"]) // 2)])):
        path = tmp_path / f"{mode}.json"
        assert main(["run", recipe, "--out", str(tmp_path / mode), "--json", str(path), "--quiet", "--cpu",
                     "--no-fp32-twin"] + flags) == 0
        reports[mode] = json.loads(path.read_text())
    assert reports["memory"]["reference_in"] == "memory" and reports["auto"]["reference_in"] == "stream"
    assert _judged(reports["auto"]) == _judged(reports["memory"])


def test_auto_places_each_pairs_reference_by_its_own(tmp_path, capsys):
    """A bf16 recipe's pair and its fp32 twin are placed apart: under a ``--reference-memory`` between
    the two references held whole (the twin's, in fp32, is the larger), the pair holds its own (which
    its perturbation run reads) and the twin streams its own, says so, and every tensor of both
    checks is judged as with both held whole."""
    import yaml

    from ttrace_megatron.cli import main

    raw = yaml.safe_load(open(os.path.join(RECIPES, "gpt_tp2_sp.yaml")))
    raw.update(dtype="bf16", name="gpt_tp2_sp")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "ttrace_megatron.cli", "plan", str(recipe), "--json", "-",
                           "--reference-in", "memory"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    whole = {s["name"]: s["total"] for s in json.loads(proc.stdout)["sides"]}
    between = (whole["reference"] + whole["fp32_twin/reference"]) // 2
    reports = {}
    for mode, flags in (("memory", ["--reference-in", "memory"]), ("auto", ["--reference-memory", str(between)])):
        path = tmp_path / f"{mode}.json"
        assert main(["run", str(recipe), "--out", str(tmp_path / mode), "--json", str(path), "--cpu"] + flags) == 0
        reports[mode] = json.loads(path.read_text())
    said = " ".join(capsys.readouterr().out.split())
    assert "the fp32 twin's reference streamed (--reference-in auto): held whole it would take about" in said
    assert "the reference streamed (--reference-in auto)" not in said  # (the pair held its own)
    assert (reports["auto"]["reference_in"], reports["auto"]["fp32_twin"]["reference_in"]) == ("memory", "stream")
    assert reports["memory"]["fp32_twin"]["reference_in"] == "memory"
    assert "perturbation" in reports["auto"]["timings_s"]
    assert _judged(reports["auto"]) == _judged(reports["memory"])
    assert _judged(reports["auto"]["fp32_twin"]) == _judged(reports["memory"]["fp32_twin"])


def test_a_failing_streamed_check_without_disk_for_its_reference_again_is_not_localized(tmp_path, monkeypatch):
    """auto streamed the reference because held whole it would not fit the memory it may take: the
    replay's reference runs again on the disk, and where the disk has filled since the check was
    planned, the check is not localized, says why, and its verdict stands."""
    from ttrace_megatron import cli
    from ttrace_megatron import plan as core

    recipe = os.path.join(RECIPES, "gpt_tp2_sp.yaml")
    proc = subprocess.run([sys.executable, "-m", "ttrace_megatron.cli", "plan", recipe, "--json", "-", "--no-fp32-twin",
                           "--cpu"] + ["--reference-in", "stream"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    planned = json.loads(proc.stdout)
    held = max(s["total"] for s in planned["sides"] if s["name"] == "reference")
    checked = cli._check_disk

    def then_full(*args, **kwargs):  # the disk fills once the check is planned
        result = checked(*args, **kwargs)
        monkeypatch.setattr(core, "free_bytes", lambda path: 0)
        return result
    monkeypatch.setattr(cli, "_check_disk", then_full)
    path = tmp_path / "report.json"
    assert cli.main(["run", recipe, "--out", str(tmp_path / "out"), "--json", str(path), "--quiet", "--cpu",
                     "--no-fp32-twin", "--reference-memory", str((planned["memory_needed"] + held) // 2),
                     "--inject", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2"]) == 1
    report = json.loads(path.read_text())
    assert report["reference_in"] == "stream" and report["verdict"] == "fail" and not report.get("culprits")
    assert "only 0 B are free under" in report["not_localized"] and "reference again" not in report["timings_s"]


def test_the_default_check_streams_a_reference_of_a_gigabyte_or_more(tmp_path, capsys):
    """At the scale ladder's 50M rung (8 layers, hidden 512, vocabulary 32768: 4.0 GB held whole) the
    default check streams its reference where it would fit held, says why, and passes."""
    import yaml

    from ttrace_megatron import plan as core
    from ttrace_megatron.cli import main

    raw = yaml.safe_load(open(os.path.join(RECIPES, "gpt_tp2_sp.yaml")))
    raw["model"].update(num_layers=8, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4)
    raw["data"]["vocab_size"] = 32768
    recipe = tmp_path / "rung.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    if (core.memory_room() or 0) < 4.1e9:
        pytest.skip(f"no room in {core.MEMORY_ROOT} to hold this reference whole here")
    path = tmp_path / "report.json"
    assert main(["run", str(recipe), "--out", str(tmp_path / "out"), "--json", str(path), "--cpu"]) == 0
    said = capsys.readouterr().out
    assert "the reference streamed (--reference-in auto): held whole it would take about 4.0 GB, from 1 GiB on" \
        in " ".join(said.split())
    report = json.loads(path.read_text())
    assert report["reference_in"] == "stream" and report["verdict"] == "pass"


@pytest.mark.parametrize("flags,why", [
    (["--no-lockstep"], "lock-step"),
    (["--keep-traces"], "--keep-traces keeps"),
])
def test_a_streamed_reference_is_refused_where_it_cannot_be(tmp_path, capsys, flags, why):
    from ttrace_megatron.cli import main

    rc = main(["run", os.path.join(RECIPES, "gpt_tp2.yaml"), "--out", str(tmp_path / "out"), "--cpu",
               "--reference-in", "stream"] + flags)
    assert rc == 2
    err = capsys.readouterr().err
    assert "--reference-in stream" in err and why in err
    assert not (tmp_path / "out" / "candidate").exists()  # refused before anything ran


def test_a_candidate_that_fails_beside_a_streamed_reference_stops_it(tmp_path):
    """Started beside its reference, a candidate rank that fails stops the reference (which would
    otherwise wait for it to let iteration 1 go until its timeout); the error is the candidate's."""
    import time

    from ttrace_megatron.adapter.run.launch import launch_beside
    from ttrace_megatron.adapter.run.runner import CANDIDATE, REFERENCE, RunSpec, trace_options
    from ttrace_megatron.errors import RunFailed

    recipe, seed = load("gpt_tp2").to_json(), str(tmp_path / "seed.safetensors")
    ref_dir, cand_dir = str(tmp_path / "reference"), str(tmp_path / "candidate")
    reference = RunSpec(recipe=recipe, role=REFERENCE, cpu=True, trace=trace_options(
        ref_dir, seed, page_cache=True, stream_readers=2))
    candidate = RunSpec(recipe=recipe, role=CANDIDATE, cpu=True, inject=["no_such_bug"], await_reference=ref_dir,
                        trace=trace_options(cand_dir, seed, reference=ref_dir, keep_tensors=False, lockstep=ref_dir,
                                            streamed_reference=True))
    start = time.monotonic()
    with pytest.raises(RunFailed) as e:
        launch_beside(reference, candidate, timeout_s=300)
    assert time.monotonic() - start < 120
    assert "candidate rank" in str(e.value) and "no_such_bug" in str(e.value)
    assert "the reference run, started beside it, was stopped" in str(e.value)
