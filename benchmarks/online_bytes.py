"""What a check writes, recorded (both sides' traces) against online (the candidate and the
perturbation run compare as they run): one JSON line per check, with the bytes of each trace
directory, the verdict, the first mismatch, the replay's culprit, the tensors judged and skipped,
and each part's seconds. The same recipe, seed and bug in both modes, one after the other.

    python benchmarks/online_bytes.py --recipe gpt_tp2_sp --wide --dtypes fp32 bf16 \\
        --inject row_allreduce_dropped:decoder.layers.3.mlp.linear_fc2 --out results/online_bytes_COMMIT.jsonl

``--wide``: the recipe at the scale ladder's 50M-parameter rung (margins.WIDE: 8 layers, hidden 512,
vocabulary 32768). Each check's directory is removed after it is measured.

``--plain``: first, each dtype's two layouts trained by plain megatron-core (the same launcher, no
tracer attached), each timed from its launch to its exit: the whole check's wall time (``wall_s``,
``ttrace run`` from its start to its report, the disk check's plan included) over their sum is the
check's cost as a ratio (issue #35: ≤ 2× for a clean fp32 check in lock-step, no replay).
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
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from margins import recipe as shipped_recipe  # noqa: E402
from ttrace_megatron.plan import MEMORY_ROOT  # noqa: E402

MODES = {"recorded": ["--keep-traces"], "online": []}  # online: ttrace run's default


def core_seconds() -> Optional[dict]:
    """The whole machine's CPU time so far, by what it did (Linux's ``/proc/stat``, every core
    summed, in seconds): ``user`` (nice included), ``kernel`` (system, irq, softirq), ``idle``
    (iowait included), ``steal`` (a VM's time its host ran something else). Two readings' difference
    says whether a stretch of wall time was work or waiting: a check's cores idle while a rank
    waits for another at a collective. None where there is no ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    fields += [0] * (8 - len(fields))
    return {"user": (fields[0] + fields[1]) / hz, "kernel": (fields[2] + fields[5] + fields[6]) / hz,
            "idle": (fields[3] + fields[4]) / hz, "steal": fields[7] / hz}


def core_seconds_since(before: Optional[dict]) -> Optional[dict]:
    now = core_seconds()
    return None if before is None or now is None else {k: round(now[k] - before[k], 2) for k in now}


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def check(name: str, dtype: str, seed: int, wide: bool, mode: str, inject: Optional[str], tmp: str,
          cpu: bool = False, reference_io: str = "page-cache", reference_in: str = "auto") -> dict:
    import yaml

    from ttrace_megatron.cli import main

    r = shipped_recipe(name, dtype, seed, wide)
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(r.to_json(), f)
    out, report_path = os.path.join(tmp, "out"), os.path.join(tmp, "report.json")
    argv = ["run", path, "--out", out, "--json", report_path, "--quiet", "--reference-in", reference_in] + MODES[mode] + (
        ["--inject", inject] if inject else []) + (["--cpu"] if cpu else [])
    start, before = time.monotonic(), core_seconds()
    with open(os.path.join(tmp, "terminal.txt"), "w") as terminal, contextlib.redirect_stdout(terminal), \
            _reference_io(reference_io):
        main(argv)
    wall, cores = round(time.monotonic() - start, 2), core_seconds_since(before)
    with open(report_path) as f:
        report = json.load(f)
    sides = {}
    for d, _, _ in os.walk(out):
        rel = os.path.relpath(d, out)
        if rel.count(os.sep) <= 1 and os.path.basename(d) in ("reference", "candidate", "reference-perturbed", "replay"):
            sides[rel] = tree_bytes(d)
    fm = report.get("first_mismatch") or {}
    import megatron.core

    row = {"recipe": name, "wide": wide, "dtype": dtype, "seed": seed, "mode": mode, "inject": inject,
           "verdict": report["verdict"], "bytes": sides, "bytes_total": tree_bytes(out),
           "first_mismatch": f"{fm.get('module')} {fm.get('phase')} {fm.get('tensor')}" if fm else None,
           "culprit": next((f"{c['module']}, {c['phase']}, {c['tensor']}" for c in report.get("culprits") or []), None),
           "judged": len(report.get("tensors") or []), "skipped": len(report.get("skipped") or []),
           "timings_s": report.get("timings_s"), "wall_s": wall, "core_seconds": cores,
           "commit": subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True).stdout.strip(),
           "megatron_core": megatron.core.__version__, "reference_io": reference_io, "reference_in": reference_in,
           # where the reference went: memory (removed once judged, its bytes not under --out) or the disk
           "reference_in_memory": str(report.get("reference", "")).startswith(MEMORY_ROOT + os.sep),
           "reference_went": report.get("reference_in"),  # where auto put it: memory, stream or disk
           "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), gloo"}
    twin = report.get("fp32_twin")
    if twin is not None:
        row.update(pair_verdict=report.get("pair_verdict"), twin_verdict=twin["verdict"])
    shutil.rmtree(out, ignore_errors=True)
    return row


