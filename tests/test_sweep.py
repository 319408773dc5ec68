"""The configuration sweep (benchmarks/sweep.py): its space is megatron's config space, and a small
fixed-seed slice of it runs clean on every submission (the full sweep is a benchmark: BENCHMARKS.md)."""

import os
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import sweep  # noqa: E402

from ttrace_megatron.adapter.recipe import model_fields  # noqa: E402

# the slice CI runs: configurations of the generator's seed CI_SEED, each run end to end
CI_SEED = 17
CI_CONFIGS = 10


def test_every_structure_and_numerics_field_is_drawn_or_excused():
    """The sweep draws from TransformerConfig's own fields: a structure or numerics field neither
    drawn nor excused (with the reason) fails here, so a new megatron field enters the sweep."""
    fields = set(model_fields.STRUCTURE) | set(model_fields.NUMERICS)
    unaccounted = sorted(f for f in fields if f not in sweep.FIELDS and f not in sweep.NOT_DRAWN)
    assert not unaccounted, f"fields neither drawn by the sweep nor listed in NOT_DRAWN: {unaccounted}"
    assert not set(sweep.FIELDS) & set(sweep.NOT_DRAWN)


def test_drawn_configurations_are_valid_recipes_and_cover_the_features():
    configs, rejected = sweep.population(60, seed=0)
    assert len(configs) == 60 and rejected >= 0
    tags = {t for raw in configs for t in sweep.features(raw)}
    for wanted in ("MoE", "GQA", "MQA", "query groups < TP", "PP uneven", "VPP", "SP", "EP", "qk_layernorm",
                   "learned_absolute", "tied", "padded vocab", "distributed optimizer", "bf16", "NoPE",
                   "sinks learnable", "recompute full", "MTP", "fp16", "overlap param gather", "sliding window", "loss mask", "per-token loss", "packed documents", "padding mask", "heterogeneous layers"):
        assert wanted in tags, f"60 draws never produced {wanted!r}"


def test_known_megatron_bug_is_recognized():
    raw = {"model": {"num_moe_experts": 4}, "parallel": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                                         "expert_tensor_parallel_size": 1}}
    assert sweep.megatron_bug(raw)
    raw["parallel"]["expert_model_parallel_size"] = 2
    assert sweep.megatron_bug(raw) is None


def test_ci_slice_has_no_crash_false_positive_or_miss():
    """A fixed-seed slice of the sweep, end to end: every configuration passes, is refused up front
    naming its field, is one megatron itself refuses or fails on (named), or hits a known megatron
    bug that ttrace detects."""
    configs, _ = sweep.population(CI_CONFIGS, CI_SEED)
    start = time.perf_counter()
    outcomes = []
    for raw in configs:
        with tempfile.TemporaryDirectory() as tmp:
            outcomes.append((raw["name"], sweep.run_one(raw, tmp)))
    bad = [(name, o.kind, o.detail[:300]) for name, o in outcomes if o.kind in sweep.FAILURES]
    assert not bad, bad
    assert any(o.kind == sweep.PASS for _, o in outcomes)
    assert time.perf_counter() - start < 180, "the CI slice must stay under 3 minutes"
