"""Traces that travel (issue #38): a moved, copied or archived pair gives the same verdict."""

import json
import os
import shutil
import tarfile

import pytest

from conftest import load
from ttrace_megatron.compare import compare_traces
from ttrace_megatron.report import to_json

WHERE = ("reference", "candidate")  # the report names the directories it read


def _without_paths(report):
    return json.dumps({k: v for k, v in report.items() if k not in WHERE}, sort_keys=True)


@pytest.mark.multiprocess
def test_a_moved_copied_or_archived_pair_gives_the_same_report(runs, tmp_path):
    """The candidate names its lock-step reference by the reference's run_id, not its path: a pair
    copied or archived elsewhere is judged as before, its Adam updates element by element."""
    ref, cand = runs.candidate(load("gpt_tp2"))
    before = to_json(compare_traces(ref, cand))
    assert before["lockstep"] is None and before["verdict"] == "pass"
    assert any(t["tolerance_source"].startswith("Adam update") for t in before["tensors"])
    copied = tmp_path / "copied"
    shutil.copytree(os.path.dirname(ref), copied)
    with tarfile.open(tmp_path / "pair.tar", "w") as tar:
        tar.add(copied, arcname="pair")
    with tarfile.open(tmp_path / "pair.tar") as tar:
        tar.extractall(tmp_path / "untarred", filter="data")
    moved = tmp_path / "moved"
    shutil.move(str(tmp_path / "untarred" / "pair"), moved)
    for root in (copied, moved):
        after = to_json(compare_traces(str(root / "reference"), str(root / os.path.basename(cand))))
        assert _without_paths(after) == _without_paths(before)


