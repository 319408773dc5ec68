"""What each part of compare costs per byte, on one core: the floor under compare's throughput.

Compare reads each key's pieces a chunk at a time (``streaming``), verifies each data file once
(xxh3), takes the pieces' sums (``tolerance.difference_sums``) and a replicated piece's digest
(CRC32), re-clips a moment where the clip coefficients differ, and judges an updated parameter
element by element (``update_rules.judge_adam_chunks``). Each part runs here alone on the 50M
rung's largest tensor (64 MiB of fp32: 16 Mi elements), a chunk at a time as compare runs it, on
one thread, best of ``--repeats``; its throughput is set against this machine's memory bandwidth
(``costs.memory_bandwidth``). No part reaches 0.5× of it on one core, and compare runs all of
them: ``compare_at_scale.py`` measures the whole on every core. One JSON line per part.

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

from costs import memory_bandwidth, read_into_page_cache  # noqa: E402

ELEMENTS = 16 << 20  # the 50M rung's embedding: 32768 × 512 fp32


def best_of(repeats, fn):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def parts(tmp: str, repeats: int):
    """(part, bytes it goes through, seconds) for each part of compare."""
    import torch

    from ttrace_megatron import streaming, trace_store
    from ttrace_megatron.placement import Layout, content_digest
    from ttrace_megatron.step_bounds import reclip_delta
    from ttrace_megatron.tolerance import difference_sums
    from ttrace_megatron.trace_store import TensorKey, TraceReader, TraceWriter, write_run_info
    from ttrace_megatron.update_rules import AdamRule, judge_adam_chunks

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(ELEMENTS, generator=gen)
    b = a * (1 + 1e-7 * torch.randn(ELEMENTS, generator=gen))
    nbytes = a.numel() * a.element_size()
    chunks = list(streaming.chunks(ELEMENTS))

    write_run_info(tmp, {"role": "reference", "world_size": 1, "num_layers": 1})
    w = TraceWriter(tmp, 0, {"tp": (0, 1)}, page_cache=True)
    key = TensorKey(1, -1, "embedding.word_embeddings", "optimizer", "weight")
    w.add(key, a.reshape(32768, 512), Layout((), (32768, 512)), depth=1)
    w.flush(1)
    w.close()
    read_into_page_cache(tmp)
    reader = TraceReader(tmp)
    rt, rec = next(reader.records())
    source = streaming.RecordSource(reader, rt, rec)
    whole = source.meta()
    fname, info = next(iter(rt.files.items()))
    data = os.path.join(rt.dir, fname)

    def read():
        for begin, end in chunks:
            streaming.read_flat(source, whole, begin, end)

    def verify():
        with open(data, "rb") as f:
            assert trace_store._verify(f, info)[1]

    yield "read a chunk at a time from the page cache", nbytes, best_of(repeats, read)
    yield "verify a data file (xxh3, from the page cache)", os.path.getsize(data), best_of(repeats, verify)
    yield "sums of a piece against the reference (two operands)", 2 * nbytes, best_of(
        repeats, lambda: [difference_sums(a[s:e], b[s:e]) for s, e in chunks])
    digest = 0
    yield "digest of a replicated piece (CRC32)", nbytes, best_of(
        repeats, lambda: [content_digest(a[s:e], digest) for s, e in chunks])
    rule = {"beta1": 0.9, "beta2": 0.95}
    yield "re-clip a moment by its main grad (two operands)", 2 * nbytes, best_of(
        repeats, lambda: [reclip_delta("exp_avg_sq", rule, b[s:e], 0.9, 0.91).add_(a[s:e]) for s, e in chunks])
    m, v = a.abs() * 1e-3, a * a * 1e-6
    adam = AdamRule(0.9, 0.95, 1e-8)
    yield "element-wise Adam check (six operands)", 6 * nbytes, best_of(
        repeats, lambda: judge_adam_chunks(adam, 1e-4, 2.0, "float32",
                                           ((s, [a[s:e], b[s:e], m[s:e], v[s:e], m[s:e], v[s:e]]) for s, e in chunks)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
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
