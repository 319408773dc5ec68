"""The scale ladder: clean checks stepped up one axis at a time, the worst error / tolerance per
tensor kind on every rung (BENCHMARKS.md, "The scale ladder").

Families (each a megatron-core GPTModel of the local spec):

* ``gpt3``: LayerNorm, GeLU MLP (4h), biases, learned absolute positions, tied embeddings;
* ``llama``: RMSNorm, SwiGLU, grouped-query attention, RoPE, untied, no biases;
* ``mixtral``: the llama family with every MLP an MoE of 4 experts, top-2.

Layouts: ``tp2_sp``, ``tp4_sp``, ``pp2`` (4 microbatches), ``dp2_distopt``, ``ep2`` (mixtral only).
Each rung steps one axis from the base (hidden 256, 2 layers, vocabulary 4096, sequence 128,
3 iterations, 512 tokens per iteration):

    width   64 256 512 1024, and 2048 at 2 layers
    depth   2 8 16 (32 and 64 with --values: 7 and 13 GB of traces for the llama family)
    vocab   128 32768 131072
    seq     32 512 2048
    iters   3 20
    tokens  128 16384 (tokens per iteration: the global batch)

Every rung runs a reference and a lock-stepped candidate through ``ttrace run`` (Adam with
megatron-core's defaults, clip_grad 1.0), writes one JSON line per run (``--jsonl``), deletes its
traces, and a rung that fails names its first mismatch. A ratio above 1 is a false positive; a
ratio that climbs along an axis is a finding even below 1.

    python benchmarks/scale.py --families gpt3 llama --layouts tp2_sp --axes width vocab \\
        --seeds 1 2 3 --dtypes fp32 --jsonl benchmarks/results/scale.jsonl
    python benchmarks/scale.py --table benchmarks/results/scale.jsonl   # the markdown tables
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterable, List, Optional, Tuple

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ttrace_megatron.keys import TensorKind, kind_of  # noqa: E402

BASE = dict(hidden=256, layers=2, vocab=4096, seq=128, iters=3, tokens=512)
AXES: Dict[str, Tuple[int, ...]] = {
    "width": (64, 256, 512, 1024, 2048),
    "depth": (2, 8, 16),
    "vocab": (128, 32768, 131072),
    "seq": (32, 512, 2048),
    "iters": (3, 20),
    "tokens": (128, 16384),
}
AXIS_FIELD = {"width": "hidden", "depth": "layers", "vocab": "vocab", "seq": "seq", "iters": "iters",
              "tokens": "tokens"}
FAMILIES = ("gpt3", "llama", "mixtral")
LAYOUTS = {
    "tp2_sp": dict(parallel={"tensor_model_parallel_size": 2, "sequence_parallel": True}, world_size=2),
    "tp4_sp": dict(parallel={"tensor_model_parallel_size": 4, "sequence_parallel": True}, world_size=4),
    "pp2": dict(parallel={"pipeline_model_parallel_size": 2}, world_size=2, microbatches=4),
    "dp2_distopt": dict(parallel={}, world_size=2, optimizer={"use_distributed_optimizer": True}),
    "ep2": dict(parallel={"expert_model_parallel_size": 2}, world_size=2, moe_only=True),
}
# the tensor kinds a row reports, in the order of a step
KINDS = ("forward", "dgrad", "wgrad", "main grad", "norm terms", "grad norm", "clip", "moments", "update", "loss",
         "routing")
_KIND_OF = {
    TensorKind.INPUT: "forward", TensorKind.OUTPUT: "forward", TensorKind.AUX_LOSS: "loss",
    TensorKind.GRAD_INPUT: "dgrad", TensorKind.GRAD_OUTPUT: "dgrad", TensorKind.PARAM_GRAD: "wgrad",
    TensorKind.MAIN_GRAD: "main grad", TensorKind.PARAM: "update", TensorKind.LOSS: "loss",
    TensorKind.SELECTION_SCORES: "forward", TensorKind.SELECTION: "routing",
    TensorKind.GRAD_NORM_TERM: "norm terms",  # each parameter's ‖g‖² as the norm counted it (issue #31)
}


def report_kind(phase: str, tensor: str) -> Optional[str]:
    """The ladder's kind of a judged tensor (None: not reported, e.g. the step count)."""
    if tensor in ("grad_norm", "grad_norm_fp64"):
        return "grad norm"
    if tensor == "clip_coefficient":
        return "clip"
    kind = kind_of(phase, tensor)
    if kind is TensorKind.OPTIMIZER_STATE:
        return "update" if tensor.endswith(".main_param") else "moments"
    return _KIND_OF.get(kind)


