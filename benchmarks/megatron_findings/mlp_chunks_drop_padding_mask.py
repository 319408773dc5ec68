"""A megatron-core bug a comparison cannot show: ``mlp_chunks_for_training`` drops the MoE layer's
padding mask (0.19.2, megatron/core/transformer/transformer_layer.py:915: each chunk's call is
``apply_module(self.mlp)(chunk)``, without the ``padding_mask`` the unchunked call passes at :928).
The router then counts padding tokens in its load-balancing map and z-loss. Every layout drops it
alike, so reference and candidate agree; ttrace refuses the combination instead
(``config.mlp_chunks_refused``).

One rank, gloo, CPU (ttrace's CUDA shim): a TransformerLayer with an MoE MLP, half its tokens
padding; prints how many padding tokens the router's balancing map was told of, per call.

    PYTHONPATH=<megatron-core 0.19> python benchmarks/megatron_findings/mlp_chunks_drop_padding_mask.py
"""
import os
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
import sys  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ttrace_megatron.adapter.cpu import cuda_shim  # noqa: E402  megatron on CPU
cuda_shim.install()
from megatron.core import parallel_state, tensor_parallel
parallel_state.initialize_model_parallel()
tensor_parallel.model_parallel_cuda_manual_seed(1)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.moe import router as router_mod

def run(chunks, mask):
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1.0,
                            moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="allgather",
                            add_bias_linear=False, mlp_chunks_for_training=chunks, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=4)
    layer = build_module(spec, config=cfg, layer_number=1)
    layer.train()
    seen = []
    original = router_mod.compute_routing_scores_for_aux_loss
    def spy(logits, topk, score_function, fused=False, padding_mask=None):
        seen.append(None if padding_mask is None else int(padding_mask.sum()))
        return original(logits, topk, score_function, fused=fused, padding_mask=padding_mask)
    router_mod.compute_routing_scores_for_aux_loss = spy
    try:
        x = torch.randn(16, 2, 32, requires_grad=True)  # [s, b, h]
        out = layer(x, attention_mask=None, padding_mask=mask)
    finally:
        router_mod.compute_routing_scores_for_aux_loss = original
    return seen

mask = torch.zeros(2, 16, dtype=torch.bool); mask[:, 8:] = True  # [b, s]: the last half is padding
for chunks in (1, 2):
    print(f"mlp_chunks_for_training={chunks}: padding tokens the router's balancing map was told of, per call:",
          run(chunks, mask))
