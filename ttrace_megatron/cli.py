"""The ``ttrace`` command: run, compare, report.

Exit status: 0 equivalent, 1 mismatch found, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from .errors import RecipeError, RunFailed, TraceError

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


COMPARE_PROGRESS_EVERY_S = 5.0  # a plain progress line at most this often where stdout is not a terminal


def _compare_progress(console: Console):
    """How compare shows its progress: a live bar in a terminal; plain lines elsewhere (a CI log),
    at most every COMPARE_PROGRESS_EVERY_S and at the end. A context manager giving the callback."""
    import contextlib

    if console.is_terminal:
        @contextlib.contextmanager
        def bar():
            with Progress(TextColumn("comparing"), BarColumn(), MofNCompleteColumn(), console=console,
                          transient=True) as progress:
                task = progress.add_task("compare", total=None)
                yield lambda done, total: progress.update(task, completed=done, total=total)
        return bar()

    start = time.monotonic()
    last = [start]

    def line(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] >= COMPARE_PROGRESS_EVERY_S:
            last[0] = now
            print(f"[ttrace] compare: {done}/{total} tensors ({now - start:.1f} s)", flush=True)
    return contextlib.nullcontext(line)


def _compare(ref_dir: str, cand_dir: str, console: Console, json_path: Optional[str] = None,
             perturbed: Optional[str] = None, workers: Optional[int] = None, quiet: bool = False,
             show_progress: bool = True, distributed: bool = False):
    """Compare with its progress shown (unless not ``show_progress``), print the report (unless
    ``quiet``), write JSON; returns the report (JSON form).

    A candidate that compared online (``--ttrace-reference``) holds verdict sums, not tensors:
    they are combined instead, with the perturbation estimate's own online sums (``perturbed``).
    ``distributed``: a rank of ``torchrun ... ttrace compare --distributed`` (gloo): every rank
    judges its share of the keys, rank 0 the verdicts and the report; the others return None.
    """
    from .compare import compare_traces
    from .fork_server import available_cores
    from .online import combine_online, has_online_results
    from .report import render, to_json, write_json

    import contextlib

    online = has_online_results(cand_dir) and not os.path.exists(os.path.join(cand_dir, "rank-00000", "manifest.json"))
    shown = _compare_progress(console) if show_progress else contextlib.nullcontext(None)
    if distributed and online:
        raise RecipeError(f"--distributed judges recorded traces; {cand_dir} was judged online (its verdict sums "
                          "are combined without it)")
    if distributed:
        comparison = _compare_across_ranks(ref_dir, cand_dir, perturbed)
        if comparison is None:
            return None
    else:
        with shown as progress:
            if online:
                comparison = combine_online(cand_dir, ref_dir, perturbed=perturbed, progress=progress)
            else:
                comparison = compare_traces(ref_dir, cand_dir, perturbed=perturbed,
                                            workers=workers or available_cores(), progress=progress)
    report = to_json(comparison)
    report["num_layers"] = int(comparison.reference_run.get("num_layers", 0))
    if not quiet:
        render(report, console, num_layers=report["num_layers"])
    if json_path:
        write_json(comparison, json_path)
    return report


def _compare_across_ranks(ref_dir: str, cand_dir: str, perturbed: Optional[str]):
    """``compare_traces(distributed=True)`` in the process group torchrun describes (gloo)."""
    import torch.distributed as dist

    from .compare import compare_traces

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RecipeError("--distributed: launch it with torchrun (RANK and WORLD_SIZE are not set)")
    dist.init_process_group("gloo")
    try:
        return compare_traces(ref_dir, cand_dir, perturbed=perturbed, distributed=True)
    finally:
        dist.destroy_process_group()


def _run_recipe(recipe, out: str, args, console: Console, json_path: Optional[str]) -> dict:
    """Reference run, candidate run, compare; then, for a bf16, fp16 or FP8 recipe, the same again
    in fp32 (its twin, from the same seed checkpoint) unless ``--no-fp32-twin``. Returns the report
    (JSON form): the recipe's own pair, with the twin's report under ``fp32_twin`` and the verdict
    of both. A valid recipe that megatron builds as another model is a FAIL localized to the build
    (no tensor is compared, and no twin runs)."""
    from .recipe import FP32_TWIN, fp32_twin

    from . import plan as core

    # this check's own flags (the next recipe decides its own; each pair's placement: _placed)
    args = argparse.Namespace(**vars(args))
    twin = None if getattr(args, "no_fp32_twin", False) else fp32_twin(recipe)
    try:  # (a contradiction of flags: refused before anything runs)
        core.check_reference_in(getattr(args, "reference_in", "auto"), args.online)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    _reference_memory(args)  # (a size that does not parse: refused here, not by the plan's process)
    if getattr(args, "reference_in", "auto") == "stream":
        why = _stream_refusal(args)
        if why:
            raise RecipeError(f"{recipe.source}: --reference-in stream: {why}")
    run_side = _side_runner(recipe, out, args, console)
    twin_out = os.path.join(out, FP32_TWIN)
    # refused before anything runs, like the recipe itself; the twin starts from the recipe's seed checkpoint
    try:
        run_twin = _side_runner(twin, twin_out, args, console, seed=_seed_path(out)) if twin else None
    except RecipeError as e:
        raise RecipeError(f"the fp32 twin of this recipe cannot run: {e} (--no-fp32-twin leaves the twin out)") \
            from None
    planned = _check_disk(recipe, out, args, console)
    scratch = _memory_scratch(planned, args)
    placed = {pair: _placed(args, planned, pair, scratch) for pair in ("", FP32_TWIN)}
    removals: List[threading.Thread] = []  # in-memory references being removed while the check goes on
    try:
        return _run_pairs(recipe, twin, out, placed, console, json_path, run_side, run_twin, removals)
    finally:
        for removal in removals:
            removal.join()
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _placed(args, planned: Optional[dict], pair: str, scratch: Optional[str]):
    """A pair's copy of the run's flags (``pair``: "" or the fp32 twin's), with where the plan put its
    reference: ``reference_scratch``, the directory in memory it goes to (None: under --out, on the
    disk); streamed, ``--reference-in stream`` (``auto_streams``: what the run says as the pair starts,
    where auto streams it) and what a failing check's rerun of it
    needs: held whole in memory where it fits there, else on the disk where that has room
    (``_localize_failure``)."""
    from . import plan as core

    placed = argparse.Namespace(**vars(args))
    name = f"{pair}/reference" if pair else "reference"
    placed.reference_scratch = scratch if planned is None or name in planned["in_memory"] else None
    if planned and name in planned.get("streamed", ()):
        placed.reference_whole = next(s["total"] for s in planned["sides"] if s["name"] == name)
        placed.again_in_memory = planned["memory_room"] is not None and placed.reference_whole <= planned["memory_room"]
        if getattr(args, "reference_in", core.AUTO) == core.AUTO:
            placed.reference_in = core.STREAM
            placed.auto_streams = _auto_streams(planned, placed.reference_whole, pair)  # (said as the pair starts)
    return placed


def _say_placed(placed, console: Console) -> None:
    """Where auto streams a pair's reference, why (``_placed``), as the pair starts."""
    if getattr(placed, "auto_streams", None):
        console.print(placed.auto_streams, highlight=False)


def _run_pairs(recipe, twin, out: str, placed: dict, console: Console, json_path: Optional[str], run_side, run_twin,
               removals: List[threading.Thread]) -> dict:
    """The recipe's pair, then its fp32 twin's (``_run_recipe``), each with its own flags
    (``placed``, by pair: ``_placed``): its reference in memory where the plan put it there, removed
    in the background once judged (``removals``: the caller waits for them before it returns)."""
    from .errors import BuiltOtherwise
    from .recipe import FP32_TWIN
    from .report import build_failure, combine_twin, render, render_twin, twin_error

    twin_out = os.path.join(out, FP32_TWIN)
    args, twin_args = placed[""], placed[FP32_TWIN]
    start = time.monotonic()
    _say_placed(args, console)
    ref_dir = _reference_dir(args.reference_scratch, out, "")
    try:
        report = _run_and_compare(recipe, out, args, console, run_side, ref_dir=ref_dir)
    except BuiltOtherwise as e:
        report = build_failure(e.side, e.rank, e.module, e.problems, recipe.name)
        render(report, console)
        run_twin = None
    _let_go_reference(report, ref_dir, out, args, console, removals)
    report["seconds"] = round(time.monotonic() - start, 2)  # every run, compare and replay of the pair
    if run_twin is not None and not getattr(args, "out", None):
        # nothing keeps the pair's traces (no --out): the twin's need not sit beside them on the disk
        for part in PAIR_TRACES:
            shutil.rmtree(os.path.join(out, part), ignore_errors=True)
    if run_twin is not None:
        console.print(f"[bold]fp32 twin[/]: {recipe.name} again in fp32, same layout and seed checkpoint, judged under "
                      f"fp32 bounds (the layout's logic; --no-fp32-twin leaves it out) → {twin_out}")
        start = time.monotonic()
        _say_placed(twin_args, console)
        twin_ref = _reference_dir(twin_args.reference_scratch, twin_out, FP32_TWIN)
        try:
            twin_report = _run_and_compare(twin, twin_out, twin_args, console, run_twin, quiet=True, ref_dir=twin_ref)
        except BuiltOtherwise as e:
            twin_report = build_failure(e.side, e.rank, e.module, e.problems, twin.name)
        except (TraceError, RecipeError, RunFailed, ValueError) as e:
            # e.g. a bug injected for the recipe's dtype that has nothing to act on in fp32 (an FP8
            # amax): the pair's verdict stands, and the check says the twin did not run, and why
            console.print(f"[yellow]the fp32 twin did not run: {e}[/]", highlight=False)
            twin_report = twin_error(str(e), twin.name)
        _let_go_reference(twin_report, twin_ref, twin_out, twin_args, console, removals)
        twin_report["seconds"] = round(time.monotonic() - start, 2)
        _write_reports(twin_report, twin_out, None, None)  # `ttrace report OUT/fp32_twin` reads it
        report = combine_twin(report, twin_report, recipe.dtype)
        render_twin(report, console)
    _write_reports(report, out, json_path, getattr(args, "html", None))
    # the verdict's scalars (online, the candidate's live ones are beside them, under ttrace/live/)
    _tensorboard(report, _tensorboard_dir(args, out), console)
    return report


PAIR_TRACES = ("reference", "candidate", "reference-perturbed", "replay")  # a pair's trace directories
REMOVAL_THREADS = 4  # at most, unlinking an in-memory reference's files (``plan.remove_tree``)


def _stream_refusal(args) -> str:
    """Why a check with these flags cannot stream its reference (``--reference-in stream``), or ""."""
    from .adapter.run.launch import cpu_ranks

    if getattr(args, "no_lockstep", False):
        return "the candidate must run in lock-step (it reads each iteration's weights from the reference)"
    if getattr(args, "megatron_lm", None) or getattr(args, "reference_megatron", None) or \
            getattr(args, "candidate_megatron", None):
        return "both sides must run on the installed megatron-core (not --megatron-lm, --*-megatron)"
    if getattr(args, "reference_model", "same") != "same":
        return "--reference-model gpt is not streamed yet"
    if not cpu_ranks(getattr(args, "cpu", False)):
        return "CPU ranks only (--cpu, or no GPU here): on GPUs the candidate's rank 0 would share its device"
    return ""


def _memory_scratch(planned: Optional[dict], args) -> Optional[str]:
    """The directory in memory that this check's references go to, or None (under ``--out``, on
    the disk): where the plan put them (``--reference-in``); without a plan (``--no-disk-check``,
    or none could be made) only where ``--reference-in memory`` or ``stream`` asks."""
    from . import plan as core

    in_memory = bool(planned["in_memory"]) if planned is not None else \
        getattr(args, "reference_in", "auto") in ("memory", "stream")
    if not in_memory:
        return None
    if not os.path.isdir(core.MEMORY_ROOT):
        raise RecipeError(f"--reference-in memory: this machine has no {core.MEMORY_ROOT} to hold the reference")
    return core.memory_scratch()


def _reference_dir(scratch: Optional[str], pair_out: str, pair: str) -> str:
    """Where a pair's reference is written: in ``scratch`` (memory), or under the pair's own --out."""
    return os.path.join(scratch, pair or "pair", "reference") if scratch else os.path.join(pair_out, "reference")


def _let_go_reference(report: dict, ref_dir: str, pair_out: str, args, console: Console,
                      removals: List[threading.Thread]) -> None:
    """An in-memory reference once its pair is judged (and localized): removed, so that the next
    pair's has the memory; a failing check's is moved under ``--out`` first where the disk has room
    for it (the evidence of a failure is kept, as on the disk; a pass needs none). The removal runs
    on a thread (``removals``) beside what the check does next (its reports, the twin's start):
    freeing a tmpfs's pages took 0.5 s for the 50M rung's 4 GB, in the kernel, and half that with
    its files unlinked on both cores of the development VM (the check waits for it before it ends)."""
    from . import plan as core

    if ref_dir == os.path.join(pair_out, "reference") or not os.path.isdir(ref_dir):
        return
    kept = os.path.join(pair_out, "reference")
    # a streamed reference that did not run again for a replay (it passed, or was not localized) kept
    # only what the verdict reads: removed, not kept. (One that ran again into ``kept``, on the disk,
    # is kept there; one that ran again in memory, here, is kept as a held one is.)
    partial = report.get("reference_in") == core.STREAM and "reference again" not in (report.get("timings_s") or {})
    if report.get("verdict") == "fail" and getattr(args, "out", None) and not partial and report.get("reference") != \
            os.path.abspath(kept):
        size = core.measured_bytes(ref_dir)
        free = core.free_bytes(pair_out)
        why = f"only {core.human(free)} are free under {pair_out}"
        if core.fits(size, free):
            shutil.rmtree(kept, ignore_errors=True)
            try:
                shutil.move(ref_dir, kept)
                report["reference"] = os.path.abspath(kept)
                console.print(f"the failing check's reference, held in memory, moved to {kept}", highlight=False)
                return
            except OSError as e:  # the disk filled meanwhile: the verdict stands, the evidence goes
                shutil.rmtree(kept, ignore_errors=True)
                why = f"moving it under {pair_out} failed ({e.strerror or e})"
        console.print(f"[yellow]the failing check's reference ({core.human(size)}, held in memory) is not kept: "
                      f"{why}[/]", highlight=False)
    from .fork_server import available_cores

    removal = threading.Thread(target=core.remove_tree, args=(ref_dir, min(available_cores(), REMOVAL_THREADS)),
                               name="ttrace-remove-reference")
    removal.start()
    removals.append(removal)
    report["reference_removed"] = True


def _seed_path(out: str) -> str:
    return os.path.join(out, "seed_checkpoint.safetensors")


def _run_and_compare(recipe, out: str, args, console: Console, run_side, quiet: bool = False,
                     ref_dir: Optional[str] = None) -> dict:
    """The reference (in ``ref_dir``: default under ``out``), the candidate (in lock-step unless asked
    otherwise), the perturbation run the recipe asks for, the comparison, and on a mismatch the
    replay that localizes it. ``quiet``: the report is not printed (the fp32 twin's is summarized
    after the recipe's own)."""
    from . import plan as core
    from .adapter.run.runner import CANDIDATE, REFERENCE

    timings = {}  # seconds per part of the check, in the order they ran (the report's "timings_s")

    def timed(part, fn, *a, **kw):
        start = time.monotonic()
        try:
            return fn(*a, **kw)
        finally:
            timings[part] = round(time.monotonic() - start, 2)

    in_memory = ref_dir is not None and ref_dir != os.path.join(out, "reference")
    ref_dir, cand_dir = ref_dir or os.path.join(out, "reference"), os.path.join(out, "candidate")
    # online: each candidate rank judges its shards as it runs; with --tensorboard the verdicts per
    # iteration go out as scalars during the run (adapter/run/live_scalars.py)
    online = dict(reference=ref_dir, keep_tensors=False, map_reference=in_memory,
                  tensorboard=_tensorboard_dir(args, out)) if args.online else {}
    lockstep = {} if args.no_lockstep else dict(lockstep=ref_dir)
    console.print(f"reference run (1 rank) → {ref_dir}" + (" (in memory, removed once judged; --reference-in disk "
                                                            "writes it under --out)" if in_memory else ""))
    # in lock-step the candidate takes the reference's weights after every step: record all of it;
    # read right after by the candidate (lock-step, online), it is written through the page cache
    ref_trace = dict(page_cache=bool(online or lockstep or in_memory), **(
        {} if args.no_lockstep else dict(iterations=None, modules=("*",), microbatches=None)))
    candidate_line = (f"candidate run ({recipe.world_size} ranks, {recipe.parallel}) → {cand_dir}"
                      + (f", injected bugs: {args.inject}" if args.inject else "")
                      + (", comparing online" if args.online else "")
                      + ("" if args.no_lockstep else ", in lock-step with the reference"))
    streamed = getattr(args, "reference_in", core.AUTO) == core.STREAM
    perturbed_dir, perturbed = _perturbation_run(recipe, args, out, online, lockstep)
    perturbation_line = (f"perturbation estimate: the reference again, round-off-sized noise in every module "
                         f"→ {perturbed_dir}")
    if not streamed:
        timed("reference", run_side, REFERENCE, ref_dir, **ref_trace)
        console.print(candidate_line)
        timed("candidate", run_side, CANDIDATE, cand_dir, args.inject, **online, **lockstep)
        if perturbed is not None:
            console.print(perturbation_line)
            timed("perturbation", run_side, REFERENCE, perturbed_dir, **perturbed)
    else:
        console.print(candidate_line + "; the reference streamed: one iteration at a time, each judged as it comes")
        readers = [(CANDIDATE, cand_dir, args.inject, dict(online, **lockstep))]
        if perturbed is not None:  # beside the candidate, reading the same reference as it comes
            console.print(perturbation_line + ", beside the candidate")
            readers.append((REFERENCE, perturbed_dir, (), perturbed))
        _streamed_timings(run_side.streamed(ref_dir, ref_trace, readers), timings)
    report = timed("compare", _compare, ref_dir, cand_dir, console, None, perturbed_dir, getattr(args, "workers", None),
                   quiet=quiet, show_progress=not getattr(args, "quiet", False))
    first = report.get("first_mismatch")
    # online too: the replay judges its modules against the reference's trace, not the candidate's
    if report["verdict"] == "fail" and first and not args.no_localize:
        _localize_failure(report, first["iteration"], out, args, console, run_side, timed, ref_dir, ref_trace,
                          lockstep, streamed, quiet)
    report["timings_s"] = timings
    report["reference_in"] = core.STREAM if streamed else core.MEMORY if in_memory else core.DISK
    if not quiet:
        from .report import timings_line

        console.print("time: " + timings_line(timings), highlight=False)
    return report


def _localize_failure(report: dict, iteration: int, out: str, args, console: Console, run_side, timed,
                      ref_dir: str, ref_trace: dict, lockstep: dict, streamed: bool, quiet: bool) -> None:
    """A failing check's replay: the candidate again, every module on the reference's inputs of the
    failing ``iteration``, and the culprits it names (into ``report``). Streamed, the reference's
    overwritten tensors are gone: it runs again (it is deterministic), up to the failing iteration
    (the replay reads nothing after it), and the replay steps with that one: held whole in memory,
    where the streamed one was, if held whole the plan's reference fits the memory it may take
    (``args.again_in_memory``: a failing check's is then moved under --out where the disk has room,
    as a held one's); else on the disk under --out, where the disk has room for it (without room
    the check is not localized, and says why)."""
    from . import plan as core
    from .adapter.run.runner import CANDIDATE, REFERENCE

    if streamed:
        shutil.rmtree(ref_dir, ignore_errors=True)  # (compared: what it kept is read no more)
        if not getattr(args, "again_in_memory", False):
            ref_dir = os.path.join(out, "reference")
            shutil.rmtree(ref_dir, ignore_errors=True)
            whole, free = getattr(args, "reference_whole", None), core.free_bytes(out)
            if whole is not None and not core.fits(whole, free):
                report["not_localized"] = (f"the replay needs the streamed reference again, up to iteration {iteration} "
                                           f"(at most {core.human(whole)}), and only {core.human(free)} are free "
                                           f"under {out}")
                console.print(f"[yellow]not localized: {report['not_localized']}[/]", highlight=False)
                report["reference_removed"] = True
                return
        console.print(f"the reference again, up to iteration {iteration}, for the replay (streamed, it kept only what "
                      f"the verdict reads) → {ref_dir}")
        timed("reference again", run_side, REFERENCE, ref_dir, **dict(ref_trace, until=iteration))
        report["reference"] = os.path.abspath(ref_dir)
        lockstep = {} if args.no_lockstep else dict(lockstep=ref_dir)
    replay_dir = os.path.join(out, "replay")
    shutil.rmtree(replay_dir, ignore_errors=True)
    console.print(f"localizing: the candidate again, every module on the reference's inputs "
                  f"(iteration {iteration}) → {replay_dir}")
    timed("replay", run_side, CANDIDATE, replay_dir, args.inject, replay=ref_dir, iterations=[iteration], **lockstep)
    report["culprits"] = timed("localize", _localize, ref_dir, replay_dir, console, quiet=quiet)


def _perturbation_run(recipe, args, out: str, online: dict, lockstep: dict) -> Tuple[Optional[str], Optional[dict]]:
    """(trace directory, trace options) of the perturbation run the recipe or ``--perturb`` asks
    for (None, None: none): in lock-step too, the noise's effect on each iteration given the
    reference's weights and routing, as the candidate is judged (free-running, MoE routing flips
    and Adam's drift would be measured as round-off); online, it compares as it runs too: its
    movements are sums, like the candidate's verdicts."""
    if not (recipe.tolerance.perturbation or args.perturb):
        return None, None
    perturbed_dir = os.path.join(out, "reference-perturbed")
    shutil.rmtree(perturbed_dir, ignore_errors=True)
    return perturbed_dir, dict(perturb=1, **lockstep, **({k: v for k, v in online.items() if k != "tensorboard"}))


def _streamed_timings(ended: Dict[str, float], timings: dict) -> None:
    """A streamed check's parts (``ended``: seconds from its start to each side's end), which add up
    to its wall time: the reference's run, then what each reader took after it and the one before."""
    from .adapter.run.runner import CANDIDATE, PERTURBATION, REFERENCE

    last = 0.0
    for side in (REFERENCE, CANDIDATE, PERTURBATION):
        if side in ended:
            timings[side] = round(max(0.0, ended[side] - last), 2)
            last = max(last, ended[side])


def _side_runner(recipe, out: str, args, console: Console, seed: Optional[str] = None):
    """``run_side(role, trace_dir, inject=(), **trace)``: one side of the check, on the installed
    megatron-core, a source tree of its own, or a Megatron-LM checkout's ``pretrain_gpt.py``.
    Everything a side could refuse is refused here, before any side runs; the last traces under
    ``out`` are removed, and the seed checkpoint too unless ``seed`` names another check's (the fp32
    twin starts from its recipe's)."""
    from .adapter.recipe.config import validate_recipe
    from .adapter.run.launch import launch, launch_beside
    from .adapter.run.runner import CANDIDATE, REFERENCE, RunSpec, trace_options
    from .adapter.run.side import check_tree

    validate_recipe(recipe)
    recipes = {REFERENCE: recipe.to_json(), CANDIDATE: recipe.to_json()}
    as_gpt = getattr(args, "reference_model", "same") == "gpt"
    if as_gpt:  # the migration check: a GPTModel reference, the HybridModel candidate named as it
        from .adapter.recipe.hybrid import gpt_equivalent
        from .recipe import recipe_from_dict

        recipes[REFERENCE] = gpt_equivalent(recipes[REFERENCE])
        validate_recipe(recipe_from_dict(recipes[REFERENCE], recipe.source))
    trees = {role: check_tree(path, flag) if path else None for role, flag, path in (
        (REFERENCE, "--reference-megatron", getattr(args, "reference_megatron", None)),
        (CANDIDATE, "--candidate-megatron", getattr(args, "candidate_megatron", None)))}
    for d in ("reference", "candidate"):
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)
    if seed is None:
        seed = _seed_path(out)
        if os.path.exists(seed):
            os.remove(seed)  # the reference writes it anew: a kept --out may hold another recipe's weights
        console.print(f"[bold]{recipe.name}[/]: {recipe.description or recipe.source}")
    selective = dict(iterations=args.iters, modules=tuple(args.modules or ["*"]), microbatches=args.microbatches)

    def spec(role, trace_dir, inject=(), **trace):
        return RunSpec(recipe=recipes[role], role=role, cpu=args.cpu, inject=list(inject), megatron=trees[role],
                       trace=trace_options(trace_dir, seed, **dict(selective, **trace)),
                       as_gpt=as_gpt and role == CANDIDATE, progress=not getattr(args, "quiet", False))

    checkout = getattr(args, "megatron_lm", None)
    if getattr(args, "megatron_lm_data", None) and not checkout:
        raise RecipeError("--megatron-lm-data needs --megatron-lm")
    if not checkout:
        def run_side(role, trace_dir, inject=(), **trace):
            return launch(spec(role, trace_dir, inject, **trace))

        def run_streamed(ref_dir, ref_trace, readers):
            """The reference written one iteration at a time for the ranks of the runs that judge
            each iteration as it comes (``--reference-in stream``; ``readers``: (role, trace
            directory, injected bugs, trace options) of the candidate, and of the perturbation run
            where the check has one): seconds from the start to each side's end, by side."""
            specs, first_reader = [], 0
            for role, reader_dir, inject, reader_trace in readers:
                specs.append(dataclasses.replace(
                    spec(role, reader_dir, inject, **dict(reader_trace, streamed_reference=True,
                                                          stream_reader=first_reader)), await_reference=ref_dir))
                first_reader += specs[-1].world_size
            first = spec(REFERENCE, ref_dir, **dict(ref_trace, stream_readers=first_reader))
            return launch_beside(first, *specs)

        run_side.streamed = run_streamed
        return run_side
    # both sides through the checkout's own pretrain_gpt.py
    from .adapter.megatron_lm import checkout as megatron_lm

    checkout = megatron_lm.check_checkout(checkout)
    # refuses an untranslatable field before anything runs
    megatron_lm.training_args(recipe, REFERENCE, {}, release=megatron_lm.release_of(checkout))
    if as_gpt or any(trees.values()):
        raise RecipeError(f"{recipe.source}: --megatron-lm runs neither --reference-model gpt nor "
                          f"--candidate/--reference-megatron yet")

    def run_side(role, trace_dir, inject=(), **trace):
        side = spec(role, trace_dir, inject, **trace)
        megatron_lm.run(checkout, side.get_recipe(), role, side.trace, inject=side.inject, cpu=args.cpu,
                        log_dir=out, data_path=args.megatron_lm_data)

    return run_side


