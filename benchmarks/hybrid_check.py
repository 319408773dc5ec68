"""HybridModel recipes on the installed megatron-core (0.18 on): each clean (must pass) and with one
injected bug (must fail, its replay's culprit the expected module and phase), and the migration
check, a GPTModel reference against the HybridModel candidate of the same layers
(``--reference-model gpt``), clean and with a bug.

    python benchmarks/hybrid_check.py [--only RECIPE ...] [--json rows.json] > table.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cli_runs  # noqa: E402

# (recipe, extra ttrace run arguments, injected bug, the culprit's module and phase)
CASES = [
    ("hybrid_tp2_sp", [], "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc2",
     "forward"),
    ("hybrid_pp2", [], "tied_embedding_grads_not_synced", "embedding.word_embeddings", "grad reduction"),
    # the grad the first chunk of stage 1 (layers 2, 3) receives from stage 0's second chunk is swapped
    ("hybrid_pp2_vpp", [], "vpp_batched_p2p_at_pp2", "decoder.layers.3.mlp.linear_fc2", "backward (arrival)"),
    ("hybrid_moe_tp2_sp_ep2", [], "moe_aux_loss_scaled_by_tp", "decoder.layers.1.mlp.router", "forward"),
    ("hybrid_moe_pp2", [], "router_topk_skips_best", "decoder.layers.1.mlp.router", "forward"),
    ("hybrid_tp2_sp", ["--reference-model", "gpt"], "row_allreduce_dropped:decoder.layers.0.mlp.linear_fc2",
     "decoder.layers.0.mlp.linear_fc2", "forward"),
    ("hybrid_moe_tp2_sp_ep2", ["--reference-model", "gpt"], "moe_aux_loss_scaled_by_tp",
     "decoder.layers.0.mlp.router", "forward"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", help="only these recipes")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    import megatron.core

    work = tempfile.mkdtemp(prefix="ttrace-hybrid-check-")
    rows = []
    try:
        for i, (recipe, extra, bug, module, phase) in enumerate(CASES):
            if args.only and recipe not in args.only:
                continue
            clean = cli_runs.ttrace_run(recipe, os.path.join(work, f"{i}-clean"), extra)
            row = {"recipe": recipe, "reference": "GPTModel" if extra else "HybridModel", "clean": clean["verdict"],
                   "clean_worst": cli_runs.worst_ratio(clean), "seconds": clean["_seconds"]}
            if bug is not None:
                buggy = cli_runs.ttrace_run(recipe, os.path.join(work, f"{i}-bug"), extra + ["--inject", bug])
                found = cli_runs.culprit(buggy)
                row.update(bug=bug, detected=buggy["verdict"] == "fail", margin=cli_runs.margin(buggy),
                           culprit=f"{found[0]} / {found[1]}", localized=found == (module, phase),
                           seconds=row["seconds"] + buggy["_seconds"])
            rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"megatron-core {megatron.core.__version__}\n")
    return cli_runs.write_table(rows, "reference", args.json)

if __name__ == "__main__":
    sys.exit(main())
