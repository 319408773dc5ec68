"""Online compare (each candidate rank judges its own shards during the run) gives the offline verdicts."""

import math
import os
import re

import pytest

from ttrace_megatron import keys
from ttrace_megatron.compare import compare_traces
from ttrace_megatron.online import combine_online

from conftest import load

pytestmark = pytest.mark.multiprocess


CAPACITY = {"moe_expert_capacity_factor": 1.0, "moe_token_drop_policy": "probs"}


def _both(runs, recipe, inject=()):
    ref = os.path.join(runs.reference(recipe), "reference")
    _, cand = runs.candidate(recipe, inject=inject, name="online", reference=ref, keep_tensors=True)
    return compare_traces(ref, cand), combine_online(cand)


@pytest.mark.parametrize("name,dtype,inject,model", [
    ("gpt_tp2", "fp32", (), {}),
    ("gpt_tp2_sp", "bf16", (), {}),
    ("gpt_tp4_sp", "fp32", (), {}),
    ("gpt_tp2_sp_dp2", "bf16", (), {}),
    ("gpt_tp2_sp", "fp32", ("row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2",), {}),
    ("gpt_tp2", "fp32", ("column_dgrad_allreduce_dropped:decoder.layers.1.self_attention.linear_qkv",), {}),
    ("gpt_tp2", "fp32", ("embedding_mask_missing",), {}),
    ("gpt_tp2_sp", "fp32", ("sp_norm_grad_not_reduced:decoder.layers.0.input_layernorm",), {}),
    # recomputed outputs: judged live against the reference's outputs (a KeyError before)
    ("gpt_tp2_recompute", "fp32", (), {}),
    # only the updated values show it (moments and settings right): judged element by element on
    # each rank's range of the distributed optimizer (skipped online before)
    ("gpt_dp2_distopt", "fp32", ("adam_step_doubled_on_rank_1",), {}),
    # routers' top-k choices judged by their scores on each rank's tokens (skipped online before):
    # bf16's near-ties over TP ranks' sequence shards; a choice that skips the best expert; an
    # expert's capacity, a top k of its column of tokens (each rank's microbatches)
    ("moe_tp2_sp_ep2", "bf16", (), {}),
    ("moe_tp2_sp_ep2", "bf16", ("router_topk_skips_best",), {}),
    ("moe_ep2", "fp32", ("capacity_keeps_least_probable",), CAPACITY),
    # EP over data-parallel ranks: no per-microbatch expert tensor is recorded (skipped, as offline)
    ("moe_ep2", "fp32", (), {}),
])
def test_online_verdicts_equal_offline(runs, name, dtype, inject, model):
    offline, online = _both(runs, load(name, dtype=dtype, model=model), inject)
    assert online.verdict == offline.verdict == ("fail" if inject else "pass")
    off = {r.key: r for r in offline.results}
    on = {r.key: r for r in online.results}
    # every offline key is judged online, except per-rank partial sums (listed as skipped); what the
    # layout cannot record (run.json's not_recorded: moe_ep2's per-microbatch expert tensors) is
    # skipped alike, not missing
    assert set(offline.skipped) <= set(online.skipped) and not online.missing_in_candidate
    partial = set(online.skipped) - set(offline.skipped)
    assert set(on) | partial == set(off) and not set(on) & partial
    # per-microbatch partial sums only (weight grads of SP replicas; an expert-TP layer's partial
    # outputs and input grads): (lock-step, Adam) updated values are judged element by element
    # online too, each rank over the elements it holds the moments of, and top-k choices by their scores
    partial_experts = ("forward", "output"), ("backward", "grad_input")
    assert all((k.phase == "backward" and k.tensor.endswith(".grad"))
               or (".experts." in k.module and (k.phase, k.tensor) in partial_experts) for k in partial)
    updated = [k for k in on if keys.is_updated_value(k)]
    assert updated and all(on[k].tolerance_source.startswith("Adam update, element-wise") for k in updated)
    if "sp" in name:
        assert any(k.phase == "backward" for k in online.skipped)
    choices = 0
    for key, a in on.items():
        b = off[key]
        assert a.verdict == b.verdict, key
        if keys.is_updated_value(key):  # error ÷ the worst element's ratio: the error's float64 vs float32 norms
            if a.verdict == "pass":
                assert a.tolerance_eps == pytest.approx(b.tolerance_eps, rel=1e-4), key
            else:  # replicas that differ: offline checks the lowest rank's copy, online every rank's
                assert a.tolerance_eps <= b.tolerance_eps * (1 + 1e-4), key
            continue
        if key.kind is keys.TensorKind.SELECTION:  # by its scores, the same rows flipped, the same worst tie
            prefix = "top-k choice judged by its scores: "
            assert a.tolerance_source.startswith(prefix) and b.tolerance_source.startswith(prefix), key
            assert _flipped(a.tolerance_source) == _flipped(b.tolerance_source), key
            assert a.reason.split(" on ")[0] == b.reason.split(" on ")[0], key  # (online: counted on one piece)
            assert a.tolerance_eps == pytest.approx(b.tolerance_eps, rel=1e-4), key
            choices += 1
            continue
        assert a.tolerance_eps == b.tolerance_eps
        if math.isfinite(b.error) and b.error > 0:
            # offline norms are float32 per 64 Ki-element chunk (relative_error: ~1e-5), online float64
            assert a.error == pytest.approx(b.error, rel=1e-4), key
        else:
            assert a.error == b.error or (math.isnan(a.error) and math.isnan(b.error)), key
    assert bool(choices) == name.startswith("moe")
    if inject:
        assert online.first_mismatch.key == offline.first_mismatch.key


