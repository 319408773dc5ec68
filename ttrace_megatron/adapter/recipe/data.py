"""Where a ``ttrace run``'s tokens come from (the recipe's ``data.source``).

``synthetic`` (the default): i.i.d. tokens drawn from the seed, one sample per sequence.
``megatron_mock``: megatron-core's MockGPTDataset built as Megatron-LM's ``pretrain_gpt.py --mock-data``
builds it (NullTokenizer of the recipe's vocabulary, the seed, the sequence length, as many samples
as the run consumes), so a trace of ttrace's runner and one of Megatron-LM's own training loop
(``--megatron-lm``) see the same tokens in the same order and compare tensor by tensor.

Either way DP rank ``r`` takes global microbatch ``g = j·dp + r`` for its ``j``-th microbatch,
samples ``[g·mbs, (g+1)·mbs)`` of the iteration's global batch: Megatron-LM's
MegatronPretrainingSampler.

Each sample carries its loss mask, position ids and attention mask, as megatron's GPTDataset builds
them (``compat.ltor_masks_and_position_ids``): 0 in the loss mask on the end-of-document token with
``eod_mask_loss``, and on synthetic data on a prompt prefix of each sample with ``masked_share``
(lengths drawn per sample, so the valid-token counts of microbatches and DP ranks differ); positions
that start again after each EOD token with ``reset_position_ids``; an attention mask that keeps each
document to itself with ``reset_attention_mask`` (None otherwise: the causal mask megatron's
attention makes itself). Synthetic samples pack documents of ``document_length`` tokens on average,
and with ``padded_share`` end in a padded tail the model is told of (``padding_mask``).
The runner applies the loss mask as Megatron-LM's ``pretrain_gpt.loss_func`` does.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator, NamedTuple, Optional, Tuple

import torch

from ...errors import RecipeError
from ...recipe import MEGATRON_INDEXED, MEGATRON_MOCK, SYNTHETIC, Recipe
from . import compat


class Sample(NamedTuple):
    """One sample, or (stacked) one microbatch: each of seq_length per sample."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]  # [1, s, s] per sample, True where masked; None: causal
    padding_mask: Optional[torch.Tensor] = None  # [s] per sample, True on padding; None: no padding


PAD_TOKEN = 0  # what fills a padded tail (its id does not matter: it carries no loss and is masked)


def eod_token(vocab_size: int) -> int:
    """The end-of-document token of the recipe's vocabulary: NullTokenizer's, the last
    (``compat.null_tokenizer``)."""
    return vocab_size - 1


def _synthetic(recipe: Recipe) -> Callable[[int], Sample]:
    d = recipe.data

    eod = eod_token(d.vocab_size)

    def sample(index: int) -> Sample:
        g = torch.Generator().manual_seed(d.seed * 1_000_003 + index)
        if d.distinct_tokens:  # no token twice in a sample; EOD only where a document ends
            tokens = torch.randperm(d.vocab_size - 1, generator=g)[:d.seq_length + 1]
        else:
            tokens = torch.randint(0, d.vocab_size, (d.seq_length + 1,), generator=g)
        if d.document_length:  # documents packed into the sample, each ended by the EOD token
            ends = torch.rand(d.seq_length + 1, generator=g) < 1.0 / d.document_length
            tokens[ends] = eod
        attention_mask, loss_mask, position_ids = compat.ltor_masks_and_position_ids(
            tokens[:-1], eod, reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
            eod_mask_loss=d.eod_mask_loss, create_attention_mask=d.reset_attention_mask)
        if d.masked_share:
            prompt = int(torch.rand((), generator=g) * 2.0 * d.masked_share * d.seq_length)
            loss_mask[:min(prompt, d.seq_length - 1)] = 0.0
        padding_mask = None
        if d.padded_share:  # a padded tail: no loss, and the model is told which tokens are padding
            pad = min(int(torch.rand((), generator=g) * 2.0 * d.padded_share * d.seq_length), d.seq_length - 1)
            padding_mask = torch.zeros(d.seq_length, dtype=torch.bool)
            padding_mask[d.seq_length - pad:] = True
            tokens[:-1][padding_mask] = PAD_TOKEN
            loss_mask[padding_mask] = 0.0
        return Sample(tokens[:-1], tokens[1:], loss_mask, position_ids, attention_mask, padding_mask)

    return sample


def _megatron_mock(recipe: Recipe) -> Callable[[int], Sample]:
    """megatron-core's MockGPTDataset with Megatron-LM's settings for ``--mock-data``: the train
    split of ``iterations × global_batch_size`` samples (no evaluation), its loss mask, positions
    and attention mask megatron's (``eod_mask_loss``, ``reset_position_ids``, ``reset_attention_mask``
    as the recipe says; the attention mask made only where it is reset, as the causal one megatron's
    attention makes itself otherwise)."""
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    return _megatron_dataset(recipe, MockGPTDataset, blend=None, blend_per_split=None)


