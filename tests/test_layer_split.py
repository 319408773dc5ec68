"""Which layers each pipeline stage and virtual chunk builds (``structure.layer_split``): ttrace's
own statement of Megatron-LM's split, against which every built chunk is checked."""

import types

import pytest

pytest.importorskip("megatron.core")

from ttrace_megatron.adapter.recipe.structure import layer_split  # noqa: E402


def config(**fields):
    base = dict(num_layers=8, num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
                pipeline_model_parallel_layout=None)
    base.update(fields)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("fields,pp,vpp,expected", [
    ({}, 1, 1, {(0, 0): range(8)}),
    ({}, 2, 1, {(0, 0): range(0, 4), (1, 0): range(4, 8)}),
    # virtual chunks take their layers chunk-major: chunk 0 of every stage, then chunk 1
    ({}, 2, 2, {(0, 0): range(0, 2), (1, 0): range(2, 4), (0, 1): range(4, 6), (1, 1): range(6, 8)}),
    ({"num_layers": 4}, 2, 2, {(0, 0): [0], (1, 0): [1], (0, 1): [2], (1, 1): [3]}),
    ({"num_layers": 7, "num_layers_in_first_pipeline_stage": 3}, 2, 1, {(0, 0): range(0, 3), (1, 0): range(3, 7)}),
    ({"num_layers": 10, "num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2}, 3, 1,
     {(0, 0): range(0, 2), (1, 0): range(2, 8), (2, 0): range(8, 10)}),
    ({"num_layers": 6, "account_for_embedding_in_pipeline_split": True,
      "account_for_loss_in_pipeline_split": True}, 2, 1, {(0, 0): range(0, 3), (1, 0): range(3, 6)}),
    ({"num_layers": 6, "pipeline_model_parallel_layout": "Et|tt|(t)*2|tL"}, 2, 2,
     {(0, 0): [0], (1, 0): [1, 2], (0, 1): [3, 4], (1, 1): [5]}),
    ({"num_layers": 3, "pipeline_model_parallel_layout": [["embedding", "decoder"], ["decoder", "decoder", "loss"]]},
     2, 1, {(0, 0): [0], (1, 0): [1, 2]}),
])
def test_the_split_assigns_every_layer_once(fields, pp, vpp, expected):
    split = layer_split(config(**fields), pp, vpp)
    assert split == {k: list(v) for k, v in expected.items()}
    layers = sorted(n for chunk in split.values() for n in chunk)
    assert layers == list(range(config(**fields).num_layers))


def test_a_layout_for_another_pipeline_is_refused():
    with pytest.raises(ValueError, match="3 segments for PP 2"):
        layer_split(config(num_layers=3, pipeline_model_parallel_layout="Et|t|tL"), 2, 1)


def test_a_hybrid_pattern_splits_by_its_segments():
    """megatron's select_pipeline_segment: segment i on virtual chunk i // PP of rank i % PP, its
    layers numbered after the earlier segments'; one segment is one stage's (None: megatron splits
    it over several stages by its own rule)."""
    from ttrace_megatron.adapter.recipe.structure import hybrid_layer_split

    assert hybrid_layer_split("*-*E", 1, 1) == {(0, 0): [0, 1, 2, 3]}
    assert hybrid_layer_split("*-|*E", 2, 1) == {(0, 0): [0, 1], (1, 0): [2, 3]}
    assert hybrid_layer_split("*|-|*|E", 2, 2) == {(0, 0): [0], (1, 0): [1], (0, 1): [2], (1, 1): [3]}
    assert hybrid_layer_split("*-*E", 2, 1) is None
