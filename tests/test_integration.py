"""The training-loop API as Megatron-LM uses it: argparse provider, install(), the patch.

The end-to-end tests drive ``tests/mini_megatron_lm`` (a stand-in for ``megatron/training`` with
its call structure, over real megatron-core) with torchrun, as a user would launch pretrain_gpt.py.
The real Megatron-LM loop is tested in ``tests/test_megatron_lm.py`` when a checkout is given
(``MEGATRON_LM_DIR``); the stand-in stays for what CI must check without one (CI cannot reach
GitHub): the ``--ttrace*`` flags through torchrun, the online compare, bitwise neutrality with and
without ``--ttrace``, refusals before training, replay and lock-step under the Megatron-LM call
structure.
The explicit calls (attach / begin_iteration / end_iteration / flush) are what every recipe run
in the other tests goes through (``adapter/run/runner.py``).
"""

import argparse
import os
import socket
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

import ttrace_megatron as ttrace
from ttrace_megatron.adapter.megatron_lm.arguments import parse_int_ranges
from ttrace_megatron.adapter.run.session import TraceOptions
from ttrace_megatron.compare import compare_traces
from ttrace_megatron.online import combine_online

from conftest import REPO

DRIVER = os.path.join(REPO, "tests", "mini_megatron_lm", "pretrain_gpt.py")


def test_extra_args_provider_chains_and_parses():
    def modelopt(parser):
        parser.add_argument("--export-quant-cfg")
        return parser

    parser = ttrace.extra_args_provider(modelopt)(argparse.ArgumentParser())
    args = parser.parse_args(["--export-quant-cfg", "fp8", "--ttrace", "--ttrace-dir", "t", "--ttrace-iters", "1,3-4",
                              "--ttrace-modules", "decoder.layers.1.*", "--ttrace-modules", "output_layer",
                              "--ttrace-ranks", "0-1", "--ttrace-microbatches", "0",
                              "--ttrace-reference", "ref", "--ttrace-seed-checkpoint", "seed.st"])
    assert args.export_quant_cfg == "fp8"
    opts = TraceOptions.from_args(args)
    assert opts == TraceOptions(enabled=True, dir="t", iterations=[1, 3, 4], modules=("decoder.layers.1.*", "output_layer"),
                                ranks=[0, 1], microbatches=[0], reference="ref", seed_checkpoint="seed.st")
    assert not opts.write_tensors  # online compare writes verdicts only
    off = TraceOptions.from_args(ttrace.extra_args_provider(argparse.ArgumentParser()).parse_args([]))
    assert not off.enabled and off.write_tensors
    # what `ttrace run --megatron-lm` gives a side comes back whole from its flags
    from ttrace_megatron.adapter.megatron_lm.checkout import trace_args

    side = TraceOptions(enabled=True, dir="cand", reference="ref", lockstep="ref", page_cache=True, map_reference=True)
    back = TraceOptions.from_args(ttrace.extra_args_provider(argparse.ArgumentParser()).parse_args(trace_args(side)))
    assert back == side
    with pytest.raises(argparse.ArgumentTypeError):
        parse_int_ranges("1,x")


def test_everything_is_a_no_op_without_ttrace():
    args = ttrace.extra_args_provider(None)(argparse.ArgumentParser()).parse_args([])
    sentinel = object()
    assert ttrace.attach(sentinel, sentinel, sentinel, args=args) is None
    ttrace.begin_iteration(1)
    ttrace.end_iteration(1, {}, 0.0, False)
    ttrace.flush()


def test_install_wraps_by_name_and_passes_results_through():
    calls = []
    training = types.ModuleType("fake_training")
    training.setup_model_and_optimizer = lambda *a, **k: calls.append("setup") or ("model", "optimizer", "sched")
    training.train_step = lambda *a, iteration=None: calls.append(("step", iteration)) or ("loss", False)
    original_step = training.train_step
    ttrace.install(training)
    ttrace.install(training)  # idempotent
    assert training.train_step is not original_step
    # --ttrace off (no parsed arguments): attach is not reached, results pass through unchanged
    assert training.train_step(1, 2, iteration=4) == ("loss", False)
    assert calls == [("step", 4)]


