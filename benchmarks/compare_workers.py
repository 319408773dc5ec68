"""Offline compare on N processes, at a size where it matters: the time, the verdict (bitwise the
serial one) and the comparing process's peak memory over the largest tensor, for N = 1, 2, 4, ...
(issue #35). A worker runs the serial code on one key at a time, so its peak is the serial one's.

The traces are synthetic, written through ``trace_store.TraceWriter`` as a run writes them (no
megatron needed, so it runs on any machine, a GPU machine's 16 cores included): a one-rank
reference and a TP2 candidate of ``layers`` layers, ``iters`` iterations of ``microbatches``
microbatches. Per layer and microbatch: an activation [tokens, hidden] split by columns (Shard),
its grad split by rows, and a weight grad [hidden, hidden] that is a TP partial sum (the SP
layernorm case, which feeds the main grad's cancellation factor); per layer and iteration a main
grad split by rows. The candidate is the reference plus relative noise of a few ε, and one
tensor carries a bug, so the verdict has both passes and a failure to agree on.

    python benchmarks/compare_workers.py --workdir /tmp --hidden 4096 --tokens 4096 --workers 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ttrace_megatron.keys import TensorKey  # noqa: E402
from ttrace_megatron.placement import Layout, Partial, Replicate, Shard  # noqa: E402
from ttrace_megatron.trace_store import TraceWriter, write_run_info  # noqa: E402


def tensors(args, g):
    """(key, full tensor, layout, depth, reduction) of the reference, in recording order."""
    h, t = args.hidden, args.tokens
    for it in range(1, args.iters + 1):
        for mb in range(args.microbatches):
            for layer in range(args.layers):
                m = f"decoder.layers.{layer}.mlp.linear_fc1"
                yield (TensorKey(it, mb, m, "forward", "output"), torch.randn(t, h, generator=g),
                       Layout((Shard(1, "tp"),), (t, h)), layer + 1, h)
            for layer in reversed(range(args.layers)):
                m = f"decoder.layers.{layer}.mlp.linear_fc1"
                yield (TensorKey(it, mb, m, "backward", "grad_input"), torch.randn(t, h, generator=g),
                       Layout((Shard(0, "tp"),), (t, h)), layer + 1, h)
                yield (TensorKey(it, mb, f"decoder.layers.{layer}.input_layernorm", "backward", "weight.grad"),
                       torch.randn(h, generator=g), Layout((Partial("tp"),), (h,)), layer + 1, t)
        for layer in range(args.layers):
            yield (TensorKey(it, -1, f"decoder.layers.{layer}.mlp.linear_fc1", "main_grad", "weight.main_grad"),
                   torch.randn(h, h, generator=g), Layout((Shard(0, "tp"),), (h, h)), layer + 1, t)
            yield (TensorKey(it, -1, f"decoder.layers.{layer}.input_layernorm", "main_grad", "weight.main_grad"),
                   torch.randn(h, generator=g), Layout((Replicate("tp"),), (h,)), layer + 1, t)


def piece(full, layout, rank, world):
    p = layout.placements[0]
    if isinstance(p, Shard):
        return full.chunk(world, dim=p.dim)[rank].contiguous()
    if isinstance(p, Partial):
        return full / world  # the pieces add up to the whole
    return full


def write_traces(args, root):
    info = {"world_size": 1, "num_layers": args.layers, "model_config": {"model": {"hidden_size": args.hidden}}}
    write_run_info(os.path.join(root, "ref"), dict(info, role="reference"))
    write_run_info(os.path.join(root, "cand"), dict(info, role="candidate", world_size=2))
    ref = TraceWriter(os.path.join(root, "ref"), 0, {"tp": (0, 1)})
    cand = [TraceWriter(os.path.join(root, "cand"), r, {"tp": (r, 2)}) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    largest = 0
    for n, (key, full, layout, depth, k) in enumerate(tensors(args, g)):
        largest = max(largest, full.numel() * 4)
        ref.add(key, full, layout, depth=depth, reduction=k)
        noisy = full * (1 + 4e-7 * torch.randn(full.shape, generator=g))
        if n == 5:  # one bug: a TP rank's half of an activation scaled
            noisy = noisy * 1.01
        for r, w in enumerate(cand):
            w.add(key, piece(noisy, layout, r, 2), layout, depth=depth, reduction=k)
    for w in [ref, *cand]:
        w.close()
    return largest


def compare_once(root, workers):
    """In a fresh process, so that its peak memory is its own."""
    code = (
        "import json, os, time\n"
        "from ttrace_megatron import compare_workers\n"
        "from ttrace_megatron.compare import compare_traces\n"
        "from ttrace_megatron.report import to_json\n"
        "def hwm(pid):\n"
        "    try:\n"
        "        for line in open(f'/proc/{pid}/status'):\n"
        "            if line.startswith('VmHWM:'):\n"
        "                return int(line.split()[1]) * 1024\n"
        "    except OSError:\n"
        "        return 0\n"
        "    return 0\n"
        "if __name__ == '__main__':\n"
        "    compare_workers.MIN_PARALLEL_BYTES = 0\n"
        "    base = hwm(os.getpid())\n"

        "    t = time.perf_counter()\n"
        f"    c = compare_traces({os.path.join(root, 'ref')!r}, {os.path.join(root, 'cand')!r}, workers={workers})\n"
        "    seconds = time.perf_counter() - t\n"

        "    print(json.dumps(dict(seconds=seconds, parent_base=base, parent_peak=hwm(os.getpid()),\n"
        "                          verdict=c.verdict,\n"
        "                          report=json.dumps(to_json(c), sort_keys=True))))\n")
    script = os.path.join(root, "compare_once.py")
    with open(script, "w") as f:
        f.write(code)
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, env=dict(
        os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--jsonl", help="append one JSON line per run here")
    args = ap.parse_args()
    root = tempfile.mkdtemp(dir=args.workdir)
    try:
        t = time.perf_counter()
        largest = write_traces(args, root)
        written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        print(f"# traces: {written / 1e9:.2f} GB written in {time.perf_counter() - t:.1f} s; largest tensor "
              f"{largest / 2**20:.0f} MiB; {os.cpu_count()} cores", flush=True)
        serial = None
        for w in args.workers:
            row = compare_once(root, w)
            serial = serial or row["report"]
            line = dict(workers=w, seconds=row["seconds"], verdict=row["verdict"], same_as_first=row["report"] == serial,
                        trace_bytes=written, largest_tensor=largest,
                        parent_peak_over_largest=(row["parent_peak"] - row["parent_base"]) / largest,
                        commit=os.environ.get("TTRACE_COMMIT", ""), cores=os.cpu_count(),
                        shape=dict(hidden=args.hidden, tokens=args.tokens, layers=args.layers, iters=args.iters,
                                   microbatches=args.microbatches))
            print(json.dumps(line), flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(line) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
