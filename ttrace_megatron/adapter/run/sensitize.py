"""Sensitizing initial weights: a seed checkpoint in which a layout's bugs show (issue #36).

Megatron's initialization (normal, std 0.02; zero biases; unit norm weights) makes a model whose
attention scores are near zero, so every attention is nearly uniform, and whose biases are zero. A
bug that scales the scores (a softmax scale from the wrong head dimension), adds a bias on every
TP rank, or applies a norm's weight to the wrong channels moves such a model's tensors by less than
bf16's round-off, or not at all, and a check of it passes. The check needs a starting point, not
megatron's: every side loads the reference's seed checkpoint whatever it was drawn from. With
``seed_init: sensitized`` the reference draws each logical weight so that activations are O(1):

* a linear's weight ``[out, in]``: N(0, 1/in), so each output is O(1) for O(1) inputs; the query and
  key projections at gain 1.5, so the scores q·k/√d have a standard deviation of about 2 and
  attention is peaked, not uniform;
* the word and position embeddings: N(0, 1) (untied); tied to the output layer: N(0, 1/hidden),
  the output layer's rule (logits O(1)), and the positions at the words' scale;
* a norm's weight: 1 + N(0, 0.2²) (N(0, 0.2²) where megatron centres gamma at zero); every bias,
  norm biases included: N(0, 0.1²), not zero;
* a router's weight ``[experts, hidden]``: N(0, 1/hidden) (well-separated top-k scores); attention
  sinks' offsets: N(0, 1);
* the vocabulary's padding rows are drawn like the rest (megatron's padding is never all-zero here).

Anything else (Mamba's ``A_log``, ``D``, ``dt_bias`` and convolution, grouped experts' weights)
keeps megatron's initialization, and the run says which. The draw is a function of the parameter's
name and of megatron's whole draw (so megatron's ``--seed`` still picks the starting point), and
nothing else: any layout loads the same logical tensors.
"""

from __future__ import annotations

import math
import zlib
from typing import Dict, List, Tuple

import torch
import xxhash


QK_GAIN = 1.5  # scores' std ≈ QK_GAIN² for unit-variance inputs: attention peaked, not uniform
NORM_WEIGHT_STD = 0.2
BIAS_STD = 0.1
# a linear whose module name ends so projects queries or keys (fused QKV, MLA's query/key projections)
QUERY_KEY_PROJECTIONS = ("linear_qkv", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                         "linear_kv_down_proj", "linear_kv_up_proj")
LINEARS = ("ColumnParallelLinear", "RowParallelLinear")
EMBEDDINGS = ("VocabParallelEmbedding", "Embedding")
ROUTERS = ("TopKRouter",)


def _draw_digest(state: Dict[str, torch.Tensor]) -> int:
    """A digest of megatron's whole draw, in name order: it changes with megatron's ``--seed`` even
    where one parameter's draw does not (zero biases, unit norm weights)."""
    digest = xxhash.xxh3_64()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.intdigest()


def _generator(name: str, draw_digest: int) -> torch.Generator:
    return torch.Generator().manual_seed((draw_digest ^ (zlib.crc32(name.encode()) << 31)) & ((1 << 63) - 1))


def _normal(shape, std: float, g: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean


def _rule(module_name: str, module_type: str, pname: str, shape: Tuple[int, ...], *, tied: bool, hidden: int,
          zero_centered_gamma: bool):
    """(mean, std) of the sensitized draw of one logical parameter, or None: megatron's is kept."""
    norm = "Norm" in module_type
    if pname == "bias" and (norm or module_type in LINEARS):
        return 0.0, BIAS_STD
    if norm and pname == "weight":
        return (0.0 if zero_centered_gamma else 1.0), NORM_WEIGHT_STD
    if pname == "softmax_offset":
        return 0.0, 1.0
    if len(shape) != 2 or pname != "weight":
        return None
    if module_type in ROUTERS:
        return 0.0, 1.0 / math.sqrt(shape[1])
    if module_type in EMBEDDINGS:  # positions at the words' scale, so neither swamps the other
        return 0.0, (1.0 / math.sqrt(hidden) if tied else 1.0)
    if module_type in LINEARS:
        gain = QK_GAIN if module_name.rsplit(".", 1)[-1] in QUERY_KEY_PROJECTIONS else 1.0
        return 0.0, gain / math.sqrt(shape[1])
    return None


def sensitize(state: Dict[str, torch.Tensor], sites: Dict[str, Tuple[str, str, str]], *, hidden: int,
              zero_centered_gamma: bool = False) -> List[str]:
    """Redraw the logical weights of ``state`` (name → tensor, in place) by the rules above.
    ``sites``: name → (module name, module type, parameter name). Returns the names that keep
    megatron's initialization."""
    tied = not any(name.endswith("output_layer.weight") for name in state)
    digest = _draw_digest(state)
    kept = []
    for name, tensor in state.items():
        module_name, module_type, pname = sites[name]
        rule = _rule(module_name, module_type, pname, tuple(tensor.shape), tied=tied, hidden=hidden,
                     zero_centered_gamma=zero_centered_gamma)
        if rule is None:
            kept.append(name)
            continue
        mean, std = rule
        state[name] = _normal(tensor.shape, std, _generator(name, digest), mean).to(tensor.dtype)
    return kept
