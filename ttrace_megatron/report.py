"""Reports: the terminal view (rich) and the machine-readable JSON of a comparison."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from . import coverage
from .compare import FAIL, FREE_RUNNING, PASS, Comparison, TensorResult, lockstep_note
from .keys import PHASES, TensorKind
from .recipe import FP32_TWIN  # the twin's report inside a bf16, fp16 or FP8 check's, as its traces' directory
from .scalars import layer_label, ratio_of


def _num(x: float):
    if x is None or isinstance(x, str):
        return x
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _g(x) -> str:
    """A number of the JSON report as text: ``_num`` writes inf and nan as strings."""
    return x if isinstance(x, str) else f"{x:.3g}"


def _mismatch_json(r: TensorResult) -> dict:
    return {"module": r.key.module, "phase": r.key.phase, "tensor": r.key.tensor, "iteration": r.key.iteration,
            "microbatch": r.key.microbatch, "error_eps": _num(r.error_eps), "tolerance_eps": _num(r.tolerance_eps),
            "reason": r.reason, "tolerance_source": r.tolerance_source}


WIDE_REPORT = 150  # columns from which the report's tables show errors and tolerances side by side


def to_json(c: Comparison) -> dict:
    first = c.first_mismatch
    return {
        "verdict": c.verdict,
        "reference": os.path.abspath(c.reference_dir),
        "candidate": os.path.abspath(c.candidate_dir),
        "recipe": c.candidate_run.get("recipe", {}).get("name"),
        "candidate_parallel": c.candidate_run.get("parallel"),
        "injected_bugs": c.candidate_run.get("injected_bugs", []),
        "versions": {"reference": c.reference_run.get("versions", {}), "candidate": c.candidate_run.get("versions", {})},
        "versions_differ": versions_differ(c.reference_run.get("versions", {}), c.candidate_run.get("versions", {})),
        "first_mismatch": _mismatch_json(first) if first else None,
        "summary": {"compared": len(c.results), "failed": len(c.failures),
                    "missing_in_candidate": len(c.missing_in_candidate),
                    "missing_in_reference": len(c.missing_in_reference), "skipped": len(c.skipped)},
        "missing_in_candidate": [str(k) for k in c.missing_in_candidate],
        "missing_in_reference": [str(k) for k in c.missing_in_reference],
        "skipped": [str(k) for k in c.skipped],
        "unjudged": [str(k) for k in c.unjudged],
        "diverged": {"why": FREE_RUNNING, "tensors": [str(k) for k in c.diverged]} if c.diverged else None,
        "coverage": c.coverage,
        "resolution": resolution(c.results),
        "lockstep": lockstep_note(c.reference_run, c.candidate_run, c.reference_dir),
        "tensors": [dict(_mismatch_json(r), verdict=r.verdict, error=_num(r.error), eps=r.eps, depth=r.depth,
                         order=r.order, shape=list(r.shape))
                    for r in c.results],
    }


BUILD = "build"  # the phase of a model built other than its recipe describes


def build_failure(side: str, rank: int, module: str, problems: List[str], recipe: Optional[str] = None) -> dict:
    """The report of a check that stopped at the build: a valid recipe that one side built as
    another model. A FAIL localized to the build (the first problem's module), with no tensor
    compared: the two sides would not be the same model."""
    first = {"module": module, "phase": BUILD, "tensor": "structure", "iteration": 0, "microbatch": -1,
             "error_eps": None, "tolerance_eps": None, "reason": problems[0] if problems else "",
             "tolerance_source": ""}
    return {"verdict": FAIL, "recipe": recipe, "build": {"side": side, "rank": rank, "problems": list(problems)},
            "first_mismatch": first, "culprits": [],
            "summary": {"compared": 0, "failed": 0, "missing_in_candidate": 0, "missing_in_reference": 0,
                        "skipped": 0},
            "tensors": []}


# a tolerance above this relative error (10 %: bf16 past ~40 layers, k·C^d·ε_bf16) is a blind spot
# worth a warning: a bug that moves the
# tensor by less is indistinguishable from round-off there (BENCHMARKS.md, "On paper at 8B-70B")
RESOLUTION_WARNING = 0.1
# the bound's depth factor C^d grows with every layer while measured round-off at initialization does
# not (BENCHMARKS.md, "Depth"); a layout partitions every layer alike, so fewer layers check it as well
DEPTH_ADVICE = ("Every layer is partitioned alike: the fewest layers the layout allows (pipeline stages × "
                "virtual stages), at full width, vocabulary and sequence, check the same layout with tighter "
                "bounds; or fp32, whose ε is 2¹⁶ times smaller.")


def resolution(results) -> Optional[dict]:
    """The loosest tolerance of the comparison, as a relative error: the smallest change a bug
    must make to that tensor to be seen. bf16 passes 10 % where k·C^d·ε_bf16 does, at d ≈ 40: the
    forward of a 40-layer model, the backward of a 19-layer one (its depth is 2(L + 1) − l)."""
    # relative bounds only: an element-wise Adam check states its tolerance through the error, and a
    # top-k choice is judged by its scores; the grad norm, the clip coefficient and the norm's terms
    # are bounded by what the run measured (step_bounds), which a bug elsewhere widens: not a
    # property of the check
    finite = [r for r in results if math.isfinite(r.tolerance_eps) and r.tolerance_eps > 0
              and r.key.kind not in (TensorKind.SELECTION, TensorKind.GRAD_NORM_TERM, TensorKind.OPTIMIZER_SCALAR)
              and not r.tolerance_source.startswith("Adam update")]
    if not finite:
        return None
    loosest = max(finite, key=lambda r: r.tolerance_eps * r.eps)
    relative = loosest.tolerance_eps * loosest.eps
    return {"loosest_relative": relative, "tensor": str(loosest.key), "warn": relative > RESOLUTION_WARNING}


def versions_differ(reference: dict, candidate: dict) -> List[str]:
    """The libraries (or their paths) the two sides ran in different versions: one line each."""
    return [f"{name}: reference {reference.get(name, '<unrecorded>')}, candidate {candidate.get(name, '<unrecorded>')}"
            for name in sorted(set(reference) | set(candidate)) if reference.get(name) != candidate.get(name)]


def write_json(c: Comparison, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_json(c), f, indent=1)


# what only the recipe's own low-precision pair can judge, the twin having none of it
DTYPE_SPECIFIC = ("Float16Module's casts, low-precision reductions and main parameters, loss scaling, FP8 scaling")


ERROR = "error"  # a verdict no comparison gave: the fp32 twin did not run
VERDICT_COLORS = {PASS: "green", FAIL: "red", ERROR: "yellow"}


def timings_line(timings: Dict[str, float]) -> str:
    """Where a check's time went, part by part (the report's ``timings_s``)."""
    return ", ".join(f"{part} {seconds:.1f} s" for part, seconds in timings.items())


def _culprit_sentence(c: dict) -> str:
    """A culprit as one sentence (plain text; the HTML page escapes it)."""
    return (f"{c['module']}, {c['phase']}, {c['tensor']} (iteration {c['iteration']}) fails on its own: "
            f"{_g(c['error_eps'])} ε against a local tolerance of {_g(c['tolerance_eps'])} ε — {c['explanation']}")


def twin_error(message: str, recipe: Optional[str] = None) -> dict:
    """The report of an fp32 twin that could not run (``message`` says why)."""
    return {"verdict": ERROR, "recipe": recipe, "error": message, "first_mismatch": None, "culprits": [],
            "summary": {"compared": 0, "failed": 0, "missing_in_candidate": 0, "missing_in_reference": 0,
                        "skipped": 0}, "tensors": []}


def combine_twin(report: dict, twin: dict, dtype: str) -> dict:
    """One check's report from its recipe's pair (``report``) and its fp32 twin's: the pair's
    report with ``dtype``, its own verdict as ``pair_verdict``, the twin's report under
    ``fp32_twin``, and as ``verdict`` a FAIL if either fails (else an error if the twin could not
    run). Each keeps its own first mismatch and culprits: the pair's is at the top, as in a check
    without a twin."""
    out = dict(report, dtype=dtype, pair_verdict=report["verdict"])
    out[FP32_TWIN] = dict(twin, dtype="fp32")
    verdicts = (report["verdict"], twin["verdict"])
    out["verdict"] = FAIL if FAIL in verdicts else ERROR if ERROR in verdicts else PASS
    return out


def first_mismatch_of(report: dict) -> Optional[dict]:
    """The first mismatch a summary line names: the recipe's own pair's, else its fp32 twin's
    (marked ``"check": "fp32 twin"``)."""
    twin = report.get(FP32_TWIN) or {}
    if report.get("first_mismatch") or not twin.get("first_mismatch"):
        return report.get("first_mismatch")
    return dict(twin["first_mismatch"], check="fp32 twin")


def headline(report: dict) -> str:
    twin = report.get(FP32_TWIN)
    if twin is None:
        return _pair_headline(report)
    dtype, own = report.get("dtype", "the recipe's dtype"), report.get("pair_verdict", report["verdict"])
    pair = _pair_headline(dict(report, verdict=own))
    if twin["verdict"] == ERROR:
        return f"{dtype}: {pair}. Its fp32 twin did not run: {twin.get('error', '')}"
    if twin.get("build"):
        return f"{dtype}: {pair}. Its fp32 twin stopped at the build: {_pair_headline(twin)}"
    if own == PASS and twin["verdict"] == PASS:
        return (f"{dtype}: {pair}; its fp32 twin (the same layout and seed checkpoint, judged under fp32 bounds): "
                f"{_pair_headline(twin)}")
    if own == PASS:
        return (f"the fp32 twin (the same layout and seed checkpoint in fp32) is not equivalent: "
                f"{_pair_headline(twin)}. The {dtype} pair passed: there the error hides in {dtype}'s round-off")
    if twin["verdict"] == PASS:
        return (f"{dtype}: {pair}. Its fp32 twin passes: the error is specific to {dtype} ({DTYPE_SPECIFIC})")
    return f"{dtype}: {pair}. Its fp32 twin fails too: {_pair_headline(twin)}"


def _pair_headline(report: dict) -> str:
    if report["verdict"] == PASS:
        skipped = report["summary"].get("skipped", 0)
        return (f"equivalent within floating-point round-off: {report['summary']['compared']} logical tensors "
                f"compared, none above its tolerance"
                + (f" ({skipped} skipped: per-rank partial sums online, which --keep-traces judges too, or "
                   f"per-microbatch tensors the candidate's layout has no counterpart for)" if skipped else ""))
    build = report.get("build")
    if build:
        more = len(build["problems"]) - 1
        return (f"the {build['side']}'s model, as megatron built it on rank {build['rank']}, is not the model the "
                f"recipe describes: {build['problems'][0]}" + (f" (and {more} more)" if more > 0 else ""))
    fm = report["first_mismatch"]
    if fm is None:
        s = report["summary"]
        return (f"tensors present on one side only: {s['missing_in_candidate']} missing in the candidate, "
                f"{s['missing_in_reference']} missing in the reference")
    mb = "" if fm["microbatch"] < 0 else f", microbatch {fm['microbatch']}"
    err = fm["error_eps"]
    err_s = f"{err:.3g} ε" if isinstance(err, (int, float)) else f"{err} ε"
    text = (f"{fm['module']}, {fm['phase']}, {fm['tensor']} (iteration {fm['iteration']}{mb}) introduced an error "
            f"of {err_s} against a tolerance of {_g(fm['tolerance_eps'])} ε")
    if str(fm.get("tolerance_source", "")).startswith("perturbation"):
        text += " (set by the perturbation estimate)"
    if fm.get("reason"):
        text += f" — {fm['reason']}"
    return text


def render_coverage(cov: Optional[dict], console: Console, max_rows: int = 10) -> None:
    """Which parameters were judged, by module type, and the ones that were not, with why."""
    if not cov:
        return
    console.print(coverage.headline(cov))
    partial = {t: row for t, row in cov["by_module_type"].items() if row["params_judged"] < row["params"]}
    if partial:
        table = Table(title="module types with parameters not judged")
        for col in ("module type", "parameters judged", "elements judged"):
            table.add_column(col)
        for t, row in partial.items():
            table.add_row(t, f"{row['params_judged']} of {row['params']}",
                          f"{row['elements_judged']:,} of {row['elements']:,}")
        console.print(table)
        for entry in cov["not_judged"][:max_rows]:
            console.print(f"  [yellow]not judged[/] {entry['param']} ({entry['module_type']}): {entry['why']}")
        if len(cov["not_judged"]) > max_rows:
            console.print(f"  … and {len(cov['not_judged']) - max_rows} more (report.json: coverage.not_judged)")
    for entry in cov.get("not_the_models", []):
        console.print(f"  [yellow]not the model's[/] {entry['param']} ({entry['where']}): {entry['why']}")


def _coverage_html(cov: Optional[dict]) -> str:
    import html

    if not cov:
        return ""
    rows = "".join(f"<tr><td>{html.escape(t)}</td><td>{r['params_judged']} of {r['params']}</td>"
                   f"<td>{r['elements_judged']:,} of {r['elements']:,}</td></tr>"
                   for t, r in cov["by_module_type"].items())
    missing = "".join(f"<li><code>{html.escape(e['param'])}</code> ({html.escape(e['module_type'])}): "
                      f"{html.escape(e['why'])}</li>" for e in cov["not_judged"])
    return (f"<h2>Coverage</h2><p>{html.escape(coverage.headline(cov))}</p><table><tr><th>module type</th>"
            f"<th>parameters judged</th><th>elements judged</th></tr>{rows}</table>"
            + (f"<h3>Not judged</h3><ul>{missing}</ul>" if missing else ""))


def render(report: dict, console: Optional[Console] = None, num_layers: Optional[int] = None,
           max_rows: int = 10) -> None:
    """The report in the terminal; a check with an fp32 twin: the recipe's own pair (with its
    culprits), then the twin's part."""
    console = console or Console()
    _render_pair(report, console, num_layers, max_rows)
    if report.get(FP32_TWIN):
        if report.get("culprits"):
            render_culprits(report["culprits"], console)
        render_twin(report, console, max_rows)


