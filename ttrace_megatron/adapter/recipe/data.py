"""Where a ``ttrace run``'s tokens come from (the recipe's ``data.source``).

``synthetic`` (the default): i.i.d. tokens drawn from the seed, one sample per sequence.
``megatron_mock``: megatron-core's MockGPTDataset built as Megatron-LM's ``pretrain_gpt.py --mock-data``
builds it (NullTokenizer of the recipe's vocabulary, the seed, the sequence length, as many samples
as the run consumes), so a trace of ttrace's runner and one of Megatron-LM's own training loop
(``--megatron-lm``) see the same tokens in the same order and compare tensor by tensor.

Either way DP rank ``r`` takes global microbatch ``g = j·dp + r`` for its ``j``-th microbatch,
samples ``[g·mbs, (g+1)·mbs)`` of the iteration's global batch: Megatron-LM's
MegatronPretrainingSampler.

Each sample carries its loss mask, as megatron's GPTDataset builds it: 0 on the end-of-document
token with ``eod_mask_loss``, and on synthetic data a prompt prefix of each sample with
``masked_share`` (lengths drawn per sample, so the valid-token counts of microbatches and DP ranks
differ). The runner applies it as Megatron-LM's ``pretrain_gpt.loss_func`` does.
"""

from __future__ import annotations

from typing import Callable, Iterator, Tuple

import torch

from ...recipe import MEGATRON_MOCK, Recipe
from . import compat

Sample = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (tokens, labels, loss_mask), each of seq_length


def eod_token(vocab_size: int) -> int:
    """The end-of-document token of the recipe's vocabulary: NullTokenizer's, the last
    (``compat.null_tokenizer``)."""
    return vocab_size - 1


def _synthetic(recipe: Recipe) -> Callable[[int], Sample]:
    d = recipe.data

    def sample(index: int) -> Sample:
        g = torch.Generator().manual_seed(d.seed * 1_000_003 + index)
        tokens = torch.randint(0, d.vocab_size, (d.seq_length + 1,), generator=g)
        loss_mask = torch.ones(d.seq_length, dtype=torch.float32)
        if d.masked_share:
            prompt = int(torch.rand((), generator=g) * 2.0 * d.masked_share * d.seq_length)
            loss_mask[:min(prompt, d.seq_length - 1)] = 0.0
        if d.eod_mask_loss:
            loss_mask[tokens[:-1] == eod_token(d.vocab_size)] = 0.0
        return tokens[:-1], tokens[1:], loss_mask

    return sample


def _megatron_mock(recipe: Recipe) -> Callable[[int], Sample]:
    """megatron-core's MockGPTDataset with Megatron-LM's settings for ``--mock-data``: the train
    split of ``iterations × global_batch_size`` samples (no evaluation), its loss mask megatron's
    (``eod_mask_loss`` as the recipe says), position ids 0 … seq − 1 (``reset_position_ids`` off)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    d = recipe.data
    config = GPTDatasetConfig(random_seed=d.seed, sequence_length=d.seq_length, blend=None, blend_per_split=None,
                              tokenizer=compat.null_tokenizer(d.vocab_size), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=d.eod_mask_loss,
                              create_attention_mask=False)
    train = BlendedMegatronDatasetBuilder(MockGPTDataset, [recipe.train.iterations * d.global_batch_size, 0, 0],
                                          lambda: True, config).build()[0]

    def sample(index: int) -> Sample:
        item = train[index]
        return (torch.as_tensor(item["tokens"]).long(), torch.as_tensor(item["labels"]).long(),
                torch.as_tensor(item["loss_mask"]).float())

    return sample


def sampler(recipe: Recipe) -> Callable[[int], Sample]:
    """Sample ``index`` of the run (the same on every rank)."""
    return _megatron_mock(recipe) if recipe.data.source == MEGATRON_MOCK else _synthetic(recipe)


def microbatches(recipe: Recipe, samples: Callable[[int], Sample], iteration: int, dp_rank: int,
                 dp_size: int) -> Iterator[Tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This DP rank's ``(j, tokens, labels, loss_mask)`` of one iteration (0-based), in megatron's
    data order."""
    d = recipe.data
    per_rank = d.global_batch_size // (d.micro_batch_size * dp_size)
    for j in range(per_rank):
        first = iteration * d.global_batch_size + (j * dp_size + dp_rank) * d.micro_batch_size
        rows = [samples(first + s) for s in range(d.micro_batch_size)]
        yield (j, *(torch.stack([row[i] for row in rows]).contiguous() for i in range(3)))
