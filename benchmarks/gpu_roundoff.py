"""What only a GPU can show about ttrace's bounds and costs: cuBLAS and Hopper FP8 round-off at the
shapes of Llama-3-8B and -70B, TF32, the grad norm's reduction, and recording from device memory.

Every figure elsewhere in BENCHMARKS.md was measured on a CPU, whose GEMM kernels block the
reduction. A user's check runs on GPUs. This script measures, on whatever device it is given,
with nothing but torch and ttrace's core (no megatron, no TransformerEngine):

``gemm``
    One GEMM at each shape a layer of the two models computes, in each input format, against the
    fp64 product of the same rounded inputs (``tolerance.single_gemm_error``), and two correct
    implementations against each other (``tolerance.local_error``, the local term of every verdict):
    the whole GEMM and the TP-way row-parallel split whose partial outputs are summed in the output
    format (a ring all-reduce sums in the tensor's dtype), and the TP-way column split.
``tf32``
    How a relative difference δ of a GEMM's fp32 inputs (the round-off a layer hands the next)
    reaches its output, with TF32 off and on. ttrace's fp32 bounds assume it arrives as δ (the
    per-layer C = 1.03 of tolerance.py). TF32 rounds each input to 10 mantissa bits; inputs that
    differ by δ round differently about δ/u_tf32 of the time, by u_tf32 each.
``fp8``
    Hopper's FP8 GEMM (``torch._scaled_mm``, e4m3 operands, per-tensor scales, bf16 output) with
    fast accumulation (TransformerEngine's forward GEMMs) and with split accumulation (its dgrad and
    wgrad GEMMs), against the fp64 product of the same FP8 values, and against ttrace's CPU
    emulation (``fp8.fp8_matmul``, fp32 accumulation) as a second correct implementation.
``norm``
    The L2 norm of N fp32 elements on the device, as megatron's grad norm computes it without apex
    (``torch.norm`` per tensor), against fp64; also the TP2 form √(a² + b²) of two halves.
``record``
    A recorded iteration from device tensors through ``trace_store.TraceWriter`` (the copy into
    pinned staging buffers, the CRC32, the write), against the disk's own write time, with each
    part's rate measured alone.

    python benchmarks/gpu_roundoff.py --jsonl OUT.jsonl            # all sections, on cuda
    python benchmarks/gpu_roundoff.py --device cpu --small         # a smoke run anywhere
    python benchmarks/gpu_roundoff.py --table OUT.jsonl            # the markdown tables
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import zlib
from typing import Dict, List

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from costs import disk_bandwidth  # noqa: E402
from ttrace_megatron.fp8 import quantize, scale_from_amax  # noqa: E402
from ttrace_megatron.formats import number_format  # noqa: E402
from ttrace_megatron.keys import FORWARD, TensorKey  # noqa: E402
from ttrace_megatron.placement import Layout, Replicate  # noqa: E402
from ttrace_megatron.tolerance import ToleranceConfig, local_error, single_gemm_error  # noqa: E402
from ttrace_megatron.trace_store import TraceWriter  # noqa: E402

K_FACTOR = ToleranceConfig().k  # a verdict's local bound is k · local_error

# Llama-3 shapes: (hidden, ffn, vocabulary); one microbatch of 8192 tokens (sequence 8192)
MODELS = {"8B": (4096, 14336, 128256), "70B": (8192, 28672, 128256)}
TOKENS = 8192
OUT_COLS = 2048  # every output column is an independent reduction: 2048 of them make the statistic


def gemm_shapes(small: bool) -> List[dict]:
    """(name, M, K) of each reduction a layer computes: K is what the tolerance takes."""
    if small:
        return [dict(model="toy", gemm="fc2 forward", m=64, k=512)]
    rows = []
    for model, (h, ffn, vocab) in MODELS.items():
        rows += [dict(model=model, gemm="qkv/fc1 forward (K = h)", m=TOKENS, k=h),
                 dict(model=model, gemm="fc2 forward, fc1 dgrad (K = ffn)", m=TOKENS, k=ffn),
                 dict(model=model, gemm="wgrad (K = tokens of a microbatch)", m=h, k=TOKENS)]
    rows.append(dict(model="8B/70B", gemm="logits dgrad into the last hidden (K = V/TP8)", m=TOKENS,
                     k=MODELS["8B"][2] // 8))
    return rows


def rel(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / ref.double().norm())


# "bf16" and "fp16" run with torch's defaults, which let cuBLAS reduce in the 16-bit format
# (allow_bf16/fp16_reduced_precision_reduction); the "-fp32 reduction" rows turn that off
FORMATS = {"fp32": (torch.float32, "fp32"), "tf32": (torch.float32, "fp32"), "bf16": (torch.bfloat16, "bf16"),
           "bf16-fp32 reduction": (torch.bfloat16, "bf16"), "fp16": (torch.float16, "fp16"),
           "fp16-fp32 reduction": (torch.float16, "fp16")}


def set_reduced_precision_reduction(on: bool) -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = on
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = on


def set_tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def gemm_section(device: str, small: bool, emit) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    for shape in gemm_shapes(small):
        m, k, n = shape["m"], shape["k"], (64 if small else OUT_COLS)
        a32 = torch.randn(m, k, device=device, generator=g)
        b32 = torch.randn(k, n, device=device, generator=g)
        for fmt, (dtype, out) in FORMATS.items():
            if device != "cuda" and (fmt == "tf32" or "reduction" in fmt):
                continue
            set_tf32(fmt == "tf32")
            set_reduced_precision_reduction("reduction" not in fmt)
            a, b = a32.to(dtype), b32.to(dtype)
            exact = a.double() @ b.double()  # tf32: against the fp32 inputs, input rounding included
            whole = a @ b
            row = dict(shape, section="gemm", fmt=fmt, out=out, n=n)
            eps = number_format(out).eps
            row["single_eps"] = rel(whole, exact, exact) / eps
            row["single_bound_eps"] = single_gemm_error(k, out) / eps
            row["local_bound_eps"] = local_error(k, out) / eps
            for tp in (2, 8):
                step = k // tp
                partial = [a[:, i * step:(i + 1) * step] @ b[i * step:(i + 1) * step] for i in range(tp)]
                ring = partial[0]
                for p in partial[1:]:
                    ring = ring + p  # in the output dtype, as a ring all-reduce of that dtype sums
                row[f"row_tp{tp}_eps"] = rel(whole, ring, exact) / eps
                cols = torch.cat([a @ b[:, i * n // tp:(i + 1) * n // tp] for i in range(tp)], dim=1)
                row[f"col_tp{tp}_eps"] = rel(whole, cols, exact) / eps
            set_tf32(False)
            set_reduced_precision_reduction(True)
            emit(row)


def tf32_section(device: str, small: bool, emit) -> None:
    """Inputs X and X·(1 + δ) with δ ~ N(0, σ²) per element, then one GEMM: the output's relative
    difference over the input's, with TF32 off and on. Linear propagation gives ≈ 1."""
    if device != "cuda":
        return
    g = torch.Generator(device=device).manual_seed(1)
    h = 512 if small else MODELS["8B"][0]
    x = torch.randn(TOKENS if not small else 64, h, device=device, generator=g)
    w = torch.randn(h, OUT_COLS if not small else 64, device=device, generator=g) / math.sqrt(h)
    eps32 = number_format("fp32").eps
    for sigma_eps in (1, 10, 100, 1000):
        noise = torch.randn(x.shape, device=device, generator=g) * (sigma_eps * eps32)
        x2 = x * (1 + noise)
        d_in = rel(x, x2, x)
        for on in (False, True):
            set_tf32(on)
            y, y2 = x @ w, x2 @ w
            d_out = rel(y, y2, y)
            emit(dict(section="tf32", tf32=on, k=h, input_diff_eps=d_in / eps32, output_diff_eps=d_out / eps32,
                      amplification=d_out / d_in if d_in else float("nan"),
                      fp32_local_bound_eps=local_error(h, "fp32") / eps32))
        set_tf32(False)


