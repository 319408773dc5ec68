"""The sensitized seed checkpoint (issue #36): O(1) activations, peaked attention, non-zero biases
and padding rows, drawn from the parameter's name and megatron's draw alone."""

import math
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import load
from ttrace_megatron.adapter.run.sensitize import BIAS_STD, NORM_WEIGHT_STD, QK_GAIN, sensitize
from ttrace_megatron.errors import RecipeError
from ttrace_megatron.recipe import recipe_from_dict

H, V, E = 256, 1024, 4


def _state():
    g = torch.Generator().manual_seed(0)
    megatron = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    state = {
        "embedding.word_embeddings.weight": megatron(V, H),
        "decoder.layers.0.input_layernorm.weight": torch.ones(H),
        "decoder.layers.0.input_layernorm.bias": torch.zeros(H),
        "decoder.layers.0.self_attention.linear_qkv.weight": megatron(3 * H, H),
        "decoder.layers.0.self_attention.linear_qkv.bias": torch.zeros(3 * H),
        "decoder.layers.0.mlp.linear_fc2.weight": megatron(H, 4 * H),
        "decoder.layers.0.mlp.router.weight": megatron(E, H),
        "decoder.layers.0.self_attention.core_attention.softmax_offset": torch.zeros(8),
        "decoder.layers.0.mixer.A_log": torch.rand(8, generator=g),
        "output_layer.weight": megatron(V, H),
    }
    sites = {
        "embedding.word_embeddings.weight": ("embedding.word_embeddings", "VocabParallelEmbedding", "weight"),
        "decoder.layers.0.input_layernorm.weight": ("decoder.layers.0.input_layernorm", "FusedLayerNorm", "weight"),
        "decoder.layers.0.input_layernorm.bias": ("decoder.layers.0.input_layernorm", "FusedLayerNorm", "bias"),
        "decoder.layers.0.self_attention.linear_qkv.weight": ("decoder.layers.0.self_attention.linear_qkv",
                                                              "ColumnParallelLinear", "weight"),
        "decoder.layers.0.self_attention.linear_qkv.bias": ("decoder.layers.0.self_attention.linear_qkv",
                                                            "ColumnParallelLinear", "bias"),
        "decoder.layers.0.mlp.linear_fc2.weight": ("decoder.layers.0.mlp.linear_fc2", "RowParallelLinear", "weight"),
        "decoder.layers.0.mlp.router.weight": ("decoder.layers.0.mlp.router", "TopKRouter", "weight"),
        "decoder.layers.0.self_attention.core_attention.softmax_offset": (
            "decoder.layers.0.self_attention.core_attention", "DotProductAttention", "softmax_offset"),
        "decoder.layers.0.mixer.A_log": ("decoder.layers.0.mixer", "MambaMixer", "A_log"),
        "output_layer.weight": ("output_layer", "ColumnParallelLinear", "weight"),
    }
    return state, sites


def _std_near(t, want):
    return abs(t.float().std().item() / want - 1) < 0.1


