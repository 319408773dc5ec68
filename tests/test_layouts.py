"""Placement inference per module kind (adapter/record/layouts.py), without torch.distributed.

megatron-core's module classes are instantiated without their constructors (which need
initialized process groups) and given the attributes the rules read: partition sizes, the
sequence-parallel flag, megatron's partition tags. Each rule is then checked against what
megatron-core does with such a tensor, and every layout against slice/merge on real values.
"""

import pytest
import torch

from ttrace_megatron.keys import (BACKWARD, FORWARD, MAIN_GRAD, OPTIMIZER, TensorKey, TensorKind, amax, main_grad,
                                  param_grad, updated_param)
from ttrace_megatron.placement import Layout, Partial, RangeShard, Replicate, Shard, merge_shards, slice_logical

layers = pytest.importorskip("megatron.core.tensor_parallel.layers")
from ttrace_megatron.adapter.record import layouts  # noqa: E402
from ttrace_megatron.adapter.record.layouts import KeyLayouts, LayoutInferenceError, ModelFacts, Site  # noqa: E402


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def fake(cls, **attrs):
    """A megatron-core module without its constructor: only the attributes given."""
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    for k, v in attrs.items():
        setattr(module, k, v)
    return module


def param(*shape, **tags):
    p = torch.nn.Parameter(torch.zeros(*shape))
    for k, v in tags.items():
        setattr(p, k, v)
    return p


def facts(**kw):
    base = dict(num_layers=2, vocab_size=250, sequence_parallel=False, gated_linear_unit=False, tp_size=2,
                hidden_size=16, tokens_per_microbatch=64, tokens_per_iteration=256)
    base.update(kw)
    return ModelFacts(**base)


def column(out_per_rank=8, in_size=16, sp=False, gather=False, expert=False, etp=1, **tags):
    return fake(layers.ColumnParallelLinear, output_size_per_partition=out_per_rank, input_size=in_size,
                output_size=out_per_rank * 2, sequence_parallel=sp, gather_output=gather, is_expert=expert,
                tp_group=_Group(etp), skip_bias_add=False, weight=param(out_per_rank, in_size, **tags))


def row(in_per_rank=8, out_size=16, sp=False):
    return fake(layers.RowParallelLinear, input_size_per_partition=in_per_rank, input_size=in_per_rank * 2,
                output_size=out_size, sequence_parallel=sp, is_expert=False, tp_group=_Group(1), skip_bias_add=True,
                weight=param(out_size, in_per_rank), bias=param(out_size))


def key(phase, tensor, module="decoder.layers.0.mlp.linear_fc1", mb=0):
    return TensorKey(1, mb if phase in (FORWARD, BACKWARD) else -1, module, phase, tensor)


def roundtrip(layout, sizes, local_shape):
    """Slicing the logical tensor for every rank and merging the pieces gives it back."""
    full = torch.randn(layout.logical_shape, dtype=torch.float64)
    axes = [p.axis for p in layout.placements]
    import itertools

    pieces = []
    for ranks in itertools.product(*(range(sizes[a]) for a in axes)):
        coords = {a: (r, sizes[a]) for a, r in zip(axes, ranks)}
        shape = local_shape(coords) if callable(local_shape) else local_shape
        pieces.append((coords, slice_logical(full, layout, coords, shape)))
    merged = merge_shards(pieces, layout)
    assert torch.allclose(merged.tensor.double(), full), layout


def test_column_parallel_weight_value_grad_and_main_grad():
    m = column(tensor_model_parallel=True, partition_dim=0, partition_stride=1)
    site = Site("decoder.layers.0.self_attention.linear_qkv", m, "weight", m.weight)
    kl = KeyLayouts(facts(), dp_size=2)
    value = kl.param_value(site)
    assert value.placements == (Replicate("dp"), Shard(0, "tp")) and value.logical_shape == (16, 16)
    grad = kl.of(key(BACKWARD, param_grad("weight"), site.module_name), site, (8, 16))
    assert grad.placements == (Shard(0, "tp"),) and grad.scale == 2.0  # each DP rank's own microbatch, dp× scaled
    main = kl.of(key(MAIN_GRAD, main_grad("weight"), site.module_name), site, (8, 16))
    assert main.placements == (Replicate("dp"), Shard(0, "tp")) and main.scale == 1.0
    assert kl.of(key(OPTIMIZER, updated_param("weight"), site.module_name), site, (8, 16)) == value
    roundtrip(value, {"dp": 2, "tp": 2}, (8, 16))


