"""A streamed reference (``--reference-in stream``) against one held whole, on every shipped recipe.

Each recipe is checked twice the default way (online, in lock-step, the reference in memory):
once with its reference written whole before the candidate starts, once streamed (the candidate
judges each iteration as the reference finishes it, and the next iteration overwrites what the
verdict never reads again: ``trace_store.Turns``). The two verdicts are set side by side: the
keys each judges, skips and lists as missing, and every judged key's verdict, error and tolerance,
which must be the same to the last bit (the same tensors judged by the same code; only when the
reference's bytes are read and where they live differ). A recipe whose two verdicts differ in
anything is a finding. A recipe with a perturbation run (bf16 by default) runs it too, after the
candidate or streamed beside it, and its estimates enter both verdicts. Beside them, what each
reference held at its end (streamed: its most), against ``ttrace plan``'s figures. One JSON line
per recipe and dtype.

    python benchmarks/stream_parity.py --dtypes fp32 --out results/stream_parity_COMMIT_MACHINE.jsonl
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
MEMORY = "/dev/shm"  # where ``ttrace run`` holds its reference (plan.MEMORY_ROOT)


def _checks(recipe, tmp: str):
    """The recipe's check with its reference held whole, then streamed: (combination, seconds) each."""
    from ttrace_megatron.adapter.run.launch import launch, launch_beside
    from ttrace_megatron.adapter.run.runner import CANDIDATE, REFERENCE, RunSpec, trace_options
    from ttrace_megatron.online import combine_online
    from ttrace_megatron.plan import measured_bytes

    out = {}
    seed = os.path.join(tmp, "seed.safetensors")
    for mode in ("held", "streamed"):
        ref = tempfile.mkdtemp(dir=MEMORY, prefix="stream-parity-")
        cand = os.path.join(tmp, mode, "candidate")
        # the perturbation run where the recipe asks for one (a low-precision recipe by default), as
        # ``ttrace run`` runs it: after the candidate, or streamed beside it
        perturbed = os.path.join(tmp, mode, "reference-perturbed") if recipe.tolerance.perturbation else None
        whole = dict(page_cache=True, iterations=None, modules=("*",), microbatches=None)
        online = dict(reference=ref, keep_tensors=False, map_reference=True, lockstep=ref)
        sides = [(CANDIDATE, cand, {})] + ([(REFERENCE, perturbed, dict(perturb=1))] if perturbed else [])
        try:
            start = time.monotonic()
            if mode == "held":
                launch(RunSpec(recipe=recipe.to_json(), role=REFERENCE, trace=trace_options(ref, seed, **whole)),
                       timeout_s=900)
                for role, where, extra in sides:
                    launch(RunSpec(recipe=recipe.to_json(), role=role,
                                   trace=trace_options(where, seed, **online, **extra)), timeout_s=900)
            else:
                readers, first = [], 0
                for role, where, extra in sides:
                    readers.append(RunSpec(recipe=recipe.to_json(), role=role, cpu=True, await_reference=ref,
                                           trace=trace_options(where, seed, streamed_reference=True,
                                                               stream_reader=first, **online, **extra)))
                    first += readers[-1].world_size
                launch_beside(RunSpec(recipe=recipe.to_json(), role=REFERENCE, cpu=True,
                                      trace=trace_options(ref, seed, stream_readers=first, **whole)),
                              *readers, timeout_s=900)
            seconds = time.monotonic() - start
            # what the reference holds at its end: held, all of it; streamed, its most (what it keeps
            # grows, and each iteration writes over the one before's, of the same size)
            out[mode] = (combine_online(cand, ref, perturbed=perturbed), round(seconds, 2), measured_bytes(ref))
        finally:
            shutil.rmtree(ref, ignore_errors=True)
    return out["held"], out["streamed"]


def parity(path: str, dtype: str, tmp: str) -> dict:
    import yaml

    from online_parity import runnable
    from ttrace_megatron.adapter.recipe.config import validate_recipe
    from ttrace_megatron.errors import RecipeError, RunFailed, TraceError
    from ttrace_megatron.recipe import recipe_from_dict

    recipe, row = runnable(path, dtype)
    if recipe is None:
        return row
    # as ``ttrace run`` reads the recipe in this dtype: its perturbation run as that dtype decides
    with open(path) as f:
        recipe = recipe_from_dict(dict(yaml.safe_load(f), dtype=dtype), source=path)
    validate_recipe(recipe)  # (as runnable validated it: the same recipe but for its perturbation run)
    try:
        (held, held_s, held_bytes), (streamed, streamed_s, streamed_bytes) = _checks(recipe, tmp)
    except (RecipeError, RunFailed, TraceError, ValueError) as e:
        return dict(row, error=f"{type(e).__name__}: {str(e)[:300]}")
    planned = _planned(recipe)
    a = {r.key: r for r in held.results}
    b = {r.key: r for r in streamed.results}
    fields = lambda r: repr(dataclasses.astuple(r))  # noqa: E731  (every field, a NaN norm equal to itself)
    differ = sorted(str(k) for k in set(a) & set(b) if fields(a[k]) != fields(b[k]))
    listed = lambda c: (sorted(map(str, c.skipped)), sorted(map(str, c.missing_in_candidate)),  # noqa: E731
                        sorted(map(str, c.missing_in_reference)), sorted(map(str, c.unjudged)),
                        sorted(map(str, c.diverged)))
    worst = lambda c: max((r.ratio for r in c.results), default=0.0)  # noqa: E731
    return dict(row, held=held.verdict, streamed=streamed.verdict, judged_held=len(a), judged_streamed=len(b),
                judged_only_held=len(set(a) - set(b)), judged_only_streamed=len(set(b) - set(a)),
                results_differ=differ[:10], lists_same=listed(held) == listed(streamed),
                identical=not differ and set(a) == set(b) and listed(held) == listed(streamed),
                worst_held=worst(held), worst_streamed=worst(streamed), held_s=held_s, streamed_s=streamed_s,
                held_bytes=held_bytes, streamed_bytes=streamed_bytes, **planned,
                perturbation=bool(recipe.tolerance.perturbation),
                streamed_planned_ratio=round(planned["streamed_planned"] / streamed_bytes, 4) if streamed_bytes else None)


def _planned(recipe) -> dict:
    """``ttrace plan``'s reference of this check (online, in lock-step, no twin): held whole, and
    streamed at its peak, in bytes."""
    from ttrace_megatron import plan as core
    from ttrace_megatron.adapter.run.plan import check_plan

    side = check_plan(recipe, online=True, twin=False, reference_in=core.STREAM).side("reference")
    return {"held_planned": side.total(), "streamed_planned": side.streamed_peak()}


def main():
    from online_parity import each_recipe

    each_recipe(parity, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
