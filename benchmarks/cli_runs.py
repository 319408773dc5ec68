"""``ttrace run`` driven from a benchmark: one recipe, its report, and the report's worst clean ratio."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def ttrace_run(recipe: str, out: str, extra: List[str]) -> Dict:
    """``ttrace run recipes/RECIPE.yaml --out OUT --json OUT/report.json EXTRA...``: its report, with
    the exit status (``_rc``) and the wall time (``_seconds``)."""
    from ttrace_megatron.cli import main

    json_path = os.path.join(out, "report.json")
    start = time.monotonic()
    rc = main(["run", os.path.join(REPO, "recipes", recipe + ".yaml"), "--out", out, "--json", json_path, *extra])
    with open(json_path) as f:
        report = json.load(f)
    report["_rc"], report["_seconds"] = rc, round(time.monotonic() - start, 1)
    return report


def worst_tensor(report: dict) -> Tuple[Optional[float], Optional[str]]:
    """The largest error / tolerance over the compared tensors (< 1 for a pass), and which tensor
    (``it{iteration} {module} {tensor}``). The report writes a non-finite number as a string: an
    infinite tolerance (an exact tie a choice may flip on) has no ratio."""
    best, where = None, None
    for t in report.get("tensors", []):
        if t.get("tolerance_eps") is None or t.get("error_eps") is None:
            continue
        error, tolerance = float(t["error_eps"]), float(t["tolerance_eps"])
        if tolerance and not math.isinf(tolerance) and (best is None or error / tolerance >= best):
            best, where = error / tolerance, f"it{t['iteration']} {t['module']} {t['tensor']}"
    return best, where


def worst_ratio(report: dict) -> Optional[float]:
    """The largest error / tolerance over the compared tensors (< 1 for a pass)."""
    return worst_tensor(report)[0]


def margin(report: dict) -> Optional[float]:
    """The first mismatch's error / tolerance (how far past its bound the bug is)."""
    fm = report.get("first_mismatch") or {}
    return fm["error_eps"] / fm["tolerance_eps"] if fm.get("tolerance_eps") else None


def culprit(report: dict) -> tuple:
    c = (report.get("culprits") or [{}])[0]
    return c.get("module"), c.get("phase")


def write_table(rows: List[Dict], second: str, json_path: Optional[str]) -> int:
    """Print the rows as a markdown table (recipe, ``second``, clean verdict, worst clean ratio, the
    bug, detected with its margin, the culprit, localized, seconds), write them to ``json_path``,
    and return 0 if every clean run passed and every bug was detected and localized, else 1."""
    print(f"| recipe | {second} | clean | worst clean error/tol | injected bug | detected (margin) | culprit | "
          "localized | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        worst = f"{r['clean_worst']:.2f}" if r.get("clean_worst") is not None else "-"
        margin = f"{r['margin']:.3g}×" if r.get("margin") else ""
        judged = "bug" in r
        print(f"| {r['recipe']} | {r[second]} | {r['clean']} | {worst} | {r.get('bug', '-')} | "
              f"{('yes' if r['detected'] else 'NO') if judged else '-'} {margin} | {r.get('culprit', '-')} | "
              f"{('yes' if r['localized'] else 'NO') if judged else '-'} | {r['seconds']} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    ok = all(r["clean"] == "pass" and r.get("detected", True) and r.get("localized", True) for r in rows)
    return 0 if ok else 1
