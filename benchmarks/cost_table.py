"""Issue #35's cost table at the scale ladder's 50M-parameter rung, every figure measured in one run.

``costs.py`` measures the per-iteration ratios on a toy trace; this measures what a user's first
check costs where its tensors are large (``margins.WIDE``: gpt_tp2_sp, 8 layers, hidden 512,
vocabulary 32768, TP2 + SP, 3 iterations, fp32), in one process, one part after the other:

1. the two layouts trained by plain megatron-core (no tracer attached; ``online_bytes.plain``);
2. the default check (online, lock-step, the reference where ``--reference-in auto`` puts it: streamed at
   this rung), then again with ``--reference-in memory`` (held whole) and ``--reference-in disk``:
   the wall time over (1), and each part's;
3. a recorded check (``--keep-traces``), then its traces compared in a fresh process from the page
   cache on one process and on every core: throughput against memory bandwidth (measured here),
   peak memory against the largest tensor;
4. the floors: this machine's write bandwidth where each reference went, compare's parts on one
   thread (``plan.measure_compare_rates``), and the judging floor the plan gives each side.

The table's rows pair each goal with its measure and, where the goal is out of reach here, the
floor of the part that keeps it there. ``--json`` keeps the raw figures (one JSON object).

    python benchmarks/cost_table.py --out results/cost_table_COMMIT_MACHINE.md --json results/cost_table_COMMIT_MACHINE.json
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if "--cpu" in sys.argv[1:]:
    # this process too builds the model (the plan's floors) under the CPU shims, which refuse a process
    # that sees CUDA: hidden before anything imported below can initialize it
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

from compare_at_scale import largest_tensor_bytes  # noqa: E402
from costs import COMPARE_CHILD, dir_bytes, memory_bandwidth, read_into_page_cache  # noqa: E402
from margins import recipe as shipped_recipe  # noqa: E402
from online_bytes import check, plain  # noqa: E402

RECIPE = "gpt_tp2_sp"
# the checks, alternated: the default (``--reference-in auto``: streamed at this rung, held whole at
# 4.0 GB, over ``plan.STREAM_FROM_BYTES``, where nothing refuses it), the reference held whole in memory,
# and on the disk
CHECKS = ("auto", "memory", "disk")
RUNG = "the 50M rung (gpt_tp2_sp, 8 layers, hidden 512, vocabulary 32768, TP2 + SP, 3 iterations, fp32)"


def add_result_args(parser: argparse.ArgumentParser) -> None:
    """A benchmark's --dir, --jsonl, --out and --table (stream_or_hold.py's, stream_iterations.py's)."""
    parser.add_argument("--dir", help="where each check's scratch goes (default: a temporary directory)")
    parser.add_argument("--jsonl", help="each row's figures, appended")
    parser.add_argument("--out", help="the Markdown table")
    parser.add_argument("--table", help="only print the table of this JSONL file (and write it to --out)")


def rows_of(path: str) -> list:
    """The rows of a benchmark's JSONL file (--table)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def add_row(row: dict, jsonl) -> None:
    """A measured row appended to ``jsonl`` where given, and printed as it comes."""
    if jsonl:
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def print_table(text: str, out) -> None:
    """The table printed, and written to ``out`` where given."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)


