"""The ``ttrace`` command: run, compare, report.

Exit status: 0 equivalent, 1 mismatch found, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings
from typing import List, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from .errors import RecipeError, RunFailed, TraceError

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


def _quiet_warnings() -> None:
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)


def _compare_and_report(ref_dir: str, cand_dir: str, json_path: Optional[str], console: Console,
                        out_dir: Optional[str] = None) -> int:
    from .compare import compare_traces
    from .report import render, to_json, write_json

    with Progress(TextColumn("comparing"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task("compare", total=None)
        comparison = compare_traces(ref_dir, cand_dir,
                                    progress=lambda done, total: progress.update(task, completed=done, total=total))
    report = to_json(comparison)
    render(report, console, num_layers=int(comparison.reference_run.get("num_layers", 0)))
    if json_path:
        write_json(comparison, json_path)
    if out_dir:
        write_json(comparison, os.path.join(out_dir, "report.json"))
    return EXIT_PASS if comparison.verdict == "pass" else EXIT_FAIL


def cmd_run(args, console: Console) -> int:
    from .adapter.config import validate_recipe
    from .adapter.launch import launch
    from .adapter.runner import CANDIDATE, REFERENCE, RunSpec
    from .recipe import default_recipe, load_recipe

    recipe = load_recipe(args.recipe) if args.recipe else default_recipe()
    validate_recipe(recipe)
    out = args.out or tempfile.mkdtemp(prefix="ttrace-")
    try:
        ref_dir, cand_dir = os.path.join(out, "reference"), os.path.join(out, "candidate")
        for d in (ref_dir, cand_dir):
            shutil.rmtree(d, ignore_errors=True)
        seed = os.path.join(out, "seed_checkpoint.safetensors")
        console.print(f"[bold]{recipe.name}[/]: {recipe.description or recipe.source}")
        common = dict(recipe=recipe.to_json(), seed_checkpoint=seed, master_port=0, cpu=args.cpu,
                      record_iterations=args.iters, record_modules=args.modules or ["*"],
                      record_microbatches=args.microbatches)
        console.print(f"reference run (1 rank) → {ref_dir}")
        launch(RunSpec(role=REFERENCE, trace_dir=ref_dir, **common))
        console.print(f"candidate run ({recipe.world_size} ranks, {recipe.parallel}) → {cand_dir}"
                      + (f", injected bugs: {args.inject}" if args.inject else ""))
        launch(RunSpec(role=CANDIDATE, trace_dir=cand_dir, inject=list(args.inject), **common))
        return _compare_and_report(ref_dir, cand_dir, args.json, console, out_dir=out if args.out else None)
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


def cmd_compare(args, console: Console) -> int:
    return _compare_and_report(args.reference, args.candidate, args.json, console)


def cmd_report(args, console: Console) -> int:
    from .report import render

    path = args.dir
    report_path = path if path.endswith(".json") else os.path.join(path, "report.json")
    if os.path.exists(report_path):
        try:
            with open(report_path) as f:
                report = json.load(f)
            verdict = report["verdict"]
        except (OSError, ValueError, KeyError) as e:
            raise TraceError(f"not a ttrace report ({e})", path=report_path) from None
        render(report, console)
        return EXIT_PASS if verdict == "pass" else EXIT_FAIL
    from .trace_store import TraceReader

    reader = TraceReader(path)
    counts = {}
    for _, rec in reader.records():
        counts[rec.key.phase] = counts.get(rec.key.phase, 0) + 1
    iterations = sorted({rec.key.iteration for _, rec in reader.records()})
    console.print(f"trace {path}: role {reader.run.get('role')}, {len(reader.ranks)} rank(s), "
                  f"iterations {iterations}, records per phase {counts}")
    return EXIT_PASS


def _int_list(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ttrace", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show library warnings")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the reference and the candidate of a recipe, then compare")
    run.add_argument("recipe", nargs="?", help="recipe YAML (default: the embedded tiny GPT, TP=2 + SP)")
    run.add_argument("--out", help="keep the traces and report.json in this directory")
    run.add_argument("--json", help="write the machine-readable report here")
    run.add_argument("--inject", action="append", default=[], metavar="BUG[:MODULE_PATTERN]",
                     help="inject a known bug into the candidate (tests and the bug zoo)")
    run.add_argument("--cpu", action="store_true", help="run on CPU with gloo even if GPUs are present")
    run.add_argument("--iters", type=_int_list, help="record only these iterations (1-based), e.g. 1,3")
    run.add_argument("--modules", action="append", metavar="PATTERN",
                     help="record only modules matching this fnmatch pattern (repeatable), e.g. 'decoder.layers.1.*'")
    run.add_argument("--microbatches", type=_int_list, help="record only these global microbatch ids, e.g. 0")

    cmp_ = sub.add_parser("compare", help="compare a candidate trace against a reference trace")
    cmp_.add_argument("reference")
    cmp_.add_argument("candidate")
    cmp_.add_argument("--json", help="write the machine-readable report here")

    rep = sub.add_parser("report", help="print the report kept in a run's --out directory, or summarize a trace")
    rep.add_argument("dir")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return EXIT_ERROR if e.code not in (0, None) else EXIT_PASS
    if not args.verbose:
        _quiet_warnings()
    console = Console()
    commands = {"run": cmd_run, "compare": cmd_compare, "report": cmd_report}
    try:
        return commands[args.command](args, console)
    except (TraceError, RecipeError, RunFailed, ValueError) as e:
        print(f"ttrace: error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
