"""Held whole or streamed: which reference makes the faster check, by the reference's size.

``plan.STREAM_FROM_BYTES`` is where ``--reference-in auto`` starts to stream a reference that would
fit held whole. This measures what it rests on: gpt_tp2_sp (fp32, TP2 + SP, 3 iterations) at sizes
from the shipped toy to the scale ladder's 50M rung, each round the two layouts trained by plain
megatron-core, then the check with its reference held whole (``--reference-in memory``), then
streamed (``--reference-in stream``), the sizes and rounds alternated. Each check's seconds are its
sides' and compare's (``timings_s``; the run's start-up and plan are the same either way), divided by
the plain training right before it. The plan's bytes held whole and streamed name each size.

    python benchmarks/stream_or_hold.py --rounds 3 --jsonl results/stream_or_hold_COMMIT_MACHINE.jsonl \\
        --out results/stream_or_hold_COMMIT_MACHINE.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if "--cpu" in sys.argv[1:]:  # (the plan's model too, under the CPU shims: hidden before anything initializes CUDA)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

from margins import recipe as shipped_recipe  # noqa: E402
from online_bytes import check, plain  # noqa: E402

RECIPE = "gpt_tp2_sp"
# None: as shipped (2 layers, hidden 64, vocabulary 250); True: the 50M rung (margins.WIDE)
SIZES = {"as shipped": None,
         "4 layers, hidden 256, vocabulary 8192": dict(num_layers=4, hidden_size=256, vocab_size=8192),
         "6 layers, hidden 384, vocabulary 16384": dict(num_layers=6, hidden_size=384, vocab_size=16384),
         "the 50M rung: 8 layers, hidden 512, vocabulary 32768": True}
MODES = ("memory", "stream")


def planned_bytes(wide) -> dict:
    """The plan's reference held whole and its streamed peak, bytes."""
    from ttrace_megatron import plan as core
    from ttrace_megatron.adapter.run.plan import check_plan

    r = shipped_recipe(RECIPE, "fp32", 1, wide or False)
    return {mode: check_plan(r, online=True, twin=False, reference_in=mode).memory_needed()
            for mode in (core.MEMORY, core.STREAM)}


def measure(rounds: int, cpu: bool, workdir, jsonl) -> list:
    rows = []
    for k in range(rounds):
        for name, wide in SIZES.items():
            with tempfile.TemporaryDirectory(dir=workdir, prefix="ttrace-stream-or-hold-") as tmp:
                trained = plain(RECIPE, "fp32", 1, wide or False, tmp, cpu)["seconds"]
                row = {"size": name, "round": k, "trained_s": round(sum(trained.values()), 2)}
                for mode in MODES:
                    run = check(RECIPE, "fp32", 1, wide or False, "online", None, tmp, cpu, reference_in=mode)
                    if run["verdict"] != "pass" or run["reference_went"] != mode:
                        raise SystemExit(f"{name}, --reference-in {mode}: {run['verdict']}, went {run['reference_went']}")
                    row[mode] = round(sum(run["timings_s"].values()), 2)
                    row[mode + "_timings_s"] = run["timings_s"]
                rows.append(row)
                if jsonl:
                    with open(jsonl, "a") as f:
                        f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    return rows


def table(rows: list, planned: dict, header: str) -> str:
    lines = [header, "", "| reference | held whole | streamed peak | trained | held whole: check | streamed: check | "
             "streamed ÷ held |", "|---|---|---|---|---|---|---|"]
    for name in SIZES:
        runs = [r for r in rows if r["size"] == name]
        each = lambda xs, f=".2f": " / ".join(format(x, f) for x in xs)  # noqa: E731
        lines.append(f"| {name} | {planned[name]['memory'] / 1e9:.2f} GB | {planned[name]['stream'] / 1e9:.2f} GB | "
                     f"{each([r['trained_s'] for r in runs])} s | {each([r['memory'] for r in runs])} s "
                     f"({each([r['memory'] / r['trained_s'] for r in runs])}×) | "
                     f"{each([r['stream'] for r in runs])} s ({each([r['stream'] / r['trained_s'] for r in runs])}×) | "
                     f"{each([r['stream'] / r['memory'] for r in runs])} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU where GPUs are (streaming needs CPU ranks)")
    parser.add_argument("--dir", help="where each round's scratch goes (default: a temporary directory)")
    parser.add_argument("--jsonl", help="each round's figures, appended")
    parser.add_argument("--out", help="the Markdown table")
    args = parser.parse_args()
    import torch

    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short=7", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    planned = {name: planned_bytes(wide) for name, wide in SIZES.items()}
    rows = measure(args.rounds, args.cpu, args.dir, args.jsonl)
    header = (f"commit {commit}; machine: {os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}, "
              f"gloo; {RECIPE}, fp32, 3 iterations; {args.rounds} rounds, sizes and checks alternated; seconds: "
              "each check's sides and compare (timings_s), against the two layouts trained right before it")
    text = table(rows, planned, header)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