def _render_pair(report: dict, console: Console, num_layers: Optional[int], max_rows: int) -> None:
    color = VERDICT_COLORS[report["verdict"]]
    title = report["verdict"].upper()
    console.print(Panel(headline(report), title=f"[bold {color}]ttrace: {title}[/]", border_style=color))
    if report.get("versions_differ"):
        console.print("the two sides ran different library versions: " + "; ".join(report["versions_differ"]))
    render_coverage(report.get("coverage"), console, max_rows)
    if report.get("lockstep"):
        console.print(f"[yellow]{report['lockstep']}[/]")
    if report.get("diverged"):
        console.print(f"[yellow]{len(report['diverged']['tensors'])} tensors not judged: "
                      f"{report['diverged']['why']}[/]")
    res = report.get("resolution")
    if res and res.get("warn"):
        console.print(f"[yellow]resolution: a tolerance of {res['loosest_relative']:.2g} relative error "
                      f"({res['tensor']}): a bug that moves a tensor by less than its tolerance cannot be told "
                      f"from round-off there. {DEPTH_ADVICE}[/]")
    tensors = report["tensors"]
    if not tensors:
        return
    if num_layers is None:
        num_layers = max((t["depth"] for t in tensors), default=1) - 1
    worst: Dict[int, Dict[str, dict]] = {}
    for t in tensors:
        ratio = _ratio(t)
        cell = worst.setdefault(t["depth"], {}).get(t["phase"])
        if cell is None or ratio > cell["ratio"]:
            worst[t["depth"]][t["phase"]] = dict(t, ratio=ratio)
    narrow = console.width < WIDE_REPORT  # an 80-column terminal: ratios, and one mismatch a record
    title = ("worst error ÷ tolerance per layer (> 1 fails)" if narrow
             else "worst error / tolerance per layer (ε units)")
    table = Table(title=title, show_lines=False)
    table.add_column("layer", no_wrap=True)
    for phase in PHASES:
        table.add_column(phase, justify="right", no_wrap=True)
    for depth in sorted(worst):
        row = [layer_label(depth, num_layers)]
        for phase in PHASES:
            t = worst[depth].get(phase)
            if t is None:
                row.append("—")
                continue
            e = t["error_eps"]
            e_s = f"{e:.3g}" if isinstance(e, (int, float)) else str(e)
            style = "red" if t["verdict"] == FAIL else "green"
            row.append(f"[{style}]{_g(t['ratio'])}[/]" if narrow else f"[{style}]{e_s} / {_g(t['tolerance_eps'])}[/]")
        table.add_row(*row)
    console.print(table)
    fails = [t for t in tensors if t["verdict"] == FAIL]
    if fails and narrow:
        console.print(f"first mismatches in execution order ({len(fails)} in all):")
        for n, t in enumerate(sorted(fails, key=lambda t: t["order"])[:max_rows], 1):
            e = t["error_eps"]
            console.print(f"{n:2d}. it{t['iteration']}{_mb(t)} {t['module']}", overflow="fold")
            console.print(f"    {t['phase']} {t['tensor']}: {_g(e) if isinstance(e, (int, float)) else e} ε, "
                          f"tolerance {_g(t['tolerance_eps'])} ε" + (f"; {t['reason']}" if t.get("reason") else ""),
                          overflow="fold")
    elif fails:
        ft = Table(title=f"first mismatches in execution order ({len(fails)} in all)")
        for col in ("iter", "mb", "module", "phase", "tensor", "error ε", "tol ε"):
            ft.add_column(col, no_wrap=col in ("module", "tensor"))
        ft.add_column("note", overflow="fold", max_width=40)
        for t in sorted(fails, key=lambda t: t["order"])[:max_rows]:
            e = t["error_eps"]
            ft.add_row(str(t["iteration"]), "—" if t["microbatch"] < 0 else str(t["microbatch"]), t["module"],
                       t["phase"], t["tensor"], f"{e:.3g}" if isinstance(e, (int, float)) else str(e),
                       _g(t['tolerance_eps']), t.get("reason", ""))
        console.print(ft)
    for side in ("missing_in_candidate", "missing_in_reference"):
        if report.get(side):
            console.print(f"[yellow]{len(report[side])} tensor(s) {side.replace('_', ' ')}:[/] "
                          + ", ".join(report[side][:max_rows]) + (" …" if len(report[side]) > max_rows else ""))


