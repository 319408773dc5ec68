"""A streamed reference's cost by the number of iterations, against one held whole.

``--reference-in stream`` publishes the reference one iteration at a time, and each candidate rank
reads the reference's manifest again as each iteration comes (``OnlineComparer.ensure``:
``TraceReader.reload`` and ``group_records`` over every record listed so far). This measures what
that costs as a check grows longer: gpt_tp2_sp as shipped (fp32, TP2 + SP), its iterations set to
each of ``ITERATIONS``, checked with its reference held whole (``--reference-in memory``) and
streamed, alternated; each check's sides' seconds (``timings_s``: the reference and the candidate,
which run beside each other when streamed) and its verdict.

    python benchmarks/stream_iterations.py --jsonl results/stream_iterations_COMMIT_MACHINE.jsonl \\
        --out results/stream_iterations_COMMIT_MACHINE.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # (streaming needs CPU ranks; the plan's model under the CPU shims)

from cost_table import _commit, _cpu_model, add_result_args, add_row, print_table, rows_of  # noqa: E402

RECIPE = os.path.join(REPO, "recipes", "gpt_tp2_sp.yaml")
ITERATIONS = (3, 12, 24, 48)
MODES = ("memory", "stream")


def one(iterations: int, mode: str, tmp: str) -> dict:
    import yaml

    from ttrace_megatron.cli import main

    raw = yaml.safe_load(open(RECIPE))
    raw["train"] = dict(raw["train"], iterations=iterations)
    path, report = os.path.join(tmp, "recipe.yaml"), os.path.join(tmp, "report.json")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        main(["run", path, "--cpu", "--quiet", "--reference-in", mode, "--out", os.path.join(tmp, "out"),
              "--json", report])
    with open(report) as f:
        r = json.load(f)
    t = r["timings_s"]
    return {"iterations": iterations, "mode": mode, "verdict": r["verdict"], "went": r.get("reference_in"),
            "timings_s": t, "sides_s": round(t["reference"] + t["candidate"], 2)}


def measure(workdir, jsonl) -> list:
    import torch

    where = {"commit": _commit(), "machine": f"{os.cpu_count()} CPU cores ({_cpu_model()}), torch {torch.__version__}, gloo"}
    rows = []
    for iterations in ITERATIONS:
        for mode in MODES:
            with tempfile.TemporaryDirectory(dir=workdir, prefix="ttrace-stream-iterations-") as tmp:
                row = dict(where, **one(iterations, mode, tmp))
            rows.append(row)
            add_row(row, jsonl)
    return rows


def table(rows: list) -> str:
    r0 = rows[0]
    lines = [f"commit {r0['commit']}; machine: {r0['machine']}; gpt_tp2_sp as shipped (fp32, TP2 + SP), its iterations "
             "set, held whole and streamed, alternated; seconds: the sides (reference + candidate, beside each other "
             "when streamed); one run of benchmarks/stream_iterations.py", "",
             "| iterations | held whole: sides | streamed: sides | streamed ÷ held | streamed: a further iteration | "
             "verdicts |", "|---|---|---|---|---|---|"]
    last = None
    for n in sorted({r["iterations"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["iterations"] == n}
        held, streamed = by["memory"], by["stream"]
        step = "" if last is None else (f"{(streamed['sides_s'] - last['sides_s']) / (n - last['iterations']):.3f} s "
                                        f"(held {(held['sides_s'] - last_held['sides_s']) / (n - last['iterations']):.3f})")
        lines.append(f"| {n} | {held['sides_s']:.2f} s (reference {held['timings_s']['reference']}, candidate "
                     f"{held['timings_s']['candidate']}) | {streamed['sides_s']:.2f} s (reference "
                     f"{streamed['timings_s']['reference']}, candidate {streamed['timings_s']['candidate']}) | "
                     f"{streamed['sides_s'] / held['sides_s']:.2f} | {step} | {held['verdict']}, {streamed['verdict']} "
                     f"(went: {held['went']}, {streamed['went']}) |")
        last, last_held = streamed, held
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_result_args(parser)
    args = parser.parse_args()
    print_table(table(rows_of(args.table) if args.table else measure(args.dir, args.jsonl)), args.out)


if __name__ == "__main__":
    main()
