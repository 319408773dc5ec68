"""What the fp32 twin costs (issue #36): ``ttrace run`` of clean low-precision recipes, the
recipe's own pair (reference, candidate, perturbation run, compare) and its fp32 twin (reference,
candidate, compare) timed in the same check, and their traces' bytes.

    python benchmarks/twin_cost.py [--recipes gpt_tp2_sp:bf16 moe_tp2_sp_ep2:bf16 ...] [--wide]
        [--jsonl benchmarks/results/twin_cost.jsonl]

``--wide``: each recipe widened to 4 layers, hidden 512, vocabulary 32k as well (margins.widen);
``--size L,H,V`` names another widened size (alone: only that size). ``--single-rank``: each side on one rank (world size 1,
no parallelism), for a machine with one GPU: the recipe's model and data, not its layout.
The ratio is the twin's seconds over the pair's: on a CPU bf16 GEMMs are ~100× slower than
fp32 ones, so it is far below what a GPU, where fp32 GEMMs are the slower ones, shows.
"""

from __future__ import annotations

import argparse
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

DEFAULT = ("gpt_tp2_sp:bf16", "gpt_pp2:bf16", "moe_tp2_sp_ep2:bf16", "gpt_tp2_sp_fp16:fp16", "gpt_tp2_sp_fp8:fp8")
WIDE = dict(num_layers=4, hidden_size=512, vocab_size=32768)


def _size_label(size) -> str:
    return f"{size['num_layers']}×{size['hidden_size']}, V {size['vocab_size'] // 1024}k" if size else "as shipped"


def _machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), gloo, torch {torch.__version__}"


def measure(name: str, dtype: str, size, single_rank: bool) -> dict:
    import yaml

    import margins
    from ttrace_megatron.cli import main
    from ttrace_megatron.plan import measured_bytes as _bytes

    raw = yaml.safe_load(open(os.path.join(REPO, "recipes", name + ".yaml")))
    if size:
        raw = margins.widen(raw, size)
    if single_rank:
        raw.update(world_size=1, parallel={})
    raw.update(dtype=dtype, name=name)
    tmp = tempfile.mkdtemp(prefix="twin-cost-")
    try:
        path = os.path.join(tmp, name + ".yaml")
        with open(path, "w") as f:
            yaml.safe_dump(raw, f)
        out = os.path.join(tmp, "out")
        rc = main(["run", path, "--out", out, "--json", os.path.join(tmp, "r.json")])
        with open(os.path.join(tmp, "r.json")) as f:
            report = json.load(f)
        twin = report["fp32_twin"]
        twin_bytes = _bytes(os.path.join(out, "fp32_twin"))
        return {"recipe": name, "dtype": dtype, "size": _size_label(size), "single_rank": single_rank, "rc": rc, "verdict": report["verdict"],
                "pair_seconds": report["seconds"], "twin_seconds": twin["seconds"],
                "ratio": round(twin["seconds"] / report["seconds"], 3),
                "pair_bytes": _bytes(out) - twin_bytes, "twin_bytes": twin_bytes}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=list(DEFAULT), metavar="RECIPE:DTYPE")
    ap.add_argument("--wide", action="store_true", help="the widened recipes too")
    ap.add_argument("--size", metavar="L,H,V", help="widen to L layers, hidden H, vocabulary V instead of 4,512,32768")
    ap.add_argument("--single-rank", action="store_true", help="each side on one rank (a one-GPU machine)")
    ap.add_argument("--jsonl")
    args = ap.parse_args()
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    wide = dict(zip(("num_layers", "hidden_size", "vocab_size"), map(int, args.size.split(",")))) if args.size else WIDE
    rows = []
    for spec in args.recipes:
        name, dtype = spec.split(":")
        for size in (None, wide) if args.wide else ((wide,) if args.size else (None,)):
            try:
                row = measure(name, dtype, size, args.single_rank)
            except Exception as e:  # one recipe's failure is a row, not the end of the measure
                row = {"recipe": name, "dtype": dtype, "size": _size_label(size), "error": repr(e)[:300]}
            row.update(commit=commit, machine=_machine())
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print("\n| recipe | dtype | size | pair s | fp32 twin s | twin / pair | pair GB | twin GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['recipe']} | {r['dtype']} | {r['size']} | {r['error']} |")
            continue
        print(f"| {r['recipe']} | {r['dtype']} | {r['size']} | "
              f"{r['pair_seconds']:.1f} | {r['twin_seconds']:.1f} | {r['ratio']:.2f} | {r['pair_bytes'] / 1e9:.2f} | "
              f"{r['twin_bytes'] / 1e9:.2f} |")


if __name__ == "__main__":
    main()