# ---- a Megatron-LM-style training script under torchrun

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc, *args, cwd, expect_ok=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), DRIVER, *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert (proc.returncode == 0) == expect_ok, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


CANDIDATE = ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16")


@pytest.fixture(scope="module")
def megatron_lm_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlm")
    seed = ("--ttrace-seed-checkpoint", "seed.safetensors")
    _torchrun(1, "--bf16", "--ttrace", "--ttrace-dir", "ref", *seed, cwd=d)
    _torchrun(2, *CANDIDATE, "--ttrace", "--ttrace-dir", "cand", *seed, "--losses-out", "traced", cwd=d)
    _torchrun(2, *CANDIDATE, "--ttrace", "--ttrace-dir", "online", "--ttrace-reference", "ref", *seed, cwd=d)
    return str(d)


@pytest.mark.multiprocess
def test_megatron_lm_candidate_matches_reference(megatron_lm_runs):
    c = compare_traces(os.path.join(megatron_lm_runs, "ref"), os.path.join(megatron_lm_runs, "cand"))
    assert c.verdict == "pass", c.first_mismatch
    assert {r.key.phase for r in c.results} == {"forward", "backward", "main_grad", "optimizer"}
    assert {r.key.iteration for r in c.results} == {1, 2}
    assert c.candidate_run["role"] == "candidate" and c.reference_run["role"] == "reference"


@pytest.mark.multiprocess
def test_megatron_lm_online_compare(megatron_lm_runs):
    online = os.path.join(megatron_lm_runs, "online")
    assert not [f for _, _, fs in os.walk(online) for f in fs if f.endswith(".safetensors")]
    c = combine_online(online)
    assert c.verdict == "pass" and len(c.results) > 100


@pytest.mark.multiprocess
def test_megatron_lm_tracing_is_neutral_and_off_by_default(megatron_lm_runs, tmp_path):
    # the same candidate without --ttrace (but from the same seed checkpoint, loaded by a traced
    # run with nothing recorded: --ttrace-iters 0) and then fully without ttrace
    _torchrun(2, *CANDIDATE, "--ttrace", "--ttrace-iters", "0", "--ttrace-dir", "quiet",
              "--ttrace-seed-checkpoint", os.path.join(megatron_lm_runs, "seed.safetensors"),
              "--losses-out", "untraced", cwd=tmp_path)
    for rank in range(2):
        a = load_file(os.path.join(megatron_lm_runs, f"traced-rank{rank}.safetensors"))
        b = load_file(os.path.join(tmp_path, f"untraced-rank{rank}.safetensors"))
        assert a.keys() == b.keys() and len(a) > 10
        for k in a:
            assert torch.equal(a[k], b[k]), k
    _torchrun(2, *CANDIDATE, "--ttrace-dir", "never", cwd=tmp_path)
    assert not os.path.exists(os.path.join(tmp_path, "never"))


@pytest.mark.multiprocess
def test_megatron_lm_unsupported_mode_is_refused_before_training(tmp_path):
    proc = _torchrun(1, "--ttrace", "--ttrace-replay", "ref", "--ttrace-reference", "ref", cwd=tmp_path,
                     expect_ok=False)
    assert "ttrace cannot trace this run yet: --ttrace-replay with --ttrace-reference" in proc.stderr + proc.stdout