def rung_shape(axis: str, value: int) -> Dict[str, int]:
    shape = dict(BASE)
    shape[AXIS_FIELD[axis]] = value
    if axis == "width" and value >= 2048:
        shape["layers"] = 2
    return shape


def recipe(family: str, layout: str, shape: Dict[str, int], seed: int, dtype: str) -> dict:
    h = shape["hidden"]
    heads = max(4, h // 64)
    lay = LAYOUTS[layout]
    model = dict(num_layers=shape["layers"], hidden_size=h, num_attention_heads=heads)
    if family == "gpt3":
        model.update(ffn_hidden_size=4 * h, normalization="LayerNorm", add_bias_linear=True,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True)
    else:
        model.update(ffn_hidden_size=(8 * h // 3 + 63) // 64 * 64, normalization="RMSNorm", gated_linear_unit=True,
                     activation_func="silu", add_bias_linear=False, position_embedding_type="rope",
                     num_query_groups=max(heads // 4, 1) * (2 if heads >= 8 else 1),
                     share_embeddings_and_output_weights=False)
    if family == "mixtral":
        model.update(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_token_dispatcher_type="alltoall",
                     ffn_hidden_size=2 * h, moe_ffn_hidden_size=2 * h)
    microbatches = lay.get("microbatches", 2)
    mbs = max(shape["tokens"] // shape["seq"] // microbatches, 1)
    dp = lay["world_size"] // (lay["parallel"].get("tensor_model_parallel_size", 1)
                               * lay["parallel"].get("pipeline_model_parallel_size", 1))
    if layout == "ep2":
        dp = 2
    gbs = max(mbs * microbatches, dp * mbs)
    out = dict(description=f"scale ladder: {family} {layout} h{h} L{shape['layers']} V{shape['vocab']} "
                           f"s{shape['seq']} it{shape['iters']} tok{gbs * shape['seq']}",
               model=model, parallel=dict(lay["parallel"]), world_size=lay["world_size"],
               optimizer=dict(optimizer="adam", lr=1e-3, **lay.get("optimizer", {})),
               data=dict(seed=seed, vocab_size=shape["vocab"], seq_length=shape["seq"], micro_batch_size=mbs,
                         global_batch_size=gbs),
               train=dict(iterations=shape["iters"]), dtype=dtype)
    return out


def worst_by_kind(report: dict) -> Dict[str, dict]:
    worst: Dict[str, dict] = {}
    for t in report.get("tensors", []):
        kind = report_kind(t["phase"], t["tensor"])
        tol, err = t.get("tolerance_eps"), t.get("error_eps")
        if kind is None or not isinstance(err, (int, float)) or tol in (None, 0, "inf"):
            continue  # "inf": a top-k choice at an exact tie, which admits anything
        if not isinstance(tol, (int, float)):
            continue
        ratio = err / tol
        if kind not in worst or ratio > worst[kind]["ratio"]:
            worst[kind] = dict(ratio=ratio, error_eps=t["error_eps"], tolerance_eps=t["tolerance_eps"],
                               tensor=f"it{t['iteration']} {t['module']} {t['tensor']}")
    return worst


def run_rung(family: str, layout: str, axis: str, value: int, seed: int, dtype: str, workdir: str,
             timeout: int) -> dict:
    shape = rung_shape(axis, value)
    spec = recipe(family, layout, shape, seed, dtype)
    name = f"{family}_{layout}_{axis}{value}_s{seed}_{dtype}"
    path = os.path.join(workdir, name + ".yaml")
    with open(path, "w") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    out = os.path.join(workdir, name)
    report = os.path.join(workdir, name + ".json")
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "ttrace_megatron.cli", "run", path, "--out", out, "--no-localize",
                           # the ladder measures each dtype's own round-off: a bf16 rung's fp32 twin is the fp32 rung
                           "--no-fp32-twin", "--json", report,
                           # both sides' traces, as the ladder has always measured them (plan_check --ladder reads them)
                           "--keep-traces"], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    seconds = time.time() - start
    disk = _du(out)
    shutil.rmtree(out, ignore_errors=True)
    row = dict(family=family, layout=layout, axis=axis, value=value, seed=seed, dtype=dtype, shape=shape,
               tokens=spec["data"]["global_batch_size"] * shape["seq"], rc=proc.returncode,
               seconds=round(seconds, 1), trace_bytes=disk)
    if os.path.exists(report):
        with open(report) as f:
            rep = json.load(f)
        row.update(verdict=rep.get("verdict"), worst=worst_by_kind(rep), params=rep.get("coverage", {}).get(
            "total", {}).get("elements"), first_mismatch=rep.get("first_mismatch"))
        os.remove(report)
    else:
        row.update(verdict="error", error=(proc.stderr or proc.stdout)[-2000:])
    return row


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def rungs(families: Iterable[str], layouts: Iterable[str], axes: Iterable[str], values: Optional[List[int]]):
    for family in families:
        for layout in layouts:
            if LAYOUTS[layout].get("moe_only") and family != "mixtral":
                continue
            for axis in axes:
                for value in (values or AXES[axis]):
                    yield family, layout, axis, value


# ---- tables
def table(rows: List[dict], errors: bool = False) -> str:
    """One markdown table per (family, layout, dtype): a line per rung, the worst ratio per kind over
    its seeds, and the verdicts (``errors``: that worst tensor's error and bound in ε beside it)."""
    groups: Dict[Tuple, List[dict]] = collections.defaultdict(list)
    for r in rows:
        groups[(r["family"], r["layout"], r["dtype"])].append(r)
    out = []
    for (family, layout, dtype), rs in sorted(groups.items()):
        out.append(f"\n**{family} {layout} {dtype}** (worst error / tolerance over the seeds; a ratio > 1 fails)\n")
        out.append("| rung | params | tokens/it | seeds | fails | " + " | ".join(KINDS) + " | s/run | trace GB |")
        out.append("|---|---|---|---|---|" + "---|" * len(KINDS) + "---|---|")
        by_rung: Dict[Tuple, List[dict]] = collections.defaultdict(list)
        for r in rs:
            by_rung[(r["axis"], r["value"])].append(r)
        for (axis, value), runs in sorted(by_rung.items(), key=lambda kv: (list(AXES).index(kv[0][0]), kv[0][1])):
            cells = []
            for kind in KINDS:
                worst = [r["worst"][kind] for r in runs if kind in r.get("worst", {})]
                w = max(worst, key=lambda w: w["ratio"]) if worst else None
                cell = f"{w['ratio']:.2g}" if w else "–"
                if w and errors and isinstance(w.get("error_eps"), (int, float)):
                    cell += f" ({w['error_eps']:.2g}/{w['tolerance_eps']:.3g})"
                cells.append(cell)
            fails = sum(r.get("verdict") == "fail" for r in runs)
            unfinished = sum(r.get("verdict") not in ("pass", "fail") for r in runs)
            fails = f"{fails} ({unfinished} did not finish)" if unfinished else str(fails)
            params = max((r.get("params") or 0) for r in runs)
            out.append(f"| {axis} {value} | {params / 1e6:.1f}M | {runs[0]['tokens']} | {len(runs)} | {fails} | "
                       + " | ".join(cells) + f" | {sum(r['seconds'] for r in runs) / len(runs):.0f} | "
                       f"{max(r['trace_bytes'] for r in runs) / 1e9:.2f} |")
    return "\n".join(out)


def slopes(rows: List[dict], dtype: str = "fp32") -> Dict[Tuple[str, str], Tuple[float, float]]:
    """Per (axis, kind): the log-log slope of the worst error (ε) and of its tolerance along the
    axis, from its smallest to its largest rung (worst over families, layouts and seeds): how each
    grows with the reduction it steps. A tolerance that is right grows at least as fast as the
    error; an error slope above the tolerance's is a finding (the bound will be crossed further up)."""
    import math

    by: Dict[Tuple[str, str, int], List[dict]] = collections.defaultdict(list)
    for r in rows:
        if r.get("dtype") == dtype and r.get("worst"):
            for kind, w in r["worst"].items():
                by[(r["axis"], kind, r["value"])].append(w)
    out = {}
    for axis in AXES:
        for kind in KINDS:
            points = sorted((v, max(w["error_eps"] for w in ws), max(w["tolerance_eps"] for w in ws))
                            for (a, k, v), ws in by.items() if a == axis and k == kind)
            points = [p for p in points if p[1] > 0]
            if len(points) < 2 or points[0][0] == points[-1][0]:
                continue
            (v0, e0, t0), (v1, e1, t1) = points[0], points[-1]
            span = math.log(v1 / v0)
            out[(axis, kind)] = (math.log(e1 / e0) / span, math.log(t1 / t0) / span)
    return out


_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf",
           "#bcbd22", "#393b79")


def plot(rows: List[dict], dtype: str = "fp32") -> str:
    """An SVG: one panel per axis, the worst error / tolerance of each kind (over families, layouts
    and seeds) at each rung, log-scaled rungs; the line at 1 is where a clean run would fail."""
    import math

    panels = [a for a in AXES if any(r["axis"] == a and r.get("dtype") == dtype and r.get("worst") for r in rows)]
    w, h, pad = 260, 180, 34
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(panels) + 150}" height="{h + 40}" '
           'font-family="sans-serif" font-size="10">']
    for i, axis in enumerate(panels):
        x0 = i * w
        values = sorted({r["value"] for r in rows if r["axis"] == axis})
        lo, hi = math.log(values[0]), math.log(values[-1]) if values[-1] > values[0] else math.log(values[0]) + 1

        def px(v, x0=x0, lo=lo, hi=hi):
            return x0 + pad + (math.log(v) - lo) / (hi - lo) * (w - 2 * pad)

        def py(r):
            return 10 + (1 - min(r, 1.2) / 1.2) * (h - 30)

        out.append(f'<rect x="{x0 + pad}" y="10" width="{w - 2 * pad}" height="{h - 30}" fill="none" stroke="#999"/>')
        out.append(f'<line x1="{x0 + pad}" x2="{x0 + w - pad}" y1="{py(1):.1f}" y2="{py(1):.1f}" stroke="red" '
                   'stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x0 + w / 2:.0f}" y="{h + 2}" text-anchor="middle">{axis}</text>')
        for v in values:
            out.append(f'<text x="{px(v):.1f}" y="{h - 8}" text-anchor="middle">{v}</text>')
        for tick in (0, 0.5, 1.0):
            out.append(f'<text x="{x0 + pad - 4}" y="{py(tick) + 3:.1f}" text-anchor="end">{tick:g}</text>')
        for kind, color in zip(KINDS, _COLORS):
            points = []
            for v in values:
                ratios = [r["worst"][kind]["ratio"] for r in rows if r["axis"] == axis and r["value"] == v
                          and r.get("dtype") == dtype and kind in r.get("worst", {})]
                if ratios:
                    points.append(f"{px(v):.1f},{py(max(ratios)):.1f}")
            if points:
                out.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    for j, (kind, color) in enumerate(zip(KINDS, _COLORS)):
        y = 20 + 14 * j
        x = w * len(panels) + 10
        out.append(f'<line x1="{x}" x2="{x + 16}" y1="{y}" y2="{y}" stroke="{color}" stroke-width="2"/>'
                   f'<text x="{x + 20}" y="{y + 3}">{kind}</text>')
    out.append(f'<text x="{w * len(panels) + 10}" y="{h + 2}">{dtype}: worst error / tolerance</text></svg>')
    return "\n".join(out)


