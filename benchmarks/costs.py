"""Costs of tracing and comparing, every figure a ratio measured in the same run.

1. Step time of a TP=2 GPT on CPU: ttrace off vs attached-but-idle vs recording one iteration.
   The recorded iteration's extra time (its own, plus the slow-down of the two iterations that
   run while its bytes are written in the background, plus the wait for the writes at the end) is
   set against the time to write its bytes at the disk bandwidth measured here: fsync'd writes of
   the same size, through the page cache and with O_DIRECT, whichever is faster.
2. Compare throughput (trace bytes read per second) against memory bandwidth measured here (a
   large tensor copy into a touched buffer), on one process and on ``--workers`` (default: one
   and every core), and compare peak memory (RSS high-water mark of a fresh process, reset
   through /proc/self/clear_refs after imports: the comparing process's, not its workers')
   against the largest logical tensor.
3. Compare time against trace size (1, 2 and 4 recorded iterations).

    python benchmarks/costs.py > costs.md
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODEL = {"name": "costs_gpt_tp2", "model": {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
                                            "ffn_hidden_size": 2048, "normalization": "LayerNorm",
                                            "add_bias_linear": True},
         "parallel": {"tensor_model_parallel_size": 2}, "world_size": 2,
         "optimizer": {"optimizer": "sgd", "lr": 0.01},
         "data": {"seed": 1, "vocab_size": 4096, "seq_length": 256, "micro_batch_size": 2, "global_batch_size": 4},
         "train": {"iterations": 17}, "dtype": "fp32"}
RECORDED = (4, 9, 14)  # the iterations recorded; the two after each run while its bytes are written
SEPARATE_RUNS = 3

COMPARE_CHILD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
from ttrace_megatron.compare import compare_traces

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))

if int(sys.argv[3]) > 1:
    # the pool's fork server started before the clock, as `ttrace compare` starts it before its own imports
    # (fork_server.prestart_compare): the clock starts after this process's imports of torch, and now after the
    # server's too; both counts of workers time the judging, neither an interpreter's start
    import os
    from ttrace_megatron.fork_server import COMPARE_PRELOAD, forkserver_context
    ready = forkserver_context(COMPARE_PRELOAD).Process(target=os.getpid)  # (served once its imports are done)
    ready.start()
    ready.join()
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # reset the RSS high-water mark (VmHWM) to the current RSS
    f.write("5")
t = time.perf_counter()
c = compare_traces(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]))
elapsed = time.perf_counter() - t
# a worker's own high-water mark over its start (its judge open) is the comparison's: compare_workers reads it
print(json.dumps({"seconds": elapsed, "peak_kib_over_baseline": status("VmHWM") - before, "tensors": len(c.results),
                  "verdict": c.verdict, "worker_peak_bytes": c.worker_peak}))
"""


def dir_bytes(path, suffix=".safetensors"):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs if f.endswith(suffix))


