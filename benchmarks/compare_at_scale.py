"""Compare's throughput and peak memory on the traces of the scale ladder's 50M-parameter rung.

``costs.py`` measures compare on a toy trace whose largest tensor is 8 MiB: there the comparing
process's fixed memory (manifests, keys, results: per record, not per byte) is ten times that
tensor. Here the same measurement runs on the traces a user's first check writes: the 50M rung
(``margins.WIDE``: 8 layers, hidden 512, vocabulary 32768, TP2 + SP, 3 iterations), recorded on
both sides by ``ttrace run --keep-traces``, then compared in a fresh process on each number of
workers, the traces in the page cache (read once before). One JSON line per compare.

    python benchmarks/compare_at_scale.py --workers 1 2 --out results/compare_at_scale_COMMIT.jsonl

``--traces DIR`` keeps the traces there (recorded once, when DIR has none) and ``--repo`` compares
with another checkout's ttrace_megatron: two commits measured on the same traces in one session.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from costs import COMPARE_CHILD, dir_bytes, memory_bandwidth, read_into_page_cache  # noqa: E402
from margins import recipe as shipped_recipe  # noqa: E402


def largest_tensor_bytes(trace_dir: str) -> int:
    import math

    import torch

    from ttrace_megatron.trace_store import TraceReader

    return max(math.prod(r.layout.logical_shape) * getattr(torch, r.dtype).itemsize
               for _, r in TraceReader(trace_dir).records())


def main():
    import yaml

    from ttrace_megatron.cli import main as cli

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="gpt_tp2_sp")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--dir", help="where the traces go (default: a temporary directory)")
    parser.add_argument("--out", required=True, help="JSON lines are appended here")
    parser.add_argument("--traces", help="keep the traces in this directory; record them only where it has none")
    parser.add_argument("--repo", default=REPO, help="the checkout whose ttrace_megatron compares (default: this one)")
    args = parser.parse_args()
    tmp = args.traces or tempfile.mkdtemp(dir=args.dir, prefix="ttrace-compare-at-scale-")
    os.makedirs(tmp, exist_ok=True)
    try:
        path = os.path.join(tmp, "recipe.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(shipped_recipe(args.recipe, "fp32", 1, True).to_json(), f)
        out = os.path.join(tmp, "out")
        if not os.path.exists(os.path.join(out, "candidate", "run.json")):
            with open(os.path.join(tmp, "terminal.txt"), "w") as t, contextlib.redirect_stdout(t):
                cli(["run", path, "--out", out, "--keep-traces", "--quiet", "--no-disk-check"])
        ref, cand = os.path.join(out, "reference"), os.path.join(out, "candidate")
        nbytes, largest, bandwidth = dir_bytes(ref) + dir_bytes(cand), largest_tensor_bytes(ref), memory_bandwidth()
        env = dict(os.environ, PYTHONPATH=args.repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
        commit = subprocess.run(["git", "-C", args.repo, "rev-parse", "--short=7", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        for workers in args.workers:
            read_into_page_cache(ref, cand)
            # (in the checkout: ``-c`` puts the working directory first on the path)
            run = subprocess.run([sys.executable, "-c", COMPARE_CHILD, ref, cand, str(workers)], capture_output=True,
                                 text=True, env=env, check=True, cwd=args.repo)
            res = json.loads(run.stdout.strip().splitlines()[-1])
            row = {"recipe": args.recipe, "rung": "50M (8 layers, h512, V32k, 3 iterations)", "workers": workers,
                   "trace_bytes": nbytes, "largest_tensor_bytes": largest, "memory_bandwidth": bandwidth,
                   "seconds": res["seconds"], "throughput": nbytes / res["seconds"],
                   "of_memory_bandwidth": nbytes / res["seconds"] / bandwidth,
                   "peak_over_baseline": res["peak_kib_over_baseline"] * 1024,
                   "peak_over_largest": res["peak_kib_over_baseline"] * 1024 / largest,
                   "worker_peak_over_largest": None if res.get("worker_peak_bytes") is None
                   else res["worker_peak_bytes"] / largest,
                   "tensors": res["tensors"], "verdict": res["verdict"], "commit": commit,
                   "machine": f"{os.cpu_count()} CPU cores ({platform.machine()})"}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    finally:
        if not args.traces:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
