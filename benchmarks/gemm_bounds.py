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

from ttrace_megatron.formats import number_format  # noqa: E402
from ttrace_megatron.roundoff import OUTPUT_FORMAT, gemm_errors_vs_fp64, to_input_format  # noqa: E402
from ttrace_megatron.tolerance import local_error, single_gemm_error  # noqa: E402

OUTPUT = {fmt: {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[out]
          for fmt, out in OUTPUT_FORMAT.items()}


def to_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    values, scale = to_input_format(x, fmt)
    return values / scale


def single_gemm_table(draws: int) -> None:
    """One implementation against fp64, tensor-core order (sequential fp32 FMA along K)."""
    g = torch.Generator().manual_seed(1)
    print(f"\nOne GEMM against fp64, tensor-core order (sequential fp32 FMA along K), {draws} draws of "
          f"[8, K] @ [K, 8]; bound `tolerance.single_gemm_error` = √K·u_acc + u_out\n")
    print("| inputs | output | K | bound (ε_out) | observed p99.9 (ε_out) | observed max (ε_out) | draws within "
          "| bound / max |")
    print("|---|---|---|---|---|---|---|---|")
    for fmt, out in OUTPUT_FORMAT.items():
        eps = number_format(out).eps
        for k in (16, 256, 4096):
            errors = gemm_errors_vs_fp64(fmt, k, draws, g).sort().values
            bound = single_gemm_error(k, out)
            p999 = float(errors[int(0.999 * (len(errors) - 1))])
            within = int((errors <= bound).sum())
            print(f"| {fmt} | {out} | {k} | {bound / eps:.2f} | {p999 / eps:.3f} | {float(errors[-1]) / eps:.3f} "
                  f"| {within}/{draws} | {bound / float(errors[-1]):.1f}× |")


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
    single_gemm_table(max(args.draws, 1000))


if __name__ == "__main__":
    main()