def test_unsupported_modes_are_named():
    from ttrace_megatron.adapter.run.session import _refuse_unsupported
    from ttrace_megatron.errors import RecipeError

    config = types.SimpleNamespace(num_moe_experts=4, fp8=None, recompute_granularity="full")
    sizes = {"tp": 2, "pp": 2, "cp": 2, "ep": 1, "dp": 2}
    two_chunks = [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)]
    with pytest.raises(RecipeError) as e:
        _refuse_unsupported(config, sizes, two_chunks, TraceOptions(enabled=True, perturb=1))
    for what in ("CP=2", "--ttrace-perturb with activation recomputation"):
        assert what in str(e.value)
    # recomputation itself is traced (a dense model, no perturbation run)
    _refuse_unsupported(types.SimpleNamespace(num_moe_experts=None, fp8=None, recompute_granularity="full"),
                        dict(sizes, cp=1), [torch.nn.Linear(1, 1)], TraceOptions(enabled=True))
    plain = types.SimpleNamespace(num_moe_experts=None, fp8=None, recompute_granularity=None)
    _refuse_unsupported(plain, dict(sizes, cp=1), [torch.nn.Linear(1, 1)], TraceOptions(enabled=True))


def test_fp32_check_with_tf32_gemms_is_refused_on_the_gpu_only():
    """TF32 GEMMs amplify fp32 round-off 20-65× per GEMM (measured on an H200): an fp32 check refuses
    them, naming the switch; a bf16 run, a CPU run and NVIDIA_TF32_OVERRIDE=0 are not refused.

    The switch is set and restored by hand: torch serves ``allow_tf32`` through its module's
    ``__getattr__``, which pytest ≥ 9.2's monkeypatch takes for a missing attribute and deletes on undo."""
    from ttrace_megatron.adapter.run import session

    fp32, bf16 = types.SimpleNamespace(bf16=False, fp16=False), types.SimpleNamespace(bf16=True, fp16=False)
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = True
        assert "TF32" in session.tf32_refusal(fp32, "cuda", environ={})
        assert "NVIDIA_TF32_OVERRIDE=0" in session.tf32_refusal(fp32, "cuda", environ={})
        assert session.tf32_refusal(fp32, "cuda", environ={"NVIDIA_TF32_OVERRIDE": "0"}) == ""
        assert session.tf32_refusal(bf16, "cuda", environ={}) == ""
        assert session.tf32_refusal(fp32, "cpu", environ={}) == ""
        matmul.allow_tf32 = False
        if getattr(matmul, "fp32_precision", None) != "tf32":
            assert session.tf32_refusal(fp32, "cuda", environ={}) == ""
    finally:
        matmul.allow_tf32 = before


@pytest.mark.multiprocess
def test_megatron_lm_replay_localizes_nothing_on_a_clean_run(megatron_lm_runs, tmp_path):
    from ttrace_megatron.compare import localize

    ref = os.path.join(megatron_lm_runs, "ref")
    _torchrun(2, *CANDIDATE, "--ttrace", "--ttrace-dir", "replay", "--ttrace-replay", ref, "--ttrace-iters", "1",
              "--ttrace-seed-checkpoint", os.path.join(megatron_lm_runs, "seed.safetensors"), cwd=tmp_path)
    loc = localize(ref, str(tmp_path / "replay"))
    assert loc.comparison.verdict == "pass" and not loc.culprits
    assert loc.comparison.candidate_run["role"] == "replay"
    assert any(r.tolerance_source.startswith("local") for r in loc.comparison.results)


@pytest.mark.multiprocess
def test_megatron_lm_lockstep_with_adam(tmp_path):
    """`--ttrace-lockstep REF` through Megatron-LM's loop: with Adam the candidate takes the
    reference's weights and moments after each step, and its updated parameters are judged
    element by element: the clean run passes."""
    seed = ("--ttrace-seed-checkpoint", "seed.safetensors")
    adam = ("--optimizer", "adam", "--lr", "1e-3")
    _torchrun(1, "--bf16", *adam, "--ttrace", "--ttrace-dir", "ref", *seed, cwd=tmp_path)
    _torchrun(2, *CANDIDATE, *adam, "--ttrace", "--ttrace-dir", "cand", *seed, "--ttrace-lockstep", "ref",
              cwd=tmp_path)
    c = compare_traces(str(tmp_path / "ref"), str(tmp_path / "cand"))
    assert c.verdict == "pass", c.first_mismatch
    updated = [r for r in c.results if r.key.kind.name == "PARAM"]
    assert updated and all(r.tolerance_source.startswith("Adam update, element-wise") for r in updated)


