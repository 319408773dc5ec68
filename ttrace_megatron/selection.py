"""Judging a top-k choice (an MoE router's) by the scores it was taken on.

A choice is discrete: two correct runs whose scores differ by round-off choose differently where a
token's k-th and (k+1)-th scores are nearly tied, and a relative error of the 0/1 map says nothing
about whether that is round-off or a bug. What does: whether each side's choice is the top k of
its own scores. If both are, then on a token where the reference chose expert ``a`` and the
candidate ``b`` instead,

    r[a] - r[b] <= (r[a] - c[a]) + (c[b] - r[b]) <= |r[a] - c[a]| + |r[b] - c[b]|

(c[b] >= c[a] since the candidate chose b), so the reference's margin is covered by the scores'
own differences, and those are judged under their own tolerance as a separate tensor. The ratio
of margin to differences (``worst_ratio``, at most 1 for a consistent pair) says how near the tie
was. A choice that is not the top k of its own scores — a wrong k, the lowest experts, indices
shifted by an expert offset — fails, whatever the scores.

Knows nothing about megatron.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch


@dataclasses.dataclass
class ChoiceVerdict:
    tokens: int
    flipped: int  # tokens whose chosen set differs from the reference's
    worst_ratio: float  # the largest reference margin / score differences over flipped tokens
    worst_token: int
    problem: str = ""  # why the choice fails: empty when it is explained by its scores


def inconsistent_rows(choice: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Rows whose chosen entries are not the top of the row: some chosen score is below some
    score not chosen (ties are consistent either way)."""
    chosen = choice > 0.5
    lowest_chosen = torch.where(chosen, scores, torch.full_like(scores, float("inf"))).amin(dim=1)
    highest_other = torch.where(chosen, torch.full_like(scores, float("-inf")), scores).amax(dim=1)
    return (lowest_chosen < highest_other).nonzero().squeeze(1)


def judge_topk_choice(cand_choice: torch.Tensor, ref_choice: torch.Tensor, cand_scores: torch.Tensor,
                      ref_scores: torch.Tensor) -> ChoiceVerdict:
    """``*_choice``: [rows, n] 0/1 maps, a top k of each row; ``*_scores``: [rows, n], what each side
    chose from. (The messages call a row a token: transpose a choice taken along the first axis.)"""
    c_choice, r_choice = cand_choice.double().reshape(-1, cand_choice.shape[-1]), ref_choice.double().reshape(
        -1, ref_choice.shape[-1])
    c, r = cand_scores.double().reshape(c_choice.shape), ref_scores.double().reshape(r_choice.shape)
    tokens = c_choice.shape[0]
    counts_c, counts_r = c_choice.sum(dim=1), r_choice.sum(dim=1)
    wrong_k = (counts_c != counts_r).nonzero().squeeze(1)
    problem = ""
    if wrong_k.numel():
        t = int(wrong_k[0])
        problem = (f"the candidate chose {int(counts_c[t])} entries where the reference chose {int(counts_r[t])} "
                   f"on {wrong_k.numel()} of {tokens} tokens (first: token {t})")
    else:
        for side, choice, scores in (("candidate", c_choice, c), ("reference", r_choice, r)):
            bad = inconsistent_rows(choice, scores)
            if bad.numel():
                problem = (f"the {side}'s choice is not the top {int(counts_r[int(bad[0])])} of its own scores on "
                           f"{bad.numel()} of {tokens} tokens (first: token {int(bad[0])})")
                break
    flipped_rows = (c_choice != r_choice).any(dim=1).nonzero().squeeze(1)
    worst, worst_token = 0.0, -1
    if not problem and flipped_rows.numel():
        # per flipped token: the reference's margin between what it chose and the candidate did not
        # (min over its lost picks) and what the candidate chose instead (max over its new picks)
        rc, cc = r_choice[flipped_rows] > 0.5, c_choice[flipped_rows] > 0.5
        rr, cr = r[flipped_rows], c[flipped_rows]
        lost, gained = rc & ~cc, cc & ~rc
        inf = torch.full_like(rr, float("inf"))
        margin = torch.where(lost, rr, inf).amin(dim=1) - torch.where(gained, rr, -inf).amax(dim=1)
        diff = (rr - cr).abs()
        explained = torch.where(lost, diff, -inf).amax(dim=1) + torch.where(gained, diff, -inf).amax(dim=1)
        ratio = torch.where(explained > 0, margin.clamp(min=0) / explained,
                            torch.where(margin > 0, inf[:, 0], torch.zeros_like(margin)))
        i = int(ratio.argmax())
        worst, worst_token = float(ratio[i]), int(flipped_rows[i])
    return ChoiceVerdict(tokens, int(flipped_rows.numel()), worst, worst_token, problem)


def judge_along(cand_choice: torch.Tensor, ref_choice: torch.Tensor, cand_scores: torch.Tensor,
                ref_scores: torch.Tensor, axis: int) -> Tuple[ChoiceVerdict, str]:
    """:func:`judge_topk_choice` of [tokens, n] maps whose top k is taken along ``axis``: 1, each
    token's (its rows are tokens); 0, each column's (the columns are judged as rows). Returns the
    verdict and what one of its rows is, for :func:`describe`."""
    if axis == 0:
        return judge_topk_choice(cand_choice.t(), ref_choice.t(), cand_scores.t(), ref_scores.t()), "column"
    return judge_topk_choice(cand_choice, ref_choice, cand_scores, ref_scores), "token"


def describe(v: ChoiceVerdict, row: str = "token", where: str = "") -> Optional[str]:
    """``row``: what one row of the choice is (a token choosing experts, an expert choosing tokens);
    ``where``: whose rows ``worst_token`` counts (one rank's piece, when the pieces were judged apart)."""
    if v.problem:
        return v.problem
    if not v.flipped:
        return f"the same top-k choice on every {row}"
    return (f"{v.flipped} of {v.tokens} {row}s chose differently, each the top k of its own scores: near-ties "
            f"the scores' differences explain (worst: {row} {v.worst_token}{where}, its margin {v.worst_ratio:.3g}× "
            f"those differences)")
