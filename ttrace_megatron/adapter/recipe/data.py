"""Where a ``ttrace run``'s tokens come from (the recipe's ``data.source``).

``synthetic`` (the default): i.i.d. tokens drawn from the seed, one sample per sequence.
``megatron_mock``: megatron-core's MockGPTDataset built as Megatron-LM's ``pretrain_gpt.py --mock-data``
builds it (NullTokenizer of the recipe's vocabulary, the seed, the sequence length, as many samples
as the run consumes), so a trace of ttrace's runner and one of Megatron-LM's own training loop
(``--megatron-lm``) see the same tokens in the same order and compare tensor by tensor.

Either way DP rank ``r`` takes global microbatch ``g = j·dp + r`` for its ``j``-th microbatch,
samples ``[g·mbs, (g+1)·mbs)`` of the iteration's global batch: Megatron-LM's
MegatronPretrainingSampler.
"""

from __future__ import annotations

from typing import Callable, Iterator, Tuple

import torch

from ...errors import RecipeError
from ...recipe import MEGATRON_MOCK, Recipe
from . import compat

Sample = Tuple[torch.Tensor, torch.Tensor]  # (tokens, labels), each of seq_length


def _synthetic(recipe: Recipe) -> Callable[[int], Sample]:
    d = recipe.data

    def sample(index: int) -> Sample:
        g = torch.Generator().manual_seed(d.seed * 1_000_003 + index)
        tokens = torch.randint(0, d.vocab_size, (d.seq_length + 1,), generator=g)
        return tokens[:-1], tokens[1:]

    return sample


def _megatron_mock(recipe: Recipe) -> Callable[[int], Sample]:
    """megatron-core's MockGPTDataset with Megatron-LM's settings for ``--mock-data``: the train
    split of ``iterations × global_batch_size`` samples (no evaluation), its loss mask all ones
    (``eod_mask_loss`` off), position ids 0 … seq − 1 (``reset_position_ids`` off)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    d = recipe.data
    config = GPTDatasetConfig(random_seed=d.seed, sequence_length=d.seq_length, blend=None, blend_per_split=None,
                              tokenizer=compat.null_tokenizer(d.vocab_size), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    train = BlendedMegatronDatasetBuilder(MockGPTDataset, [recipe.train.iterations * d.global_batch_size, 0, 0],
                                          lambda: True, config).build()[0]

    def sample(index: int) -> Sample:
        item = train[index]
        if not bool(torch.all(torch.as_tensor(item["loss_mask"]) == 1)):
            raise RecipeError(f"{recipe.source}: data: megatron_mock sample {index} masks tokens out of the loss, "
                              f"which ttrace's runner does not apply")
        return torch.as_tensor(item["tokens"]).long(), torch.as_tensor(item["labels"]).long()

    return sample


def sampler(recipe: Recipe) -> Callable[[int], Sample]:
    """Sample ``index`` of the run (the same on every rank)."""
    return _megatron_mock(recipe) if recipe.data.source == MEGATRON_MOCK else _synthetic(recipe)


def microbatches(recipe: Recipe, samples: Callable[[int], Sample], iteration: int, dp_rank: int,
                 dp_size: int) -> Iterator[Tuple[int, torch.Tensor, torch.Tensor]]:
    """This DP rank's ``(j, tokens, labels)`` of one iteration (0-based), in megatron's data order."""
    d = recipe.data
    per_rank = d.global_batch_size // (d.micro_batch_size * dp_size)
    for j in range(per_rank):
        first = iteration * d.global_batch_size + (j * dp_size + dp_rank) * d.micro_batch_size
        rows = [samples(first + s) for s in range(d.micro_batch_size)]
        yield j, torch.stack([t for t, _ in rows]).contiguous(), torch.stack([l for _, l in rows]).contiguous()
