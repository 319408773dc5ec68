"""The HTML report in a real headless browser (where Chromium is installed; CI machines may lack it)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from render_report import find_browser, render_and_check  # noqa: E402

from conftest import RECIPES  # noqa: E402

pytestmark = pytest.mark.skipif(find_browser() is None, reason="no Chromium installed")


def test_report_renders_in_headless_chromium(tmp_path):
    from ttrace_megatron.cli import main

    out = tmp_path / "run"
    assert main(["run", os.path.join(RECIPES, "gpt_tp2.yaml"), "--out", str(out),
                 "--inject", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2"]) == 1
    facts = render_and_check(str(out / "report.html"), str(tmp_path / "shot.png"), find_browser())
    assert facts["svg_plots"] == 4 and facts["culprit_box"]
    report_rows = __import__("json").loads((out / "report.json").read_text())["summary"]["compared"]
    assert facts["table_rows"] == report_rows
    assert facts["screenshot"] == (1280, 1400) and facts["distinct_bytes"] > 20  # drawn, not blank