def fp8_section(device: str, small: bool, emit) -> None:
    if device != "cuda" or not hasattr(torch, "_scaled_mm"):
        return
    g = torch.Generator(device=device).manual_seed(2)
    ks = (512,) if small else (4096, 8192, 14336, 28672)
    m, n = (64, 64) if small else (TOKENS, OUT_COLS)
    eps = number_format("bf16").eps
    for k in ks:
        a = torch.randn(m, k, device=device, generator=g)
        b = torch.randn(k, n, device=device, generator=g)
        sa, sb = scale_from_amax(float(a.abs().max()), "e4m3"), scale_from_amax(float(b.abs().max()), "e4m3")
        qa, qb = quantize(a, sa, "e4m3"), quantize(b, sb, "e4m3")
        exact = (qa.double() @ qb.double()) / (sa * sb)
        inv_a = torch.tensor(1.0 / sa, device=device, dtype=torch.float32)
        inv_b = torch.tensor(1.0 / sb, device=device, dtype=torch.float32)
        qb_cm = qb.t().contiguous().t()  # _scaled_mm wants the second operand column-major
        set_tf32(False)
        emulated = ((qa.float() @ qb.float()) / (sa * sb)).to(torch.bfloat16)  # ttrace's fp8.fp8_matmul
        for fast in (True, False):
            real = torch._scaled_mm(qa, qb_cm, scale_a=inv_a, scale_b=inv_b, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast)
            half = k // 2
            parts = [torch._scaled_mm(qa[:, i * half:(i + 1) * half].contiguous(),
                                      qb[i * half:(i + 1) * half].t().contiguous().t(), scale_a=inv_a,
                                      scale_b=inv_b, out_dtype=torch.bfloat16, use_fast_accum=fast)
                     for i in range(2)]
            emit(dict(section="fp8", k=k, m=m, n=n, fast_accum=fast,
                      single_eps=rel(real, exact, exact) / eps,
                      single_bound_eps=single_gemm_error(k, "bf16") / eps,
                      row_tp2_eps=rel(real, parts[0] + parts[1], exact) / eps,
                      vs_emulation_eps=rel(real, emulated, exact) / eps,
                      emulation_single_eps=rel(emulated, exact, exact) / eps,
                      local_bound_eps=local_error(k, "bf16") / eps))