def _write_reports(report: dict, out: str, json_path: Optional[str], html_path: Optional[str]) -> None:
    """report.json and report.html in ``out``, and where ``--json`` and ``--html`` ask."""
    from .report import write_html

    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    write_html(report, os.path.join(out, "report.html"))
    if html_path:
        write_html(report, html_path)


def _localize(ref_dir: str, replay_dir: str, console: Console, quiet: bool = False) -> list:
    from .compare import localize
    from .report import culprits_json, render_culprits

    culprits = culprits_json(localize(ref_dir, replay_dir))
    if not quiet:
        render_culprits(culprits, console)
    return culprits


def cmd_localize(args, console: Console) -> int:
    culprits = _localize(args.reference, args.replay, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"culprits": culprits}, f, indent=1)
    return EXIT_FAIL if culprits else EXIT_PASS


def _recipe_paths(target: str) -> List[str]:
    if os.path.isdir(target):
        paths = sorted(os.path.join(target, f) for f in os.listdir(target) if f.endswith((".yaml", ".yml")))
        if not paths:
            raise RecipeError(f"{target}: no recipe (*.yaml) in this directory")
        return paths
    return [target]


def cmd_run(args, console: Console) -> int:
    """One recipe (or the embedded default), or every recipe of a directory with a summary."""
    if not getattr(args, "megatron_lm", None):  # (pretrain_gpt.py runs are started by torchrun)
        from .adapter.run.server import prestart, prestart_early

        if not prestart_early(args.cpu):  # first, before anything imports torch, where no GPU is in sight
            import torch

            prestart(cpu=not torch.cuda.is_available())
    from .recipe import default_recipe, load_recipe
    from .report import first_mismatch_of, headline

    _check_tensorboard(args)
    targets = _recipe_paths(args.recipe) if args.recipe else [None]
    many = len(targets) > 1 or (args.recipe and os.path.isdir(args.recipe))
    out_root = args.out or tempfile.mkdtemp(prefix="ttrace-")
    rows = []
    try:
        for target in targets:
            start = time.monotonic()
            name = os.path.splitext(os.path.basename(target))[0] if target else "default"
            row = {"recipe": name, "source": target or "<embedded>"}
            try:
                recipe = load_recipe(target) if target else default_recipe()
                out = os.path.join(out_root, recipe.name) if many else out_root
                recipe_args = args
                if many and getattr(args, "tensorboard", None):  # one TensorBoard run per recipe
                    recipe_args = argparse.Namespace(**dict(vars(args), tensorboard=os.path.join(args.tensorboard,
                                                                                                 recipe.name)))
                report = _run_recipe(recipe, out, recipe_args, console, None if many else args.json)
                row.update(verdict=report["verdict"], first_mismatch=first_mismatch_of(report),
                           message=headline(report))
            except (TraceError, RecipeError, RunFailed, ValueError) as e:
                if not many:
                    raise
                row.update(verdict="error", first_mismatch=None, message=str(e))
                console.print(f"[red]{name}: error:[/] {e}", markup=True, highlight=False)
            row["seconds"] = round(time.monotonic() - start, 2)
            rows.append(row)
    finally:
        if not args.out:
            shutil.rmtree(out_root, ignore_errors=True)
    if many:
        _print_summary(rows, console)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"verdict": _overall(rows), "recipes": rows}, f, indent=1)
    if args.junit:
        write_junit(rows, args.junit)
    return {"pass": EXIT_PASS, "fail": EXIT_FAIL}.get(_overall(rows), EXIT_ERROR)


