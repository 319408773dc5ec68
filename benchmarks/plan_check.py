"""``ttrace plan``'s predictions against the bytes real checks wrote (issue #35: within 5 %).

    python benchmarks/plan_check.py --ladder benchmarks/results/scale_terms_*.jsonl [--jsonl OUT]
    python benchmarks/plan_check.py --recipes recipes/gpt_tp2_sp.yaml ... [--jsonl OUT]

``--ladder``: every rung of the scale ladder's result files, whose rows hold the bytes each check's
``--out`` directory held (``trace_bytes``: both sides, the perturbation run of a bf16 rung, the seed
checkpoint and the reports; run with ``--no-fp32-twin --no-localize``). The recipe of each rung is
rebuilt with ``scale.recipe`` and planned; nothing runs. ``--recipes``: each recipe is run with
``ttrace run --out`` as a user runs it (its fp32 twin included) and every trace directory is
compared with its side's prediction.
"""

from __future__ import annotations

import argparse
import itertools
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


def _commit() -> str:
    return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def ladder_rows(paths):
    import scale
    from ttrace_megatron.adapter.run import plan as planner
    from ttrace_megatron.recipe import recipe_from_dict

    shapes = {}
    for path in paths:
        for line in open(path):
            row = json.loads(line)
            if row.get("verdict") not in ("pass", "fail") or not row.get("trace_bytes"):
                continue
            spec = scale.recipe(row["family"], row["layout"], row["shape"], row["seed"], row["dtype"])
            recipe = recipe_from_dict(dict(spec, name=f"{row['family']}_{row['layout']}"), source=path)
            key = json.dumps(dict(spec, data=dict(spec["data"], seed=0)), sort_keys=True)
            if key not in shapes:
                shapes[key] = planner.model_shape(recipe)
            plan = planner.check_plan(recipe, twin=False, keep=True, shape=shapes[key])
            predicted = plan.all_bytes()
            yield {"source": os.path.basename(path), "family": row["family"], "layout": row["layout"],
                   "axis": row["axis"], "value": row["value"], "seed": row["seed"], "dtype": row["dtype"],
                   "measured": row["trace_bytes"], "predicted": predicted,
                   "ratio": round(predicted / row["trace_bytes"], 4)}


def recipe_rows(paths):
    from ttrace_megatron import plan as core
    from ttrace_megatron.adapter.run import plan as planner
    from ttrace_megatron.recipe import load_recipe

    from ttrace_megatron.adapter.recipe.config import validate_recipe
    from ttrace_megatron.errors import RecipeError

    for path in paths:
        recipe = load_recipe(path)
        try:
            validate_recipe(recipe)  # what the run refuses (HybridModel on a release without it) has no plan
            plan = planner.check_plan(recipe)
        except RecipeError as e:
            yield {"recipe": recipe.name, "dtype": recipe.dtype, "refused": str(e)[:200]}
            continue
        tmp = tempfile.mkdtemp(prefix="plan-check-")
        try:
            out = os.path.join(tmp, "out")
            # every side recorded (run's default judges the candidate online and writes no tensor of it)
            proc = subprocess.run([sys.executable, "-m", "ttrace_megatron.cli", "run", path, "--out", out, "--quiet",
                                   "--no-localize", "--keep-traces"], capture_output=True, text=True, cwd=REPO)
            for side in plan.sides:
                d = os.path.join(out, side.name)
                measured = core.measured_bytes(d) if os.path.isdir(d) else 0
                yield {"recipe": recipe.name, "dtype": recipe.dtype, "side": side.name, "rc": proc.returncode,
                       "measured": measured, "predicted": side.total(),
                       "ratio": round(side.total() / measured, 4) if measured else None}
            seed = os.path.join(out, "seed_checkpoint.safetensors")
            if os.path.exists(seed):
                yield {"recipe": recipe.name, "dtype": recipe.dtype, "side": core.SEED_CHECKPOINT, "rc": proc.returncode,
                       "measured": os.path.getsize(seed), "predicted": plan.seed_checkpoint_bytes,
                       "ratio": round(plan.seed_checkpoint_bytes / os.path.getsize(seed), 4)}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ladder", nargs="*", default=[])
    ap.add_argument("--recipes", nargs="*", default=[])
    ap.add_argument("--jsonl")
    args = ap.parse_args()
    meta = dict(commit=_commit(), machine=f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})")
    rows = []
    for row in itertools.chain(ladder_rows(args.ladder), recipe_rows(args.recipes)):
        row.update(meta)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
    ratios = [r["ratio"] for r in rows if r.get("ratio")]
    if ratios:
        worst = max(rows, key=lambda r: abs((r.get("ratio") or 1) - 1))
        print(f"\n{len(ratios)} predictions, predicted / measured {min(ratios):.3f}–{max(ratios):.3f}; "
              f"worst: {json.dumps({k: v for k, v in worst.items() if k not in ('commit', 'machine')})}")


if __name__ == "__main__":
    main()
