"""How tight is the local (same-input) GEMM bound? Random GEMMs, fp64 as the exact answer.

For each input format, reduction length K and number of partial sums p (a row-parallel GEMM
split over p ranks, partial sums added in fp32): two correct implementations — the whole-K GEMM
and the p-way split — both rounded to the output format, compared relative to the exact product.
Reported against ``tolerance.local_error(K, output format)``, the local term used by every verdict.

    python benchmarks/gemm_bounds.py [--draws 200] > gemm_bounds.md
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ttrace_megatron.fp8 import quantize, scale_from_amax  # noqa: E402
from ttrace_megatron.formats import number_format  # noqa: E402
from ttrace_megatron.tolerance import local_error  # noqa: E402


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to 10 mantissa bits (nearest, ties away), as tensor cores read TF32 inputs."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def to_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "tf32":
        return round_to_tf32(x)
    if fmt in ("e4m3", "e5m2"):
        s = scale_from_amax(float(x.abs().max()), fmt)
        return quantize(x, s, fmt).float() / s
    return x.to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[fmt])).float()


OUTPUT = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "e4m3": torch.bfloat16, "e5m2": torch.bfloat16}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--draws", type=int, default=200)
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    g = torch.Generator().manual_seed(0)
    print(f"commit {commit}; {os.cpu_count()} CPU cores, torch {torch.__version__}; {args.draws} draws of "
          f"[16, K] @ [K, 16] per row, standard normal inputs\n")
    print("| inputs | output | K | partial sums | local bound (ε_out) | observed p99.9 (ε_out) | observed max (ε_out) "
          "| bound / max |")
    print("|---|---|---|---|---|---|---|---|")
    for fmt, out in OUTPUT.items():
        eps = number_format(str(out).replace("torch.", "")).eps
        for k in (64, 1024, 8192):
            for p in (2, 4):
                errs = []
                for _ in range(args.draws):
                    a = to_format(torch.randn(16, k, generator=g), fmt)
                    b = to_format(torch.randn(k, 16, generator=g), fmt)
                    exact = a.double() @ b.double()
                    whole = (a @ b).to(out).double()
                    split = sum(a[:, i * k // p:(i + 1) * k // p] @ b[i * k // p:(i + 1) * k // p]
                                for i in range(p)).to(out).double()
                    errs.append(float((whole - split).norm() / exact.norm()))
                errs.sort()
                bound = local_error(k, str(out).replace("torch.", ""))
                p999 = errs[min(len(errs) - 1, int(0.999 * len(errs)))]
                ratio = f"{bound / errs[-1]:.0f}×" if errs[-1] > 0 else "∞ (all equal)"
                print(f"| {fmt} | {str(out).replace('torch.', '')} | {k} | {p} | {bound / eps:.1f} | {p999 / eps:.3f} "
                      f"| {errs[-1] / eps:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