def _megatron_dataset(recipe: Recipe, dataset_class, **source) -> Callable[[int], Sample]:
    """The train split of ``iterations × global_batch_size`` samples of a megatron GPT dataset class,
    built by megatron's BlendedMegatronDatasetBuilder as Megatron-LM builds it, with the recipe's
    seed, sequence, NullTokenizer and mask switches (``source``: where the tokens come from); the
    attention mask made only where it is reset, as the causal one megatron's attention makes itself
    otherwise."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    d = recipe.data
    config = GPTDatasetConfig(random_seed=d.seed, sequence_length=d.seq_length,
                              tokenizer=compat.null_tokenizer(d.vocab_size), reset_position_ids=d.reset_position_ids,
                              reset_attention_mask=d.reset_attention_mask, eod_mask_loss=d.eod_mask_loss,
                              create_attention_mask=d.reset_attention_mask, **source)
    train = BlendedMegatronDatasetBuilder(dataset_class, [recipe.train.iterations * d.global_batch_size, 0, 0],
                                          lambda: True, config).build()[0]

    def sample(index: int) -> Sample:
        item = train[index]
        mask = item.get("attention_mask")
        return Sample(torch.as_tensor(item["tokens"]).long(), torch.as_tensor(item["labels"]).long(),
                      torch.as_tensor(item["loss_mask"]).float(), torch.as_tensor(item["position_ids"]).long(),
                      None if mask is None else torch.as_tensor(mask))

    return sample


# real text as megatron's preprocessing writes it, with the smallest tokenizer that needs no training:
# UTF-8 bytes, and the end-of-document token after them (NullTokenizer's last, as eod_token says)
BYTE_VOCAB = 257


def write_documents(prefix: str, documents: Iterable[torch.Tensor]) -> str:
    """A megatron indexed dataset (``PREFIX.bin``/``.idx``) of ``documents`` (token ids, one tensor a
    document), written with megatron-core's IndexedDatasetBuilder. Returns the prefix."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for ids in documents:
        builder.add_document(ids.to(torch.int32), [ids.numel()])
    builder.finalize(prefix + ".idx")
    return prefix


def write_text_dataset(text_path: str, prefix: str) -> str:
    """An indexed dataset of a text file, as ``tools/preprocess_data.py --append-eod`` writes one:
    each paragraph (blank-line separated) a document of its UTF-8 bytes and the end-of-document
    token. Read with ``data: {source: megatron_indexed, path: PREFIX, vocab_size: 257}``."""
    with open(text_path, encoding="utf-8") as f:
        paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    return write_documents(prefix, (torch.tensor(list(text.encode("utf-8")) + [eod_token(BYTE_VOCAB)])
                                    for text in paragraphs))


def indexed_path(recipe: Recipe) -> str:
    """The recipe's indexed dataset prefix, relative to the recipe's directory unless absolute."""
    path = os.path.expanduser(recipe.data.path)
    if os.path.isabs(path) or not os.path.isfile(recipe.source):
        return os.path.abspath(path)
    return os.path.join(os.path.dirname(os.path.abspath(recipe.source)), path)


def _megatron_indexed(recipe: Recipe) -> Callable[[int], Sample]:
    """megatron-core's GPTDataset over an indexed dataset, as Megatron-LM's pretrain_gpt.py builds it
    for ``--data-path PREFIX --split 100,0,0``: the train split of ``iterations × global_batch_size``
    samples, documents shuffled and packed by megatron's own indices (built once, cached beside the
    data), masks and positions by the recipe's switches."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    prefix = indexed_path(recipe)
    if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        raise RecipeError(f"{recipe.source}: data: 'path' {prefix} has no {prefix}.bin and {prefix}.idx (an "
                          f"indexed dataset: ttrace_megatron.adapter.recipe.data.write_text_dataset writes one)")
    return _megatron_dataset(recipe, GPTDataset, blend=([prefix], None), split="100,0,0")


def source_signature(recipe: Recipe) -> str:
    """What the model signature says of the data: the source, and an indexed dataset's prefix as
    Megatron-LM's arguments name it (``megatron_lm.api.training_signature``), so that a trace of
    ttrace's runner and one of Megatron-LM's loop over the same files agree."""
    if recipe.data.source == MEGATRON_INDEXED:
        return "megatron_data:" + indexed_path(recipe)
    return recipe.data.source or SYNTHETIC


def sampler(recipe: Recipe) -> Callable[[int], Sample]:
    """Sample ``index`` of the run (the same on every rank)."""
    if recipe.data.source == MEGATRON_MOCK:
        return _megatron_mock(recipe)
    if recipe.data.source == MEGATRON_INDEXED:
        return _megatron_indexed(recipe)
    return _synthetic(recipe)


def microbatches(recipe: Recipe, samples: Callable[[int], Sample], iteration: int, dp_rank: int,
                 dp_size: int) -> Iterator[Tuple[int, Sample]]:
    """This DP rank's ``(j, microbatch)`` of one iteration (0-based), in megatron's data order: the
    samples stacked (the attention mask [b, 1, s, s], as megatron's collate makes it)."""
    d = recipe.data
    per_rank = d.global_batch_size // (d.micro_batch_size * dp_size)
    for j in range(per_rank):
        first = iteration * d.global_batch_size + (j * dp_size + dp_rank) * d.micro_batch_size
        rows = [samples(first + s) for s in range(d.micro_batch_size)]
        yield j, Sample(*(None if rows[0][i] is None else torch.stack([row[i] for row in rows]).contiguous()
                          for i in range(len(Sample._fields))))