def norm_section(device: str, small: bool, emit) -> None:
    g = torch.Generator(device=device).manual_seed(3)
    eps = number_format("fp32").eps
    for log2n in ((20,) if small else (24, 27, 30)):
        x = torch.randn(1 << log2n, device=device, generator=g)
        exact = float(x.double().norm())
        whole = float(torch.norm(x))
        half = x.numel() // 2
        a, b = float(torch.norm(x[:half])), float(torch.norm(x[half:]))
        tp2 = math.sqrt(a * a + b * b)
        emit(dict(section="norm", elements=x.numel(), torch_norm_eps=abs(whole - exact) / exact / eps,
                  tp2_halves_eps=abs(tp2 - whole) / exact / eps))
        del x


def record_section(device: str, small: bool, emit, workdir: str) -> None:
    """One iteration of ``count`` tensors of ``mib`` MiB each, recorded from ``device`` memory."""
    count, mib = (8, 4) if small else (64, 64)
    nbytes = count * (mib << 20)
    tensors = [torch.randn((mib << 20) // 4, device=device) for _ in range(count)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rates = disk_bandwidth(workdir, nbytes, repeats=2)
    # each part alone: the copy into a pinned buffer, the CRC32, an xxHash where installed
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=(device == "cuda"))
    sync()
    t = time.perf_counter()
    for x in tensors:
        host.copy_(x.view(torch.uint8).reshape(-1))
    sync()
    d2h = nbytes / (time.perf_counter() - t)
    view = memoryview(host.numpy())
    t = time.perf_counter()
    for _ in range(count):
        zlib.crc32(view)
    crc = nbytes / (time.perf_counter() - t)
    row = dict(section="record", device=device, commit=os.environ.get("TTRACE_COMMIT", ""), tensors=count, mib=mib, bytes=nbytes, d2h_GBps=d2h / 1e9,
               crc32_GBps=crc / 1e9, **{f"disk_{k.replace(' ', '_')}_GBps": v / 1e9 for k, v in rates.items()})
    try:
        import xxhash
        t = time.perf_counter()
        for _ in range(count):
            xxhash.xxh3_64_intdigest(view)
        row["xxh3_GBps"] = nbytes / (time.perf_counter() - t) / 1e9
    except ImportError:
        row["xxh3_GBps"] = None
    # the whole path: TraceWriter.add on the recording thread, the writes on its thread
    layout = Layout((Replicate("tp"),), (len(tensors[0]),))
    trace = tempfile.mkdtemp(dir=workdir)
    writer = TraceWriter(trace, 0, {"tp": (0, 1)})
    sync()
    t0 = time.perf_counter()
    for i, x in enumerate(tensors):
        writer.add(TensorKey(1, 0, f"layer{i}", FORWARD, "output"), x, layout)
    t_add = time.perf_counter() - t0
    writer.close()
    t_all = time.perf_counter() - t0
    from safetensors import safe_open
    with safe_open(os.path.join(writer.dir, writer.records[-1].file), "pt") as f:
        row_back = f.get_tensor(writer.records[-1].name)
    intact = bool(torch.equal(row_back, tensors[-1].cpu()))
    shutil.rmtree(trace)
    best_disk = max(rates.values())
    row.update(record_s=t_all, add_s=t_add, write_s=nbytes / best_disk,
               record_over_write=t_all / (nbytes / best_disk), failed=writer.failed, read_back_equal=intact)
    emit(row)


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    meta = next((r for r in rows if r.get("section") == "meta"), {})
    print(f"device {meta.get('device_name')}, torch {meta.get('torch')}, CUDA {meta.get('cuda')}, "
          f"commit {meta.get('commit')}\n")
    by = lambda s: [r for r in rows if r.get("section") == s]  # noqa: E731
    if by("gemm"):
        print("| model | GEMM | M×K×N | inputs | one GEMM vs fp64 (ε_out) | its bound | whole vs row TP2 | "
              "vs row TP8 | vs col TP2 | vs col TP8 | local bound (ε_out) | worst / (k·local) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in by("gemm"):
            pair = max(r["row_tp2_eps"], r["row_tp8_eps"], r["col_tp2_eps"], r["col_tp8_eps"])
            print(f"| {r['model']} | {r['gemm']} | {r['m']}×{r['k']}×{r['n']} | {r['fmt']} | {r['single_eps']:.3g} "
                  f"| {r['single_bound_eps']:.3g} | {r['row_tp2_eps']:.3g} | {r['row_tp8_eps']:.3g} "
                  f"| {r['col_tp2_eps']:.3g} | {r['col_tp8_eps']:.3g} | {r['local_bound_eps']:.3g} "
                  f"| {pair / (K_FACTOR * r['local_bound_eps']):.3g} |")
    if by("tf32"):
        print("\n| K | input difference (ε32) | TF32 | output difference (ε32) | amplification | fp32 local bound (ε32) |")
        print("|---|---|---|---|---|---|")
        for r in by("tf32"):
            print(f"| {r['k']} | {r['input_diff_eps']:.3g} | {'on' if r['tf32'] else 'off'} | "
                  f"{r['output_diff_eps']:.3g} | {r['amplification']:.3g} | {r['fp32_local_bound_eps']:.3g} |")
    if by("fp8"):
        print("\n| K | accumulation | real vs fp64 (ε_bf16) | bound, fp32 acc. | whole vs row TP2 | real vs emulation "
              "| emulation vs fp64 | local bound | worst pair / (k·local) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in by("fp8"):
            pair = max(r["row_tp2_eps"], r["vs_emulation_eps"])
            print(f"| {r['k']} | {'fast' if r['fast_accum'] else 'split'} | {r['single_eps']:.3g} "
                  f"| {r['single_bound_eps']:.3g} | {r['row_tp2_eps']:.3g} | {r['vs_emulation_eps']:.3g} "
                  f"| {r['emulation_single_eps']:.3g} | {r['local_bound_eps']:.3g} "
                  f"| {pair / (K_FACTOR * r['local_bound_eps']):.3g} |")
    if by("norm"):
        print("\n| elements | torch.norm fp32 vs fp64 (ε) | TP2 halves √(a²+b²) vs whole (ε) |")
        print("|---|---|---|")
        for r in by("norm"):
            print(f"| {r['elements']:,} | {r['torch_norm_eps']:.3g} | {r['tp2_halves_eps']:.3g} |")
    if by("record"):
        print("\n| commit | device | bytes | D2H into pinned (GB/s) | CRC32 (GB/s) | xxh3 (GB/s) | disk (GB/s) | recorded "
              "(s) | of which add() (s) | write alone (s) | recorded / write |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in by("record"):
            disk = ", ".join(f"{k[5:-5].replace('_', ' ')} {v:.2f}" for k, v in r.items()
                             if k.startswith("disk_"))
            xxh = f"{r['xxh3_GBps']:.1f}" if r.get("xxh3_GBps") else "–"
            print(f"| {r.get('commit', '')} | {r['device']} | {r['bytes'] / 1e9:.2f} GB | {r['d2h_GBps']:.1f} | {r['crc32_GBps']:.2f} | {xxh} "
                  f"| {disk} | {r['record_s']:.2f} | {r['add_s']:.2f} | {r['write_s']:.2f} "
                  f"| {r['record_over_write']:.2f} |")


SECTIONS = {"gemm": gemm_section, "tf32": tf32_section, "fp8": fp8_section, "norm": norm_section}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="toy sizes: a smoke run of every section")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS) + ["record"])
    ap.add_argument("--jsonl", help="append one JSON line per measurement here")
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help="where the record section writes")
    ap.add_argument("--repeats", type=int, default=1, help="the record section this many times")
    ap.add_argument("--table", metavar="JSONL", help="print the markdown tables of a results file and exit")
    args = ap.parse_args()
    if args.table:
        table(args.table)
        return
    out = open(args.jsonl, "a") if args.jsonl else None

    def emit(row: Dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    commit = os.environ.get("TTRACE_COMMIT", "")
    emit(dict(section="meta", device=args.device, torch=torch.__version__, cuda=torch.version.cuda,
              device_name=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
              commit=commit, small=args.small))
    for name in args.sections:
        t = time.perf_counter()
        try:
            if name == "record":
                for _ in range(args.repeats):
                    record_section(args.device, args.small, emit, args.workdir)
            else:
                SECTIONS[name](args.device, args.small, emit)
        except Exception as e:  # one section's failure must not lose the others' figures
            emit(dict(section="error", of=name, error=f"{type(e).__name__}: {e}"))
        print(f"# {name}: {time.perf_counter() - t:.1f} s", flush=True)


if __name__ == "__main__":
    main()
