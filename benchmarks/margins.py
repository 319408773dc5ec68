"""Clean-recipe round-off vs injected bugs: the table in BENCHMARKS.md.

For each shipped recipe × dtype × seed, runs the reference and the clean candidate and reports the
largest error/tolerance ratio (must stay < 1: no false positive); for each injected bug, the
first mismatch, whether it names the injected module and phase, and its error/tolerance ratio.

    python benchmarks/margins.py [--seeds 5] > margins.md
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import warnings
from typing import Optional, Union

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# an entry's expected module is where the bug reports acting (``bugs.TOUCHED_ENV``): the layout decides it
REPORTED = "<reported by the bug>"

BUGS = [  # (recipe, bug spec, expected module (a glob, or REPORTED), expected phase of the end-to-end first mismatch[, dtypes])
    ("gpt_tp2_sp", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc2", "forward"),
    ("gpt_tp2", "row_allreduce_dropped:decoder.layers.0.self_attention.linear_proj",
     "decoder.layers.0.self_attention.linear_proj", "forward"),
    ("gpt_tp2", "column_dgrad_allreduce_dropped:decoder.layers.1.self_attention.linear_qkv",
     "decoder.layers.1.self_attention.linear_qkv", "backward"),
    ("gpt_tp2", "embedding_mask_missing", "embedding.word_embeddings", "forward"),
    ("gpt_tp2_sp", "sp_norm_grad_not_reduced:decoder.layers.0.input_layernorm",
     "decoder.layers.0.input_layernorm", "main_grad"),
    ("gpt_tp4_sp", "row_allreduce_dropped:decoder.layers.0.mlp.linear_fc2", "decoder.layers.0.mlp.linear_fc2", "forward"),
    ("gpt_tp2_sp_dp2", "dp_grad_not_averaged", "embedding.word_embeddings", "main_grad"),
    # the first TP-replicated parameter's term of the norm (issue #31): counted on both TP ranks
    ("gpt_tp2", "grad_norm_counts_tp_replicas", "embedding.position_embeddings", "optimizer"),
    ("gpt_tp2_sp", "gated_mlp_halves_swapped:decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc1",
     "forward"),
    ("gpt_tp2", "qkv_groups_reversed:decoder.layers.1.self_attention.linear_qkv",
     "decoder.layers.1.self_attention.linear_qkv", "forward"),
    ("gpt_tp2", "cross_entropy_mask_missing", "loss", "forward"),
    ("gpt_tp2", "cross_entropy_grad_into_padding", "output_layer", "backward"),
    # a recomputed layer's input regathered in the wrong order (issue #33): end to end, the first
    # recomputed output (layer 0's linear_qkv, recomputed_output) differs from the reference's output;
    # the replay names the grad arriving at layer 1's linear_proj (the recomputed residual path is not hooked)
    ("gpt_tp2_recompute", "recompute_input_shards_swapped", "decoder.layers.*.self_attention.linear_*", "forward"),
    # NoPE layers picked by a stage-local layer number (issue #33): the third layer, on the second stage,
    # gets RoPE; the fault is inside core attention, between linear_qkv and linear_proj
    ("gpt_pp2_nope", "attention_layer_number_stage_local", "decoder.layers.2.self_attention.linear_proj", "forward"),
    # attention sinks' offsets on the wrong heads (issue #33): inside core attention
    ("gpt_tp2_sinks", "softmax_offsets_on_the_wrong_heads", "decoder.layers.0.self_attention.linear_proj", "forward"),
    # multi-token prediction (issue #33): the projection's gather, and the MTP loss's scale
    ("deepseek_mtp_tp2_sp", "mtp_projection_gather_reduces_grad", "mtp.layers.0.eh_proj", "backward"),
    ("deepseek_mtp_tp2_sp", "mtp_loss_scale_ignores_microbatches", "mtp.layers.0.output_layer", "backward"),
    # fp16 (issue #33): ranks at different loss scales
    ("gpt_tp2_sp_fp16", "grad_scaler_state_on_rank0_only", "output_layer", "backward", ("fp16",)),
    # overlap_param_gather (issue #33): the first module of a bucket runs before its gather
    ("gpt_dp2_distopt_overlap", "param_gather_hook_missing", "embedding.word_embeddings", "forward"),
    ("gpt_pp2", "tied_embedding_grads_not_synced", "embedding.word_embeddings", "main_grad"),
    # the distributed optimizer's shard bugs act where the shard layout puts them: the bug reports it
    ("gpt_dp2_distopt", "distopt_grad_shard_offset", REPORTED, "optimizer"),
    ("gpt_pp2_vpp", "vpp_batched_p2p_at_pp2", "decoder.layers.1.mlp.linear_fc2", "backward"),
    ("moe_tp2_sp_ep2", "moe_aux_loss_scaled_by_tp", "decoder.layers.0.mlp.router", "forward"),
    ("gpt_dp2", "dp_grad_not_averaged", "embedding.word_embeddings", "main_grad"),
    ("gpt_tp2_dp2", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc2",
     "forward"),
    ("moe_ep2", "expert_grads_scaled_by_edp", "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1", "main_grad"),
    ("moe_etp2", "expert_tp_partials_not_reduced", "decoder.layers.0.mlp", "forward"),
    ("moe_tp2_sp_ep2", "router_topk_skips_best", "decoder.layers.0.mlp.router", "forward"),
    # core attention's softmax scale from the partition's head dimension (issue #36): √2 at TP2, below
    # bf16's round-off at megatron's near-uniform initial attention; its fp32 twin sees it
    ("gpt_tp2_sp", "softmax_scale_from_partition_head_dim", "decoder.layers.0.self_attention.linear_proj", "forward"),
    ("qwen3_tp2", "qk_layernorm_grads_not_reduced", "decoder.layers.0.self_attention.q_layernorm", "main_grad"),
    ("gpt_tp2_sp", "fp8_amax_wrong_group:decoder.layers.0.self_attention.linear_qkv",
     "decoder.layers.0.self_attention.linear_qkv", "forward", ("fp8",)),
    ("gpt_tp2_sp", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc2",
     "forward", ("fp8",)),
    ("gpt_tp2", "column_dgrad_allreduce_dropped:decoder.layers.1.self_attention.linear_qkv",
     "decoder.layers.1.self_attention.linear_qkv", "backward", ("fp8",)),
]
BUGS += [  # the optimizer (issue #16), under Adam with megatron's defaults
    ("gpt_tp2_dp2_adam", "clip_applied_twice", "embedding.word_embeddings", "optimizer"),
    ("gpt_tp2_dp2_adam", "weight_decay_ignores_param_groups", "optimizer", "optimizer"),
    ("gpt_tp2_dp2_adam", "lr_schedule_skipped_on_one_rank", "optimizer", "optimizer"),
    ("gpt_dp2_distopt", "param_allgather_skipped", "embedding.word_embeddings", "optimizer"),
    ("gpt_dp2_distopt", "adam_state_stepped_on_wrong_shard", REPORTED, "optimizer"),
    # issue #34: a data path that drops a mask on one rank, a router not told of the padding
    ("masked_dp2_distopt", "loss_mask_dropped_on_dp_rank_1", "loss", "forward"),
    ("packed_dp2_distopt", "document_mask_dropped_on_dp_rank_1", "decoder.layers.0.self_attention.linear_proj",
     "forward"),
    ("padded_moe_ep2_distopt", "router_ignores_padding_mask_on_ep_rank_1", "decoder.layers.0.mlp.router", "forward"),
    # the first expert parameter's term of the norm (issue #31): not counted at all
    ("moe_tp2_sp_ep2", "grad_norm_misses_expert_ranks", "decoder.layers.*.mlp.experts.*", "optimizer"),
]
BUG_DTYPES = ("fp32", "bf16")  # unless the entry names its own (FP8 bugs need the FP8 emulation)
DTYPES = ("fp32", "bf16", "fp8")  # fp8: TE's hybrid FP8 GEMMs emulated on CPU (adapter.cpu.fp8_emulation)
FAMILIES = ("gpt3_tp2_sp", "gpt3_pp2_dp2", "llama3_tp2_sp", "llama3_tp4_sp", "qwen2_tp2", "qwen2_pp2_vpp", "mixtral_ep2",
            "mixtral_tp2_sp_ep2", "deepseek_ep2", "deepseek_tp2_sp_ep2",  # issue #17's model families
            "gptoss_ep2", "gptoss_tp2_sp_ep2", "llama4_pp2", "llama4_tp2_sp_ep2",  # issue #33's
            "nemotron_nas_tp2")
CLEAN = ("gpt_tp2", "gpt_tp2_sp", "gpt_tp4_sp", "gpt_dp2", "gpt_tp2_dp2", "gpt_tp2_dp2_adam", "gpt_tp2_sp_dp2",
         "gpt_pp2", "gpt_pp2_vpp", "gpt_dp2_distopt", "moe_tp2_sp_ep2", "moe_ep2", "moe_etp2", "qwen3_tp2",
         "gpt_tp2_recompute", "gpt_pp2_nope", "deepseek_mtp_tp2_sp", "gpt_dp2_distopt_overlap",
         # issue #34's data and losses
         "masked_tp2_sp", "masked_pp2", "masked_dp2_distopt", "packed_tp2_sp", "packed_pp2", "packed_dp2_distopt",
         "padded_moe_pp2", "padded_moe_ep2_distopt")
# recipes that fail on stock megatron-core by a megatron bug (benchmarks/upstream_bugs, live and unfixed):
# not clean, each an expected FAIL (gpt_tp2_sinks: softmax_offset_counted_on_tp_rank0_only;
# padded_moe_tp2_sp_ep2: moe_z_loss_padding_mean_per_sequence_shard)
MEGATRON_FINDINGS = ("gpt_tp2_sinks", "padded_moe_tp2_sp_ep2")


# issue #31's detection at width: the zoo's recipes widened to (at least) this, structure and layout kept
WIDE = dict(num_layers=8, hidden_size=512, vocab_size=32768)


def widen(raw: dict, size: Optional[dict] = None) -> dict:
    """A recipe at ``size``'s (default ``WIDE``'s) layers (at least), width (FFN, expert FFN, heads and
    query groups scaled with it) and vocabulary (at least); everything else — layout, norms,
    activations, biases, tying, MoE — as shipped."""
    size = size or WIDE
    model, data = raw["model"], raw["data"]
    scale = size["hidden_size"] / model["hidden_size"]
    heads = model["num_attention_heads"]
    shipped_layers = model["num_layers"]
    model["num_layers"] = max(model["num_layers"], size["num_layers"])
    model["hidden_size"] = size["hidden_size"]
    for field in ("ffn_hidden_size", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "kv_channels"):
        if model.get(field):
            model[field] = int(model[field] * scale) if field != "kv_channels" else model[field]
    model["num_attention_heads"] = heads * 2 if size["hidden_size"] // (heads * 2) >= 32 else heads
    if model.get("num_query_groups"):
        model["num_query_groups"] = model["num_query_groups"] * model["num_attention_heads"] // heads
    data["vocab_size"] = max(data["vocab_size"], size["vocab_size"])
    for key in ("moe_layer_freq",):  # a per-layer pattern names the shipped depth
        if isinstance(model.get(key), list):
            model[key] = (model[key] * size["num_layers"])[:model["num_layers"]]
    if isinstance(model.get("no_rope_freq"), list):
        # NoPE layers keep their place in the depth (the first layer of the second pipeline stage stays
        # so), not tiled: a pattern that repeats with the stage length would hide a stage-local layer number
        nope = [i * model["num_layers"] // shipped_layers for i, v in enumerate(model["no_rope_freq"]) if v]
        model["no_rope_freq"] = [1 if i in nope else 0 for i in range(model["num_layers"])]
    return raw


def first_nope_layer_module(r) -> str:
    """Where ``attention_layer_number_stage_local`` shows: the first NoPE layer's attention output
    (layers.2 as shipped, layers.4 at 8 layers: ``widen`` keeps it the second stage's first layer)."""
    return f"decoder.layers.{r.model['no_rope_freq'].index(1)}.self_attention.linear_proj"


def chunk_boundary_module(r) -> str:
    """Where ``vpp_batched_p2p_at_pp2`` shows: the grad arriving at the last layer of virtual chunk 1
    (the first chunk whose output-grad comes from the other rank's chunk 2). Its global index grows
    with the layers per chunk: layers.1 at 4 layers in 4 chunks, layers.3 at 8 (``widen``)."""
    p = r.parallel
    per_chunk = r.model["num_layers"] // (p["pipeline_model_parallel_size"] * p["virtual_pipeline_model_parallel_size"])
    return f"decoder.layers.{2 * per_chunk - 1}.mlp.linear_fc2"


def expected_module(module: str, touched: str):
    """module name -> whether it is where the entry's bug acts: ``module``'s glob, or for
    :data:`REPORTED` one of the modules the bug reported to ``touched`` (none reported: no module)."""
    if module != REPORTED:
        return lambda name: fnmatch.fnmatchcase(name, module)
    reported = set()
    if os.path.exists(touched):
        with open(touched) as f:
            for line in f:
                reported.update(json.loads(line)["modules"])
    return reported.__contains__


# entries whose module depends on the recipe's depth: the module is computed from the recipe run
EXPECTED_AT = {"vpp_batched_p2p_at_pp2": chunk_boundary_module,
               "attention_layer_number_stage_local": first_nope_layer_module}


SEED_INIT = None  # --seed-init: every recipe's train.seed_init (None: as it ships)


def recipe(name: str, dtype: str, seed: int, wide: Union[bool, dict] = False):
    """A shipped recipe in ``dtype`` with data/initialization seed ``seed`` (``wide``: :func:`widen`, to
    ``WIDE`` or to the size it gives)."""
    import yaml

    from ttrace_megatron.recipe import recipe_from_dict

    path = os.path.join(REPO, "recipes", name + ".yaml")
    raw = yaml.safe_load(open(path))
    if wide:
        raw = widen(raw, wide if isinstance(wide, dict) else None)
    raw.update(dtype=dtype, name=name)
    if dtype == "fp8":  # as a recipe that says dtype: fp8 gets it
        raw.get("tolerance", {}).pop("perturbation", None)
    if dtype == "fp16":  # megatron's default initial scale 2**32 would skip every step of a 3-iteration run
        raw.setdefault("optimizer", {}).setdefault("initial_loss_scale", 4096)
    raw["data"]["seed"] = seed
    if SEED_INIT:
        raw.setdefault("train", {})["seed_init"] = SEED_INIT
    return recipe_from_dict(raw, source=path)


def pair(r, tmp, inject=(), calibrate=False, lockstep=True, seed=None):
    """End-to-end comparison as the recipe ships (with the perturbation estimate where it asks
    for it), then the localization replay of the first mismatch's iteration (1 for a clean run), as
    ``ttrace run`` replays it, the candidate in lock-step with the
    reference as ``ttrace run`` runs it (``lockstep=False``: on its own weights). ``calibrate``:
    also the perturbation run, for every recipe, and the analytic-only comparison."""
    from ttrace_megatron.adapter.run.launch import launch
    from ttrace_megatron.adapter.run.runner import CANDIDATE, REFERENCE, RunSpec, trace_options
    from ttrace_megatron.compare import compare_traces, localize

    seed = seed or os.path.join(tmp, "seed.safetensors")  # the fp32 twin's: its recipe's
    ref, cand, pert = (os.path.join(tmp, d) for d in ("ref", "cand", "pert"))

    def spec(role, trace_dir, bugs=(), **trace):
        return RunSpec(recipe=r.to_json(), role=role, inject=list(bugs), trace=trace_options(trace_dir, seed, **trace))

    step = dict(lockstep=ref) if lockstep else {}
    launch(spec(REFERENCE, ref))
    launch(spec(CANDIDATE, cand, inject, **step))
    if calibrate or r.tolerance.perturbation:
        launch(spec(REFERENCE, pert, perturb=1, **step))  # lock-stepped like the candidate
    shipped = compare_traces(ref, cand, perturbed=pert if r.tolerance.perturbation else None)
    failing = shipped.first_mismatch.key.iteration if shipped.first_mismatch is not None else 1
    launch(spec(CANDIDATE, os.path.join(tmp, "replay"), inject, replay=ref, iterations=[failing], **step))
    extra = {}
    if calibrate:
        analytic = compare_traces(ref, cand)
        observed = {x.key: x.error for x in compare_traces(ref, pert).results}
        ratios = [x.error / observed[x.key] for x in analytic.results if observed.get(x.key, 0) > 0]
        extra = dict(analytic_fps=len(analytic.failures), worst_over_observed=max(ratios))
    return shipped, localize(ref, os.path.join(tmp, "replay")), extra


def main():
    warnings.filterwarnings("ignore")
    from ttrace_megatron.adapter.zoo.bugs import TOUCHED_ENV
    from ttrace_megatron.compare import phase_label
    from ttrace_megatron.recipe import fp32_twin

    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--recipes", nargs="*", help="only these recipes (default: all)")
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES),
                        help=f"these dtypes (default: {DTYPES}; fp16 too when asked)")
    parser.add_argument("--bugs-only", action="store_true", help="only the bug-zoo table")
    parser.add_argument("--no-lockstep", action="store_true", help="candidates train on their own weights")
    parser.add_argument("--wide", action="store_true", help="the recipes widened to 8 layers, hidden 512, "
                        "vocabulary 32k (issue #31's detection at width)")
    parser.add_argument("--size", nargs=3, type=int, metavar=("LAYERS", "HIDDEN", "VOCAB"),
                        help="widened to this size instead of --wide's (how a bug's margin dilutes with width)")
    parser.add_argument("--bugs", nargs="*", help="only these bugs (names, without a module pattern)")
    parser.add_argument("--twin", action="store_true", help="bug table: a bf16/fp16/fp8 entry also runs its fp32 "
                        "twin (the same recipe in fp32 from the same seed checkpoint, as `ttrace run` does) and "
                        "reports the twin's verdict, margin and culprit beside the recipe's own")
    parser.add_argument("--seed-init", choices=("megatron", "sensitized"),
                        help="every recipe's train.seed_init (default: as each ships, megatron's)")
    parser.add_argument("--families", action="store_true", help="the model-family recipes, as they ship (no "
                        "calibration runs: the last two columns are left empty)")
    args = parser.parse_args()
    # one file for the whole run, named before the first launch: the worker processes are forked
    # from a server that keeps the environment it started with
    touched = os.environ.setdefault(TOUCHED_ENV, os.path.join(tempfile.mkdtemp(prefix="ttrace_zoo_"), "touched.jsonl"))
    global SEED_INIT
    SEED_INIT = args.seed_init
    if args.size:
        args.wide = dict(zip(("num_layers", "hidden_size", "vocab_size"), args.size))
    wanted = (lambda name: name in args.recipes) if args.recipes else (lambda name: True)

    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    size = args.wide if isinstance(args.wide, dict) else WIDE if args.wide else None
    print(f"commit {commit}; {f'widened to {size}; ' if size else ''}"
          f"{f'seed_init {SEED_INIT}; ' if SEED_INIT else ''}machine: {os.cpu_count()} CPU cores, gloo, torch "
          f"{__import__('torch').__version__}, megatron-core {__import__('megatron.core').core.__version__}\n")
    print("| recipe | dtype | seeds | tensors per run | false positives | worst clean error / tolerance (ε) | worst ratio "
          "| replay: false culprits | replay: worst local ratio | analytic bound only: false positives "
          "| worst clean error / perturbation-observed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    calibrate = not args.families
    for name in filter(wanted, () if args.bugs_only else FAMILIES if args.families else CLEAN):
        for dtype in args.dtypes:
            worst, fps, n, false_culprits, worst_local = None, 0, 0, 0, 0.0
            analytic_fps, over_observed = 0, 0.0
            twin_rows = []  # (fps, tensors, worst, false culprits) of each seed's fp32 twin (--twin)
            for seed in range(1, args.seeds + 1):
                with tempfile.TemporaryDirectory() as tmp:
                    r = recipe(name, dtype, seed, args.wide)
                    c, loc, extra = pair(r, tmp, calibrate=calibrate, lockstep=not args.no_lockstep)
                    twin = fp32_twin(r) if args.twin else None
                    if twin is not None:
                        tdir = os.path.join(tmp, "fp32_twin")
                        os.makedirs(tdir)
                        tc, tloc, _ = pair(twin, tdir, lockstep=not args.no_lockstep,
                                           seed=os.path.join(tmp, "seed.safetensors"))
                        twin_rows.append((len(tc.failures), len(tc.results), max(tc.results, key=lambda x: x.ratio),
                                          len(tloc.culprits)))
                if calibrate:
                    analytic_fps += extra["analytic_fps"]
                    over_observed = max(over_observed, extra["worst_over_observed"])
                fps += len(c.failures)
                n = len(c.results)
                w = max(c.results, key=lambda r: r.ratio)
                if worst is None or w.ratio > worst.ratio:
                    worst = w
                false_culprits += len(loc.culprits)
                worst_local = max([worst_local] + [r.ratio for r in loc.comparison.results
                                                    if r.tolerance_source.startswith("local")])
            print(f"| {name} | {dtype} | {args.seeds} | {n} | {fps} | {worst.error_eps:.3g} / {worst.tolerance_eps:.3g} "
                  f"({worst.key.module} {worst.key.phase} {worst.key.tensor}) | {worst.ratio:.2f} | {false_culprits} "
                  f"| {worst_local:.2f} | " + (f"{analytic_fps} | {over_observed:.2f} |" if calibrate else "— | — |"),
                  flush=True)
            if twin_rows:
                tw = max((row[2] for row in twin_rows), key=lambda x: x.ratio)
                print(f"| {name} | fp32 twin of {dtype} | {args.seeds} | {twin_rows[0][1]} | "
                      f"{sum(row[0] for row in twin_rows)} | {tw.error_eps:.3g} / {tw.tolerance_eps:.3g} ({tw.key.module} "
                      f"{tw.key.phase} {tw.key.tensor}) | {tw.ratio:.2f} | {sum(row[3] for row in twin_rows)} | — | — | — |",
                      flush=True)
    print()
    twin_cols = (" fp32 twin: detected | twin: first mismatch | twin: error / tolerance | twin: replay culprit "
                 "| twin: culprit is the injected module | twin: culprit error / local tolerance |") if args.twin else ""
    print("| recipe | dtype | injected bug | detected | first mismatch | localized | error / tolerance "
          "| replay culprit | culprit is the injected module | culprit error / local tolerance |" + twin_cols)
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" * 6 if args.twin else ""))
    chosen = (lambda bug: bug.split(":")[0] in args.bugs) if args.bugs else (lambda bug: True)
    for name, bug, module, phase, *dtypes in (b for b in BUGS if wanted(b[0]) and chosen(b[1]) and not args.families):
        for dtype in (d for d in (dtypes[0] if dtypes else BUG_DTYPES) if d in args.dtypes):
            r = recipe(name, dtype, 1, args.wide)
            if bug in EXPECTED_AT:
                module = EXPECTED_AT[bug](r)
            twin_cells = ""
            with tempfile.TemporaryDirectory() as tmp:
                open(touched, "w").close()  # this entry's reports only
                c, loc, _ = pair(r, tmp, [bug], lockstep=not args.no_lockstep)
                matches = expected_module(module, touched)
                twin = fp32_twin(r) if args.twin else None
                if twin is not None:
                    tdir = os.path.join(tmp, "fp32_twin")
                    os.makedirs(tdir)
                    try:
                        tc, tloc, _ = pair(twin, tdir, [bug], lockstep=not args.no_lockstep,
                                           seed=os.path.join(tmp, "seed.safetensors"))
                    except Exception as e:  # a bug of the recipe's dtype with nothing to act on in fp32
                        tc = None
                        twin_cells = f" did not run: {str(e).splitlines()[0][:80]} | — | — | — | — | — |"
                if twin is not None and tc is not None:
                    tfm, tcu = tc.first_mismatch, tloc.culprit
                    twin_cells = (f" {'yes' if tc.verdict == 'fail' else 'NO'} | "
                                  f"{f'{tfm.key.module} {tfm.key.phase} {tfm.key.tensor}' if tfm else '—'} | "
                                  f"{f'{tfm.ratio:.3g}' if tfm else '—'} | "
                                  f"{f'{tcu.key.module}, {phase_label(tcu.key)}, {tcu.key.tensor}' if tcu else '—'} | "
                                  f"{'yes' if tcu and matches(tcu.key.module) else 'NO'} | "
                                  f"{f'{tcu.ratio:.3g}' if tcu else '—'} |")
                elif args.twin and twin is None:
                    twin_cells = " — | — | — | — | — | — |"
            fm = c.first_mismatch
            detected = c.verdict == "fail"
            where = f"{fm.key.module} {fm.key.phase} {fm.key.tensor}" if fm else "—"
            localized = bool(fm) and matches(fm.key.module) and fm.key.phase == phase
            ratio = f"{fm.ratio:.3g}" if fm else "—"
            cu = loc.culprit
            culprit = f"{cu.key.module}, {phase_label(cu.key)}, {cu.key.tensor}" if cu else "—"
            right = bool(cu) and matches(cu.key.module)
            print(f"| {name} | {dtype} | `{bug}` | {'yes' if detected else 'NO'} | {where} | "
                  f"{'yes' if localized else 'NO'} | {ratio} | {culprit} | {'yes' if right else 'NO'} | "
                  f"{f'{cu.ratio:.3g}' if cu else '—'} |" + twin_cells, flush=True)


if __name__ == "__main__":
    main()