def test_distributed_optimizer_main_grad_is_an_owned_range():
    m = column()
    site = Site("decoder.layers.0.self_attention.linear_qkv", m, "weight", m.weight)
    kl = KeyLayouts(facts(), dp_size=2, owned_ranges={m.weight: ((0, 100, 128), 1)})
    main = kl.of(key(MAIN_GRAD, main_grad("weight"), site.module_name), site, (8, 16))
    assert main.placements == (Shard(0, "tp"), RangeShard("dp", (0, 100, 128), (8, 16)))
    roundtrip(main, {"dp": 2, "tp": 2}, lambda coords: ((100,), (28,))[coords["dp"][0]])


def test_gated_fc1_is_strided_and_a_wrong_tag_is_an_error():
    m = column(tensor_model_parallel=True, partition_dim=0, partition_stride=2)
    site = Site("decoder.layers.0.mlp.linear_fc1", m, "weight", m.weight)
    layout = layouts.param_layout(site, facts(gated_linear_unit=True))
    assert layout.placements[-1] == Shard(0, "tp", stride=2)
    roundtrip(layout, {"dp": 1, "tp": 2}, (8, 16))
    with pytest.raises(LayoutInferenceError, match="partition_stride"):
        layouts.param_layout(site, facts(gated_linear_unit=False))  # the module needs stride 1, tag says 2
    wrong_size = column(out_per_rank=6)
    with pytest.raises(LayoutInferenceError, match="partition size"):
        layouts.param_layout(Site("x.linear_fc1", wrong_size, "weight", param(8, 16)), facts())


def test_row_parallel_bias_is_replicated_and_a_partial_sum_per_microbatch_under_sp():
    m = row(sp=True)
    site = Site("decoder.layers.0.mlp.linear_fc2", m, "bias", m.bias)
    f = facts(sequence_parallel=True)
    assert layouts.param_layout(site, f).placements == (Replicate("dp"), Replicate("tp"))
    assert layouts.param_layout(site, f, microbatch_grad=True).placements == (Partial("tp"),)
    assert layouts.param_layout(Site("x", m, "weight", m.weight), f).placements[-1] == Shard(1, "tp")
    # without SP every rank sees every token: a replica
    assert layouts.param_layout(Site("x", row(), "bias", m.bias), facts(), microbatch_grad=True).placements == (
        Replicate("tp"),)


def test_norm_weight_under_sp_and_a_tag_on_a_replicated_param_is_an_error():
    norm = torch.nn.LayerNorm(16)
    site = Site("decoder.layers.0.input_layernorm", norm, "weight", norm.weight)
    assert layouts.param_layout(site, facts(sequence_parallel=True), microbatch_grad=True).placements == (
        Partial("tp"),)
    norm.weight.tensor_model_parallel = True
    with pytest.raises(LayoutInferenceError, match="replicates"):
        layouts.param_layout(site, facts())


def test_vocab_embedding_keeps_its_padding_and_orders_its_output_like_every_activation():
    """A vocabulary's padding rows are real parameters (in the softmax, the grad norm, the weight
    decay), so the logical tensor is the padded one: 256 rows held over TP2, 256 compared, though
    the tokenizer's vocabulary is 250."""
    emb = fake(layers.VocabParallelEmbedding, num_embeddings_per_partition=128, reduce_scatter_embeddings=False,
               weight=param(128, 16))
    site = Site("embedding.word_embeddings", emb, "weight", emb.weight)
    assert facts().vocab_size == 250
    value = layouts.param_layout(site, facts())
    assert value.logical_shape == (256, 16)
    roundtrip(value, {"dp": 1, "tp": 2}, (128, 16))
    out = layouts.activation_layout(TensorKind.OUTPUT, site.module_name, emb, facts(), (2, 32, 16))
    assert out.permute == (1, 0, 2) and out.logical_shape == (32, 2, 16)  # stored [b, s, h]
    emb.reduce_scatter_embeddings = True
    out = layouts.activation_layout(TensorKind.OUTPUT, site.module_name, emb, facts(), (16, 2, 16))
    assert out.placements == (Shard(0, "tp"),) and out.logical_shape == (32, 2, 16)


def test_column_activations_with_and_without_sp():
    m = column(sp=True)
    f = facts(sequence_parallel=True)
    name = "decoder.layers.0.self_attention.linear_qkv"
    assert layouts.activation_layout(TensorKind.INPUT, name, m, f, (16, 2, 16)).placements == (Shard(0, "tp"),)
    out = layouts.activation_layout(TensorKind.OUTPUT, name, m, f, (32, 2, 8))
    assert out.placements == (Shard(-1, "tp"),) and out.logical_shape == (32, 2, 16)
    assert layouts.activation_layout(TensorKind.INPUT, name, column(), facts(), (32, 2, 16)).placements == (
        Replicate("tp"),)


