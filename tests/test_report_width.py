"""The terminal report at 80, 120 and 200 columns (issue #37): no line wider than the terminal,
module names whole on one line, nothing cut to an ellipsis, notes not folded a character a line."""

import io

import pytest
from rich.console import Console

from ttrace_megatron import keys
from ttrace_megatron.compare import FAIL, PASS, Comparison, TensorResult
from ttrace_megatron.keys import TensorKey
from ttrace_megatron.report import render, to_json

LONG = "decoder.layers.11.mlp.experts.local_experts.3.linear_fc1"
NOTE = ("candidate replicas differ (ranks 0, 1: max |Δ| 0.5); a partial sum; the values are 2× the reference "
        "(a reduction counted twice?)")


def _report():
    results = []
    for n, (module, phase, tensor, fails) in enumerate([
            ("embedding.word_embeddings", keys.FORWARD, keys.OUTPUT, False),
            (LONG, keys.FORWARD, keys.OUTPUT, True),
            ("decoder.layers.11.self_attention.linear_qkv", keys.BACKWARD, keys.GRAD_INPUT, True),
            (LONG, keys.MAIN_GRAD, keys.main_grad("weight"), True)]):
        results.append(TensorResult(key=TensorKey(1, -1 if phase == keys.MAIN_GRAD else 0, module, phase, tensor),
                                    verdict=FAIL if fails else PASS, error=1e-3 if fails else 1e-7, eps=2.0 ** -23,
                                    tolerance_eps=37.1, order=n, depth=12 if "layers" in module else 0, shape=(4,),
                                    reason=NOTE if fails else ""))
    return to_json(Comparison("ref", "cand", results, [], [], {}, {}))


@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_report_fits_the_terminal(width):
    out = io.StringIO()
    render(_report(), Console(file=out, width=width, color_system=None), num_layers=12)
    text = out.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert any(LONG in line for line in lines)  # whole, on one line
    assert "…" not in text
    # no column folded to a character or two a line (the 80-column failure the issue showed)
    assert not any(line.strip() and len(line.strip("│ ┃")) <= 2 and line.count("│") > 3 for line in lines)
    if width < 150:
        assert "worst error ÷ tolerance per layer" in text and " 1. it1 mb0 " + LONG in text
    else:
        assert "worst error / tolerance per layer" in text and "first mismatches" in text


@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_recipes_summary_and_the_culprit_panel_fit_the_terminal(width):
    from ttrace_megatron.cli import _print_summary
    from ttrace_megatron.report import render_culprits

    rows = [{"recipe": "deepseek_mtp_tp2_sp", "verdict": "pass", "seconds": 41.5},
            {"recipe": "padded_moe_tp2_sp_ep2", "verdict": "fail", "seconds": 63.0, "message": "",
             "first_mismatch": {"module": LONG, "phase": "forward", "tensor": "output"}},
            {"recipe": "gpt_pp2", "verdict": "error", "seconds": 2.0, "message": NOTE}]
    culprits = [{"module": LONG, "phase": "forward", "tensor": "output", "iteration": 1, "microbatch": 0,
                 "error_eps": 1.2e7, "tolerance_eps": 37.1, "explanation": NOTE}] * 2
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    _print_summary(rows, console)
    render_culprits(culprits, console)
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text
    assert "padded_moe_tp2_sp_ep2" in text and "deepseek_mtp_tp2_sp" in text  # recipe names whole