@contextlib.contextmanager
def _reference_io(how: str):
    """``direct``: every side written with O_DIRECT and fsync'd, as before ``ttrace run`` wrote a
    reference read right after through the page cache (``TraceOptions.page_cache``): the A/B of it."""
    if how == "page-cache":
        yield
        return
    from ttrace_megatron.adapter.run import runner

    real = runner.trace_options
    runner.trace_options = lambda *a, **kw: real(*a, **dict(kw, page_cache=False))
    try:
        yield
    finally:
        runner.trace_options = real


def plain(name: str, dtype: str, seed: int, wide: bool, tmp: str, cpu: bool = False) -> dict:
    """The check's two layouts trained by plain megatron-core (no tracer attached): seconds of each
    from its launch to its exit, as ``ttrace run`` launches its sides (a warm launcher, as the checks
    after it find it)."""
    import megatron.core

    from ttrace_megatron.adapter.run.launch import launch
    from ttrace_megatron.adapter.run.runner import CANDIDATE, REFERENCE, Probes, RunSpec, trace_options

    r = shipped_recipe(name, dtype, seed, wide)
    seconds, cores = {}, {}
    # twice: the first launch of a process starts the launcher's fork server (its imports), which the
    # checks after it find started; the second's seconds (and the machine's core-seconds) are kept
    for role in (REFERENCE, CANDIDATE, REFERENCE, CANDIDATE):
        start, before = time.monotonic(), core_seconds()
        launch(RunSpec(recipe=r.to_json(), role=role, cpu=cpu,
                       trace=trace_options(os.path.join(tmp, role), os.path.join(tmp, "seed.safetensors"))),
               probes=Probes(trace=False), timeout_s=3600)
        seconds[role] = round(time.monotonic() - start, 2)
        cores[role] = core_seconds_since(before)
    return {"recipe": name, "wide": wide, "dtype": dtype, "seed": seed, "mode": "plain", "seconds": seconds,
            "core_seconds": cores,
            "commit": subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True).stdout.strip(),
            "megatron_core": megatron.core.__version__,
            "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), gloo"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="gpt_tp2_sp")
    parser.add_argument("--wide", action="store_true")
    parser.add_argument("--dtypes", nargs="+", default=["fp32"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--inject", help="a bug checked in both modes after the clean checks")
    parser.add_argument("--dir", help="where the checks run (default: a temporary directory)")
    parser.add_argument("--out", required=True, help="JSON lines are appended here")
    parser.add_argument("--plain", action="store_true",
                        help="first time each dtype's two layouts trained without ttrace (the whole check's ratio)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--reference-io", nargs="+", choices=("page-cache", "direct"), default=["page-cache"],
                        help="how the reference is written (direct: O_DIRECT and fsync'd, as before 3831f07); "
                             "each check runs once per choice")
    parser.add_argument("--reference-in", nargs="+", choices=("auto", "memory", "disk"), default=["auto"],
                        help="ttrace run --reference-in: each check runs once per choice (after --reference-io's)")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU even where GPUs are (ttrace run --cpu)")
    args = parser.parse_args()
    for dtype in args.dtypes if args.plain else []:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            row = plain(args.recipe, dtype, args.seed, args.wide, tmp, args.cpu)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    checks = [(dtype, None) for dtype in args.dtypes] + ([("fp32", args.inject)] if args.inject else [])
    for dtype, inject in checks:
        for mode, how, where in ((m, h, w) for m in args.modes for h in args.reference_io for w in args.reference_in):
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                row = check(args.recipe, dtype, args.seed, args.wide, mode, inject, tmp, args.cpu, how, where)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