def render_twin(report: dict, console: Optional[Console] = None, max_rows: int = 10) -> None:
    """The fp32 twin's part of a check: its report (in full where it fails, with its culprits),
    then one line with both verdicts."""
    console = console or Console()
    twin = report[FP32_TWIN]
    if twin["verdict"] == ERROR:
        console.print(Panel(twin.get("error", ""), title="[bold yellow]fp32 twin: did not run[/]",
                            border_style="yellow"), highlight=False)
    elif twin["verdict"] == FAIL:
        console.print("[bold]the fp32 twin[/] (the same layout and seed checkpoint in fp32, under fp32 bounds):")
        render(twin, console, num_layers=twin.get("num_layers"), max_rows=max_rows)
        if twin.get("culprits"):
            render_culprits(twin["culprits"], console)
    else:
        console.print(Panel(_pair_headline(twin), title="[bold green]fp32 twin: PASS[/]", border_style="green"))
    if twin.get("timings_s"):
        console.print("fp32 twin time: " + timings_line(twin["timings_s"]), highlight=False)
    own = report.get("pair_verdict", report["verdict"])
    color = VERDICT_COLORS[report["verdict"]]
    console.print(f"[bold {color}]ttrace: {report['verdict'].upper()}[/] — {report.get('dtype')}: {own.upper()}, "
                  f"fp32 twin: {twin['verdict'].upper()}")


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
                        f"{_g(c['error_eps'])} ε against a local tolerance of {_g(c['tolerance_eps'])} ε — "
                        f"{c['explanation']}", title="[bold red]culprit[/]", border_style="red"))
    if len(culprits) > 1 and console.width < WIDE_REPORT:
        console.print(f"every module failing on its own ({len(culprits)}), in execution order:")
        for n, c in enumerate(culprits[:max_rows], 1):
            console.print(f"{n:2d}. it{c['iteration']}{_mb(c)} {c['module']}", overflow="fold")
            console.print(f"    {c['phase']} {c['tensor']}: {_g(c['error_eps'])} ε, local tolerance "
                          f"{_g(c['tolerance_eps'])} ε", overflow="fold")
    elif len(culprits) > 1:
        table = Table(title=f"every module failing on its own ({len(culprits)}), in execution order")
        for col in ("iter", "mb", "module", "phase", "tensor", "error ε", "local tol ε"):
            table.add_column(col, no_wrap=col == "module")
        for c in culprits[:max_rows]:
            table.add_row(str(c["iteration"]), _mb(c).strip()[2:] or "—", c["module"], c["phase"], c["tensor"],
                          _g(c["error_eps"]), _g(c["tolerance_eps"]))
        console.print(table)


