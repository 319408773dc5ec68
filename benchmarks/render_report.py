"""Render the HTML report in a real headless browser: the check behind "the HTML report renders".

Runs a recipe with an injected bug through ``ttrace run`` (so the report has a verdict, a
culprit, plots and the tensor table), opens ``report.html`` in headless Chromium, and checks
what the browser built: the DOM it parsed (four SVG plots, the culprit box, one table row per
tensor) and a screenshot of the rendered page (its size, and that it is not blank).

    python benchmarks/render_report.py [--out benchmarks/report_screenshot.png]

Needs a Chromium binary (Debian: ``apt-get install chromium``); not part of CI, which cannot
assume one. ``tests/test_html_browser.py`` runs the same check where one is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_browser():
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


def headless(browser: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
                          capture_output=True, text=True, timeout=120)


def png_facts(path: str):
    """(width, height, distinct byte values in the decoded image data): a blank page has very few."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    chunks, pos = [], 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IDAT":
            chunks.append(data[pos + 8:pos + 8 + length])
        pos += 12 + length
    pixels = zlib.decompress(b"".join(chunks))
    return width, height, len(set(pixels[::97]))


def render_and_check(html_path: str, screenshot: str, browser: str) -> dict:
    dom = headless(browser, "--dump-dom", "file://" + os.path.abspath(html_path)).stdout
    shot = headless(browser, "--window-size=1280,1400", f"--screenshot={os.path.abspath(screenshot)}",
                    "file://" + os.path.abspath(html_path))
    if not os.path.exists(screenshot):
        raise RuntimeError(f"the browser wrote no screenshot: {shot.stderr[-500:]}")
    width, height, distinct = png_facts(screenshot)
    return {"svg_plots": dom.count("<svg"), "culprit_box": 'class="culprit"' in dom,
            "table_rows": dom.count("<tr class="), "screenshot": (width, height), "distinct_bytes": distinct}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "report_screenshot.png"))
    args = parser.parse_args()
    browser = find_browser()
    if browser is None:
        sys.exit("no Chromium found (apt-get install chromium)")
    from ttrace_megatron.cli import main as ttrace

    with tempfile.TemporaryDirectory() as tmp:
        ttrace(["run", os.path.join(REPO, "recipes", "gpt_tp2.yaml"), "--out", tmp,
                "--inject", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2"])
        facts = render_and_check(os.path.join(tmp, "report.html"), args.out, browser)
    version = subprocess.run([browser, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"{version}: {facts}")


if __name__ == "__main__":
    main()