def test_expert_linears_use_the_expert_axes_and_their_grads_swap_partial_and_replica():
    fc1 = column(expert=True, etp=2)
    name = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1"
    f = facts()
    assert layouts.param_layout(Site(name, fc1, "weight", fc1.weight), f).placements == (
        Replicate("edp"), Shard(0, "etp"))
    assert layouts.activation_layout(TensorKind.INPUT, name, fc1, f, (5, 16)).placements == (Replicate("etp"),)
    # explicit expert communication: the dispatcher reduces the input grad over expert-TP
    assert layouts.activation_layout(TensorKind.GRAD_INPUT, name, fc1, f, (5, 16)).placements == (Partial("etp"),)


def test_tied_embedding_across_stages():
    emb = fake(layers.VocabParallelEmbedding, num_embeddings_per_partition=256, reduce_scatter_embeddings=False,
               weight=param(256, 16, shared_embedding=True))
    site = Site("embedding.word_embeddings", emb, "weight", emb.weight)
    f = facts(pp_size=2, tp_size=1)
    assert layouts.param_layout(site, f).placements[0] == Replicate("pp")
    assert layouts.param_layout(site, f, microbatch_grad=True).placements[0] == Partial("pp")


def test_every_kind_has_a_layout_and_backward_keys_carry_the_loss_scale():
    f = facts(sequence_parallel=True, pp_size=2)
    kl = KeyLayouts(f, dp_size=4)
    m = column(sp=True)
    site = Site("decoder.layers.0.self_attention.linear_qkv", m)
    grad_out = kl.of(key(BACKWARD, "grad_output", site.module_name), site, (32, 2, 8))
    assert grad_out.scale == 4.0 and grad_out.placements == (Shard(-1, "tp"),)
    assert kl.of(key(FORWARD, "output", site.module_name), site, (32, 2, 8)).scale == 1.0
    assert kl.of(key(BACKWARD, amax("grad_output"), site.module_name), site, (1,)) == Layout(
        (Replicate("tp"),), (1,), scale=4.0)
    scalar = kl.of(TensorKey(1, -1, "optimizer", OPTIMIZER, "grad_norm"), Site("optimizer"), (1,))
    assert scalar.placements == (Replicate("pp"), Replicate("dp"), Replicate("tp"))
    from megatron.core.transformer.moe.router import TopKRouter as Router

    router = fake(Router)
    aux = kl.of(key(FORWARD, "load_balancing_loss", "decoder.layers.0.mlp.router"), Site("x", router), (1,))
    assert aux.placements == (Partial("tp"),)  # a sum over this rank's sequence shard
    loss = kl.of(key(FORWARD, "per_token_loss", "loss"), Site("loss"), (2, 32))
    assert loss.placements == (Replicate("tp"),)


def test_reduction_lengths_by_kind():
    f = facts()
    m = column()
    assert layouts.reduction_length("x", m, TensorKind.OUTPUT, f) == 16  # fprop: over input features
    assert layouts.reduction_length("x", m, TensorKind.GRAD_INPUT, f) == 16  # dgrad: over output features
    assert layouts.reduction_length("x", m, TensorKind.PARAM_GRAD, f) == 64  # wgrad: the microbatch's tokens
    for kind in (TensorKind.MAIN_GRAD, TensorKind.PARAM, TensorKind.OPTIMIZER_SCALAR):
        assert layouts.reduction_length("x", m, kind, f) == 256  # the iteration's tokens
    assert layouts.reduction_length("output_layer", m, TensorKind.INPUT, f) == 250  # log-sum-exp
    assert layouts.reduction_length("decoder.layers.0.input_layernorm", None, TensorKind.OUTPUT, f) == 16


def test_experts_whose_tokens_no_placement_describes_are_named():
    """EP × expert-TP against TP under sequence parallelism, and the alltoall dispatcher's order of
    an expert's tokens where EP and expert-TP are both above one (sources expert-TP rank first:
    shards 0, 2, 1, 3 at EP 2 × expert-TP 2, measured on sweep0025 of seed 0)."""
    from ttrace_megatron.adapter.record.layouts import (EXPERT_TOKENS_INTERLEAVED, EXPERT_TOKENS_MIXED,
                                                        EXPERT_TOKENS_SPLIT, expert_tokens_unmatched)

    assert expert_tokens_unmatched(2, 2, 4, True, "alltoall") == EXPERT_TOKENS_INTERLEAVED
    assert expert_tokens_unmatched(2, 2, 4, True, "allgather") is None  # gathered over TP, in order
    assert expert_tokens_unmatched(2, 1, 2, True, "alltoall") is None  # moe_tp2_sp_ep2
    assert expert_tokens_unmatched(1, 2, 2, True, "alltoall") is None  # moe_etp2
    assert expert_tokens_unmatched(2, 2, 2, True, "alltoall") == EXPERT_TOKENS_MIXED
    assert expert_tokens_unmatched(1, 1, 2, True, "alltoall") == EXPERT_TOKENS_SPLIT
