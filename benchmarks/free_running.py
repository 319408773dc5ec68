"""Clean recipes outside lock-step (issue #38): ``ttrace run RECIPE --no-lockstep`` on each clean shipped
recipe, which must pass. Each row: the verdict, the tensors judged and those listed as not judged
(computed from weights that diverged after the first step), and the worst judged ratio.

    python benchmarks/free_running.py [--recipes gpt_tp2 ...] [--jsonl OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_runs import ttrace_run, worst_ratio  # noqa: E402
from margins import CLEAN  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=list(CLEAN))
    ap.add_argument("--jsonl")
    args = ap.parse_args()
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    for name in args.recipes:
        out = tempfile.mkdtemp(prefix="ttrace-free-")
        try:
            # recorded: later updates are judged from each side's previous parameters, which an
            # online check does not keep (it lists them as diverged)
            r = ttrace_run(name, out, ["--no-lockstep", "--no-localize", "--keep-traces"])
            row = dict(recipe=name, commit=commit, verdict=r.get("verdict"), rc=r["_rc"], seconds=r["_seconds"],
                       judged=r.get("summary", {}).get("compared"),
                       not_judged=len((r.get("diverged") or {}).get("tensors", [])), worst=worst_ratio(r),
                       first_mismatch=r.get("first_mismatch"))
        except Exception as e:  # a run that could not finish is a row too
            row = dict(recipe=name, commit=commit, verdict="error", error=f"{type(e).__name__}: {e}"[:300])
        finally:
            shutil.rmtree(out, ignore_errors=True)
        print(json.dumps(row), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