def _overall(rows) -> str:
    verdicts = {r["verdict"] for r in rows}
    return "error" if "error" in verdicts else ("fail" if "fail" in verdicts else "pass")


def _print_summary(rows, console: Console) -> None:
    from .report import WIDE_REPORT

    from .report import VERDICT_COLORS as colors
    if console.width < WIDE_REPORT:  # one record a recipe: names are never folded or cut
        console.print("recipes:")
        for r in rows:
            fm = r.get("first_mismatch")
            console.print(f"[{colors[r['verdict']]}]{r['verdict']:5}[/] {r['recipe']} ({r['seconds']:.1f} s)")
            if fm:
                console.print(f"      first mismatch{' (fp32 twin)' if fm.get('check') else ''}: {fm['module']} "
                              f"{fm['phase']} {fm['tensor']}", overflow="fold")
            elif r["verdict"] != "pass":
                console.print(f"      {r['message']}", overflow="fold")
        return
    table = Table(title="recipes")
    for col in ("recipe", "verdict", "seconds", "first mismatch / error"):
        table.add_column(col, overflow="fold")
    for r in rows:
        fm = r.get("first_mismatch")
        where = (f"{'fp32 twin: ' if fm.get('check') else ''}{fm['module']} {fm['phase']} {fm['tensor']}" if fm
                 else ("" if r["verdict"] == "pass" else r["message"]))
        table.add_row(r["recipe"], f"[{colors[r['verdict']]}]{r['verdict']}[/]", f"{r['seconds']:.1f}", where)
    console.print(table)


