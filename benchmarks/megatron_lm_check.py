"""The real Megatron-LM path, end to end, on a checkout you give it (it fetches nothing).

For each recipe: ``ttrace run RECIPE --megatron-lm CHECKOUT`` clean (must pass), then with one
injected bug (must fail, and the replay's culprit must be the expected module and phase); both
sides go through the checkout's own ``pretrain_gpt.py``. With ``--patched``, the checkout is copied,
the release's patch (``patches/``) applied to the copy, and the runs go through the patch instead
of ``install()``. ``--data`` adds a run on Megatron-LM's GPTDataset over a small indexed dataset
written here (DP 2, several microbatches), instead of its mock dataset.

    python benchmarks/megatron_lm_check.py --checkout /path/to/Megatron-LM [--patched] [--data] > table.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
import cli_runs  # noqa: E402

# (recipe, injected bug, the culprit's module and phase)
CASES = [
    ("gpt_tp2", "row_allreduce_dropped:decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc2", "forward"),
    ("gpt_tp2_sp", "sp_norm_grad_not_reduced", "decoder.layers.0.input_layernorm", "grad reduction"),
    ("gpt_pp2", "tied_embedding_grads_not_synced", "embedding.word_embeddings", "grad reduction"),
    ("gpt_dp2", "dp_grad_not_averaged", "embedding.word_embeddings", "grad reduction"),
    ("moe_ep2", "expert_grads_scaled_by_edp", "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1",
     "grad reduction"),
    ("deepseek_mtp_tp2_sp", "mtp_projection_gather_reduces_grad", "mtp.layers.0.eh_proj", "backward (arrival)"),
]


def ttrace_run(recipe: str, checkout: str, out: str, extra: List[str]) -> Dict:
    return cli_runs.ttrace_run(recipe, out, ["--megatron-lm", checkout, *extra])


def patched_copy(checkout: str, into: str) -> str:
    import subprocess

    from ttrace_megatron.adapter.megatron_lm import checkout as megatron_lm

    copy = os.path.join(into, "Megatron-LM")
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git", "*.so", "__pycache__"))
    subprocess.run(["git", "apply", megatron_lm.patch_for(copy)], cwd=copy, check=True)
    return copy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", required=True, help="a Megatron-LM checkout (e.g. at core_v0.16.1)")
    parser.add_argument("--patched", action="store_true", help="run through the release's patch, on a copy")
    parser.add_argument("--data", action="store_true", help="also run gpt_dp2 on GPTDataset over an indexed dataset")
    parser.add_argument("--only", action="append", help="only these recipes")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    from ttrace_megatron.adapter.megatron_lm import checkout as megatron_lm

    work = tempfile.mkdtemp(prefix="ttrace-mlm-check-")
    checkout = patched_copy(args.checkout, work) if args.patched else os.path.abspath(args.checkout)
    release = megatron_lm.release_of(checkout)
    rows = []
    cases = [c for c in CASES if not args.only or c[0] in args.only]
    extra_runs = [("gpt_dp2", ["--megatron-lm-data", megatron_lm.write_indexed_dataset(
        os.path.join(work, "data", "tokens"), vocab_size=250, documents=64, seed=7)])] if args.data else []
    try:
        for recipe, bug, module, phase in cases:
            clean = ttrace_run(recipe, checkout, os.path.join(work, recipe, "clean"), [])
            buggy = ttrace_run(recipe, checkout, os.path.join(work, recipe, "bug"), ["--inject", bug])
            found = cli_runs.culprit(buggy)
            rows.append({
                "recipe": recipe, "data": "mock", "clean": clean["verdict"], "clean_worst": cli_runs.worst_ratio(clean),
                "bug": bug, "detected": buggy["verdict"] == "fail", "margin": cli_runs.margin(buggy),
                "culprit": f"{found[0]} / {found[1]}", "localized": found == (module, phase),
                "seconds": clean["_seconds"] + buggy["_seconds"],
                "megatron_core": clean["versions"]["candidate"].get("megatron.core")
                if isinstance(clean.get("versions"), dict) and "candidate" in clean["versions"] else None,
            })
        for recipe, extra in extra_runs:
            clean = ttrace_run(recipe, checkout, os.path.join(work, recipe, "indexed"), extra)
            rows.append({"recipe": recipe, "data": "GPTDataset (indexed)", "clean": clean["verdict"],
                         "clean_worst": cli_runs.worst_ratio(clean), "seconds": clean["_seconds"]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"Megatron-LM checkout {args.checkout} (megatron-core {release}), "
          f"{'the patch' if args.patched else 'install()'}\n")
    return cli_runs.write_table(rows, "data", args.json)

if __name__ == "__main__":
    sys.exit(main())
