"""Held whole or streamed: which reference makes the faster check, by the reference's size.

``plan.STREAM_FROM_BYTES`` is where ``--reference-in auto`` starts to stream a reference that would
fit held whole. This measures what it rests on: gpt_tp2_sp (fp32, TP2 + SP, 3 iterations) at sizes
from the shipped toy to the scale ladder's 50M rung, each round the two layouts trained by plain
megatron-core, then the check with its reference held whole (``--reference-in memory``), then
streamed (``--reference-in stream``), the sizes and rounds alternated. Each check's seconds are its
sides' and compare's (``timings_s``; the run's start-up and plan are the same either way), divided by
the plain training right before it. The plan's bytes held whole and streamed name each size.
Then the rung once each way with a bug injected (``FAILING``): a failing streamed check runs its
reference again, up to the failing iteration, for the replay; and once each way in bf16, where a
perturbation run reads the streamed reference beside the candidate, and the fp32 twin follows. The
two reports' every tensor entry (the twin's too) and culprits must be identical.

    python benchmarks/stream_or_hold.py --cpu --rounds 3 --jsonl results/stream_or_hold_COMMIT_MACHINE.jsonl \\
        --out results/stream_or_hold_COMMIT_MACHINE.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if "--cpu" in sys.argv[1:]:  # (the plan's model too, under the CPU shims: hidden before anything initializes CUDA)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

from cost_table import _commit, _cpu_model, add_result_args, add_row, print_table, rows_of  # noqa: E402
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


def measure(rounds: int, cpu: bool, workdir, jsonl, planned: dict) -> list:
    import torch

    where = {"commit": _commit(), "machine": f"{os.cpu_count()} CPU cores ({_cpu_model()}), torch {torch.__version__}, gloo"}
    rows = []
    for k in range(rounds):
        for name, wide in SIZES.items():
            with tempfile.TemporaryDirectory(dir=workdir, prefix="ttrace-stream-or-hold-") as tmp:
                trained = plain(RECIPE, "fp32", 1, wide or False, tmp, cpu)["seconds"]
                row = dict(where, size=name, round=k, trained_s=round(sum(trained.values()), 2),
                           held_bytes=planned[name]["memory"], streamed_bytes=planned[name]["stream"])
                for mode in MODES:
                    run = check(RECIPE, "fp32", 1, wide or False, "online", None, tmp, cpu, reference_in=mode)
                    if run["verdict"] != "pass" or run["reference_went"] != mode:
                        raise SystemExit(f"{name}, --reference-in {mode}: {run['verdict']}, went {run['reference_went']}")
                    row[mode] = round(sum(run["timings_s"].values()), 2)
                    row[mode + "_timings_s"] = run["timings_s"]
                rows.append(row)
                add_row(row, jsonl)
    return rows


# a bug at the rung: a failing streamed check runs its reference again, up to the failing iteration, for the replay
FAILING = "row_allreduce_dropped:decoder.layers.5.mlp.linear_fc2"
# the rung's checks held whole and streamed, once each: (label, dtype, injected bug)
AT_THE_RUNG = (("failing", "fp32", FAILING),
               # bf16: its perturbation run reads a streamed reference beside the candidate; its fp32 twin follows
               ("bf16", "bf16", None))


# the rung in bf16 with each pair's reference placed by auto (the pair's held: its perturbation run reads
# it; the fp32 twin's streamed), against both held and both streamed, the order turned each round
PLACED = ("memory", "auto", "stream")


def at_the_rung(label: str, dtype: str, inject, cpu: bool, workdir, jsonl, modes=MODES) -> dict:
    """The 50M rung's check in ``dtype`` (``inject`` injected, or clean), its reference placed each
    way of ``modes`` (``--reference-in``), in that order: every seconds part (a twin's too), where
    each pair's reference went, and whether the reports judge every tensor alike (the twin's too) and
    name the same culprits."""
    import torch

    reports, row = {}, {"size": label, "dtype": dtype, "inject": inject, "commit": _commit(), "modes": list(modes),
                        "machine": f"{os.cpu_count()} CPU cores ({_cpu_model()}), torch {torch.__version__}, gloo"}
    for mode in modes:
        with tempfile.TemporaryDirectory(dir=workdir, prefix="ttrace-stream-or-hold-") as tmp:
            run = check(RECIPE, dtype, 1, True, "online", inject, tmp, cpu, reference_in=mode)
            if mode != "auto" and run["reference_went"] != mode:
                raise SystemExit(f"the rung, {label}, --reference-in {mode}: the reference went {run['reference_went']}")
            with open(os.path.join(tmp, "report.json")) as f:
                reports[mode] = json.load(f)
        twin = reports[mode].get("fp32_twin") or {}
        row[mode] = round(sum(run["timings_s"].values()) + sum((twin.get("timings_s") or {}).values()), 2)
        row[mode + "_timings_s"], row[mode + "_verdict"], row[mode + "_culprit"] = \
            run["timings_s"], run["verdict"], run["culprit"]
        row[mode + "_went"] = [run["reference_went"]] + ([twin.get("reference_in")] if twin else [])
        if twin:
            row[mode + "_twin_timings_s"], row[mode + "_twin_verdict"] = twin.get("timings_s"), twin["verdict"]

    def entries(report: dict) -> list:
        return sorted(json.dumps(t, sort_keys=True) for t in report["tensors"] + (report.get("fp32_twin") or {}).get(
            "tensors", []))
    first = reports[modes[0]]
    row.update(same_tensors=all(entries(reports[m]) == entries(first) for m in modes), tensors=len(entries(first)),
               same_culprits=all(reports[m].get("culprits") == first.get("culprits") for m in modes))
    add_row(row, jsonl)
    return row


def table(rows: list) -> str:
    if not rows:
        raise SystemExit("no rows to tabulate")
    rounds = max([r["round"] for r in rows if "round" in r] or [0]) + 1
    if not any("round" in r for r in rows):  # (--placed-rounds: the rung in bf16 alone)
        header = (f"commit {rows[0]['commit']}; machine: {rows[0]['machine']}; {RECIPE} at the 50M rung in bf16, 3 iterations, "
                  f"with its perturbation run and fp32 twin; {len(rows)} rounds, the order of the three placements turned "
                  "each round; seconds: each check's sides and compare (timings_s), the twin's too; one run of "
                  "benchmarks/stream_or_hold.py --placed-rounds")
        return header + "\n" + "\n".join(_rung_line(r) for r in rows) + "\n"
    header = (f"commit {rows[0]['commit']}; machine: {rows[0]['machine']}; {RECIPE}, 3 iterations; by size in fp32, {rounds} rounds, "
              "sizes and checks alternated; seconds: each check's sides and compare (timings_s), against the two "
              "layouts trained right before it; one run of benchmarks/stream_or_hold.py")
    lines = [header, "", "| reference | held whole | streamed peak | trained | held whole: check | streamed: check | "
             "streamed ÷ held |", "|---|---|---|---|---|---|---|"]
    for name in SIZES:
        runs = [r for r in rows if r["size"] == name]
        if not runs:
            continue
        each = lambda xs, f=".2f": " / ".join(format(x, f) for x in xs)  # noqa: E731
        lines.append(f"| {name} | {runs[0]['held_bytes'] / 1e9:.2f} GB | {runs[0]['streamed_bytes'] / 1e9:.2f} GB | "
                     f"{each([r['trained_s'] for r in runs])} s | {each([r['memory'] for r in runs])} s "
                     f"({each([r['memory'] / r['trained_s'] for r in runs])}×) | "
                     f"{each([r['stream'] for r in runs])} s ({each([r['stream'] / r['trained_s'] for r in runs])}×) | "
                     f"{each([r['stream'] / r['memory'] for r in runs])} |")
    for r in (r for r in rows if "inject" in r):
        lines.append(_rung_line(r))
    return "\n".join(lines) + "\n"


MODE_NAMES = {"memory": "held whole", "stream": "streamed", "auto": "auto"}


def _rung_line(r: dict) -> str:
    """One check at the rung, each way it was placed: its seconds and their parts (a twin's too),
    where each pair's reference went, the verdicts and culprits, and whether the ways agree."""
    modes = r.get("modes") or list(MODES)

    def parts(mode: str) -> str:
        twin = r.get(mode + "_twin_timings_s")
        return ", ".join(f"{k} {v}" for k, v in r[mode + "_timings_s"].items()) + (
            f"; its fp32 twin: " + ", ".join(f"{k} {v}" for k, v in twin.items()) if twin else "")

    def went(mode: str) -> str:
        places = r.get(mode + "_went")
        return "" if mode != "auto" or not places else f"the pair's {places[0]}" + (
            f", the twin's {places[1]}" if len(places) > 1 else "") + "; "

    what = f"with `{r['inject']}` injected" if r["inject"] else "clean"
    twins = (" (twins " + " and ".join(r[m + "_twin_verdict"] for m in modes) + ")"
             if r.get(modes[0] + "_twin_verdict") else "")
    ways = ", ".join(f"{MODE_NAMES[m]} {r[m]} s ({went(m)}{parts(m)})" for m in modes)
    return (f"\nthe 50M rung in {r.get('dtype', 'fp32')}, {what}: {ways}; " + " and ".join(r[m + "_verdict"] for m in modes)
            + f"{twins}, culprit " + " and ".join(str(r[m + "_culprit"]) for m in modes) + f"; the {r['tensors']} tensors' "
            f"entries {'identical' if r['same_tensors'] else 'DIFFERENT'}, the culprits "
            f"{'identical' if r['same_culprits'] else 'DIFFERENT'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU where GPUs are (streaming needs CPU ranks)")
    add_result_args(parser)
    parser.add_argument("--placed-rounds", type=int, default=0, metavar="N",
                        help="only the rung in bf16, held whole, placed by auto and streamed, N rounds, the order turned")
    args = parser.parse_args()
    if args.table:
        rows = rows_of(args.table)
    elif args.placed_rounds:
        rows = [at_the_rung("bf16, each pair placed", "bf16", None, args.cpu, args.dir, args.jsonl,
                            PLACED[k % 3:] + PLACED[:k % 3]) for k in range(args.placed_rounds)]
        if any(r["auto_went"] != ["memory", "stream"] for r in rows):  # (not the placement this compares: too little memory)
            raise SystemExit(f"auto placed the pair's and the twin's references {[r['auto_went'] for r in rows]}")
    else:
        planned = {name: planned_bytes(wide) for name, wide in SIZES.items()}
        rows = measure(args.rounds, args.cpu, args.dir, args.jsonl, planned)
        rows += [at_the_rung(*case, args.cpu, args.dir, args.jsonl) for case in AT_THE_RUNG]
    print_table(table(rows), args.out)


if __name__ == "__main__":
    main()