def write_junit(rows, path: str) -> None:
    """JUnit XML, one test case per recipe, for CI systems."""
    from xml.etree import ElementTree as ET

    suite = ET.Element("testsuite", name="ttrace", tests=str(len(rows)),
                       failures=str(sum(r["verdict"] == "fail" for r in rows)),
                       errors=str(sum(r["verdict"] == "error" for r in rows)),
                       time=f"{sum(r['seconds'] for r in rows):.2f}")
    for r in rows:
        case = ET.SubElement(suite, "testcase", classname="ttrace.recipes", name=r["recipe"], time=f"{r['seconds']:.2f}")
        if r["verdict"] == "fail":
            ET.SubElement(case, "failure", message=r["message"]).text = json.dumps(r["first_mismatch"], indent=1)
        elif r["verdict"] == "error":
            ET.SubElement(case, "error", message=r["message"])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def cmd_compare(args, console: Console) -> int:
    if not getattr(args, "distributed", False):  # its workers' server first, before torch is imported here
        from .fork_server import prestart_compare

        prestart_compare(args.candidate, getattr(args, "workers", None))
    report = _compare(args.reference, args.candidate, console, args.json, getattr(args, "perturbed", None),
                      getattr(args, "workers", None), distributed=getattr(args, "distributed", False))
    if report is None:  # a rank of --distributed other than 0
        return EXIT_PASS
    if getattr(args, "html", None):
        from .report import write_html

        write_html(report, args.html)
    return EXIT_PASS if report["verdict"] == "pass" else EXIT_FAIL


