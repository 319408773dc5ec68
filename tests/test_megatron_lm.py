"""``ttrace run --megatron-lm``: Megatron-LM's own ``pretrain_gpt.py`` and training loop, end to end.

The recipe's translation to Megatron-LM's flags and the patches are checked everywhere. The real
runs need a Megatron-LM checkout (``MEGATRON_LM_DIR``, at ``core_v0.16.1`` or ``core_v0.19.0``;
CI has no GitHub, so they are skipped there with the reason) and Megatron-LM's own dependencies
beyond megatron-core (triton, pybind11 for its dataset helpers). On CPU they run with gloo and
``cuda_shim.MEGATRON_LM_SHIMS``.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from ttrace_megatron.adapter.megatron_lm import checkout as megatron_lm
from ttrace_megatron.errors import RecipeError
from ttrace_megatron.recipe import load_recipe

from conftest import RECIPES, REPO

CHECKOUT = os.environ.get("MEGATRON_LM_DIR")
needs_checkout = pytest.mark.skipif(not CHECKOUT, reason="set MEGATRON_LM_DIR to a Megatron-LM checkout (tag "
                                                         "core_v0.16.1 or core_v0.19.0) to run the real training loop")


def _recipe(name):
    return load_recipe(os.path.join(RECIPES, name + ".yaml"))


def test_recipe_translates_to_megatron_lm_flags():
    argv = megatron_lm.training_args(_recipe("gpt_tp2_sp"), "candidate", _recipe("gpt_tp2_sp").parallel,
                                      release="0.16.1")
    text = " ".join(argv)
    for flag in ("--num-layers 2", "--hidden-size 64", "--group-query-attention --num-query-groups 2",
                 "--normalization RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type rope",
                 "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size 2", "--sequence-parallel",
                 "--optimizer adam", "--lr 0.001", "--seed 1234", "--seq-length 32", "--micro-batch-size 2",
                 "--global-batch-size 4", "--train-iters 3", "--mock-data", "--vocab-size 249",
                 "--transformer-impl local", "--hidden-dropout 0", "--attention-dropout 0", "--ttrace-role candidate"):
        assert flag in text, flag
    reference = " ".join(megatron_lm.training_args(_recipe("gpt_tp2_sp"), "reference", {}, release="0.16.1"))
    assert "--tensor-model-parallel-size" not in reference and "--sequence-parallel" not in reference
    # the recipe's 250 tokens, EOD included: NullTokenizer's --vocab-size 249 through 0.17, 250 from 0.18
    assert "--vocab-size 250" in " ".join(megatron_lm.training_args(_recipe("gpt_tp2"), "reference", {},
                                                                     release="0.18.0"))
    tied = " ".join(megatron_lm.training_args(_recipe("gpt_pp2"), "candidate", _recipe("gpt_pp2").parallel,
                                               release="0.19.1"))
    assert "--untie-embeddings-and-output-weights" not in tied and "--pipeline-model-parallel-size 2" in tied


@pytest.mark.parametrize("section,key,value", [
    ("model", "softmax_type", "learnable"), ("parallel", "virtual_pipeline_model_parallel_size", 2),
    ("optimizer", "weight_decay", 0.1), ("model", "activation_func", "squared_relu"),
])
def test_fields_without_a_translation_are_refused_by_name(section, key, value):
    recipe = _recipe("gpt_tp2")
    getattr(recipe, section)[key] = value
    with pytest.raises(RecipeError, match=f"--megatron-lm: .*'{key}'|--megatron-lm: {key}"):
        megatron_lm.training_args(recipe, "candidate", recipe.parallel, release="0.16.1")


def test_moe_and_mtp_translate_to_megatron_lm_flags():
    recipe = _recipe("deepseek_tp2_sp_ep2")
    text = " ".join(megatron_lm.training_args(recipe, "candidate", recipe.parallel, release="0.16.1"))
    for flag in ("--num-experts 16", "--moe-router-topk 4", "--moe-ffn-hidden-size 16", "--moe-layer-freq [0,1,1]",
                 "--moe-shared-expert-intermediate-size 32", "--moe-router-score-function sigmoid",
                 "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor 2.5", "--moe-router-dtype fp32",
                 "--moe-router-load-balancing-type seq_aux_loss", "--moe-token-dispatcher-type alltoall",
                 "--mtp-num-layers 1", "--mtp-loss-scaling-factor 0.3", "--expert-model-parallel-size 2",
                 "--expert-tensor-parallel-size 1"):
        assert flag in text, flag


def test_missing_training_imports_are_named_up_front(tmp_path, monkeypatch):
    import importlib.util

    for need in ("pretrain_gpt.py", "megatron/training/training.py", "megatron/core/__init__.py"):
        (tmp_path / need).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / need).write_text("")
    # whatever this environment has: six and regex missing, the rest present
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("six", "regex") else object())
    with pytest.raises(RecipeError, match=r"imports six, regex, not installed .*pip install -e '\.\[megatron-lm\]'"):
        megatron_lm.check_checkout(str(tmp_path))


def test_not_a_checkout_is_named(tmp_path):
    with pytest.raises(RecipeError, match="not a Megatron-LM checkout"):
        megatron_lm.check_checkout(str(tmp_path))


@pytest.mark.parametrize("patch", sorted(megatron_lm.PATCHES.values()))
def test_each_patch_adds_fewer_than_10_lines(patch):
    with open(os.path.join(REPO, "patches", patch)) as f:
        text = f.read()
    added = [line for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert 0 < len(added) < 10, added
    assert set(re.findall(r"^\+\+\+ b/(\S+)", text, re.M)) == {"pretrain_gpt.py", "megatron/training/training.py"}


# ---- the real loop (MEGATRON_LM_DIR)

@needs_checkout
def test_the_release_patch_applies():
    subprocess.run(["git", "apply", "--check", megatron_lm.patch_for(CHECKOUT)], cwd=CHECKOUT, check=True)


def _run(tmp_path, recipe, checkout, *extra):
    from ttrace_megatron.cli import main

    out = tmp_path / "out"
    rc = main(["run", os.path.join(RECIPES, recipe + ".yaml"), "--megatron-lm", checkout, "--out", str(out),
               "--json", str(tmp_path / "report.json"), *extra])
    return rc, json.loads((tmp_path / "report.json").read_text()), out


# (recipe, injected bug, the culprit's module and phase)
REAL = [
    ("gpt_tp2", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc2", "forward"),
    ("gpt_tp2_sp", "sp_norm_grad_not_reduced", "decoder.layers.0.input_layernorm", "grad reduction"),
    ("gpt_pp2", "tied_embedding_grads_not_synced", "embedding.word_embeddings", "grad reduction"),
    ("gpt_dp2", "dp_grad_not_averaged", "embedding.word_embeddings", "grad reduction"),
    ("moe_ep2", "expert_grads_scaled_by_edp", "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1",
     "grad reduction"),
    ("deepseek_mtp_tp2_sp", "mtp_projection_gather_reduces_grad", "mtp.layers.0.eh_proj", "backward (arrival)"),
]


@needs_checkout
@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe,bug,module,phase", REAL, ids=[r[0] for r in REAL])
def test_real_training_loop_clean_and_its_bug_localized(tmp_path, recipe, bug, module, phase):
    rc, report, out = _run(tmp_path / "clean", recipe, CHECKOUT)
    assert (rc, report["verdict"]) == (0, "pass"), report.get("first_mismatch")
    assert report["versions"]["candidate"]["megatron.core.path"] == os.path.abspath(CHECKOUT)
    total = report["coverage"]["total"]
    assert total["params_judged"] == total["params"]
    rc, report, _ = _run(tmp_path / "bug", recipe, CHECKOUT, "--inject", bug)
    assert (rc, report["verdict"]) == (1, "fail")
    assert (report["culprits"][0]["module"], report["culprits"][0]["phase"]) == (module, phase)


@needs_checkout
@pytest.mark.multiprocess
def test_a_bf16_check_through_the_real_loop_runs_its_fp32_twin(tmp_path):
    """Both pairs through pretrain_gpt.py (issue #36): the bf16 pair with --bf16, its twin without,
    from the bf16 reference's seed checkpoint; a bug bf16 round-off hides is the twin's FAIL."""
    import yaml

    from ttrace_megatron.cli import main

    with open(os.path.join(RECIPES, "gpt_tp2.yaml")) as f:
        raw = yaml.safe_load(f)
    raw["dtype"] = "bf16"
    recipe = tmp_path / "gpt_tp2_bf16.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    # (both references under --out, to read their run.json: a passing pair's is removed if held in memory)
    rc = main(["run", str(recipe), "--megatron-lm", CHECKOUT, "--out", str(out), "--json", str(tmp_path / "r.json"),
               "--inject", "softmax_scale_from_partition_head_dim", "--reference-in", "disk"])
    report = json.loads((tmp_path / "r.json").read_text())
    assert (rc, report["verdict"], report["pair_verdict"]) == (1, "fail", "pass"), report.get("first_mismatch")
    twin = report["fp32_twin"]
    assert twin["culprits"][0]["module"] == "decoder.layers.0.self_attention.linear_proj"
    with open(out / "fp32_twin" / "reference" / "run.json") as f:
        assert json.load(f)["compute_dtype"] == "float32"
    with open(out / "reference" / "run.json") as f:
        assert json.load(f)["compute_dtype"] == "bfloat16"


@needs_checkout
@pytest.mark.multiprocess
def test_online_verdicts_go_out_through_megatron_lms_tensorboard_writer(tmp_path):
    """--online through pretrain_gpt.py with --tensorboard: the candidate gets Megatron-LM's own
    --tensorboard-dir, and ttrace's scalars land in Megatron-LM's event file beside its loss."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    tb = tmp_path / "tb"
    rc, report, _ = _run(tmp_path, "gpt_tp2", CHECKOUT, "--online", "--tensorboard", str(tb),
                         "--inject", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2")
    assert (rc, report["verdict"]) == (1, "fail")
    acc = accumulator.EventAccumulator(str(tb), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "lm loss" in tags  # Megatron-LM's own writer
    over = {e.step: e.value for e in acc.Scalars("ttrace/live/shards_over_tolerance")}
    assert sorted(over) == [1, 2, 3] and min(over.values()) > 0
    [first] = [e for e in acc.Tensors("ttrace/live/first_failure/text_summary") if e.step == 1]
    assert first.tensor_proto.string_val[0].decode().startswith("decoder.layers.1.mlp.linear_fc2, forward, output")


@needs_checkout
@pytest.mark.multiprocess
def test_real_gpt_dataset_over_an_indexed_dataset_passes(tmp_path):
    """Megatron-LM's GPTDataset and its sampler (DP order, several microbatches) instead of the
    mock data: the candidate's token ids are compared with the reference's per global microbatch
    (the embedding's forward input), so the "same data" claim is checked, not assumed."""
    prefix = megatron_lm.write_indexed_dataset(str(tmp_path / "data" / "tokens"), vocab_size=250, documents=64,
                                               seed=7)
    rc, report, _ = _run(tmp_path, "gpt_dp2", CHECKOUT, "--megatron-lm-data", prefix)
    assert (rc, report["verdict"]) == (0, "pass"), report.get("first_mismatch")
    inputs = [t for t in report["tensors"] if t["module"] == "embedding.word_embeddings"
              and t["phase"] == "forward" and t["tensor"] == "input"]
    assert {t["microbatch"] for t in inputs} == {0, 1}


@needs_checkout
@pytest.mark.multiprocess
def test_real_loop_and_ttrace_runner_read_real_text_alike(tmp_path):
    """Real text (issue #34): tests/data/corpus.txt as an indexed dataset, read by GPTDataset in
    ttrace's runner (data source megatron_indexed) and in Megatron-LM's pretrain_gpt.py (the same
    prefix as --data-path), both one-rank references from one seed checkpoint, with EOD masks and
    packed documents: the traces compare clean tensor by tensor, token ids and masks included."""
    from conftest import load
    from ttrace_megatron.adapter.recipe import data

    corpus = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")
    prefix = data.write_text_dataset(corpus, str(tmp_path / "data" / "corpus"))
    # a TP-1 recipe: both one-rank references then pad the 257-token vocabulary alike (ttrace pads a
    # reference to its candidate's TP, Megatron-LM to its own)
    recipe = load("gpt_dp2", data={"source": "megatron_indexed", "path": prefix, "vocab_size": data.BYTE_VOCAB,
                                   "seq_length": 64, "eod_mask_loss": True, "reset_position_ids": True,
                                   "reset_attention_mask": True})
    c = _runner_and_real_loop(recipe, tmp_path)
    assert c.verdict == "pass", c.first_mismatch
    assert any(r.key.tensor == "loss_mask" for r in c.results)
    assert any(r.key.module == "embedding.word_embeddings" and r.key.tensor == "input" for r in c.results)


@needs_checkout
@pytest.mark.multiprocess
def test_the_patched_checkout_runs_clean(tmp_path):
    """The patch route: a patched copy of the checkout runs the same recipe clean (ttrace neither
    installs nor chains its flags a second time)."""
    copy = tmp_path / "Megatron-LM"
    shutil.copytree(CHECKOUT, copy, ignore=shutil.ignore_patterns(".git", "*.so", "__pycache__"))
    subprocess.run(["git", "apply", megatron_lm.patch_for(str(copy))], cwd=copy, check=True)
    assert megatron_lm.patched(str(copy)) == (True, True)
    rc, report, _ = _run(tmp_path, "gpt_tp2", str(copy))
    assert (rc, report["verdict"]) == (0, "pass"), report.get("first_mismatch")


@needs_checkout
def test_help_lists_the_ttrace_flags():
    """``pretrain_gpt.py --help`` through ttrace's chained parser. core_v0.19.0's own --help fails
    before printing anything, with or without ttrace: the help of its
    ``--moe-paged-stash-buffer-size-factor-cuda`` has an unescaped ``%`` ("1.10 = 10%)"), which
    argparse formats."""
    proc = subprocess.run([sys.executable, "-m", "ttrace_megatron.adapter.megatron_lm.checkout", CHECKOUT, "--", "--help"],
                          cwd=CHECKOUT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TTRACE_MEGATRON_LM_CPU="1"))
    if megatron_lm.release_of(CHECKOUT).startswith("0.19."):
        assert proc.returncode != 0 and "unsupported format character ')'" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--ttrace-seed-checkpoint" in proc.stdout and "--ttrace-lockstep" in proc.stdout


@pytest.mark.release_slice
@pytest.mark.multiprocess
def test_ttrace_runner_trains_on_megatrons_mock_dataset(runs):
    """``data: source: megatron_mock``: ttrace's runner builds megatron-core's MockGPTDataset as
    Megatron-LM's --mock-data does (runs in CI: megatron-core alone)."""
    from conftest import load

    ref, cand = runs.candidate(load("gpt_tp2", data={"source": "megatron_mock"}))
    from ttrace_megatron.compare import compare_traces

    c = compare_traces(ref, cand)
    assert c.verdict == "pass", c.first_mismatch
    run = json.load(open(os.path.join(ref, "run.json")))
    assert run["model_config"]["training"]["data_source"] == "megatron_mock"


def _runner_and_real_loop(recipe, tmp_path):
    """ttrace's runner (on the checkout's megatron-core) and Megatron-LM's pretrain_gpt.py, both as
    one-rank references of ``recipe`` from the same seed checkpoint: their comparison."""
    from ttrace_megatron.adapter.run.launch import launch
    from ttrace_megatron.adapter.run.runner import REFERENCE, RunSpec, trace_options
    from ttrace_megatron.adapter.run.session import TraceOptions
    from ttrace_megatron.adapter.run.side import check_tree
    from ttrace_megatron.compare import compare_traces

    seed = str(tmp_path / "seed.safetensors")
    ours, real = str(tmp_path / "ttrace-runner"), str(tmp_path / "megatron-lm")
    launch(RunSpec(recipe=recipe.to_json(), role=REFERENCE, trace=trace_options(ours, seed),
                   megatron=check_tree(CHECKOUT, "MEGATRON_LM_DIR")), timeout_s=600)
    megatron_lm.run(CHECKOUT, recipe, REFERENCE, TraceOptions(enabled=True, dir=real, seed_checkpoint=seed))
    return compare_traces(ours, real)


def test_synthetic_data_is_refused_for_the_real_loop():
    recipe = _recipe("gpt_tp2")
    recipe.data.source = "synthetic"
    with pytest.raises(RecipeError, match="source 'synthetic' is ttrace's own data"):
        megatron_lm.training_args(recipe, "reference", {}, release="0.16.1")
    recipe.data.source = "megatron_mock"  # the mock data, and a dataset given: one of them would be ignored
    with pytest.raises(RecipeError, match="asks for the mock dataset"):
        megatron_lm.training_args(recipe, "reference", {}, release="0.16.1", data_path="/data/tokens")


@needs_checkout
@pytest.mark.multiprocess
def test_real_loop_and_ttrace_runner_write_the_same_trace(tmp_path):
    """One model signature, one data order, one math: ttrace's own runner (on the checkout's
    megatron-core, megatron-core's MockGPTDataset) and Megatron-LM's pretrain_gpt.py (its --mock-data),
    both as one-rank references from the same seed checkpoint, compare clean tensor by tensor."""
    from conftest import load

    # with megatron's EOD loss mask (--eod-mask-loss), which both loops hand the model, and packed
    # documents' positions and attention mask (--reset-position-ids, --reset-attention-mask) (issue #34)
    recipe = load("gpt_tp2", data={"source": "megatron_mock", "eod_mask_loss": True, "reset_position_ids": True,
                                   "reset_attention_mask": True})
    c = _runner_and_real_loop(recipe, tmp_path)
    assert c.verdict == "pass", c.first_mismatch
    assert any(r.key.module == "embedding.word_embeddings" and r.key.tensor == "input" for r in c.results)
    assert any(r.key.tensor == "loss_mask" for r in c.results)
