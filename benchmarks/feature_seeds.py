"""A feature of a later megatron-core release, checked clean over seeds, in fp32 and in bf16 (with
the fp32 twin ``ttrace run`` adds), and with its injected bug: one JSON line per check.

    python benchmarks/feature_seeds.py --feature mtp_repeated --seeds 1 2 3 --out results/FEATURE_COMMIT.jsonl

Each check is ``ttrace run`` on a shipped recipe with the feature's fields set, from a temporary
recipe file. A clean line has ``verdict`` (the check's: pair or twin failing), ``pair_verdict`` and
``twin_verdict`` for bf16, and the worst error / tolerance of each (``summary.py`` reads them as a
clean population); a line with ``inject`` is a bug's check: whether it was detected, its first
mismatch, margin and the replay's culprit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import Dict, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_runs import margin, worst_tensor  # noqa: E402

# name -> (shipped recipe, model fields set on it, the feature's injected bug, what it is)
FEATURES = {
    "mtp_repeated": ("deepseek_mtp_tp2_sp", {"mtp_num_layers": 2, "mtp_use_repeated_layer": True},
                     "mtp_projection_gather_reduces_grad",
                     "deepseek_mtp_tp2_sp + mtp_num_layers 2, mtp_use_repeated_layer (one MTP layer at both depths)"),
    "quantile_balancing_ep2": ("moe_ep2", {"moe_router_load_balancing_type": "quantile_balancing",
                                           "moe_router_quantile_balancing_ema": 0.5, "moe_aux_loss_coeff": None},
                               "qb_beta_not_averaged_over_dp",
                               "moe_ep2 + quantile balancing (EMA 0.5; no aux loss), EP2 over DP2"),
    "quantile_balancing_tp2_sp_ep2": ("moe_tp2_sp_ep2", {"moe_router_load_balancing_type": "quantile_balancing",
                                                         "moe_router_quantile_balancing_ema": 0.5,
                                                         "moe_aux_loss_coeff": None},
                                      "qb_quantile_over_the_rank_shard",
                                      "moe_tp2_sp_ep2 + quantile balancing (EMA 0.5; no aux loss)"),
    "mlp_chunks_tp2": ("gpt_tp2", {"mlp_chunks_for_training": 2}, "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2",
                       "gpt_tp2 + mlp_chunks_for_training 2 (the MLP run on each half of the sequence)"),
    "heterogeneous_tp2": ("nemotron_nas_tp2", {}, "gathered_linear_pieces_reversed",
                          "nemotron_nas_tp2: heterogeneous layers (full GQA, no attention with a wider MLP, both "
                          "replaced by a gathered linear, MHA without an MLP) at TP2"),
    "heterogeneous_tp2_dp2_distopt": ("nemotron_nas_tp2", {}, "heterogeneous_block_config_off_by_one",
                                      "nemotron_nas_tp2 at TP2 × DP2 with the distributed optimizer"),
    "mlp_chunks_moe_ep2": ("moe_ep2", {"mlp_chunks_for_training": 2}, "expert_grads_scaled_by_edp",
                           "moe_ep2 + mlp_chunks_for_training 2 (the MoE layer run on each half of the sequence)"),
}


def _block(attention: dict, ffn: dict) -> dict:
    return {"attention": dict({"no_op": False, "replace_with_linear": False, "n_heads_in_group": None}, **attention),
            "ffn": dict({"no_op": False, "replace_with_linear": False, "ffn_mult": None}, **ffn)}


# 8 layers at width 512 in the Hugging Face keys of Llama-Nemotron's config.json (n_heads_in_group,
# ffn_mult): GQA of 4 and 2 groups, MHA, no attention, a linear attention, a linear MLP, a skipped layer
WIDE_BLOCKS = [_block({"n_heads_in_group": 2}, {"ffn_mult": 2.625}), _block({"no_op": True}, {"ffn_mult": 1.3125}),
               _block({"n_heads_in_group": 4}, {"ffn_mult": 2.625}),
               _block({"replace_with_linear": True, "n_heads_in_group": None}, {"ffn_mult": 2.625}),
               _block({"n_heads_in_group": None}, {"replace_with_linear": True, "ffn_mult": None}),
               _block({"no_op": True}, {"no_op": True, "ffn_mult": None}),
               _block({"n_heads_in_group": 1}, {"ffn_mult": 5.25}), _block({"n_heads_in_group": None}, {"ffn_mult": None})]
FEATURES["heterogeneous_wide_tp2"] = (
    "nemotron_nas_tp2", {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "num_query_groups": 4,
                         "ffn_hidden_size": 1536, "heterogeneous_layers_config_encoded_json": {"block_configs": WIDE_BLOCKS}},
    "gathered_linear_pieces_reversed:decoder.layers.3.self_attention",
    "nemotron_nas_tp2 at 8 layers, hidden 512, vocabulary 32000, 512 tokens an iteration (Nemotron-NAS blocks in "
    "the Hugging Face keys)")

# a feature's other sections, set on the shipped recipe's (merged into a mapping, replacing a value)
SECTIONS = {
    "heterogeneous_tp2_dp2_distopt": {"parallel": {"tensor_model_parallel_size": 2}, "world_size": 4,
                                      "optimizer": {"use_distributed_optimizer": True}},
    "heterogeneous_wide_tp2": {"data": {"vocab_size": 32000, "seq_length": 128, "micro_batch_size": 2,
                                        "global_batch_size": 4}},
}


def worst(report: dict) -> Dict[str, object]:
    ratio, where = worst_tensor(report)
    return {"worst": ratio or 0.0, "worst_tensor": where}


def check(feature: str, dtype: str, seed: int, inject: Optional[str]) -> dict:
    import yaml

    from ttrace_megatron.cli import main

    name, fields, _, what = FEATURES[feature]
    with open(os.path.join(REPO, "recipes", name + ".yaml")) as f:
        raw = yaml.safe_load(f)
    raw["model"].update(fields)
    for section, value in SECTIONS.get(feature, {}).items():
        raw[section] = dict(raw.get(section) or {}, **value) if isinstance(value, dict) else value
    raw["model"] = {k: v for k, v in raw["model"].items() if v is not None}  # None: the field taken out
    raw["dtype"] = dtype
    raw["data"]["seed"] = seed
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}_{feature}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(raw, f)
        report_path = os.path.join(tmp, "report.json")
        with open(os.path.join(tmp, "terminal.txt"), "w") as terminal, contextlib.redirect_stdout(terminal):
            main(["run", path, "--out", os.path.join(tmp, "out"), "--json", report_path, "--quiet"]
                 + (["--inject", inject] if inject else []))  # the terminal report, kept apart
        with open(report_path) as f:
            report = json.load(f)
    import megatron.core

    row = {"recipe": what, "dtype": dtype, "seed": seed, "verdict": report["verdict"],
           "commit": subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True).stdout.strip(),
           "megatron_core": megatron.core.__version__, "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), gloo"}
    twin = report.get("fp32_twin")
    if twin is not None:
        row["pair_verdict"] = report["pair_verdict"]
    row.update(worst(report))
    if twin is not None:
        row.update(twin_verdict=twin["verdict"], **{f"twin_{k}": v for k, v in worst(twin).items()})
    if inject:
        fm = report.get("first_mismatch") or {}
        row.update(inject=inject, detected=report["verdict"] == "fail",
                   first_mismatch=f"{fm.get('module')} {fm.get('phase')} {fm.get('tensor')}" if fm else None,
                   margin=margin(report), culprit=next((f"{c['module']}, {c['phase']}, {c['tensor']}"
                                                         for c in report.get("culprits") or []), None))
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--feature", choices=sorted(FEATURES), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--bug-only", action="store_true", help="only the feature's injected bug (seed 1, fp32)")
    parser.add_argument("--out", required=True, help="the JSON lines are appended here (the ranks print to stdout)")
    args = parser.parse_args()
    checks = [] if args.bug_only else [(dtype, seed, None) for dtype in args.dtypes for seed in args.seeds]
    for dtype, seed, inject in checks + [("fp32", args.seeds[0], FEATURES[args.feature][2])]:
        row = check(args.feature, dtype, seed, inject)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
