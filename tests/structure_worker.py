"""Builds recipe variants in one gloo process of world size 1 and prints, per variant, the
parameter names and shapes ttrace built, and what the structure check says of the same variant
built with a spec that drops the spec-level fields (the layer spec ttrace used to build); for a
HybridModel variant, what it says of the built model against the pattern rotated by one layer.

Run by tests/test_model_fields.py: ``python structure_worker.py VARIANTS_JSON``."""

import json
import os
import sys

import torch
import torch.distributed as dist


def main(variants):
    from ttrace_megatron.adapter.cpu import cuda_shim  # noqa: F401  (quiet warnings)
    from ttrace_megatron.adapter.run import worker_env

    cuda_shim.install()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29617")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ttrace_megatron.adapter.recipe import build
    from ttrace_megatron.adapter.recipe import config as cfg
    from ttrace_megatron.adapter.recipe.structure import check_built_as_described
    from ttrace_megatron.errors import RecipeError
    from ttrace_megatron.recipe import recipe_from_dict

    parallel_state.initialize_model_parallel()
    out = {}
    for name, model in variants.items():
        recipe = recipe_from_dict({"name": name, "model": model, "world_size": 1,
                                   "data": {"vocab_size": 100, "seq_length": 8}})
        entry = {}
        try:
            chunks, config = build.gpt_chunks(recipe, {})
            entry["params"] = {n: list(p.shape) for n, p in chunks[0].named_parameters()}
        except RecipeError as e:
            entry["refused"] = str(e)
            out[name] = entry
            continue
        pattern = model.get("hybrid_layer_pattern")
        if pattern is not None:
            rotated = pattern[1:] + pattern[0]
            entry["rotated_problems"] = check_built_as_described(chunks, config, cfg.gpt_model_kwargs(recipe), rotated)
            out[name] = entry
            continue
        # the old way: the local spec with nothing but experts and normalization
        old_spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                            normalization=config.normalization)
        old = GPTModel(config=config, transformer_layer_spec=old_spec, vocab_size=cfg.padded_vocab_size(recipe),
                       max_sequence_length=8, **cfg.gpt_model_kwargs(recipe))
        entry["old_problems"] = check_built_as_described([old], config, cfg.gpt_model_kwargs(recipe))
        out[name] = entry
    print("RESULT " + json.dumps(out))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
