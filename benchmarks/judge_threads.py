"""An online rank's element-wise Adam checks on its training thread, or on threads beside it.

``online.judge_threads_for`` gives each candidate rank the cores it has beyond one (at most
``online.JUDGE_THREADS_MAX``) to run its element-wise Adam checks on, beside its training; on a
2-core machine a rank of two has one core and judges on its own thread, as before. This measures
what the threads change where there are cores to spare: at the scale ladder's 50M rung (gpt_tp2_sp,
fp32, TP2 + SP, 3 iterations), each round the two layouts trained by plain megatron-core, then the
check with its reference held whole (``--reference-in memory``) and as ``auto`` places it, each with
``--judge-threads 0`` and with the default, the order of the two alternated round by round. Each
check's seconds are its sides' and compare's (``timings_s``), divided by the plain training right
before it. Then the rung once each way with ``adam_step_doubled_on_rank_1`` injected, which only
the updated values show. Each pair's reports must judge every tensor alike, bit for bit.

    python benchmarks/judge_threads.py --cpu --rounds 3 --jsonl results/judge_threads_COMMIT_MACHINE.jsonl \\
        --out results/judge_threads_COMMIT_MACHINE.md
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

from cost_table import _commit, _cpu_model  # noqa: E402
from online_bytes import check, plain  # noqa: E402

RECIPE = "gpt_tp2_sp"
PLACES = ("memory", "auto")
# (label, the run's flags): on the training thread, and as the default gives the machine's cores
THREADS = (("own thread", ["--judge-threads", "0"]), ("default", []))
FAILING = "adam_step_doubled_on_rank_1"


def _one(inject, where: str, flags, cpu: bool, workdir) -> tuple:
    """(the row of one check, its report's tensor entries as sorted JSON)."""
    with tempfile.TemporaryDirectory(dir=workdir, prefix="ttrace-judge-threads-") as tmp:
        run = check(RECIPE, "fp32", 1, True, "online", inject, tmp, cpu, reference_in=where, extra=flags)
        with open(os.path.join(tmp, "report.json")) as f:
            report = json.load(f)
    return run, sorted(json.dumps(t, sort_keys=True) for t in report["tensors"]), report.get("culprits")


def measure(rounds: int, cpu: bool, workdir, jsonl) -> list:
    import torch

    from ttrace_megatron.fork_server import available_cores
    from ttrace_megatron.online import judge_threads_for

    where_run = {"commit": _commit(), "cores": available_cores(), "judge_threads": judge_threads_for(available_cores() // 2),
                 "machine": f"{os.cpu_count()} CPU cores ({_cpu_model()}), torch {torch.__version__}, gloo"}
    rows = []
    cases = [(k, None) for k in range(rounds)] + [(rounds, FAILING)]
    for k, inject in cases:
        with tempfile.TemporaryDirectory(dir=workdir, prefix="ttrace-judge-threads-") as tmp:
            trained = plain(RECIPE, "fp32", 1, True, tmp, cpu)["seconds"]
        for where in PLACES if inject is None else PLACES[:1]:
            row = dict(where_run, round=k, inject=inject, reference_in=where, trained_s=round(sum(trained.values()), 2),
                       trained=trained)
            entries = {}
            for label, flags in (THREADS if k % 2 == 0 else THREADS[::-1]):
                run, entries[label], culprits = _one(inject, where, flags, cpu, workdir)
                row[label] = dict(seconds=round(sum(run["timings_s"].values()), 2), timings_s=run["timings_s"],
                                  verdict=run["verdict"], went=run["reference_went"], culprits=culprits)
            row.update(same_tensors=entries[THREADS[0][0]] == entries[THREADS[1][0]], tensors=len(entries[THREADS[0][0]]),
                       same_culprits=row[THREADS[0][0]]["culprits"] == row[THREADS[1][0]]["culprits"])
            rows.append(row)
            if jsonl:
                with open(jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list) -> str:
    if not rows:
        raise SystemExit("no rows to tabulate")
    own, default = (label for label, _ in THREADS)
    r0 = rows[0]
    lines = [f"commit {r0['commit']}; machine: {r0['machine']}; {r0['cores']} cores: the default gives each candidate "
             f"rank {r0['judge_threads']} judging thread(s); {RECIPE} at the 50M rung, fp32, 3 iterations; seconds: each "
             "check's sides and compare (timings_s), against the two layouts trained right before it; one run of "
             "benchmarks/judge_threads.py", "",
             "| round | reference | trained | on the training thread | on judging threads (the default) | default ÷ own "
             "thread | every tensor entry |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        what = r["reference_in"] + (f", `{r['inject']}` injected" if r["inject"] else "")
        a, b = r[own], r[default]
        lines.append(f"| {r['round'] + 1} | {what} (went: {b['went']}) | {r['trained_s']:.2f} s | {a['seconds']:.2f} s "
                     f"({a['seconds'] / r['trained_s']:.2f}×; candidate {a['timings_s'].get('candidate')}), {a['verdict']} | "
                     f"{b['seconds']:.2f} s ({b['seconds'] / r['trained_s']:.2f}×; candidate "
                     f"{b['timings_s'].get('candidate')}), {b['verdict']} | {b['seconds'] / a['seconds']:.2f} | "
                     f"{'identical' if r['same_tensors'] else 'DIFFERENT'} ({r['tensors']}), culprits "
                     f"{'identical' if r['same_culprits'] else 'DIFFERENT'} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU where GPUs are")
    parser.add_argument("--dir", help="where each check's scratch goes (default: a temporary directory)")
    parser.add_argument("--jsonl", help="each row's figures, appended")
    parser.add_argument("--out", help="the Markdown table")
    parser.add_argument("--table", help="only print the table of this JSONL file (and write it to --out)")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = measure(args.rounds, args.cpu, args.dir, args.jsonl)
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