def _auto_streams(planned: dict, whole: int, pair: str = "") -> str:
    """What ``ttrace run`` says where ``--reference-in auto`` streams a pair's reference (``whole``:
    its bytes held whole; ``pair``: "" or the fp32 twin's; auto streams only where the plan has a
    memory room), and why: held whole it would not fit, or it
    is large enough that streaming takes about as long or less (``plan.STREAM_FROM_BYTES``)."""
    from . import plan as core

    room = planned["memory_room"]
    why = (f"more than the {core.human(room)} it may take here" if whole > room
           else f"from {core.STREAM_FROM_BYTES / 2 ** 30:g} GiB on, streamed writes over its pages and takes about as "
                "long or less")
    name = f"{pair}/reference" if pair else "reference"
    peak = next((s["streamed_peak"] for s in planned.get("sides", ()) if s["name"] == name), planned["memory_needed"])
    who = "the fp32 twin's reference" if pair else "the reference"
    return (f"{who} streamed (--reference-in auto): held whole it would take about {core.human(whole)}, {why}; "
            f"one iteration at a time, at most {core.human(peak)}")


PLAN_FLAGS = ("no_fp32_twin", "perturb", "no_lockstep")  # run's switches that change what a check writes (and --keep-traces)


def _plan_of(recipe, args, keep: bool, shape=None, room: Optional[int] = None):
    """The plan of ``ttrace run`` of ``recipe`` with ``args``'s flags (in this process: it builds
    the model on the meta device, with megatron's parallel state of one rank), its reference in
    memory or on the disk as ``--reference-in`` and ``room`` (what memory it may take) decide: each
    pair's apart (``plan.reference_placement``, by its own reference's bytes and its own perturbation
    run), so that a bf16 recipe's pair may hold its reference, which its perturbation run reads beside
    the candidate, while its fp32 twin, with none, streams its own. The pairs run one after the other."""
    from . import plan as core
    from .adapter.run.plan import PERTURBED, TWIN, Selection, check_plan

    lockstep = not getattr(args, "no_lockstep", False)
    selection = Selection(iterations=args.iters, modules=tuple(args.modules or ["*"]), microbatches=args.microbatches)

    def plan(reference_in: str, twin_reference_in: Optional[str] = None):
        return check_plan(recipe, online=args.online, perturb=True if args.perturb else None,
                          twin=not args.no_fp32_twin, keep=keep, selection=selection, reference_everything=lockstep,
                          shape=shape, reference_in=reference_in, twin_reference_in=twin_reference_in)

    held, streamed = plan(core.MEMORY), plan(core.STREAM)
    refused = getattr(args, "stream_refused", "") or _stream_refusal(args)
    where = {}
    for pair in ("", TWIN):
        reference = pair + "reference"
        if not any(side.name == reference for side in held.sides):
            continue
        perturbed = any(side.name == pair + PERTURBED for side in held.sides)
        where[pair] = core.reference_placement(getattr(args, "reference_in", core.AUTO), held.held(reference),
                                               streamed.held(reference), room, args.online, refused, perturbed)
    return plan(where[""], where.get(TWIN))


# the selections `ttrace plan --budget` offers, each as run's flags: fewer iterations, one microbatch,
# the online check (after --keep-traces), both sides free-running, no twin (what each leaves unjudged is the
# user's choice); one that changes nothing of what was asked is not offered
BUDGET_OPTIONS = (
    ("--iters 1 (in lock-step the reference still records every iteration)", dict(iters=[1])),
    ("--iters 1 --microbatches 0", dict(iters=[1], microbatches=[0])),
    ("without --keep-traces (the candidate judged online, writing no tensors)", dict(online=True)),
    ("--no-lockstep --iters 1 --microbatches 0", dict(no_lockstep=True, iters=[1], microbatches=[0])),
    ("--no-fp32-twin (the layout's logic then judged in the recipe's dtype only)", dict(no_fp32_twin=True)),
)


