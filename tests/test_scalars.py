"""A check's verdicts as TensorBoard scalars (scalars.py, adapter/run/live_scalars.py), read back with
tensorboard's own event reader: written during an online candidate's run from every rank's shards,
and from a finished report (`ttrace run --tensorboard`, `ttrace report DIR --tensorboard OUT`)."""

import json
import math
import os

import pytest

from conftest import RECIPES

from ttrace_megatron import scalars

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

BUG = "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2"


def _events(path):
    acc = event_accumulator.EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    values = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in tags["scalars"]}
    texts = {e.step: e.tensor_proto.string_val[0].decode() for tag in tags["tensors"]
             if "first_failure" in tag for e in acc.Tensors(tag)}
    return values, texts


def _row(it, phase, depth, order, ratio, module="m"):
    return {"module": module, "phase": phase, "tensor": "output", "iteration": it, "microbatch": 0, "depth": depth,
            "order": order, "verdict": "fail" if ratio > 1 else "pass", "error_eps": ratio * 10.0,
            "tolerance_eps": 10.0, "reason": ""}


def test_iteration_scalars_and_their_merge_over_ranks():
    rank0 = scalars.iteration_scalars([_row(1, "forward", 1, 5, 0.5), _row(1, "backward", 2, 9, 3.0, "late")], 2)
    rank1 = scalars.iteration_scalars([_row(1, "forward", 2, 7, 2.0, "early"), _row(1, "forward", 0, 1, 0.1)], 2)
    merged = scalars.merge(rank0 + rank1)
    assert merged.worst_by_phase == {"forward": 2.0, "backward": 3.0}
    assert merged.worst_by_layer == {"layer 0": 0.5, "layer 1": 3.0, "embedding": 0.1}
    assert merged.over_tolerance == 2
    assert merged.first_failure.startswith("early, forward, output (iteration 1, microbatch 0): 20 ε")
    # exact tensors, bounds that admit anything, the JSON report's strings
    assert scalars.ratio_of("inf", 0.0) == math.inf and scalars.ratio_of(3.0, "inf") == 0.0
    assert scalars.ratio_of(0.0, 0.0) == 0.0 and scalars.ratio_of("nan", 2.0) == math.inf


def test_wandb_style_writer_gets_one_log_per_iteration():
    class Log:
        def __init__(self):
            self.calls = []

        def log(self, values, step):
            self.calls.append((step, values))

    w = Log()
    s = scalars.merge(scalars.iteration_scalars([_row(2, "forward", 1, 0, 4.0)], 1))
    scalars.write(w, s, live=True)
    [(step, values)] = w.calls
    assert step == 2 and values[scalars.SHARDS_OVER] == 1.0 and values["ttrace/live/worst_ratio/forward"] == 4.0
    assert values["ttrace/live/first_failure"].startswith("m, forward, output (iteration 2")


def test_online_check_writes_scalars_during_the_run_and_report_converts(tmp_path):
    """A bug's online check: every iteration's scalars come from the ranks' shards during the run,
    the first failure names the injected module; the kept report converts offline."""
    from ttrace_megatron.cli import main

    out, live, offline = tmp_path / "bug", tmp_path / "tb_live", tmp_path / "tb_report"
    assert main(["run", os.path.join(RECIPES, "gpt_tp2.yaml"), "--online", "--quiet", "--out", str(out),
                 "--tensorboard", str(live), "--inject", BUG]) == 1
    values, texts = _events(live)
    assert sorted(values[scalars.SHARDS_OVER]) == [1, 2, 3]
    assert all(n > 0 for n in values[scalars.SHARDS_OVER].values())
    assert values["ttrace/live/worst_ratio/forward"][1] > 100
    assert texts[1].startswith("decoder.layers.1.mlp.linear_fc2, forward, output (iteration 1")

    report = json.loads((out / "report.json").read_text())
    assert main(["report", str(out), "--tensorboard", str(offline)]) == 1
    values, texts = _events(offline)
    failed = {}
    for t in report["tensors"]:
        failed[t["iteration"]] = failed.get(t["iteration"], 0) + (t["verdict"] == "fail")
    assert values[scalars.TENSORS_OVER] == {it: float(n) for it, n in failed.items()}
    assert texts[1].startswith(report["first_mismatch"]["module"])


def test_clean_check_writes_scalars_under_one(tmp_path):
    from ttrace_megatron.cli import main

    tb = tmp_path / "tb"
    assert main(["run", os.path.join(RECIPES, "gpt_tp2_sp.yaml"), "--quiet", "--tensorboard", str(tb)]) == 0
    values, texts = _events(tb)
    assert values[scalars.TENSORS_OVER] == {1: 0.0, 2: 0.0, 3: 0.0}
    worst = [v for tag, steps in values.items() if tag.startswith("ttrace/worst_ratio") for v in steps.values()]
    assert worst and max(worst) <= 1.0
    assert texts == {}
