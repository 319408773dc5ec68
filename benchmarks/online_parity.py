"""The default check (online) against the recorded one (``--keep-traces``) on every shipped recipe.

Each recipe's candidate runs once in lock-step with its reference, judging online *and* writing
its tensors; its online verdict (``online.combine_online``) is set beside the offline comparison of
the same tensors (``compare.compare_traces``): the verdict, the keys each judges, skips and lists
as missing, and every key whose verdict differs. A clean recipe that passes offline and fails
online (or the reverse) is a finding of the default switch. One JSON line per recipe and dtype.

    python benchmarks/online_parity.py --dtypes fp32 bf16 --out results/online_parity_COMMIT.jsonl
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def runnable(path: str, dtype: str):
    """(the recipe at ``path`` in ``dtype`` or None, its row): the row says why where it is refused."""
    from ttrace_megatron.adapter.recipe.config import validate_recipe
    from ttrace_megatron.errors import RecipeError
    from ttrace_megatron.recipe import load_recipe

    recipe = load_recipe(path)
    recipe.dtype = dtype
    row = {"recipe": recipe.name, "dtype": dtype}
    try:
        validate_recipe(recipe)
    except RecipeError as e:
        return None, dict(row, refused=str(e)[:200])
    return recipe, row


def parity(path: str, dtype: str, tmp: str) -> dict:
    from ttrace_megatron.adapter.run.launch import launch
    from ttrace_megatron.adapter.run.runner import CANDIDATE, REFERENCE, RunSpec, trace_options
    from ttrace_megatron.compare import compare_traces
    from ttrace_megatron.errors import RecipeError, RunFailed, TraceError
    from ttrace_megatron.online import combine_online

    recipe, row = runnable(path, dtype)
    if recipe is None:
        return row
    ref, cand, seed = (os.path.join(tmp, d) for d in ("reference", "candidate", "seed.safetensors"))
    try:
        launch(RunSpec(recipe=recipe.to_json(), role=REFERENCE, trace=trace_options(ref, seed)), timeout_s=900)
        launch(RunSpec(recipe=recipe.to_json(), role=CANDIDATE,
                       trace=trace_options(cand, seed, lockstep=ref, reference=ref, keep_tensors=True)), timeout_s=900)
        offline, online = compare_traces(ref, cand), combine_online(cand)
    except (RecipeError, RunFailed, TraceError, ValueError) as e:
        return dict(row, error=f"{type(e).__name__}: {str(e)[:300]}")
    off = {r.key: r for r in offline.results}
    on = {r.key: r for r in online.results}
    differ = sorted(str(k) for k in set(on) & set(off) if on[k].verdict != off[k].verdict)
    worst = lambda c: max((r.ratio for r in c.results), default=0.0)  # noqa: E731
    return dict(row, offline=offline.verdict, online=online.verdict, same=offline.verdict == online.verdict,
                judged_offline=len(off), judged_online=len(on), judged_only_offline=len(set(off) - set(on)),
                judged_only_online=len(set(on) - set(off)), skipped_online=len(online.skipped),
                missing_online=len(online.missing_in_candidate), missing_offline=len(offline.missing_in_candidate),
                verdicts_differ=differ[:10], worst_offline=worst(offline), worst_online=worst(online))


def each_recipe(parity_of, description: str) -> None:
    """``parity_of(recipe path, dtype, scratch directory)`` of every shipped recipe (or ``--recipes``)
    and ``--dtypes``: one JSON line each, with the commit, megatron-core and machine, appended to
    ``--out`` (stream_parity.py runs its own this way)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--recipes", nargs="*", help="recipe files (default: recipes/*.yaml)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32"])
    parser.add_argument("--out", required=True, help="JSON lines are appended here")
    args = parser.parse_args()
    import megatron.core

    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    for path in args.recipes or sorted(glob.glob(os.path.join(REPO, "recipes", "*.yaml"))):
        for dtype in args.dtypes:
            tmp = tempfile.mkdtemp(prefix="online-parity-")
            try:
                row = parity_of(path, dtype, tmp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            row.update(commit=commit, megatron_core=megatron.core.__version__,
                       machine=f"{os.cpu_count()} CPU cores ({platform.machine()}), gloo")
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


def main():
    each_recipe(parity, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
