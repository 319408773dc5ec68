"""Reports: the terminal view (rich) and the machine-readable JSON of a comparison."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, Optional

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from .compare import FAIL, PASS, Comparison, TensorResult
from .trace_store import PHASES


def _num(x: float):
    if x is None or isinstance(x, str):
        return x
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _mismatch_json(r: TensorResult) -> dict:
    return {"module": r.key.module, "phase": r.key.phase, "tensor": r.key.tensor, "iteration": r.key.iteration,
            "microbatch": r.key.microbatch, "error_eps": _num(r.error_eps), "tolerance_eps": _num(r.tolerance_eps),
            "reason": r.reason}


def to_json(c: Comparison) -> dict:
    first = c.first_mismatch
    return {
        "verdict": c.verdict,
        "reference": os.path.abspath(c.reference_dir),
        "candidate": os.path.abspath(c.candidate_dir),
        "recipe": c.candidate_run.get("recipe", {}).get("name"),
        "candidate_parallel": c.candidate_run.get("parallel"),
        "injected_bugs": c.candidate_run.get("injected_bugs", []),
        "first_mismatch": _mismatch_json(first) if first else None,
        "summary": {"compared": len(c.results), "failed": len(c.failures),
                    "missing_in_candidate": len(c.missing_in_candidate),
                    "missing_in_reference": len(c.missing_in_reference), "skipped": len(c.skipped)},
        "missing_in_candidate": [str(k) for k in c.missing_in_candidate],
        "missing_in_reference": [str(k) for k in c.missing_in_reference],
        "skipped": [str(k) for k in c.skipped],
        "tensors": [dict(_mismatch_json(r), verdict=r.verdict, error=_num(r.error), eps=r.eps, depth=r.depth,
                         order=r.order, shape=list(r.shape), tolerance_source=r.tolerance_source)
                    for r in c.results],
    }


def write_json(c: Comparison, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_json(c), f, indent=1)


def headline(report: dict) -> str:
    if report["verdict"] == PASS:
        skipped = report["summary"].get("skipped", 0)
        return (f"equivalent within floating-point round-off: {report['summary']['compared']} logical tensors "
                f"compared, none above its tolerance"
                + (f" ({skipped} per-rank partial sums not judgeable online)" if skipped else ""))
    fm = report["first_mismatch"]
    if fm is None:
        s = report["summary"]
        return (f"tensors present on one side only: {s['missing_in_candidate']} missing in the candidate, "
                f"{s['missing_in_reference']} missing in the reference")
    mb = "" if fm["microbatch"] < 0 else f", microbatch {fm['microbatch']}"
    err = fm["error_eps"]
    err_s = f"{err:.3g} ε" if isinstance(err, (int, float)) else f"{err} ε"
    text = (f"{fm['module']}, {fm['phase']}, {fm['tensor']} (iteration {fm['iteration']}{mb}) introduced an error "
            f"of {err_s} against a tolerance of {fm['tolerance_eps']:.3g} ε")
    if fm.get("reason"):
        text += f" — {fm['reason']}"
    return text


def _layer_label(depth: int, num_layers: int) -> str:
    if depth == 0:
        return "embedding"
    if depth > num_layers:
        return "output / loss"
    return f"layer {depth - 1}"


def render(report: dict, console: Optional[Console] = None, num_layers: Optional[int] = None,
           max_rows: int = 10) -> None:
    console = console or Console()
    ok = report["verdict"] == PASS
    color = "green" if ok else "red"
    title = "PASS" if ok else "FAIL"
    console.print(Panel(headline(report), title=f"[bold {color}]ttrace: {title}[/]", border_style=color))
    tensors = report["tensors"]
    if not tensors:
        return
    if num_layers is None:
        num_layers = max((t["depth"] for t in tensors), default=1) - 1
    worst: Dict[int, Dict[str, dict]] = {}
    for t in tensors:
        e, tol = t["error_eps"], t["tolerance_eps"]
        ratio = (e / tol) if isinstance(e, (int, float)) and tol else math.inf
        cell = worst.setdefault(t["depth"], {}).get(t["phase"])
        if cell is None or ratio > cell["ratio"]:
            worst[t["depth"]][t["phase"]] = dict(t, ratio=ratio)
    table = Table(title="worst error / tolerance per layer (ε units)", show_lines=False)
    table.add_column("layer")
    for phase in PHASES:
        table.add_column(phase, justify="right")
    for depth in sorted(worst):
        row = [_layer_label(depth, num_layers)]
        for phase in PHASES:
            t = worst[depth].get(phase)
            if t is None:
                row.append("—")
                continue
            e = t["error_eps"]
            e_s = f"{e:.3g}" if isinstance(e, (int, float)) else str(e)
            style = "red" if t["verdict"] == FAIL else "green"
            row.append(f"[{style}]{e_s} / {t['tolerance_eps']:.3g}[/]")
        table.add_row(*row)
    console.print(table)
    fails = [t for t in tensors if t["verdict"] == FAIL]
    if fails:
        ft = Table(title=f"first mismatches in execution order ({len(fails)} in all)")
        for col in ("iter", "mb", "module", "phase", "tensor", "error ε", "tol ε"):
            ft.add_column(col, no_wrap=col in ("module", "tensor"))
        ft.add_column("note", overflow="fold", max_width=40)
        for t in sorted(fails, key=lambda t: t["order"])[:max_rows]:
            e = t["error_eps"]
            ft.add_row(str(t["iteration"]), "—" if t["microbatch"] < 0 else str(t["microbatch"]), t["module"],
                       t["phase"], t["tensor"], f"{e:.3g}" if isinstance(e, (int, float)) else str(e),
                       f"{t['tolerance_eps']:.3g}", t.get("reason", ""))
        console.print(ft)
    for side in ("missing_in_candidate", "missing_in_reference"):
        if report.get(side):
            console.print(f"[yellow]{len(report[side])} tensor(s) {side.replace('_', ' ')}:[/] "
                          + ", ".join(report[side][:max_rows]) + (" …" if len(report[side]) > max_rows else ""))


def culprits_json(localization) -> list:
    """The ``culprits`` of the JSON report: what modules computed and failed on their own."""
    from .compare import explain, phase_label

    return [{"module": r.key.module, "phase": phase_label(r.key), "tensor": r.key.tensor,
             "iteration": r.key.iteration, "microbatch": r.key.microbatch, "error_eps": _num(r.error_eps),
             "tolerance_eps": _num(r.tolerance_eps), "explanation": explain(r)} for r in localization.culprits]


def render_culprits(culprits: list, console: Optional[Console] = None, max_rows: int = 5) -> None:
    console = console or Console()
    if not culprits:
        console.print("[green]localization: every module's outputs match given the reference's inputs[/] "
                      "(the mismatch enters outside the hooked modules)")
        return
    c = culprits[0]
    console.print(Panel(f"{c['module']}, {c['phase']}, {c['tensor']} (iteration {c['iteration']}) fails on its own: "
                        f"{c['error_eps']:.3g} ε against a local tolerance of {c['tolerance_eps']:.3g} ε — "
                        f"{c['explanation']}", title="[bold red]culprit[/]", border_style="red"))
    if len(culprits) > 1:
        table = Table(title=f"every module failing on its own ({len(culprits)}), in execution order")
        for col in ("module", "phase", "tensor", "error ε", "local tol ε"):
            table.add_column(col)
        for c in culprits[:max_rows]:
            table.add_row(c["module"], c["phase"], c["tensor"], f"{c['error_eps']:.3g}", f"{c['tolerance_eps']:.3g}")
        console.print(table)