def _flat_keys(obj, prefix=""):
    if isinstance(obj, dict):
        return {k for key, v in obj.items() for k in _flat_keys(v, f"{prefix}{key}.")}
    return {prefix[:-1]}


@pytest.mark.multiprocess
def test_megatron_lm_and_ttrace_run_write_one_model_signature(megatron_lm_runs, runs):
    """`pretrain_gpt.py --ttrace` and `ttrace run` describe the model with one function: the same
    fields, so their traces can be checked against each other (the data must then agree too)."""
    import json

    from conftest import load

    with open(os.path.join(megatron_lm_runs, "ref", "run.json")) as f:
        mlm = json.load(f)["model_config"]
    with open(os.path.join(runs.reference(load("gpt_tp2_sp", dtype="bf16")), "reference", "run.json")) as f:
        ours = json.load(f)["model_config"]
    assert _flat_keys(mlm) == _flat_keys(ours)
    assert mlm["model"]["bf16"] is True and ours["model"]["bf16"] is True
    assert {"seed", "seq_length", "micro_batch_size", "global_batch_size", "iterations"} <= set(mlm["training"])


@pytest.mark.multiprocess
def test_a_rank_past_its_timeout_is_shown_where_it_was(tmp_path):
    """A run that outlives its timeout names each rank still running and the innermost frames of
    its threads (each rank dumps them on SIGUSR1 before it is killed), not just "did not finish"."""
    from conftest import load
    from ttrace_megatron.adapter.run.launch import launch
    from ttrace_megatron.adapter.run.runner import REFERENCE, RunSpec, trace_options
    from ttrace_megatron.errors import RunFailed

    spec = RunSpec(recipe=load("gpt_tp2", train={"iterations": 1000}).to_json(), role=REFERENCE,
                   trace=trace_options(str(tmp_path / "ref"), str(tmp_path / "seed.safetensors")))
    with pytest.raises(RunFailed) as e:
        launch(spec, timeout_s=3.0)
    message = str(e.value)
    assert "did not finish within 3 s; where its ranks were" in message
    assert "--- reference rank 0, innermost frame first ---" in message
    assert 'File "' in message and "line" in message


@pytest.mark.multiprocess
def test_a_killed_rank_is_named_with_its_signal_and_position(tmp_path):
    """A rank killed mid-run (SIGKILL, as the OOM killer does) is named: side, rank, signal, and the
    last whole iteration its trace reached (issue #38)."""
    import signal
    import time

    from conftest import error_dirs, launch_in_thread, load, rank_pid
    from ttrace_megatron.adapter.run.runner import REFERENCE, RunSpec, trace_options

    before = error_dirs()
    spec = RunSpec(recipe=load("gpt_tp2", train={"iterations": 1000}).to_json(), role=REFERENCE,
                   trace=trace_options(str(tmp_path / "ref"), str(tmp_path / "seed.safetensors")))
    thread, outcome = launch_in_thread(spec, timeout_s=300)
    manifest = tmp_path / "ref" / "rank-00000" / "manifest.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (manifest.exists() and "iter-000002" in manifest.read_text()):
        time.sleep(0.2)
    pid = rank_pid(before, tmp_path / "ref", 0)
    os.kill(pid, signal.SIGKILL)
    thread.join(120)
    message = outcome["error"]
    assert "--- reference rank 0 was killed by SIGKILL" in message
    assert "its trace reached iteration" in message and "the last whole one" in message