# --------------------------------------------------------------------------------------------
# HTML: one self-contained file (inline CSS and SVG, no scripts, nothing fetched)


def _mb(entry: dict) -> str:
    """The microbatch as ' mbN', or '' for a tensor of the whole step (microbatch < 0)."""
    return "" if entry.get("microbatch", -1) < 0 else f" mb{entry['microbatch']}"


def _ratio(t: dict) -> float:
    return ratio_of(t["error_eps"], t["tolerance_eps"])


def _svg_plot(tensors: list, phase: str, culprit: Optional[dict], width: int = 560, height: int = 220) -> str:
    """Worst error/tolerance per layer (log scale) for one phase; 1 = the tolerance."""
    import html

    worst: Dict[int, float] = {}
    for t in tensors:
        if t["phase"] == phase:
            worst[t["depth"]] = max(worst.get(t["depth"], 0.0), _ratio(t))
    if not worst:
        return f"<p>no {html.escape(phase)} tensors</p>"
    depths = sorted(worst)
    lo, hi = -3.0, 3.0
    for r in worst.values():
        if 0 < r < math.inf:
            lo, hi = min(lo, math.floor(math.log10(r))), max(hi, math.ceil(math.log10(r)))
    pad = 40

    def x(i):
        return pad + (width - 2 * pad) * (i + 0.5) / len(depths)

    def y(r):
        v = hi if r == math.inf else (lo if r <= 0 else min(max(math.log10(r), lo), hi))
        return height - pad - (height - 2 * pad) * (v - lo) / (hi - lo)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(phase)}: worst error / tolerance per layer">',
             f'<line x1="{pad}" y1="{y(1):.1f}" x2="{width - pad}" y2="{y(1):.1f}" stroke="#c00" stroke-dasharray="4"/>',
             f'<text x="{width - pad}" y="{y(1) - 4:.1f}" font-size="11" text-anchor="end" fill="#c00">tolerance</text>']
    for e in range(int(lo), int(hi) + 1, max(1, int(hi - lo) // 6)):
        parts.append(f'<text x="{pad - 4}" y="{y(10 ** e) + 4:.1f}" font-size="10" text-anchor="end">1e{e}</text>')
    for i, d in enumerate(depths):
        r = worst[d]
        hit = culprit is not None and culprit.get("depth") == d and culprit.get("phase_key") == phase
        color = "#c00" if r > 1 else "#2a7"
        outline = ' stroke="#000" stroke-width="2"' if hit else ""
        parts.append(f'<circle cx="{x(i):.1f}" cy="{y(r):.1f}" r="{7 if hit else 4}" fill="{color}"{outline}>'
                     f'<title>depth {d}: {r:.3g}</title></circle>')
        parts.append(f'<text x="{x(i):.1f}" y="{height - pad + 14}" font-size="10" text-anchor="middle">{d}</text>')
    parts.append(f'<text x="{width / 2}" y="{height - 6}" font-size="11" text-anchor="middle">layer depth '
                 f'(0 = embedding, last = output / loss)</text></svg>')
    return "".join(parts)


def to_html(report: dict) -> str:
    """The report as one self-contained HTML page: verdict, culprit, per-layer plots, every tensor."""
    import html

    ok = report["verdict"] == PASS
    culprits = report.get("culprits") or []
    culprit = dict(culprits[0]) if culprits else None
    tensors = report.get("tensors", [])
    if culprit:  # find its depth for the plot
        for t in tensors:
            if (t["module"], t["tensor"]) == (culprit["module"], culprit["tensor"]):
                culprit.update(depth=t["depth"], phase_key=t["phase"])
                break
    rows = []
    for t in sorted(tensors, key=lambda t: t["order"]):
        cls = "fail" if t["verdict"] == FAIL else "pass"
        e = t["error_eps"]
        rows.append(f'<tr class="{cls}"><td>{t["iteration"]}</td><td>{"—" if t["microbatch"] < 0 else t["microbatch"]}'
                    f'</td><td>{html.escape(t["module"])}</td><td>{html.escape(t["phase"])}</td>'
                    f'<td>{html.escape(t["tensor"])}</td><td>{_g(e)}</td>'
                    f'<td>{_g(t["tolerance_eps"])}</td><td>{html.escape(t.get("reason", ""))}</td></tr>')
    culprit_html, twin_html = "", ""
    twin = report.get(FP32_TWIN)
    if twin:
        twin_culprits = "".join(f'<p>culprit: {html.escape(_culprit_sentence(c))}</p>'
                                for c in (twin.get("culprits") or [])[:1])
        twin_fails = sorted((t for t in twin.get("tensors", []) if t["verdict"] == FAIL), key=lambda t: t["order"])
        twin_rows = "".join(
            f'<tr class="fail"><td>{t["iteration"]}</td><td>{html.escape(t["module"])}</td>'
            f'<td>{html.escape(t["phase"])}</td><td>{html.escape(t["tensor"])}</td><td>{_g(t["error_eps"])}</td>'
            f'<td>{_g(t["tolerance_eps"])}</td></tr>' for t in twin_fails[:20])
        twin_table = (f'<p>its first mismatches in execution order ({len(twin_fails)} in all):</p><table><tr>'
                      f'<th>iter</th><th>module</th><th>phase</th><th>tensor</th><th>error ε</th><th>tol ε</th></tr>'
                      f'{twin_rows}</table>') if twin_fails else ""
        twin_text = twin.get("error") if twin["verdict"] == ERROR else _pair_headline(twin)
        twin_html = (f'<div class="{"culprit" if twin["verdict"] == FAIL else "verdict"}"><h2>fp32 twin: '
                     f'{twin["verdict"].upper()}</h2><p>{html.escape(twin_text or "")}</p>'
                     f'{twin_culprits}{twin_table}</div>')
    versions_html = "".join(f"<p>the two sides ran different library versions: {html.escape(line)}</p>"
                            for line in report.get("versions_differ") or [])
    if culprits:
        c = culprits[0]
        culprit_html = f'<div class="culprit"><h2>Culprit</h2><p>{html.escape(_culprit_sentence(c))}</p></div>'
    # later iterations carry the first error everywhere: plot the iteration where it appears
    first = report.get("first_mismatch")
    plotted = [t for t in tensors if first is None or t["iteration"] == first["iteration"]]
    plot_title = ("Worst error / tolerance per layer" if first is None else
                  f"Worst error / tolerance per layer, iteration {first['iteration']} (the first mismatch's)")
    plots = "".join(f"<h3>{phase}</h3>{_svg_plot(plotted, phase, culprit)}" for phase in PHASES)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ttrace: {report["verdict"].upper()}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1100px; }}
.verdict {{ padding: 1em; border: 2px solid {"#2a7" if ok else "#c00"}; border-radius: 6px; }}
.culprit {{ padding: 0.5em 1em; border-left: 6px solid #c00; background: #fee; margin-top: 1em; }}
table {{ border-collapse: collapse; font-size: 12px; width: 100%; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 2px 6px; text-align: left; }}
tr.fail td {{ background: #fdd; }}
</style></head><body>
<h1>ttrace: {report["verdict"].upper()}</h1>
<div class="verdict">{html.escape(headline(report))}</div>
{versions_html}
{culprit_html}
{twin_html}
{_coverage_html(report.get("coverage"))}
<h2>{html.escape(plot_title)}</h2>{plots}
<h2>Every tensor ({len(tensors)}), in execution order</h2>
<table><tr><th>iter</th><th>mb</th><th>module</th><th>phase</th><th>tensor</th><th>error ε</th><th>tol ε</th>
<th>note</th></tr>{"".join(rows)}</table>
</body></html>
"""


def write_html(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_html(report))