def _commit() -> str:
    return subprocess.run(["git", "-C", REPO, "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def _cpu_model() -> str:
    """The first CPU's model name, with its family and model numbers: a VM may show only "AMD EPYC",
    and two VMs of one kind ran on Zen 3 (family 25) and Zen 5 (family 26) hosts, whose figures differ."""
    fields = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break
            name, _, value = line.partition(":")
            fields[name.strip()] = value.strip()
    if "model name" not in fields:
        return platform.machine()
    numbers = [f"{k} {fields[n]}" for k, n in (("family", "cpu family"), ("model", "model")) if n in fields]
    return ", ".join([fields["model name"]] + numbers)


def whole_checks(tmp: str, repeats: int, cpu: bool, reference_bytes: int, streamed_bytes: int) -> dict:
    """(1) and (2): plain training, then the default check (``--reference-in auto``: where it puts
    the reference here), the check with its reference held whole in memory, and with it on the disk,
    the four alternated ``repeats`` times: each check is divided by the plain training right
    before it (this VM's timings move by 10-20 % from one check to the next, and by 1.4× between its
    phases: a table at 8dd6c98 divided both repeats by one plain training of 5.9 s, where the others
    took 5.0-5.2). Right before each check, the reference's bytes are written alone where that check
    puts them (:func:`write_at_size`; a streamed reference's peak, ``streamed_bytes``): the time to
    write them, in the state the machine is in for that check."""
    from ttrace_megatron import plan as core
    from ttrace_megatron.adapter.run.launch import cpu_ranks

    refused = "" if cpu_ranks(cpu) else "GPU ranks"  # (as ``cli._stream_refusal`` says of this check's flags)
    out = {"trained_s": None, **{where: [] for where in CHECKS}}
    for k in range(repeats):
        os.makedirs(os.path.join(tmp, f"plain-{k}"))
        trained_run = plain(RECIPE, "fp32", 1, True, os.path.join(tmp, f"plain-{k}"), cpu)
        trained = trained_run["seconds"]
        out["trained_s"] = out["trained_s"] or trained
        for where in CHECKS:
            work = os.path.join(tmp, f"{where}-{k}")
            os.makedirs(work)
            # where ``ttrace run`` will put this reference (plan.reference_placement, as the run decides it)
            placed = core.reference_placement(where, reference_bytes, streamed_bytes, core.memory_room(), True, refused)
            held = placed != core.DISK
            place = core.MEMORY_ROOT if held else work
            written = write_at_size(place, reference_bytes if placed != core.STREAM else streamed_bytes)
            # the same bytes into memory already held, and freed (the reference held whole only)
            into_held = held_write(place, reference_bytes) if where == core.MEMORY else None
            row = check(RECIPE, "fp32", 1, True, "online", None, work, cpu, reference_in=where)
            out[where].append(dict(row, write_at_size_bps=written, held=into_held, trained_s=trained,
                                   trained_core_seconds=trained_run.get("core_seconds")))
            shutil.rmtree(work, ignore_errors=True)
    return out


def write_at_size(directory: str, nbytes: int) -> float:
    """Bytes a second of writing ``nbytes`` (the reference's, rounded up to 1 MiB a file) alone in
    ``directory`` as the tracer writes them: in ``trace_store.WRITE_LANES`` files at once, a thread
    each, each fsync'd (``plan.measure_write_bandwidth``) and removed after. (One thread into one
    file, as tables before 2026-11-29 timed it, takes up to twice as long on tmpfs here: a recording
    written by two lanes measured 0.56-0.94× that.) At a check's own size, not 256 MiB: this VM gives
    a process memory it has not touched lately at a fraction of the rate it gives memory freed
    moments before (writing 4 GB into /dev/shm measured 0.55-0.58 GB/s where 256 MiB measured
    1.8-2.4 GB/s), and a check's reference is such memory."""
    import threading

    from ttrace_megatron import plan as core
    from ttrace_megatron.trace_store import WRITE_LANES

    each = -(-nbytes // (WRITE_LANES << 20)) << 20
    threads = [threading.Thread(target=core.measure_write_bandwidth, args=(directory, each))
               for _ in range(WRITE_LANES)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return WRITE_LANES * each / max(time.monotonic() - start, 1e-9)


def held_write(directory: str, nbytes: int) -> dict:
    """The reference's bytes written as :func:`write_at_size` writes them, but into files that already
    hold as many bytes (their pages overwritten in place, none allocated), then those files freed
    (unlinked as ``ttrace run`` removes an in-memory reference: ``plan.remove_tree``). What a
    reference written into memory the check already holds would pay for its writes, against
    memory it has not touched lately: on this VM a tmpfs page written for the first time cost
    0.37-0.44 s/GB in the kernel, overwritten 0.21-0.23, and freeing it 0.13-0.14 (one thread, 1 GB,
    2026-11-29). The files are first written untimed."""
    import threading

    from ttrace_megatron import plan as core
    from ttrace_megatron.fork_server import available_cores
    from ttrace_megatron.trace_store import WRITE_LANES

    each = -(-nbytes // (WRITE_LANES << 20)) << 20
    work = tempfile.mkdtemp(dir=directory, prefix=".ttrace-held-")
    paths = [os.path.join(work, f"lane{k}") for k in range(WRITE_LANES)]
    block = os.urandom(1 << 20)

    def write(path: str, mode: str) -> None:
        with open(path, mode) as f:
            for _ in range(each // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    def lanes(mode: str) -> float:
        threads = [threading.Thread(target=write, args=(path, mode)) for path in paths]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.monotonic() - start

    try:
        lanes("wb")
        overwrite_s = lanes("r+b")  # the same files from their start: every page already there
    finally:
        start = time.monotonic()
        core.remove_tree(work, min(available_cores(), 4))  # as ``cli.REMOVAL_THREADS`` removes a reference
        free_s = time.monotonic() - start
    return {"overwrite_bps": WRITE_LANES * each / max(overwrite_s, 1e-9), "free_s": free_s}


def recorded_compare(tmp: str, workers, cpu: bool) -> dict:
    """(3): both sides recorded, compared from the page cache in a fresh process on each count of workers."""
    import yaml

    from ttrace_megatron.cli import main as cli

    path = os.path.join(tmp, "recipe.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(shipped_recipe(RECIPE, "fp32", 1, True).to_json(), f)
    out = os.path.join(tmp, "recorded")
    with open(os.path.join(tmp, "terminal.txt"), "w") as t, contextlib.redirect_stdout(t):
        cli(["run", path, "--out", out, "--keep-traces", "--quiet", "--no-disk-check"] + (["--cpu"] if cpu else []))
    ref, cand = os.path.join(out, "reference"), os.path.join(out, "candidate")
    result = {"trace_bytes": dir_bytes(ref) + dir_bytes(cand), "largest_tensor_bytes": largest_tensor_bytes(ref),
              "compares": []}
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for n in workers:
        read_into_page_cache(ref, cand)
        run = subprocess.run([sys.executable, "-c", COMPARE_CHILD, ref, cand, str(n)], capture_output=True, text=True,
                             env=env, check=True, cwd=REPO)
        result["compares"].append(dict(json.loads(run.stdout.strip().splitlines()[-1]), workers=n))
    shutil.rmtree(out, ignore_errors=True)
    return result


def floors(tmp: str, workers) -> dict:
    """(4): write bandwidth where a reference goes (memory, the disk), compare's parts, the judging floors
    (the recorded pair's on each count of workers compare runs on)."""
    import dataclasses

    from ttrace_megatron import plan as core
    from ttrace_megatron.adapter.run.plan import check_plan
    from ttrace_megatron.fork_server import available_cores

    recipe = shipped_recipe(RECIPE, "fp32", 1, True)
    rates = core.measure_compare_rates(tmp)
    held = check_plan(recipe, online=True, twin=False, reference_in=core.MEMORY)  # the held check's
    recorded = check_plan(recipe, online=False, twin=False)
    cores = available_cores()
    def best(where):  # (of three: a single 256 MiB write here has measured 0.5 and 2.6 GB/s minutes apart)
        return max(core.measure_write_bandwidth(where) for _ in range(3))

    return {"write_bandwidth": {"memory": best(core.MEMORY_ROOT) if core.memory_room() else None, "disk": best(tmp)},
            "staging_copy": max(staging_copy_rate() for _ in range(3)),
            "compare_rates": dataclasses.asdict(rates), "cores": cores,
            # the held check's: its ranks read the reference held in memory through maps
            "judging_floor_online": core.judging_seconds(held, rates, cores),
            "judging_floor_recorded": core.judging_seconds(recorded, rates, cores),
            "compare_floor_by_workers": {str(n): core.judging_seconds(recorded, rates, n)["candidate"]
                                         for n in workers},
            "reference_bytes": held.side("reference").total(),
            "streamed_bytes": check_plan(recipe, online=True, twin=False, reference_in=core.STREAM).memory_needed()}


def staging_copy_rate(nbytes: int = 256 << 20) -> float:
    """Bytes a second a recording rank copies tensors into its staging buffers at, alone on one
    thread (``stream_writer``: 8 MiB buffers, warm, its ``copy_bytes``; 32 MiB fp32 tensors, written
    once before)."""
    import torch

    from ttrace_megatron import stream_writer

    sources = [torch.ones(8 << 20) for _ in range(max(1, nbytes // (32 << 20)))]
    stage = torch.zeros(stream_writer.STAGING_BYTES, dtype=torch.uint8)
    start = time.perf_counter()
    for src in sources:
        flat = src.view(torch.uint8)
        for at in range(0, flat.numel(), stage.numel()):
            n = min(stage.numel(), flat.numel() - at)
            stream_writer.copy_bytes(stage[:n], flat[at:at + n])
    return sum(s.numel() * 4 for s in sources) / (time.perf_counter() - start)


def each(xs, f: str = ".1f") -> str:
    """Each repeat's figure, in order: ``a / b``."""
    return " / ".join(format(x, f) for x in xs)


def cores_row(runs: list, check: str = "the default check") -> tuple:
    """Where the machine's cores went during each ``check``, against the plain training right
    before it (both sides' launches summed): work in user space, work in the kernel (a fresh page's
    fault and zeroing, a tmpfs write), and idle (a rank waiting for another, or for its writes).
    From ``/proc/stat``, the whole machine: what else ran then is in it too."""
    def parts(c: dict) -> str:
        return f"user {c['user']:.1f} + kernel {c['kernel']:.1f} + idle {c['idle']:.1f}"

    def summed(r: dict) -> dict:
        sides = r["trained_core_seconds"].values()
        return {k: sum(c[k] for c in sides) for k in ("user", "kernel", "idle")}

    def share(c: dict) -> float:
        return c["idle"] / max(c["user"] + c["kernel"] + c["idle"], 1e-9)
    checks, plains = [r["core_seconds"] for r in runs], [summed(r) for r in runs]
    return (f"where the cores went during {check} (core-seconds of the whole machine, /proc/stat), "
            "against the two layouts' plain training right before it",
            " / ".join(parts(c) for c in checks) + " core-s; trained: " + " / ".join(parts(c) for c in plains),
            f"idle {each([100 * share(c) for c in checks], '.0f')} % of the check's core-seconds, "
            f"{each([100 * share(c) for c in plains], '.0f')} % of the training's; busy "
            f"{each([(c['user'] + c['kernel']) / (p['user'] + p['kernel']) for c, p in zip(checks, plains)], '.2f')}× "
            "the training's", "")


def recording_passes_row(m: dict) -> tuple:
    """What recording to memory does to every byte, each pass at its own measured speed, one after
    the other: copied into staging, hashed (xxh3: compare's verifying rate), written (at its own
    size, alone, right before each check: ``write_at_size``); against the write alone. On this
    machine the passes share its cores with the training they record."""
    fl = m["floors"]
    size = fl["reference_bytes"]
    writes = [r["write_at_size_bps"] for r in m["whole"]["memory"]]
    copy, hashed = size / fl["staging_copy"], size / fl["compare_rates"]["verify"]
    totals = [copy + hashed + size / w for w in writes]
    return ("recording's passes over the reference's bytes, each at its own speed, one after the other: "
            f"copy {fl['staging_copy'] / 1e9:.1f} GB/s, hash {fl['compare_rates']['verify'] / 1e9:.1f} GB/s, "
            f"write {each([w / 1e9 for w in writes], '.2f')} GB/s (at its size, before each check)",
            " / ".join(f"{copy:.2f} + {hashed:.2f} + {size / w:.2f} = {t:.2f} s" for w, t in zip(writes, totals)),
            " / ".join(f"{t / (size / w):.2f}" for w, t in zip(writes, totals))
            + f"× the time to write its bytes (the passes share the {fl['cores']} cores with the training they "
              "record)", "≤ 1.2×")


def recording_row(went: str, extra: list, at_size: list, fl: dict) -> tuple:
    """The reference's extra time over training it alone, against the time to write its bytes: at
    their own size, alone, right before each check (``write_at_size``), and the short write of the
    floors (256 MiB, the best of 3) beside it, which tables before 2026-11-27 divided by."""
    from ttrace_megatron.trace_store import WRITE_LANES

    size, short = fl["reference_bytes"], fl["write_bandwidth"][went]
    return (f"recorded iterations ({went}): the reference's extra time over training it alone",
            f"{each(extra)} s for {size / 1e9:.2f} GB",
            f"{each([e / (size / w) for e, w in zip(extra, at_size)], '.2f')}× the time to write its bytes, "
            f"alone right before each check, into {WRITE_LANES} files at once as the tracer writes them "
            f"({each([size / w for w in at_size])} s: {each([w / 1e9 for w in at_size], '.2f')} GB/s, {went}); "
            f"{each([e / (size / short) for e in extra], '.2f')}× at {short / 1e9:.2f} GB/s (256 MiB, one file, "
            "the best of 3)",
            "≤ 1.2×")


def held_row(runs: list, fl: dict) -> tuple:
    """The reference's bytes written into memory the check already holds (:func:`held_write`), right
    before each held check, against the same bytes into fresh memory (``write_at_size``) and the
    freeing after: what a check saves on its fresh pages where it writes its reference into memory
    it holds (as a streamed reference writes each iteration over the one before's), beside the rest
    of its parts."""
    size = fl["reference_bytes"]
    fresh = [size / r["write_at_size_bps"] for r in runs]
    over = [size / r["held"]["overwrite_bps"] for r in runs]
    free = [r["held"]["free_s"] for r in runs]
    return ("the reference's bytes written into memory already held (files that hold as many bytes, "
            "overwritten in place, as the tracer writes), right before each check; then freed as a check "
            "frees its reference",
            f"{each(over, '.2f')} s ({each([size / o / 1e9 for o in over], '.2f')} GB/s); freed in "
            f"{each(free, '.2f')} s",
            f"{each([f / o for f, o in zip(fresh, over)], '.2f')}× faster than into fresh memory "
            f"({each(fresh, '.2f')} s); fresh pages and their freeing: "
            f"{each([f - o + z for f, o, z in zip(fresh, over, free)], '.2f')} s of the held check", "")


def _against_floor(fl: dict, workers: int, seconds: float) -> str:
    """Compare's time against its parts' floor on as many processes: every part one after the other
    at its rate on one thread (``plan.compare_seconds``), the work split evenly. The slowest part's
    row bounds what compare could reach; this one says how far it is from what its parts allow."""
    floor = fl.get("compare_floor_by_workers", {}).get(str(workers))
    if floor is None:
        return ""
    return (f"; {seconds / floor:.2f}× its parts' floor of {floor:.1f} s (every part one after the other, "
            f"the plan's, on {workers} process{'es' if workers > 1 else ''})")


CHECK_NAMES = {"auto": "the default check", "memory": "the check with its reference held whole",
               "disk": "the check with its reference on the disk"}


def whole_row(where: str, runs: list, trained) -> tuple:
    """One check's wall time against the two layouts trained right before it, by part: each side's
    own where they ran one after the other, the two together where the reference was streamed (its
    sides take turns an iteration at a time)."""
    from ttrace_megatron.plan import STREAM as STREAMED  # (a report's reference_in where it was streamed)

    went = runs[0].get("reference_went") or ("memory" if runs[0]["reference_in_memory"] else "disk")
    how = {STREAMED: "streamed (in memory, one iteration at a time, the two sides taking turns)",
           "memory": "held whole in memory", "disk": "on the disk"}[went]
    label = {"auto": f"the default (--reference-in auto): online, the reference {how}",
             "memory": "online, the reference held whole in memory (--reference-in memory)",
             "disk": "online, the reference on the disk (--reference-in disk)"}[where]
    parts = [r["timings_s"] for r in runs]
    if went == STREAMED:
        sides = (f"the two sides {each([p['reference'] + p['candidate'] for p in parts])} (trained alone "
                 f"{each([sum(trained(r).values()) for r in runs])})")
    else:
        sides = (f"reference {each([p['reference'] for p in parts])} (trained alone "
                 f"{each([trained(r)['reference'] for r in runs])}), candidate {each([p['candidate'] for p in parts])} "
                 f"(alone {each([trained(r)['candidate'] for r in runs])})")
    return (f"the whole check, {label} ({', '.join(r['verdict'] for r in runs)}; "
            f"{runs[0]['bytes_total'] / 1e9:.2f} GB written to the disk)",
            f"{each([r['wall_s'] for r in runs])} s: {sides}, compare {each([p['compare'] for p in parts])}, the rest "
            f"{each([r['wall_s'] - sum(p.values()) for r, p in zip(runs, parts)])}",
            f"{each([r['wall_s'] / sum(trained(r).values()) for r in runs], '.2f')}× the two layouts "
            f"trained right before it ({each([sum(trained(r).values()) for r in runs])} s)", "≤ 2×")


def floor_rows(held: list, fl: dict, floor: float, trained) -> list:
    """The held check with each part at its floor, one after the other: its bytes written alone into
    fresh memory, and into memory already held (:func:`held_row`)."""
    if not held[0]["reference_in_memory"]:
        return []
    rows = []
    plains = [sum(trained(r).values()) for r in held]
    writes = [fl["reference_bytes"] / r["write_at_size_bps"] for r in held]
    least = [p + w + floor for p, w in zip(plains, writes)]
    rows.append(("the whole check with each part at its floor, one after the other: the two layouts trained, "
                 "the reference's bytes written to memory alone right before each check, the candidate's "
                 "judging at the plan's floor",
                 " / ".join(f"{p:.1f} + {w:.1f} + {floor:.1f} = {t:.1f} s" for p, w, t in zip(plains, writes, least)),
                 f"{each([t / p for p, t in zip(plains, least)], '.2f')}× the two layouts trained", "≤ 2×"))
    if all(r.get("held") for r in held):
        rows.append(held_row(held, fl))
        over = [fl["reference_bytes"] / r["held"]["overwrite_bps"] for r in held]
        least = [p + w + floor for p, w in zip(plains, over)]
        rows.append(("the same, the reference's bytes written into memory already held (the row above)",
                     " / ".join(f"{p:.1f} + {w:.1f} + {floor:.1f} = {t:.1f} s" for p, w, t in zip(plains, over, least)),
                     f"{each([t / p for p, t in zip(plains, least)], '.2f')}× the two layouts trained", "≤ 2×"))
    return rows


def table(m: dict) -> list:
    """The rows: (measure, value, ratio, goal). Each check against the plain training right before
    it (tables before 2026-11-29: against one, before all)."""
    from ttrace_megatron import plan as core

    first = m["whole"]["trained_s"]

    def trained(r: dict) -> dict:
        return r.get("trained_s") or first
    bw, rates, fl = m["memory_bandwidth"], m["floors"]["compare_rates"], m["floors"]
    rows = []
    for where in CHECKS:
        runs = m["whole"][where]
        rows.append(whole_row(where, runs, trained))
        if where != "disk" and all(r.get("core_seconds") and r.get("trained_core_seconds") for r in runs):
            rows.append(cores_row(runs, CHECK_NAMES[where]))
        if runs[0].get("reference_went") == core.STREAM:  # (its sides overlap: no recording of its own to time)
            continue
        went = "memory" if runs[0]["reference_in_memory"] else "disk"
        extra = [r["timings_s"]["reference"] - trained(r)["reference"] for r in runs]
        rows.append(recording_row(went, extra, [r["write_at_size_bps"] for r in runs], fl))
        if where == "memory" and fl.get("staging_copy"):
            rows.append(recording_passes_row(m))
    held = m["whole"]["memory"]
    judged = [r["timings_s"]["candidate"] - trained(r)["candidate"] for r in held]
    floor = fl["judging_floor_online"]["candidate"]
    rows.append(("the candidate's online judging, the reference held whole: its extra time over training it alone "
                 f"(both ranks on {fl['cores']} cores)", f"{each(judged)} s",
                 f"{each([j / floor for j in judged])}× the plan's floor of {floor:.1f} s a rank (its parts at the "
                 "rates below; its reference in memory, read through maps, its own tensors neither read nor "
                 "verified)", ""))
    rows += floor_rows(held, fl, floor, trained)
    rec = m["recorded"]
    for c in rec["compares"]:
        thr = rec["trace_bytes"] / c["seconds"]
        n = c["workers"]
        rows.append((f"compare from the page cache, {n} worker{'s' if n > 1 else ''} ({rec['trace_bytes'] / 1e9:.2f} GB, "
                     f"{c['tensors']} keys, verdict {c['verdict']})", f"{c['seconds']:.1f} s, {thr / 1e9:.2f} GB/s",
                     f"{thr / bw:.3f}× memory bandwidth ({bw / 1e9:.1f} GB/s)" + _against_floor(fl, n, c["seconds"]),
                     "≥ 0.5×"))
        peak, largest = c["peak_kib_over_baseline"] * 1024, rec["largest_tensor_bytes"]
        rows.append((f"compare peak over baseline, the comparing process, {n} worker{'s' if n > 1 else ''}",
                     f"{peak / 2**20:.0f} MiB", f"{peak / largest:.2f}× the largest tensor "
                     f"({largest / 2**20:.0f} MiB)", "≤ 2×"))
        if c.get("worker_peak_bytes") is not None:  # (a pool's: the most any worker held over its start)
            rows.append((f"compare peak over its start, each of the {n} workers (the most any held)",
                         f"{c['worker_peak_bytes'] / 2**20:.0f} MiB",
                         f"{c['worker_peak_bytes'] / largest:.2f}× the largest tensor", "≤ 2× per worker"))
    slowest = min(("verify", "read", "sums", "update"), key=lambda k: rates[k])
    names = {"verify": "verifying (xxh3)", "read": "reading a chunk at a time", "sums": "a piece's sums",
             "update": "the element-wise Adam check"}
    rows.append(("compare's parts on one thread: " + ", ".join(f"{names[k]} {rates[k] / 1e9:.1f} GB/s "
                                                               f"({rates[k] / bw:.3f}×)" for k in names),
                 f"the slowest: {names[slowest]}",
                 f"a floor of {min(1.0, fl['cores'] * rates[slowest] / bw):.3f}× memory bandwidth on all "
                 f"{fl['cores']} cores", "≥ 0.5×"))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the Markdown table")
    parser.add_argument("--json", help="the raw figures")
    parser.add_argument("--dir", help="where the traces go (default: a temporary directory)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--repeats", type=int, default=2, help="each whole check, alternated (default 2)")
    parser.add_argument("--cpu", action="store_true",
                        help="gloo on the CPU where GPUs are (ttrace run --cpu): one GPU cannot hold the TP2 candidate")
    args = parser.parse_args()
    import torch

    tmp = tempfile.mkdtemp(dir=args.dir, prefix="ttrace-cost-table-")
    try:
        m = {"commit": _commit(), "machine": f"{os.cpu_count()} CPU cores ({_cpu_model()}), torch "
                                             f"{torch.__version__}, gloo" + ("; GPUs hidden (--cpu)" if args.cpu else "")}
        # the bandwidths first, on a quiet machine (after 8 GB of traces were deleted, a write to memory measured 0.5 GB/s)
        m["floors"] = floors(tmp, list(dict.fromkeys(args.workers)))
        m["memory_bandwidth"] = memory_bandwidth()
        m["whole"] = whole_checks(tmp, args.repeats, args.cpu, m["floors"]["reference_bytes"],
                                  m["floors"]["streamed_bytes"])
        m["recorded"] = recorded_compare(tmp, list(dict.fromkeys(args.workers)), args.cpu)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=1)
    lines = [f"commit {m['commit']}; machine: {m['machine']}; {RUNG}; one run of benchmarks/cost_table.py", "",
             "| measure | value | ratio | goal |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table(m)]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
