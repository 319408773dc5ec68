"""What the fp32 twin costs (issue #36): ``ttrace run`` of clean low-precision recipes, the
recipe's own pair (reference, candidate, perturbation run, compare) and its fp32 twin (reference,
candidate, compare) timed in the same check, and their traces' bytes.

    python benchmarks/twin_cost.py [--recipes gpt_tp2_sp:bf16 moe_tp2_sp_ep2:bf16 ...] [--wide]
        [--jsonl benchmarks/results/twin_cost.jsonl]

``--wide``: each recipe widened to 4 layers, hidden 512, vocabulary 32k as well (margins.widen).
The ratio is the twin's seconds over the pair's: on this CPU bf16 GEMMs are ~100× slower than
fp32 ones, so it is far below what a GPU, where fp32 GEMMs are the slower ones, would show.
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


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def measure(name: str, dtype: str, wide: bool) -> dict:
    import yaml

    import margins
    from ttrace_megatron.cli import main

    raw = yaml.safe_load(open(os.path.join(REPO, "recipes", name + ".yaml")))
    if wide:
        raw = margins.widen(raw, WIDE)
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
        return {"recipe": name, "dtype": dtype, "wide": wide, "rc": rc, "verdict": report["verdict"],
                "pair_seconds": report["seconds"], "twin_seconds": twin["seconds"],
                "ratio": round(twin["seconds"] / report["seconds"], 3),
                "pair_bytes": _bytes(out) - twin_bytes, "twin_bytes": twin_bytes}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=list(DEFAULT), metavar="RECIPE:DTYPE")
    ap.add_argument("--wide", action="store_true", help="the widened recipes too")
    ap.add_argument("--jsonl")
    args = ap.parse_args()
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    rows = []
    for spec in args.recipes:
        name, dtype = spec.split(":")
        for wide in (False, True) if args.wide else (False,):
            row = dict(measure(name, dtype, wide), commit=commit,
                       machine=f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), gloo")
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print("\n| recipe | dtype | size | pair s | fp32 twin s | twin / pair | pair GB | twin GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['dtype']} | {'4×512, V 32k' if r['wide'] else 'as shipped'} | "
              f"{r['pair_seconds']:.1f} | {r['twin_seconds']:.1f} | {r['ratio']:.2f} | {r['pair_bytes'] / 1e9:.2f} | "
              f"{r['twin_bytes'] / 1e9:.2f} |")


if __name__ == "__main__":
    main()