def _plan_recipe(args):
    """(recipe, notes): the recipe file, the embedded recipe, or one read off a Megatron-LM command line."""
    import shlex

    from .recipe import default_recipe, load_recipe, recipe_from_dict

    if not args.megatron_lm_args:
        if args.world_size:
            raise RecipeError("--world-size goes with --megatron-lm-args (a recipe names its own)")
        return (load_recipe(args.recipe) if args.recipe else default_recipe()), []
    from .adapter.megatron_lm.plan_args import SOURCE, recipe_from_args

    if args.recipe:
        raise RecipeError("give a recipe or --megatron-lm-args, not both")
    if not args.world_size:
        raise RecipeError("--megatron-lm-args needs --world-size N: the ranks the candidate runs on")
    raw, not_read = recipe_from_args(shlex.split(args.megatron_lm_args), args.world_size)
    notes = [f"read from the Megatron-LM arguments; not read (they change no recorded byte): "
             f"{' '.join(not_read)}"] if not_read else []
    return recipe_from_dict(raw, source=SOURCE), notes


def cmd_plan(args, console: Console) -> int:
    """What ``ttrace run`` of a recipe with these flags will write, before anything runs."""
    from . import plan as core
    from .adapter.recipe.config import validate_recipe
    from .adapter.run.plan import model_shape
    from .fork_server import available_cores

    recipe, notes = _plan_recipe(args)
    validate_recipe(recipe)  # what run refuses, plan refuses alike
    shape = model_shape(recipe)
    room = core.memory_room(limit=_reference_memory(args))
    plan = _plan_of(recipe, args, keep=bool(args.out), shape=shape, room=room)
    plan.notes += notes
    where = args.out or tempfile.gettempdir()
    free = core.free_bytes(where)
    bandwidth = core.measure_write_bandwidth(core.existing_parent(where)) if args.measure_disk else None
    memory_write = core.measure_memory_write(plan) if args.measure_disk else None
    rates = core.measure_compare_rates(core.existing_parent(where)) if args.measure_disk else None
    budget = core.parse_bytes(args.budget) if args.budget else None
    options = [("as asked", plan)] + [
        (flags, _plan_of(recipe, argparse.Namespace(**dict(vars(args), **change)), keep=bool(args.out), shape=shape,
                         room=room))
        for flags, change in BUDGET_OPTIONS if budget is not None and not change.items() <= vars(args).items()]
    planned = dict(plan.to_json(), free_bytes=free, where=os.path.abspath(where), memory_room=room,
                   options=[dict(flags=flags, disk_needed=p.disk_needed()) for flags, p in options])
    workers = available_cores()
    if bandwidth is not None:
        planned["write_bandwidth"] = {"disk": bandwidth, "memory": memory_write[0] if memory_write else None,
                                      "memory_bytes_timed": memory_write[1] if memory_write else None}
        planned["write_seconds"] = {"disk": plan.all_bytes() / bandwidth,
                                    "memory": plan.memory_written() / memory_write[0] if memory_write else None}
    if rates is not None:
        planned["compare_rates"] = dataclasses.asdict(rates)
        planned["judging_seconds"] = core.judging_seconds(plan, rates, workers)
    if args.json == "-":
        print(json.dumps(planned, indent=1))
        return EXIT_PASS
    if args.json:
        with open(args.json, "w") as f:
            json.dump(planned, f, indent=1)
    for line in core.format_plan(plan, free=free, budget=budget, write_bandwidth=bandwidth, options=options,
                                 compare_rates=rates, workers=workers, memory_room=room,
                                 memory_write=memory_write):
        console.print(line, highlight=False, markup=False, overflow="ignore", crop=False)
    return EXIT_PASS


def _reference_memory(args) -> Optional[int]:
    """``--reference-memory`` in bytes, or None (not given)."""
    from . import plan as core

    text = getattr(args, "reference_memory", None)
    if not text:
        return None
    try:
        return core.parse_bytes(text)
    except ValueError as e:
        raise RecipeError(f"--reference-memory: {e}") from None


PLAN_TIMEOUT_S = 300  # the disk check's plan: a build on the meta device takes seconds; never wait on a hang


def _plan_command(recipe_path: str, plan_path: str, out: str, args, stream_refused: str = "") -> List[str]:
    """``ttrace plan`` with the flags of ``ttrace run`` that change what a check writes, and where
    the reference goes (``stream_refused``: why this run may not stream it, which the plan's
    process cannot tell from those flags)."""
    cmd = [sys.executable, "-m", "ttrace_megatron.cli", "plan", recipe_path, "--json", plan_path]
    cmd += [f"--{flag.replace('_', '-')}" for flag in PLAN_FLAGS if getattr(args, flag, False)]
    cmd += [] if getattr(args, "online", True) else ["--keep-traces"]
    cmd += ["--reference-in", getattr(args, "reference_in", "auto")]
    if getattr(args, "reference_memory", None):
        cmd += ["--reference-memory", args.reference_memory]
    if getattr(args, "cpu", False):
        cmd += ["--cpu"]
    if stream_refused:
        cmd += ["--stream-refused", stream_refused]
    for flag in ("iters", "microbatches"):
        if getattr(args, flag, None):
            cmd += [f"--{flag}", ",".join(map(str, getattr(args, flag)))]
    for pattern in getattr(args, "modules", None) or []:
        cmd += ["--modules", pattern]
    if getattr(args, "out", None):
        cmd += ["--out", out]
    return cmd