def test_free_running_online_lists_what_diverged_as_offline(runs):
    """Without lock-step, after the first step the sides train different weights (Adam's ±lr on
    round-off grads): offline lists what comes after it as diverged, online too (it keeps no previous
    parameters, so later updates are listed as well); the first step's update is judged element by
    element from the seed checkpoint both started from."""
    recipe = load("gpt_tp2")
    ref = os.path.join(runs.reference(recipe), "reference")
    _, cand = runs.candidate(recipe, name="online-free", reference=ref, keep_tensors=True, lockstep=False)
    offline, online = compare_traces(ref, cand), combine_online(cand)
    assert online.verdict == offline.verdict == "pass"
    assert offline.diverged and set(offline.diverged) <= set(online.diverged)
    later_updates = set(online.diverged) - set(offline.diverged)
    assert all(keys.is_updated_value(k) and k.iteration > 1 for k in later_updates)
    assert {r.key for r in online.results} == {r.key for r in offline.results} - later_updates
    first = [r for r in online.results if keys.is_updated_value(r.key)]
    assert first and all(r.key.iteration == 1 and "not in lock-step, first iteration" in r.tolerance_source
                         for r in first)


def _flipped(source):
    """How many rows a choice's judgement says were chosen differently (0: the same choice)."""
    match = re.search(r"(\d+) of \d+ (?:token|column)s chose differently", source)
    return int(match.group(1)) if match else 0