def test_each_kind_of_weight_is_drawn_for_o1_activations_and_peaked_attention():
    state, sites = _state()
    a_log = state["decoder.layers.0.mixer.A_log"].clone()
    kept = sensitize(state, sites, hidden=H)
    assert kept == ["decoder.layers.0.mixer.A_log"] and torch.equal(state["decoder.layers.0.mixer.A_log"], a_log)
    assert _std_near(state["embedding.word_embeddings.weight"], 1.0)  # untied: an output layer of its own
    assert _std_near(state["output_layer.weight"], 1 / math.sqrt(H))
    assert _std_near(state["decoder.layers.0.self_attention.linear_qkv.weight"], QK_GAIN / math.sqrt(H))
    assert _std_near(state["decoder.layers.0.mlp.linear_fc2.weight"], 1 / math.sqrt(4 * H))
    assert _std_near(state["decoder.layers.0.mlp.router.weight"], 1 / math.sqrt(H))
    norm = state["decoder.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1) < 0.05 and _std_near(norm, NORM_WEIGHT_STD)
    for bias in ("decoder.layers.0.input_layernorm.bias", "decoder.layers.0.self_attention.linear_qkv.bias"):
        assert _std_near(state[bias], BIAS_STD)
    assert state["decoder.layers.0.self_attention.core_attention.softmax_offset"].abs().min() > 0
    # the vocabulary's padding rows (megatron pads V to a multiple of 128·TP) are drawn too
    assert state["embedding.word_embeddings.weight"][-8:].abs().sum(dim=1).min() > 0


def test_the_draw_depends_on_the_names_and_megatrons_whole_draw_only():
    a, sites = _state()
    b, _ = _state()
    sensitize(a, sites, hidden=H)
    sensitize(b, sites, hidden=H)
    assert all(torch.equal(a[k], b[k]) for k in a)  # deterministic
    c, _ = _state()
    c["decoder.layers.0.mlp.linear_fc2.weight"] += 1e-3  # megatron drew another starting point (its --seed)
    sensitize(c, sites, hidden=H)
    assert not torch.equal(a["decoder.layers.0.mlp.linear_fc2.weight"], c["decoder.layers.0.mlp.linear_fc2.weight"])
    # zero biases too: another megatron seed, other biases (not one draw for every calibration seed)
    bias = "decoder.layers.0.self_attention.linear_qkv.bias"
    assert not torch.equal(a[bias], c[bias])
    # two zero biases of one shape still get different draws
    assert not torch.equal(a["decoder.layers.0.input_layernorm.bias"][:16], a["decoder.layers.0.self_attention"
                                                                              ".linear_qkv.bias"][:16])


def test_tied_embeddings_take_the_output_layers_rule_and_zero_centred_gamma_its_own():
    state, sites = _state()
    del state["output_layer.weight"], sites["output_layer.weight"]
    sensitize(state, sites, hidden=H, zero_centered_gamma=True)
    assert _std_near(state["embedding.word_embeddings.weight"], 1 / math.sqrt(H))
    assert abs(state["decoder.layers.0.input_layernorm.weight"].mean().item()) < 0.05


def test_seed_init_is_validated_by_name():
    raw = {"model": {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2}, "train": {"seed_init": "xavier"}}
    with pytest.raises(RecipeError, match="seed_init"):
        recipe_from_dict(raw, "r.yaml")
    assert recipe_from_dict(dict(raw, train={}), "r.yaml").train.seed_init == "megatron"


@pytest.mark.multiprocess
def test_the_reference_writes_the_sensitized_weights_every_side_loads(runs):
    """The reference's seed checkpoint under ``seed_init: sensitized``: the query/key projection at
    its gain, norms off one, biases and padding rows non-zero; megatron's draw otherwise."""
    recipe = load("gpt_tp2", train={"seed_init": "sensitized"})
    out = runs.reference(recipe)
    state = load_file(os.path.join(out, "seed.safetensors"))
    megatron = load_file(os.path.join(runs.reference(load("gpt_tp2")), "seed.safetensors"))
    h = recipe.model["hidden_size"]
    qkv = state["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert abs(qkv.std().item() * math.sqrt(h) / QK_GAIN - 1) < 0.2
    assert state["decoder.layers.0.self_attention.linear_qkv.bias"].abs().min() > 0
    assert megatron["decoder.layers.0.self_attention.linear_qkv.bias"].abs().max() == 0
    assert state["decoder.layers.0.input_layernorm.weight"].std() > 0.1
    words = state["embedding.word_embeddings.weight"]
    assert words.shape[0] > recipe.data.vocab_size and words[recipe.data.vocab_size:].abs().sum(dim=1).min() > 0


def test_a_seed_checkpoint_says_how_it_was_drawn_and_a_run_asking_otherwise_is_refused(tmp_path):
    from safetensors.torch import save_file

    from ttrace_megatron.adapter.run.seed_checkpoint import seed_init_of, share_initial_weights

    old, drawn = str(tmp_path / "old.safetensors"), str(tmp_path / "drawn.safetensors")
    save_file({"w": torch.zeros(2)}, old)  # written before ttrace recorded the draw: megatron's
    save_file({"w": torch.zeros(2)}, drawn, metadata={"seed_init": "sensitized"})
    assert (seed_init_of(old, 0), seed_init_of(drawn, 0)) == ("megatron", "sensitized")
    with pytest.raises(RecipeError, match="holds megatron initial weights, and this run asks for sensitized"):
        share_initial_weights(old, None, None, None, 0, "candidate", 2, init="sensitized")
    with pytest.raises(RecipeError, match="seed_init must be one of"):
        share_initial_weights(old, None, None, None, 0, "candidate", 2, init="xavier")


def test_megatron_lm_sides_are_told_the_recipes_seed_init():
    """``ttrace run --megatron-lm``: the recipe's seed_init reaches pretrain_gpt.py as
    ``--ttrace-seed-init``, and the flag comes back as the session's option."""
    import argparse

    from ttrace_megatron.adapter.megatron_lm.arguments import add_arguments
    from ttrace_megatron.adapter.megatron_lm.checkout import trace_args
    from ttrace_megatron.adapter.run.session import TraceOptions

    trace = TraceOptions(enabled=True, dir="t", seed_checkpoint="seed.safetensors")
    sensitized = load("gpt_tp2", train={"seed_init": "sensitized"})
    argv = trace_args(trace, sensitized)
    assert argv[argv.index("--ttrace-seed-init") + 1] == "sensitized"
    assert "--ttrace-seed-init" not in trace_args(trace, load("gpt_tp2"))
    options = TraceOptions.from_args(add_arguments(argparse.ArgumentParser()).parse_args(argv))
    assert options.seed_init == "sensitized" and options.seed_checkpoint == "seed.safetensors"


def test_distinct_tokens_repeat_no_token_within_a_sample_and_leave_eod_to_document_ends():
    from ttrace_megatron.adapter.recipe.data import eod_token, sampler

    recipe = load("gpt_tp2", data={"distinct_tokens": True})
    draw = sampler(recipe)
    for index in range(8):
        s = draw(index)
        tokens = torch.cat([s.tokens, s.labels[-1:]])
        assert len(set(tokens.tolist())) == len(tokens) == recipe.data.seq_length + 1
        assert eod_token(recipe.data.vocab_size) not in tokens.tolist()
    assert not torch.equal(draw(0).tokens, draw(1).tokens)
    with pytest.raises(RecipeError, match="distinct_tokens"):
        load("gpt_tp2", data={"distinct_tokens": True, "vocab_size": 16})
    with pytest.raises(RecipeError, match="distinct_tokens"):
        load("gpt_tp2", data={"distinct_tokens": True, "source": "megatron_mock"})