@pytest.mark.multiprocess
def test_a_reference_that_is_not_the_lockstep_partner_is_said_so(runs, tmp_path):
    """A reference run again (same recipe, another run_id) is not the run the candidate stepped with:
    the report says so; the updates are judged element by element from each side's own previous
    parameters, what the diverged weights compute after the first step is listed as not judged, and
    the clean pair passes."""
    ref, cand = runs.candidate(load("gpt_tp2"))
    again = tmp_path / "reference"
    shutil.copytree(ref, again)
    run = json.loads((again / "run.json").read_text())
    (again / "run.json").write_text(json.dumps(dict(run, run_id="another-run")))
    report = to_json(compare_traces(str(again), cand))
    assert report["lockstep"] and "not in lock-step with this reference" in report["lockstep"]
    assert report["verdict"] == "pass"
    updates = [t for t in report["tensors"] if t["tolerance_source"].startswith("Adam update")]
    # the candidate stepped from its partner's weights, which this comparison does not have: only
    # the first step, from the seed checkpoint both started from, is judged
    assert updates and all("not in lock-step, first iteration" in t["tolerance_source"] for t in updates)
    assert {t["iteration"] for t in updates} == {1}
    assert report["diverged"]["tensors"] and all(not t.startswith("it1 ") for t in report["diverged"]["tensors"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["gpt_tp2", "gpt_tp2_sp_dp2", "moe_tp2_sp_ep2"])
def test_a_free_running_candidate_never_false_alarms(runs, name):
    """Without lock-step (ttrace run --no-lockstep) a clean pair passes: the first iteration judged
    whole, every update element by element, the rest listed as not judged with why."""
    ref, cand = runs.candidate(load(name), lockstep=False)
    report = to_json(compare_traces(ref, cand))
    assert report["verdict"] == "pass", report["first_mismatch"]
    assert report["diverged"] and report["lockstep"] is None
    updates = {t["iteration"] for t in report["tensors"] if t["tolerance_source"].startswith("Adam update")}
    assert updates == {1, 2, 3}  # each step judged from each side's own previous parameter


@pytest.mark.multiprocess
def test_a_free_running_candidate_recorded_from_its_second_iteration_never_false_alarms(runs):
    """Recording only iterations 2 and 3 of a free-running candidate: no judged step starts from the
    seed checkpoint, and an update whose previous parameter was not recorded is listed as not
    judged, not judged by a bound that cannot hold for it."""
    ref, cand = runs.candidate(load("gpt_tp2"), lockstep=False, name="from-it2", iterations=[2, 3])
    report = to_json(compare_traces(ref, cand))
    assert report["verdict"] == "pass", report["first_mismatch"]
    updates = {(t["iteration"], t["tensor"]) for t in report["tensors"] if t["tolerance_source"].startswith("Adam")}
    assert updates and {i for i, _ in updates} == {3}  # from iteration 2's recorded parameters
    assert any(t.startswith("it2 ") and "[optimizer] " in t for t in report["diverged"]["tensors"])


@pytest.mark.multiprocess
def test_a_nan_the_candidate_computes_is_a_fail_naming_the_first_tensor_that_holds_it(tmp_path):
    """A NaN produced by the candidate's own computation on one rank (not a synthetic trace): a FAIL,
    not an error, whose first mismatch is the tensor that first holds it, on the rank that holds it,
    even where the merge would take another rank's (finite) copy; the replay names its module."""
    from conftest import RECIPES
    from ttrace_megatron.cli import main

    rc = main(["run", os.path.join(RECIPES, "gpt_tp2.yaml"), "--quiet", "--json", str(tmp_path / "r.json"),
               "--inject", "nonfinite_output_on_rank_1:decoder.layers.1.mlp.linear_fc2"])
    report = json.loads((tmp_path / "r.json").read_text())
    assert (rc, report["verdict"]) == (1, "fail")
    first = report["first_mismatch"]
    assert (first["module"], first["phase"], first["tensor"], first["iteration"]) == \
        ("decoder.layers.1.mlp.linear_fc2", "forward", "output", 1)
    assert first["error_eps"] == "inf"
    assert "the candidate's copy on rank(s) [1] holds 1 NaN/Inf" in first["reason"]
    assert report["culprits"][0]["module"] == "decoder.layers.1.mlp.linear_fc2"


@pytest.mark.multiprocess
def test_sides_of_different_megatron_core_versions_are_said_so(runs, tmp_path, capsys):
    """A pair whose sides ran different megatron-core releases (a release check, which is allowed)
    is judged, and the report says the versions differ, in the JSON and on the terminal."""
    from ttrace_megatron.cli import main

    ref, cand = runs.candidate(load("gpt_tp2"))
    pair = tmp_path / "pair"
    shutil.copytree(os.path.dirname(ref), pair)
    cand_dir = pair / os.path.basename(cand)
    run = json.loads((cand_dir / "run.json").read_text())
    run["versions"]["megatron.core"] = "0.19.2"
    (cand_dir / "run.json").write_text(json.dumps(run))
    assert main(["compare", str(pair / "reference"), str(cand_dir), "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert any("megatron.core" in d and "0.19.2" in d for d in report["versions_differ"])
    assert "the two sides ran different library versions" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_a_rank_hung_in_a_collective_is_shown_where_it_waits(tmp_path):
    """A candidate rank that stops answering (SIGSTOP) leaves its partner blocked in a collective:
    past the timeout, the blocked rank is shown with its frames (waiting in a collective) and the
    stopped one is named as not answering."""
    import signal
    import time

    from conftest import error_dirs, launch_in_thread, rank_pid
    from ttrace_megatron.adapter.run.launch import launch
    from ttrace_megatron.adapter.run.runner import CANDIDATE, REFERENCE, RunSpec, trace_options

    seed = str(tmp_path / "seed.safetensors")
    launch(RunSpec(recipe=load("gpt_tp2", train={"iterations": 1}).to_json(), role=REFERENCE,
                   trace=trace_options(str(tmp_path / "ref"), seed)), timeout_s=300)
    before = error_dirs()
    spec = RunSpec(recipe=load("gpt_tp2", train={"iterations": 100000}).to_json(), role=CANDIDATE,
                   trace=trace_options(str(tmp_path / "cand"), seed, iterations=[1]))
    thread, outcome = launch_in_thread(spec, timeout_s=25)
    pid, deadline = None, time.monotonic() + 20
    while pid is None and time.monotonic() < deadline:
        time.sleep(0.5)
        pid = rank_pid(before, tmp_path / "cand", 1)
    assert pid is not None
    time.sleep(3.0)  # a few iterations in
    os.kill(pid, signal.SIGSTOP)
    thread.join(120)
    message = outcome["error"]
    assert "did not finish within 25 s; where its ranks were" in message
    assert "--- candidate rank 1: no stack (it did not answer SIGUSR1) ---" in message
    blocked = message.split("--- candidate rank 0, innermost frame first ---", 1)[1].split("---", 1)[0]
    # the training thread's innermost frame: a collective of torch.distributed, or megatron's wait on one
    # (tensor_parallel/layers.py's handle.wait() of the dgrad all-reduce, mappings' all-reduces)
    innermost = blocked.split("Current thread", 1)[1].split("File ", 2)[1]
    assert any(where in innermost for where in ("torch/distributed", "tensor_parallel/")), blocked