def test_the_perturbation_estimate_online_widens_the_tolerances_as_offline(runs):
    """bf16's perturbation run compares online too (its movements as sums, no tensors written), and
    the online verdict takes the same perturbation-widened tolerances as the offline one."""
    from ttrace_megatron.adapter.run.launch import launch
    from ttrace_megatron.adapter.run.runner import REFERENCE, RunSpec, trace_options
    from ttrace_megatron.compare import compare_traces

    recipe = load("gpt_tp2_sp", dtype="bf16")
    out = runs.reference(recipe)
    ref = os.path.join(out, "reference")
    _, cand = runs.candidate(recipe, name="online", reference=ref, keep_tensors=True)
    online_pert = os.path.join(out, "reference-perturbed-online")
    launch(RunSpec(recipe=recipe.to_json(), role=REFERENCE, trace=trace_options(
        online_pert, os.path.join(out, "seed.safetensors"), perturb=1, lockstep=ref, reference=ref)), timeout_s=300)
    assert not [f for _, _, fs in os.walk(online_pert) for f in fs if f.endswith(".safetensors")]
    offline = compare_traces(ref, cand, perturbed=runs.perturbed(recipe))
    online = combine_online(cand, perturbed=online_pert)
    assert online.verdict == offline.verdict == "pass"
    off = {r.key: r for r in offline.results}
    for r in online.results:
        assert r.tolerance_eps == pytest.approx(off[r.key].tolerance_eps, rel=1e-3), r.key
    # the same tensors take the perturbation's term (none would, without the online perturbation run)
    judged = {r.key for r in online.results}
    on_observed = {r.key for r in online.results if "perturbation observed" in r.tolerance_source}
    off_observed = {r.key for r in offline.results if "perturbation observed" in r.tolerance_source and r.key in judged}
    assert on_observed and on_observed == off_observed
    assert all("perturbation observed" not in r.tolerance_source for r in combine_online(cand).results)


def test_online_only_writes_no_tensors(runs):
    recipe = load("gpt_tp2_sp")
    ref = os.path.join(runs.reference(recipe), "reference")
    _, cand = runs.candidate(recipe, name="online-only", reference=ref, keep_tensors=False)
    files = [f for _, _, fs in os.walk(cand) for f in fs]
    assert not [f for f in files if f.endswith(".safetensors")], files
    assert sorted(f for f in files if f == "online.json") == ["online.json"] * recipe.world_size
    assert combine_online(cand).verdict == "pass"


def test_combining_online_reads_no_reference_moments(runs, monkeypatch):
    """After the run, a moment's cancellation factor is its main grad's: combining reads the
    reference's main grads added up from SP replicas' partial sums (their norms), not the moments
    stepped with them, and every tolerance is the one it gave when it read both."""
    from ttrace_megatron import compare, online

    recipe = load("gpt_tp2_sp")
    ref = os.path.join(runs.reference(recipe), "reference")
    _, cand = runs.candidate(recipe, name="online-reads", reference=ref, keep_tensors=False)
    with monkeypatch.context() as m:  # as before: every key whose factor may exceed 1 read whole
        m.setattr(compare.Cancellation, "reads_reference", compare.Cancellation.needs_reference)
        before = {r.key: r for r in combine_online(cand).results}
    read = []
    real = online.logical_tensor

    def logged(reader, pieces):
        read.append(pieces[0][1].key)
        return real(reader, pieces)
    monkeypatch.setattr(online, "logical_tensor", logged)
    combined = combine_online(cand)
    kinds = {k.kind for k in read}
    assert keys.TensorKind.MAIN_GRAD in kinds and keys.TensorKind.OPTIMIZER_STATE not in kinds, sorted(map(str, read))
    stepped = {(k.iteration, k.module) for k in read if k.kind is keys.TensorKind.MAIN_GRAD}
    moments = [r for r in combined.results
               if r.key.kind is keys.TensorKind.OPTIMIZER_STATE and (r.key.iteration, r.key.module) in stepped]
    assert moments and any("terms cancel" in r.tolerance_source for r in moments)
    assert combined.verdict == "pass" and set(before) == {r.key for r in combined.results}
    for r in combined.results:
        assert (r.tolerance_eps, r.tolerance_source, r.error) == (
            before[r.key].tolerance_eps, before[r.key].tolerance_source, before[r.key].error), r.key


