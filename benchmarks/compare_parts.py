"""What each part of compare costs per byte, on one core: the floor under compare's throughput.

Compare reads each key's pieces a chunk at a time (``streaming``), verifies each data file once
(xxh3), takes the pieces' sums (``tolerance.difference_sums``) and a replicated piece's digest
(CRC32), re-clips a moment where the clip coefficients differ, and judges an updated parameter
element by element (``update_rules.judge_adam_chunks``). Each part runs here alone on the 50M
rung's largest tensor (64 MiB of fp32: 16 Mi elements), a chunk at a time as compare runs it, on
one thread, best of three (the digest and the re-clip: of ``--repeats``); its throughput is set
against this machine's memory bandwidth (``costs.memory_bandwidth``). The Adam check's float64
arithmetic is the slowest part by far; ``compare_at_scale.py`` measures the whole on every core.
One JSON line per part.

    python benchmarks/compare_parts.py --out benchmarks/results/compare_parts_COMMIT_MACHINE.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from costs import memory_bandwidth  # noqa: E402

ELEMENTS = 16 << 20  # the 50M rung's embedding: 32768 × 512 fp32


def best_of(repeats, fn):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def parts(tmp: str, repeats: int):
    """(part, bytes it goes through, seconds) for each part of compare: the parts ``ttrace plan
    --measure-disk`` times (``plan.measure_compare_rates``, best of three), and the digest and the
    re-clip beside them."""
    import torch

    from ttrace_megatron.placement import content_digest
    from ttrace_megatron.plan import measure_compare_rates
    from ttrace_megatron.step_bounds import reclip_delta
    from ttrace_megatron.streaming import chunks

    rates = measure_compare_rates(tmp, ELEMENTS)
    nbytes = 4 * ELEMENTS
    for part, rate, operands in (("read a chunk at a time from the page cache", rates.read, 1),
                                 ("verify a data file (xxh3, from the page cache)", rates.verify, 1),
                                 ("sums of a piece against the reference (two operands)", rates.sums, 2),
                                 ("element-wise Adam check (six operands)", rates.update, 6)):
        yield part, operands * nbytes, operands * nbytes / rate
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(ELEMENTS, generator=gen), torch.randn(ELEMENTS, generator=gen)
    spans = list(chunks(ELEMENTS))
    yield "digest of a replicated piece (CRC32)", nbytes, best_of(
        repeats, lambda: [content_digest(a[s:e]) for s, e in spans])
    rule = {"beta1": 0.9, "beta2": 0.95}
    yield "re-clip a moment by its main grad (two operands)", 2 * nbytes, best_of(
        repeats, lambda: [reclip_delta("exp_avg_sq", rule, b[s:e], 0.9, 0.91).add_(a[s:e]) for s, e in spans])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="of the digest and the re-clip (the rest: best of 3)")
    parser.add_argument("--out", required=True, help="JSON lines are appended here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # a compare worker's setting: the pool is the parallelism
    bandwidth = memory_bandwidth()
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short=7", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="ttrace-compare-parts-") as tmp:
        for part, nbytes, seconds in parts(tmp, args.repeats):
            row = {"part": part, "bytes": nbytes, "seconds": seconds, "GBps": nbytes / seconds / 1e9,
                   "of_memory_bandwidth": nbytes / seconds / bandwidth, "memory_bandwidth": bandwidth, "threads": 1,
                   "commit": commit, "machine": f"{os.cpu_count()} CPU cores ({platform.machine()})"}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
