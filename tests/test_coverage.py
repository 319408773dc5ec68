"""Coverage (ttrace_megatron.coverage): every parameter of the reference's list is judged or named
with why; the summary counts parameters and elements by module type."""

from ttrace_megatron import coverage
from ttrace_megatron.keys import BACKWARD, MAIN_GRAD, TensorKey, main_grad, param_grad

PARAMS = [
    {"param": "decoder.layers.0.mlp.linear_fc1.weight", "module": "decoder.layers.0.mlp.linear_fc1",
     "name": "weight", "module_type": "ColumnParallelLinear", "numel": 100, "requires_grad": True},
    {"param": "decoder.layers.0.self_attention.k_layernorm.bias", "module": "decoder.layers.0.self_attention.k_layernorm",
     "name": "bias", "module_type": "LayerNorm", "numel": 8, "requires_grad": True},
    {"param": "decoder.layers.0.mlp.linear_fc2.weight", "module": "decoder.layers.0.mlp.linear_fc2",
     "name": "weight", "module_type": "RowParallelLinear", "numel": 100, "requires_grad": False},
    {"param": "embedding.word_embeddings.weight", "module": "embedding.word_embeddings", "name": "weight",
     "module_type": "VocabParallelEmbedding", "numel": 50, "requires_grad": True},
]


def test_every_parameter_is_judged_or_named_with_why():
    ref_run = {"parameters": PARAMS, "unjudged_params": [
        {"param": "decoder.layers.0.self_attention.k_layernorm.bias", "why": "zero by construction"}]}
    cand_run = {"record_filter": {"modules": ["decoder.*"]}}
    judged = [TensorKey(1, 0, "decoder.layers.0.mlp.linear_fc1", BACKWARD, param_grad("weight")),
              TensorKey(1, -1, "decoder.layers.0.mlp.linear_fc1", MAIN_GRAD, main_grad("weight")),
              TensorKey(1, 0, "decoder.layers.0.mlp.linear_fc1", BACKWARD, "grad_output")]  # not about a param
    cov = coverage.summary(coverage.param_coverage(ref_run, cand_run, judged))
    assert cov["total"] == {"params": 4, "params_judged": 1, "elements": 258, "elements_judged": 100}
    why = {e["param"]: e["why"] for e in cov["not_judged"]}
    assert why["decoder.layers.0.self_attention.k_layernorm.bias"] == "zero by construction"
    assert why["decoder.layers.0.mlp.linear_fc2.weight"] == coverage.FROZEN
    assert why["embedding.word_embeddings.weight"] == coverage.NOT_SELECTED
    assert cov["by_module_type"]["ColumnParallelLinear"]["params_judged"] == 1
    assert "1 of 4 parameters judged" in coverage.headline(cov)


def test_a_trace_without_a_parameter_list_says_so():
    cov = coverage.summary(coverage.param_coverage({}, {}, []))
    assert "lists no parameters" in coverage.headline(cov)
