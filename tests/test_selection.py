"""The top-k choice judge (``selection``): near-ties that round-off flips pass, a choice that is not
the top k of its own scores fails, whatever the scores."""

import torch

from ttrace_megatron.selection import describe, inconsistent_rows, judge_topk_choice


def _choice(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.zeros_like(scores).scatter(1, scores.topk(k, dim=1).indices, 1.0)


def _scores(seed: int, tokens: int = 256, experts: int = 8) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_same_choice_passes_with_no_flip():
    r = _scores(0)
    v = judge_topk_choice(_choice(r, 2), _choice(r, 2), r, r)
    assert not v.problem and v.flipped == 0 and v.worst_ratio == 0.0
    assert describe(v) == "the same top-k choice on every token"


def test_roundoff_flips_at_near_ties_pass_and_stay_within_the_bound():
    r = _scores(1, tokens=4096).float()
    # bf16 round-off of the same fp32 scores: near-ties flip, nothing else
    c = r.to(torch.bfloat16).float() + 1e-3 * _scores(2, tokens=4096).float()
    v = judge_topk_choice(_choice(c, 2), _choice(r, 2), c, r)
    assert v.flipped > 0, "the test needs near-ties that flip"
    assert not v.problem and 0.0 <= v.worst_ratio <= 1.0


def test_exact_tie_broken_the_other_way_passes():
    r = torch.tensor([[1.0, 0.5, 0.5, 0.1]])
    ref = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    cand = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    v = judge_topk_choice(cand, ref, r, r)
    assert not v.problem and v.flipped == 1 and v.worst_ratio == 0.0


def test_choice_that_skips_the_best_fails():
    r = _scores(3)
    skips_best = torch.zeros_like(r).scatter(1, r.topk(3, dim=1).indices[:, 1:], 1.0)
    v = judge_topk_choice(skips_best, _choice(r, 2), r, r)
    assert "not the top 2 of its own scores" in v.problem and "candidate" in v.problem


def test_wrong_k_fails():
    r = _scores(4)
    v = judge_topk_choice(_choice(r, 3), _choice(r, 2), r, r)
    assert "chose 3 entries where the reference chose 2" in v.problem


def test_flip_with_a_large_margin_is_not_explained_by_consistent_scores():
    # the candidate's scores are wrong (judged on their own), yet its choice is its own top k: the
    # choice passes and the margin ratio stays <= 1 — the scores' tensor carries the failure
    r = torch.tensor([[3.0, 2.0, 0.0, -1.0]])
    c = torch.tensor([[3.0, -5.0, 4.0, -1.0]])
    v = judge_topk_choice(_choice(c, 2), _choice(r, 2), c, r)
    assert not v.problem and v.flipped == 1 and v.worst_ratio <= 1.0


def test_inconsistent_rows_allows_ties():
    scores = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    choice = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert inconsistent_rows(choice, scores).tolist() == [1]