def test_cli_run_online(tmp_path):
    import json

    from ttrace_megatron.cli import main

    assert main(["run", os.path.join(os.path.dirname(__file__), "..", "recipes", "gpt_tp2.yaml"), "--online",
                 "--out", str(tmp_path / "clean"), "--json", str(tmp_path / "clean.json")]) == 0
    assert main(["run", "--online", "--out", str(tmp_path / "bug"), "--json", str(tmp_path / "bug.json"),
                 "--inject", "row_allreduce_dropped:decoder.layers.0.mlp.linear_fc2"]) == 1
    with open(tmp_path / "bug.json") as f:
        first = json.load(f)["first_mismatch"]
    assert (first["module"], first["phase"], first["tensor"]) == ("decoder.layers.0.mlp.linear_fc2", "forward", "output")
    # localized as the recorded check localizes it: the replay needs the reference's trace only
    with open(tmp_path / "bug.json") as f:
        culprit = json.load(f)["culprits"][0]
    assert (culprit["module"], culprit["phase"]) == ("decoder.layers.0.mlp.linear_fc2", "forward")
    # the check held its reference in memory where it fits, and moved the failing check's under --out: the
    # candidate's report finds it beside it, by the run id it judged against
    assert main(["report", str(tmp_path / "bug" / "candidate")]) == 1
    from ttrace_megatron.errors import TraceError
    from ttrace_megatron.online import online_reference_of

    run = json.loads((tmp_path / "bug" / "candidate" / "run.json").read_text())
    assert run["online_reference_id"]
    assert online_reference_of(str(tmp_path / "bug" / "candidate"), dict(run, online_reference=str(tmp_path / "gone"))) \
        == os.path.join(str(tmp_path / "bug"), "reference")
    with pytest.raises(TraceError, match="is gone"):  # a passing check's: removed once judged (its report.json stays)
        online_reference_of(str(tmp_path / "bug" / "candidate"), dict(run, online_reference=str(tmp_path / "gone"),
                                                                      online_reference_id="another"))


def test_a_steps_moments_are_given_back_once_its_values_are_judged(tmp_path):
    """An online rank holds a parameter's moments only until every updated value the reference
    recorded of its step is judged (here: the value, then its two moments, the recorder's order),
    not until the iteration's flush: the next parameter's step reads into the same buffers."""
    import torch

    from ttrace_megatron import keys
    from ttrace_megatron.keys import TensorKey
    from ttrace_megatron.online import OnlineComparer
    from ttrace_megatron.placement import Layout, Replicate
    from ttrace_megatron.trace_store import TraceWriter, write_run_info

    rule = {"kind": "adam", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    write_run_info(str(tmp_path / "ref"), {"role": "reference", "world_size": 1, "num_layers": 2,
                                           "model_config": {"model": {"hidden_size": 8}}, "update_rule": rule})
    write_run_info(str(tmp_path / "cand"), {"role": "candidate", "world_size": 1, "num_layers": 2,
                                            "model_config": {"model": {"hidden_size": 8}}, "update_rule": rule,
                                            "online_reference": str(tmp_path / "ref")})
    layout = Layout((Replicate("tp"),), (64, 64))
    params = ("decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc1")
    names = (keys.updated_param("weight"), keys.optimizer_state("weight", keys.EXP_AVG),
             keys.optimizer_state("weight", keys.EXP_AVG_SQ))
    order = [TensorKey(1, -1, module, keys.OPTIMIZER, name) for module in params for name in names]
    writer = TraceWriter(str(tmp_path / "ref"), 0, {"tp": (0, 1)})
    for key in order:
        writer.add(key, torch.rand(64, 64), layout)
    writer.flush(1)
    writer.close()
    comparer = OnlineComparer(str(tmp_path / "ref"), str(tmp_path / "cand"), 0, {"tp": (0, 1)}, lockstep=True)
    held = []
    for key in order:
        comparer.add(key, torch.rand(64, 64), layout)
        held.append(len(comparer._steps))
    # after a value and one moment the step waits; after its second moment it is judged and given back
    assert held == [1, 1, 0, 1, 1, 0]
    assert all(e.update_detail for e in comparer.entries if keys.is_updated_value(e.key))  # (judged: no lr here)
    comparer.flush(1)
    comparer.close()