def _plan_in_process(argv: List[str], error_path: str) -> None:
    """``ttrace plan ARGV`` as the body of a process of its own (``_check_disk``): nothing printed,
    its error's last line kept in ``error_path``, its status the process's exit code."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = main(argv)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which runs the check without it
        err.write(f"{type(e).__name__}: {e}\n")
        rc = EXIT_ERROR
    if rc != EXIT_PASS:
        with open(error_path, "w") as f:
            f.write(_last_line(err.getvalue()))
    sys.exit(rc)


def _check_disk(recipe, out: str, args, console: Console) -> Optional[dict]:
    """Refuse a check whose traces would not fit the disk under ``out`` (or whose reference, asked
    in memory, would not fit there), with the numbers, before anything runs (``--no-disk-check``
    runs it anyway); returns the plan (JSON form), None where none was made. The plan is made in a
    process of its own: it starts megatron's parallel state, which this process must not hold; on CPU that process is
    forked from the ranks' fork server, its imports done (a fresh interpreter spent ~5 s importing
    torch and megatron-core). A plan that fails or hangs never stops the check: it runs without the
    disk check, and says so."""
    from . import plan as core
    from .adapter.run.launch import run_function

    if getattr(args, "no_disk_check", False):
        return None
    with tempfile.TemporaryDirectory(prefix="ttrace-plan-") as tmp:
        recipe_path, plan_path = os.path.join(tmp, "recipe.yaml"), os.path.join(tmp, "plan.json")
        with open(recipe_path, "w") as f:
            json.dump(dict(recipe.to_json(), name=recipe.name), f)  # JSON is YAML
        refused = _stream_refusal(args)
        command = _plan_command(recipe_path, plan_path, out, args, refused)
        error_path = os.path.join(tmp, "error.txt")
        rc = run_function(_plan_in_process, (command[command.index("plan"):], error_path), PLAN_TIMEOUT_S,
                          cpu=bool(getattr(args, "cpu", False)))
        failed = None
        if rc is None:
            failed = f"no plan within {PLAN_TIMEOUT_S} s"
        elif rc != 0 or not os.path.exists(plan_path):
            failed = f"exit code {rc}"
            if os.path.exists(error_path):
                with open(error_path) as f:
                    failed = f.read() or failed
        if failed:
            console.print(f"[yellow]the disk check could not plan this check ({failed}); running without it[/]",
                          highlight=False)
            return None
        with open(plan_path) as f:
            planned = json.load(f)
    need, free = planned["disk_needed"], core.free_bytes(out)
    if not core.fits(need, free):
        raise RecipeError(core.disk_refusal_text(recipe.name, need, free, out))
    room = planned.get("memory_room")
    if planned.get("in_memory") and (room is None or planned["memory_needed"] > room):
        raise RecipeError(core.memory_refusal_text(recipe.name, planned["memory_needed"], room,
                                                   core.STREAM if planned.get("streamed") else core.MEMORY,
                                                   limited=bool(getattr(args, "reference_memory", None))))
    return planned


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def cmd_report(args, console: Console) -> int:
    from .report import render

    _check_tensorboard(args)
    path = args.dir
    report_path = path if path.endswith(".json") else os.path.join(path, "report.json")
    if os.path.exists(report_path):
        try:
            with open(report_path) as f:
                report = json.load(f)
            verdict = report["verdict"]
        except (OSError, ValueError, KeyError) as e:
            raise TraceError(f"not a ttrace report ({e})", path=report_path) from None
        render(report, console)
        _tensorboard(report, args.tensorboard, console)
        return EXIT_PASS if verdict == "pass" else EXIT_FAIL
    from .online import has_online_results
    from .trace_store import TraceReader

    if has_online_results(path):
        from .trace_store import RUN_FILE, read_json

        from .online import online_reference_of

        run = read_json(os.path.join(path, RUN_FILE), rank=None)
        report = _compare(online_reference_of(path, run), path, console)
        _tensorboard(report, args.tensorboard, console)
        return EXIT_PASS if report["verdict"] == "pass" else EXIT_FAIL
    if args.tensorboard:
        raise TraceError("--tensorboard writes a report's scalars: give the --out directory of `ttrace run` (its "
                         "report.json) or an online candidate's trace; compare a recorded pair first", path=path)
    reader = TraceReader(path)
    counts = {}
    for _, rec in reader.records():
        counts[rec.key.phase] = counts.get(rec.key.phase, 0) + 1
    iterations = sorted({rec.key.iteration for _, rec in reader.records()})
    console.print(f"trace {path}: role {reader.run.get('role')}, {len(reader.ranks)} rank(s), "
                  f"iterations {iterations}, records per phase {counts}")
    return EXIT_PASS


def _tensorboard_dir(args, out: str) -> Optional[str]:
    """Where this check's scalars go: ``--tensorboard DIR``, the fp32 twin's under ``DIR/fp32_twin``."""
    from .recipe import FP32_TWIN

    base = getattr(args, "tensorboard", None)
    if not base:
        return None
    twin = os.path.basename(os.path.normpath(out)) == FP32_TWIN
    return os.path.abspath(os.path.join(base, FP32_TWIN) if twin else base)


def _check_tensorboard(args) -> None:
    """``--tensorboard`` needs the tensorboard package: said before anything runs, not after the check."""
    if getattr(args, "tensorboard", None):
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise RecipeError("--tensorboard needs the tensorboard package: pip install tensorboard "
                              "(or this package's extra: pip install -e '.[tensorboard]')")


def _tensorboard(report: dict, out: Optional[str], console: Console) -> None:
    """``--tensorboard OUT``: the report's scalars per iteration as a TensorBoard event file."""
    if not out:
        return
    from .scalars import write_report

    n = write_report(report, out)
    console.print(f"TensorBoard scalars of {n} iteration(s) → {out} (tensorboard --logdir {out})", highlight=False)


def _int_list(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_online_arguments(parser: argparse.ArgumentParser, plan: bool = False) -> None:
    """Online (the default) or --keep-traces: whether the candidate writes its tensors."""
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--online", dest="online", action="store_true",
                     help="as run by default: " + ONLINE_HELP if plan else "the default: " + ONLINE_HELP)
    how.add_argument("--keep-traces", dest="online", action="store_false",
                     help=("as run --keep-traces: " if plan else "") + KEEP_TRACES_HELP)
    parser.set_defaults(online=True)
    parser.add_argument("--reference-in", choices=REFERENCE_IN_CHOICES, default="auto",
                        help=("as run --reference-in: " if plan else "") + REFERENCE_IN_HELP)
    parser.add_argument("--reference-memory", metavar="SIZE",
                        help=("as run --reference-memory: " if plan else "") + REFERENCE_MEMORY_HELP)
    if plan:
        parser.add_argument("--cpu", action="store_true",
                            help="as run --cpu: the check's ranks on CPU even if GPUs are present (a streamed "
                                 "reference needs them)")
        # run's reason its reference may not stream, for auto to decide as run will (the disk check's plan)
        parser.add_argument("--stream-refused", default="", help=argparse.SUPPRESS)


ONLINE_HELP = ("each candidate rank judges its shards against the reference's trace while it runs and writes "
               "verdict sums, not tensors (so does the perturbation run); only the reference's trace, and on a "
               "mismatch the replay of its iteration, take disk")
REFERENCE_IN_CHOICES = ("auto", "memory", "disk", "stream")  # plan.REFERENCE_IN (not imported: it loads torch)
REFERENCE_IN_HELP = ("where the reference's trace is written: memory (a directory in /dev/shm, never written to the "
                     "disk, removed once its pair is judged; a failing "
                     "check's moved under --out), disk (under --out), stream (in memory, one iteration at a time: "
                     "the candidate (and a perturbation run, beside it) judges each iteration as the reference "
                     "finishes it, and the next overwrites what the verdict does not read again; CPU ranks, online "
                     "and in lock-step; a failing check runs the reference again, up to the failing iteration, for "
                     "its replay: in memory where held whole it fits, else on the disk under --out), or auto (the default, where the check keeps no traces; "
                     "each pair's reference, a bf16 recipe's and its fp32 twin's, placed by its own: stream where nothing "
                     "refuses it, its peak fits half the memory available (--reference-memory), held whole it "
                     "would take 1 GiB or more and no perturbation run would read it too; else memory where its "
                     "bytes fit; else stream where its peak fits; else disk)")
REFERENCE_MEMORY_HELP = ("the most a reference held in memory may take, e.g. 40GB (default: half the memory available "
                         "as the check starts), within /dev/shm's free space: auto holds it whole, streams it or writes "
                         "it to the disk by it, and memory and stream are refused above it")
KEEP_TRACES_HELP = ("record the candidate's (and the perturbation run's) tensors too and compare the two traces "
                    "after the run: about twice the disk, for `ttrace compare` to read again later; what only this "
                    "judges: per-microbatch partial sums (an SP replica's weight grad, an expert-TP layer's partial "
                    "outputs), whose reduced values are judged either way")


