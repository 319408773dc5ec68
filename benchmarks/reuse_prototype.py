"""What a reference that holds one iteration would save: its recording into fresh memory against
its recording into the pages of its own last iteration, and against a recording whose bytes go
nowhere (issue #35; not built, measured).

Why. Held whole in memory, a check's reference writes every recorded byte into pages the check has
not touched lately. On the 2-core development VM that was most of the recording's extra time
(BENCHMARKS.md's cost table: the held-memory rows). A streamed reference (the candidate judges
iteration i, then the reference overwrites iteration i's files with iteration i+1's) would hold
one iteration and write the rest into pages it holds. That needs changes across the check (the
history of issue #35 lists them); this measures the reference side of it first.

How. The package is copied into a temporary directory and patched there, never here: the writer
renames the previous iteration's file of the same part to each new file's name once the manifest
lists it whole, and opens it without truncating it (the file is cut to its size at the end, as
always). Only the reference can run so (a candidate would find the earlier iterations gone). A
third variant writes no tensor's bytes at all (each file's header and size only, so its files are
holes): everything else of the recording (the hooks, the staging copies, the hashes, the
manifest) runs as it does, so its extra time over training is the recording's floor without
memory to write, and the fresh variant's over it is what its writes cost. The reference side of
the 50M rung is launched as ``ttrace run`` launches it (in ``/dev/shm``, recording everything,
through the page cache), each round: an untraced warm-up, plain, traced; the variants alternated.
One JSON line a run.

    python benchmarks/reuse_prototype.py --rounds 3 --out results/reuse_prototype_COMMIT_MACHINE.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "gpt_tp2_sp"  # the scale ladder's 50M rung, as the cost table runs it (--wide, fp32)
REUSE = "TTRACE_PROTOTYPE_REUSE"  # set in the patched copy's environment: overwrite the last iteration
UNWRITTEN = "TTRACE_PROTOTYPE_UNWRITTEN"  # set there: no tensor's bytes written (headers only)
VARIANTS = ("fresh", "reuse", "unwritten")

# (file, the text the patch replaces, its replacement): it fails loudly where the code moved
PATCH = (
    ("ttrace_megatron/trace_store.py",
     """        self._open[lane] = _OpenFile(StreamingFile(self._writer, os.path.join(self.dir, fname), self.direct_io,
                                                   self.sync, lane=lane), fname, iteration)""",
     """        keep = False
        if os.environ.get("%s") == "1" and iteration > 1:
            prev = fname.replace(f"iter-{iteration:06d}", f"iter-{iteration - 1:06d}")
            with self._lock:
                listed = prev in self.files
            if listed:
                os.rename(os.path.join(self.dir, prev), os.path.join(self.dir, fname))
                keep = True
        self._open[lane] = _OpenFile(StreamingFile(self._writer, os.path.join(self.dir, fname), self.direct_io,
                                                   self.sync, lane=lane, keep=keep), fname, iteration)""" % REUSE),
    ("ttrace_megatron/stream_writer.py",
     """    def __init__(self, writer: "BackgroundWriter", path: str, direct_io: bool, sync: bool = True, lane: int = 0):""",
     """    def __init__(self, writer: "BackgroundWriter", path: str, direct_io: bool, sync: bool = True, lane: int = 0,
                 keep: bool = False):"""),
    ("ttrace_megatron/stream_writer.py",
     "self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)",
     "self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if keep else os.O_TRUNC), 0o644)"),
    ("ttrace_megatron/stream_writer.py",
     """    def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
        while len(data):""",
     """    def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
        if os.environ.get("%s") == "1" and offset >= HEADER_REGION:
            return
        while len(data):""" % UNWRITTEN),
)

CHILD = r"""
import json, os, shutil, sys, time
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
from online_bytes import core_seconds, core_seconds_since, shipped_recipe, tree_bytes
from ttrace_megatron.adapter.run.launch import launch
from ttrace_megatron.adapter.run.runner import REFERENCE, Probes, RunSpec, trace_options

def side(trace_dir, seed, trace):
    r = shipped_recipe(%r, "fp32", 1, True)
    start = time.monotonic()
    launch(RunSpec(recipe=r.to_json(), role=REFERENCE, cpu=True,
                   trace=trace_options(trace_dir, seed, page_cache=True, iterations=None, modules=("*",),
                                       microbatches=None)),
           probes=Probes(trace=trace), timeout_s=1800)
    return time.monotonic() - start

if __name__ == "__main__":
    work, seed = sys.argv[2], sys.argv[3]
    side(os.path.join(work, "warm"), seed, False)  # the launcher's fork server, the seed checkpoint
    plain = side(os.path.join(work, "plain"), seed, False)
    before = core_seconds()
    traced = side(os.path.join(work, "traced"), seed, True)
    cores = core_seconds_since(before)
    held = tree_bytes(os.path.join(work, "traced"))
    # the memory the files hold (a file of the unwritten variant is a hole of its size)
    allocated = sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(os.path.join(work, "traced"))
                    for f in fs)
    start = time.monotonic()
    shutil.rmtree(os.path.join(work, "traced"))
    print(json.dumps({"plain_s": round(plain, 2), "traced_s": round(traced, 2), "extra_s": round(traced - plain, 2),
                      "held_bytes": held, "allocated_bytes": allocated, "freed_s": round(time.monotonic() - start, 2), "core_seconds": cores}))
""" % RECIPE


def patched_copy(root: str) -> str:
    """The package copied under ``root`` with :data:`PATCH` applied; the copy's path."""
    shutil.copytree(os.path.join(REPO, "ttrace_megatron"), os.path.join(root, "ttrace_megatron"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name, old, new in PATCH:
        path = os.path.join(root, name)
        with open(path) as f:
            text = f.read()
        if text.count(old) != 1:
            raise SystemExit(f"the prototype's patch no longer applies to {name}: update PATCH")
        with open(path, "w") as f:
            f.write(text.replace(old, new))
    return root


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True, help="JSON lines are appended here")
    parser.add_argument("--memory", default="/dev/shm", help="where the reference goes (ttrace run's memory root)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="alternated in this order each round")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="ttrace-reuse-") as tmp:
        code = patched_copy(os.path.join(tmp, "code"))
        seed = os.path.join(tmp, "seed.safetensors")
        for k in range(args.rounds):
            for variant in args.variants:
                work = tempfile.mkdtemp(dir=args.memory, prefix="ttrace-reuse-")
                env = dict(os.environ, PYTHONPATH=code + os.pathsep + REPO, **{
                    REUSE: "1" if variant == "reuse" else "0", UNWRITTEN: "1" if variant == "unwritten" else "0"})
                try:
                    run = subprocess.run([sys.executable, "-c", CHILD, REPO, work, seed], env=env, cwd=tmp,
                                         capture_output=True, text=True, check=True)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                row = dict(json.loads(run.stdout.strip().splitlines()[-1]), variant=variant, round=k,
                           recipe=RECIPE, commit=commit, machine=f"{os.cpu_count()} CPU cores ({platform.machine()})")
                print(json.dumps(row), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
