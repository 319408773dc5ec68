"""How far an fp32 grad norm lands from the exact one, by kernel and size (BENCHMARKS.md, "The grad
norm at size"; docs/tolerance.md, "The grad norm and what the clip coefficient scales").

For n elements (Gaussian, 1 % of them 30× larger, as embedding rows hit by frequent tokens are), the
relative error against an fp64 norm, in ε_fp32, of:

* ``torch.norm`` in fp32 on this CPU: what megatron-core's fallback ``local_multi_tensor_l2_norm``
  (``megatron/core/utils.py``) calls per tensor when neither apex nor TransformerEngine is installed;
* the same tensor as two halves combined as √(a² + b²): a TP2 run's norm of a TP-split tensor;
* a chunked sum of squares (64 Ki elements a chunk, the chunks summed pairwise): the shape of
  apex's and TE's ``multi_tensor_l2norm`` on a GPU, emulated in fp32 on the CPU.

    python benchmarks/norm_roundoff.py [--draws 3]
"""

from __future__ import annotations

import argparse
import math

import torch

EPS = torch.finfo(torch.float32).eps
SIZES = (1 << 16, 1 << 20, 1 << 22, 25 << 20)


def chunked_norm(x: torch.Tensor, chunk: int = 1 << 16) -> float:
    """Σ x² per 64 Ki-element chunk in fp32, the chunk sums added pairwise in fp32, then √."""
    sums = torch.stack([(c * c).sum() for c in x.split(chunk)])
    while sums.numel() > 1:
        if sums.numel() % 2:
            sums = torch.cat([sums, sums.new_zeros(1)])
        sums = sums[0::2] + sums[1::2]
    return float(sums[0].sqrt())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=3)
    args = ap.parse_args()
    print("| elements | torch.norm fp32 (CPU) vs fp64 | two halves √(a²+b²) vs whole | chunked tree (GPU-like) vs fp64 |")
    print("|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for n in SIZES:
        cols = ([], [], [])
        for _ in range(args.draws):
            x = torch.randn(n, generator=gen) * 1e-3
            x[: n // 100] *= 30
            exact = float(torch.linalg.vector_norm(x.double()))
            whole = float(torch.norm(x))
            halves = math.sqrt(sum(float(torch.norm(h)) ** 2 for h in x.chunk(2)))
            cols[0].append(abs(whole - exact) / exact / EPS)
            cols[1].append(abs(whole - halves) / exact / EPS)
            cols[2].append(abs(chunked_norm(x) - exact) / exact / EPS)
        print(f"| {n:,} | " + " | ".join(f"{min(c):.3g}–{max(c):.3g} ε" for c in cols) + " |")


if __name__ == "__main__":
    main()