def _add_run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("recipe", nargs="?",
                     help="recipe YAML, or a directory: run every recipe in it and print a summary "
                          "(default: the embedded tiny GPT, TP=2 + SP)")
    run.add_argument("--out", help="keep the traces and report.json in this directory (one subdirectory per recipe)")
    run.add_argument("--json", help="write the machine-readable report here (a summary for a directory)")
    run.add_argument("--junit", help="write JUnit XML here, one test case per recipe")
    run.add_argument("--html", help="write the self-contained HTML report here (also kept as report.html in --out)")
    run.add_argument("--inject", action="append", default=[], metavar="BUG[:MODULE_PATTERN]",
                     help="inject a known bug into the candidate (tests and the bug zoo)")
    run.add_argument("--no-localize", action="store_true",
                     help="on a mismatch, do not replay the candidate to find the module that introduces it")
    _add_online_arguments(run)
    run.add_argument("--tensorboard", metavar="DIR",
                     help="the check's verdicts per iteration as TensorBoard scalars in DIR (worst error / tolerance "
                          "per phase and layer, tensors over tolerance, the first failing tensor); online (the default), "
                          "written during the candidate's run, from every rank's shards")
    run.add_argument("--cpu", action="store_true", help="run on CPU with gloo even if GPUs are present")
    run.add_argument("--candidate-megatron", metavar="PATH",
                     help="run the candidate (and its replay) on the megatron-core of this source tree (a Megatron-LM "
                          "checkout or a patched copy: the directory holding megatron/core); default: the installed one")
    run.add_argument("--reference-megatron", metavar="PATH",
                     help="run the reference (and its perturbation run) on the megatron-core of this source tree")
    run.add_argument("--megatron-lm", metavar="PATH",
                     help="run both sides through the real pretrain_gpt.py of the Megatron-LM checkout at PATH "
                          "(the recipe translated to its flags, mock data, ttrace added by install())")
    run.add_argument("--megatron-lm-data", metavar="PREFIX",
                     help="with --megatron-lm: Megatron-LM's GPTDataset over this indexed dataset (PREFIX.bin/.idx) "
                          "instead of its mock data")
    run.add_argument("--reference-model", choices=("same", "gpt"), default="same",
                     help="gpt: the reference is the GPTModel a HybridModel recipe of attention/MLP pairs ('*-*-', "
                          "'*E*E') equals, one GPT layer per pair, and the candidate's tensors are named as that "
                          "GPT's (a GPT-to-HybridModel migration check)")
    run.add_argument("--no-lockstep", action="store_true",
                     help="let the candidate train on its own weights. By default it runs in lock-step: after each "
                          "optimizer step it takes the reference's parameters and optimizer state, so every "
                          "iteration is judged given identical weights and state (and the reference records every "
                          "iteration)")
    run.add_argument("--no-fp32-twin", action="store_true",
                     help="a bf16, fp16 or FP8 recipe without its fp32 twin. By default the check also runs the "
                          "recipe in fp32 (same layout and seed checkpoint) and judges it under fp32 bounds, where a "
                          "bug of the layout's logic stands 10^3-10^5x above round-off; the recipe's own pair then "
                          "judges what is specific to its dtype")
    run.add_argument("--quiet", action="store_true",
                     help="no line per finished iteration of each side (printed by default: a check at a realistic "
                          "size runs for minutes between a side's start and the verdict)")
    run.add_argument("--perturb", action="store_true",
                     help="the perturbation estimate: run the reference a second time with round-off-sized noise "
                          "and bound each tensor by what it moved, too (a recipe's tolerance.perturbation)")
    run.add_argument("--iters", type=_int_list, help="record only these iterations (1-based), e.g. 1,3")
    run.add_argument("--modules", action="append", metavar="PATTERN",
                     help="record only modules matching this fnmatch pattern (repeatable), e.g. 'decoder.layers.1.*'")
    run.add_argument("--microbatches", type=_int_list, help="record only these global microbatch ids, e.g. 0")
    run.add_argument("--no-disk-check", action="store_true",
                     help="run even if `ttrace plan` predicts more trace bytes than the disk under --out has free")
    run.add_argument("--workers", type=int, metavar="N",
                     help="compare on this many processes (default: the cores this process may use); the verdict is the same "
                          "bit for bit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ttrace", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show library warnings")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_run_arguments(sub.add_parser("run", help="run the reference and the candidate of a recipe, then compare"))

    plan = sub.add_parser("plan", help="what `ttrace run` of a recipe will write (bytes per side, iteration and "
                                       "tensor kind, disk needed), before anything runs")
    plan.add_argument("recipe", nargs="?", help="recipe YAML (default: the embedded tiny GPT)")
    plan.add_argument("--out", help="where the traces would go, as run's --out (all sides kept); default: a "
                                    "temporary directory, whose pair is removed before the fp32 twin runs")
    plan.add_argument("--megatron-lm-args", metavar="ARGS",
                      help="plan the check of a pretrain_gpt.py run from its flags (one quoted string) instead of a "
                           "recipe; with --world-size")
    plan.add_argument("--world-size", type=int, metavar="N", help="the ranks of the run --megatron-lm-args describes")
    plan.add_argument("--budget", metavar="SIZE", help="suggest a selective recording that fits SIZE (e.g. 200GB)")
    plan.add_argument("--measure-disk", action="store_true",
                      help="time a 256 MiB write where the traces go, a write of what is held in memory (256 MiB "
                           "to 1 GiB) there, and compare's parts on this machine, and estimate the write and judging "
                           "times")
    plan.add_argument("--json", help="write the plan here as JSON ('-': nothing printed)")
    _add_online_arguments(plan, plan=True)
    for flag, text in (("--no-fp32-twin", "as run --no-fp32-twin"),
                       ("--perturb", "as run --perturb"), ("--no-lockstep", "as run --no-lockstep")):
        plan.add_argument(flag, action="store_true", help=text)
    plan.add_argument("--iters", type=_int_list, help="as run --iters")
    plan.add_argument("--modules", action="append", metavar="PATTERN", help="as run --modules")
    plan.add_argument("--microbatches", type=_int_list, help="as run --microbatches")

    cmp_ = sub.add_parser("compare", help="compare a candidate trace against a reference trace")
    cmp_.add_argument("reference")
    cmp_.add_argument("candidate")
    cmp_.add_argument("--json", help="write the machine-readable report here")
    cmp_.add_argument("--html", help="write the self-contained HTML report here")
    cmp_.add_argument("--perturbed", metavar="DIR",
                      help="a perturbation run of the reference (--ttrace-perturb): each tolerance is at least "
                           "k_p times how far it moved each tensor")
    cmp_.add_argument("--workers", type=int, metavar="N",
                      help="compare on this many processes (default: the cores this process may use); the verdict is the same "
                          "bit for bit")
    cmp_.add_argument("--distributed", action="store_true",
                      help="launched by torchrun (over several machines where a trace is larger than one): each rank "
                           "judges its share of the keys, rank 0 the verdicts in order and the report; the verdict is "
                           "the same bit for bit")

    loc = sub.add_parser("localize", help="judge a replay trace (--ttrace-replay) module by module under local bounds")
    loc.add_argument("reference")
    loc.add_argument("replay")
    loc.add_argument("--json", help="write the culprits here")

    rep = sub.add_parser("report", help="print the report kept in a run's --out directory, or summarize a trace")
    rep.add_argument("dir")
    rep.add_argument("--tensorboard", metavar="OUT", default=None,
                     help="also write the report's scalars per iteration (worst error / tolerance per phase and "
                          "layer, tensors over tolerance, the first failing tensor) as a TensorBoard event file in OUT")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return EXIT_ERROR if e.code not in (0, None) else EXIT_PASS
    if args.verbose:
        os.environ["TTRACE_VERBOSE"] = "1"  # rank processes read it too
    from .adapter.run.worker_env import quiet_warnings

    quiet_warnings()
    console = Console()
    commands = {"run": cmd_run, "compare": cmd_compare, "report": cmd_report, "localize": cmd_localize,
                "plan": cmd_plan}
    try:
        return commands[args.command](args, console)
    except (TraceError, RecipeError, RunFailed, ValueError) as e:
        print(f"ttrace: error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