# on paper: Llama-3-8B- and -70B-shaped checks (one microbatch of 8192 tokens, 8 per iteration)
PAPER = {"8B": dict(h=4096, ffn=14336, L=32, V=128256, s=8192, mbs=1, gbs=8),
         "70B": dict(h=8192, ffn=28672, L=80, V=128256, s=8192, mbs=1, gbs=8)}


# the ladder's axes at a paper shape: (axis, the shape's value, the ladder's base value)
def _paper_axes(c: dict) -> List[Tuple[str, int, int]]:
    return [("width", c["h"], BASE["hidden"]), ("depth", c["L"], BASE["layers"]), ("vocab", c["V"], BASE["vocab"]),
            ("seq", c["s"], BASE["seq"]), ("tokens", c["gbs"] * c["s"], BASE["tokens"])]


def expected_error(rows: List[dict], dtype: str, kind: str, c: dict) -> Tuple[Optional[float], str]:
    """The error a clean check of shape ``c`` should show for ``kind``, in ε: the worst error at the
    ladder's base rung (all families and seeds), times (value / base)^slope along each axis the ladder
    measured in ``dtype`` (:func:`slopes`). A negative slope counts as 0: an error is not assumed to
    shrink with size. Axes not measured in ``dtype`` count as flat and are named."""
    base = [r["worst"][kind]["error_eps"] for r in rows if r.get("dtype") == dtype and r.get("worst")
            and kind in r["worst"] and r.get("shape") == BASE]
    if not base:
        return None, "not measured"
    fits = slopes(rows, dtype)
    value, unmeasured = max(base), []
    for axis, target, at in _paper_axes(c):
        if target == at:
            continue
        if (axis, kind) in fits:
            value *= (target / at) ** max(fits[(axis, kind)][0], 0.0)
        else:
            unmeasured.append(axis)
    return value, ("flat along " + ", ".join(unmeasured)) if unmeasured else "all axes"