def disk_bandwidth(directory, nbytes, repeats=3):
    """Median of ``repeats`` fsync'd writes of ``nbytes`` through the page cache, and the same with
    ``O_DIRECT`` (the way the trace writer writes where it can). This machine's disk is noisy."""
    import mmap

    blob = mmap.mmap(-1, min(nbytes, 64 << 20))  # page-aligned, as O_DIRECT wants
    blob.write(os.urandom(len(blob)))
    view = memoryview(blob)
    path = os.path.join(directory, "disk-probe.bin")
    rates = {}
    for mode, flags in (("page cache", 0), ("O_DIRECT", getattr(os, "O_DIRECT", 0))):
        if mode == "O_DIRECT" and not flags:
            continue
        rates[mode] = []
        for _ in range(repeats):
            t = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags)
            written = 0
            while written < nbytes:
                n = min(len(view), -(-(nbytes - written) // 4096) * 4096)
                written += os.write(fd, view[:n])
            os.fsync(fd)
            os.close(fd)
            rates[mode].append(written / (time.perf_counter() - t))
            os.remove(path)
    return {mode: statistics.median(r) for mode, r in rates.items()}


def read_into_page_cache(*dirs):
    """Read every file under ``dirs`` once, so that what reads them next finds them in memory."""
    for d in dirs:
        for root, _, files in os.walk(d):
            for name in files:
                with open(os.path.join(root, name), "rb") as fh:
                    while fh.read(16 << 20):
                        pass


def memory_bandwidth():
    """Best of 5 copies of 256 MiB into an already-touched buffer (read + write bytes per second)."""
    import torch

    x = torch.ones(256 << 20, dtype=torch.uint8)
    y = torch.zeros_like(x)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        best = max(best, 2 * x.numel() / (time.perf_counter() - t))
    return best


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=MODEL["data"]["vocab_size"],
                        help="a larger vocabulary makes the largest tensors (embedding, logits) larger")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1],
                        help="compare the trace in the page cache on this many processes (each a row)")
    parser.add_argument("--no-scale", action="store_true", help="leave out part 3 (compare time against trace size)")
    args = parser.parse_args()
    vocab = args.vocab_size
    MODEL["data"] = dict(MODEL["data"], vocab_size=vocab)
    warnings.filterwarnings("ignore")
    import torch

    from ttrace_megatron.adapter.run.launch import launch
    from ttrace_megatron.adapter.run.runner import CANDIDATE, REFERENCE, Probes, RunSpec, trace_options
    from ttrace_megatron.recipe import recipe_from_dict
    from ttrace_megatron.trace_store import TraceReader

    recipe = recipe_from_dict(MODEL)
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="ttrace-costs-")
    if not os.environ.get("TTRACE_KEEP_BENCH"):
        atexit.register(shutil.rmtree, tmp, True)  # several GiB of traces: a full /tmp stops everything
    seed = os.path.join(tmp, "seed.safetensors")

    def run(role, name, recipe_json=None, probes=Probes(timings=True), **trace):
        d = os.path.join(tmp, name)
        launch(RunSpec(recipe=recipe_json or recipe.to_json(), role=role, trace=trace_options(d, seed, **trace)),
               timeout_s=1800, probes=probes)
        with open(os.path.join(d, "timings-rank00000.json")) as f:
            return d, json.load(f)

    run(REFERENCE, "reference", iterations=list(RECORDED))
    step = lambda x: x["step_s"] + x["flush_s"]
    steady = lambda t: statistics.median(step(x) for x in t["iterations"] if x["iteration"] >= 2)
    # separate runs, alternated: one run per mode is as noisy here (±3%) as the goal
    off_runs, idle_runs = [], []
    for k in range(SEPARATE_RUNS):
        off_runs.append(steady(run(CANDIDATE, f"off-{k}", probes=Probes(timings=True, trace=False))[1]))
        idle_runs.append(steady(run(CANDIDATE, f"idle-{k}", iterations=[])[1]))
    rec_dir, rec = run(CANDIDATE, "record", iterations=list(RECORDED))
    off_s, idle_s = statistics.median(off_runs), statistics.median(idle_runs)
    # interleaved: attached-but-idle on even iterations, detached on odd ones, in one process
    long = dict(recipe.to_json(), train=dict(recipe.to_json()["train"], iterations=41))
    _, alt = run(CANDIDATE, "interleaved", recipe_json=long,
                 probes=Probes(timings=True, alternate_idle=True), iterations=[])
    t = {x["iteration"]: step(x) for x in alt["iterations"]}
    pair_ratios = sorted(t[i] / ((t[i - 1] + t[i + 1]) / 2) for i in range(4, 41, 2))
    q = lambda f: pair_ratios[min(len(pair_ratios) - 1, int(f * len(pair_ratios)))]
    # a recorded iteration's cost: its own extra time and the slow-down of the two iterations
    # during which its bytes are written in the background (the median over the recorded
    # iterations: one alone varies by ±80 ms here), plus the wait for the writes at the end
    by_it = {x["iteration"]: step(x) for x in rec["iterations"]}
    affected = {i for r in RECORDED for i in range(r, r + 3)}
    base = statistics.median(v for i, v in by_it.items() if i >= 2 and i not in affected)
    per_recorded = {r: [by_it[i] - base for i in range(r, r + 3)] for r in RECORDED}
    typical = sorted(RECORDED, key=lambda r: sum(per_recorded[r]))[len(RECORDED) // 2]
    during = per_recorded[typical]
    extra = sum(during) + rec["close_s"]
    rank0_bytes = dir_bytes(os.path.join(rec_dir, "rank-00000")) // len(RECORDED)
    disk_bw = disk_bandwidth(tmp, rank0_bytes)
    best_mode = max(disk_bw, key=disk_bw.get)
    write_s = rank0_bytes / disk_bw[best_mode]

    print(f"commit {commit}; machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo; model: "
          f"GPT 4 layers, hidden 512, ffn 2048, seq 256, micro-batch 2 × 2 microbatches, vocab {vocab}, TP=2, fp32\n")
    print("| measure | value | ratio | goal |")
    print("|---|---|---|---|")
    runs = lambda xs: " / ".join(f"{x * 1e3:.0f}" for x in xs)
    print(f"| step time, ttrace off (median of iterations 2–17; median of {SEPARATE_RUNS} runs) | {off_s * 1e3:.0f} ms "
          f"({runs(off_runs)}) | 1.00 | |")
    print(f"| step time, attached but idle (the same, runs alternated with the above) | {idle_s * 1e3:.0f} ms "
          f"({runs(idle_runs)}) | {idle_s / off_s:.3f}× off | ≤ 1.02× |")
    print(f"| attached-but-idle step / mean of its two detached neighbours, one process ({len(pair_ratios)} pairs) "
          f"| quartiles {q(0.25):.3f} / {q(0.5):.3f} / {q(0.75):.3f} | {q(0.5):.3f}× (median) | ≤ 1.02× |")
    bw_text = ", ".join(f"{m} {v / 2**20:.0f} MiB/s" for m, v in disk_bw.items())
    totals = ", ".join(f"{r}: {sum(per_recorded[r]) * 1e3:+.0f}" for r in RECORDED)
    print(f"| recorded iteration: extra time (rank 0; the median of iterations {totals} ms) | {extra * 1e3:.0f} ms "
          f"for {rank0_bytes / 2**20:.1f} MiB (iterations {typical}, {typical + 1}, {typical + 2}: "
          f"{' / '.join(f'{d * 1e3:+.0f}' for d in during)} ms; waiting for the writes at the end "
          f"{rec['close_s'] * 1e3:.0f} ms) | {extra / write_s:.2f}× the time to write its bytes at "
          f"{disk_bw[best_mode] / 2**20:.0f} MiB/s (the faster of {bw_text}) | ≤ 1.2× |")

    mem_bw = memory_bandwidth()
    largest = 0
    for _, r in TraceReader(os.path.join(tmp, "reference")).records():
        numel = 1
        for s in r.layout.logical_shape:
            numel *= s
        largest = max(largest, numel * torch.empty(0, dtype=getattr(torch, r.dtype)).element_size())
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nbytes = dir_bytes(os.path.join(tmp, "reference")) + dir_bytes(rec_dir)
    cases = [("as written (O_DIRECT: not in the page cache)", 1)] + [
        ("in the page cache (read once before)", n) for n in dict.fromkeys(args.workers)]
    for cache, workers in cases:
        if cache.startswith("in"):
            read_into_page_cache(os.path.join(tmp, "reference"), rec_dir)
        out = subprocess.run([sys.executable, "-c", COMPARE_CHILD, os.path.join(tmp, "reference"), rec_dir,
                              str(workers)], capture_output=True, text=True, env=env, check=True)
        res = json.loads(out.stdout.strip().splitlines()[-1])
        thr = nbytes / res["seconds"]
        print(f"| compare throughput, trace {cache}, {workers} worker{'s' if workers > 1 else ''} "
              f"({res['tensors']} tensors, {nbytes / 2**20:.1f} MiB, verdict {res['verdict']}) | "
              f"{thr / 2**20:.0f} MiB/s | {thr / mem_bw:.3f}× memory bandwidth ({mem_bw / 2**30:.1f} GiB/s) | ≥ 0.5× |")
        peak = res["peak_kib_over_baseline"] * 1024
        print(f"| compare peak memory over baseline, the comparing process, {workers} worker"
              f"{'s' if workers > 1 else ''} | {peak / 2**20:.1f} MiB | {peak / largest:.1f}× the largest "
              f"logical tensor ({largest / 2**20:.1f} MiB) | ≤ 2× |")

    if args.no_scale:
        return
    print("\n| recorded iterations | trace MiB (both sides) | compare s | s per MiB |")
    print("|---|---|---|---|")
    for iters in ([1], [1, 2], [1, 2, 3, 4]):
        name = "scale-" + "-".join(map(str, iters))
        rd, _ = run(REFERENCE, name + "-ref", iterations=iters)
        cd, _ = run(CANDIDATE, name + "-cand", iterations=iters)
        out = subprocess.run([sys.executable, "-c", COMPARE_CHILD, rd, cd, "1"], capture_output=True, text=True,
                             env=env, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        mib = (dir_bytes(rd) + dir_bytes(cd)) / 2**20
        print(f"| {len(iters)} | {mib:.1f} | {r['seconds']:.2f} | {r['seconds'] / mib:.4f} |")


if __name__ == "__main__":
    main()