def paper(rows: Optional[List[dict]] = None) -> str:
    """The analytic bound of each kind of tensor at 8B and 70B shapes, in fp32 and bf16, from the same
    ``tolerance_for`` and reduction lengths the checks use (the grad norm's is measured, not listed);
    with the ladder's results (``rows``), the error it predicts there (:func:`expected_error`)."""
    from ttrace_megatron import keys
    from ttrace_megatron.tolerance import tolerance_for

    out = ["| shape | dtype | tensor (K) | bound (ε) | bound (relative) | expected error (ε) | expected / bound "
           "| fit |", "|---|---|---|---|---|---|---|---|"]
    for name, c in PAPER.items():
        L = c["L"]
        kinds = [("forward, last layer's fc2 (K = ffn)", keys.FORWARD, L, c["ffn"], "forward"),
                 ("forward, attention's output (K = max(h, s))", keys.FORWARD, L, max(c["h"], c["s"]), "forward"),
                 ("dgrad, first layer's fc1 (K = ffn)", keys.BACKWARD, 1, c["ffn"], "dgrad"),
                 ("wgrad, first layer (K = max(tokens/mb, h))", keys.BACKWARD, 1, max(c["mbs"] * c["s"], c["h"]),
                  "wgrad"),
                 ("main grad, embedding (K = tokens/iteration)", keys.MAIN_GRAD, 0, c["gbs"] * c["s"], "main grad"),
                 ("per-token loss (K = V)", keys.FORWARD, L + 1, c["V"], "loss")]
        for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
            for label, phase, depth, k, kind in kinds:
                t = tolerance_for(phase, depth, L, dtype, k)
                expected, fit = expected_error(rows, short, kind, c) if rows else (None, "–")
                cells = (f"{expected:.3g} | {expected / t.tolerance_eps:.2g} | {fit}" if expected is not None
                         else f"– | – | {fit}")
                out.append(f"| {name} (h {c['h']}, L {L}, V {c['V']}, s {c['s']}) | {dtype} | {label} | "
                           f"{t.tolerance_eps:.3g} | {t.tolerance_eps * t.eps:.2e} | {cells} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--axes", nargs="+", default=list(AXES), choices=list(AXES))
    ap.add_argument("--values", nargs="+", type=int, help="these values of the axis instead of all its rungs")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    ap.add_argument("--jsonl", help="append one JSON line per run here")
    ap.add_argument("--workdir", help="where traces go while a rung runs (default: a temporary directory)")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--table", metavar="JSONL", help="print the tables of a results file and exit")
    ap.add_argument("--paper", action="store_true", help="print the bounds at 8B and 70B shapes and exit (with "
                    "--table JSONL: and the errors the ladder's slopes predict there)")
    ap.add_argument("--plot", metavar="SVG", help="with --table: also write the ratios' plot here (fp32)")
    ap.add_argument("--errors", action="store_true", help="with --table: each cell also gives the worst tensor's "
                    "error / bound in ε")
    ap.add_argument("--axis", choices=list(AXES), help="with --table: only the rungs of this axis")
    args = ap.parse_args(argv)
    if args.paper:
        rows = None
        if args.table:
            with open(args.table) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        print(paper(rows))
        return 0
    if args.table:
        with open(args.table) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if args.axis:
            rows = [r for r in rows if r.get("axis") == args.axis]
        print(table(rows, args.errors))
        if args.plot:
            with open(args.plot, "w") as f:
                f.write(plot(rows))
        for dtype in sorted({r.get("dtype") for r in rows if r.get("dtype")}):
            fits = slopes(rows, dtype)
            if fits:
                print(f"\n**Growth along each axis, {dtype}** (log-log slope of the worst error / of its tolerance, "
                      "smallest to largest rung)\n")
                print("| axis | " + " | ".join(KINDS) + " |\n|---|" + "---|" * len(KINDS))
                for axis in AXES:
                    cells = [f"{fits[(axis, k)][0]:.2f} / {fits[(axis, k)][1]:.2f}" if (axis, k) in fits else "–"
                             for k in KINDS]
                    if any(c != "–" for c in cells):
                        print(f"| {axis} | " + " | ".join(cells) + " |")
        return 0
    workdir = args.workdir or tempfile.mkdtemp(prefix="ttrace-scale-")
    os.makedirs(workdir, exist_ok=True)
    rows = []
    for family, layout, axis, value in rungs(args.families, args.layouts, args.axes, args.values):
        for dtype in args.dtypes:
            for seed in args.seeds:
                try:
                    row = run_rung(family, layout, axis, value, seed, dtype, workdir, args.timeout)
                except subprocess.TimeoutExpired:
                    row = dict(family=family, layout=layout, axis=axis, value=value, seed=seed, dtype=dtype,
                               verdict="timeout")
                rows.append(row)
                worst = max(((k, v["ratio"]) for k, v in row.get("worst", {}).items()), key=lambda kv: kv[1],
                            default=("-", float("nan")))
                print(f"{family} {layout} {axis}={value} seed {seed} {dtype}: {row.get('verdict')} "
                      f"worst {worst[0]} {worst[1]:.3g} ({row.get('seconds', 0)} s, "
                      f"{row.get('trace_bytes', 0) / 1e9:.2f} GB)", flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(row) + "\n")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
