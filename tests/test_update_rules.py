"""The element-wise Adam update check (update_rules.py) against real torch AdamW steps.

Two correct runs: torch's AdamW in fp32 steps the same parameters and state with grads that differ
by round-off (and, for elements whose exact grad is 0, by their sign). The check must accept every
element, over many draws and steps, in fp32 and with bf16 model copies; and it must reject steps
that applied another lr, weight decay on the wrong tensor, moments it did not record, or a stale
parameter.
"""

import dataclasses

import pytest
import torch

from ttrace_megatron import update_rules
from ttrace_megatron.update_rules import AdamRule, judge_adam_update

RULE = AdamRule(beta1=0.9, beta2=0.999, eps=1e-8)


def _step(p0, state, grad, lr, wd, steps_before):
    """One torch AdamW step in fp32 from (p0, state); returns (p', exp_avg, exp_avg_sq)."""
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=(RULE.beta1, RULE.beta2), eps=RULE.eps, weight_decay=wd)
    if state is not None:
        opt.state[p] = {"step": torch.tensor(float(steps_before)), "exp_avg": state[0].clone(),
                        "exp_avg_sq": state[1].clone()}
    p.grad = grad.clone()
    opt.step()
    s = opt.state[p]
    return p.detach().clone(), s["exp_avg"].clone(), s["exp_avg_sq"].clone()


def _pair(seed, n=4096, steps_before=0, lr=1e-3, wd=0.01, rel_noise=1e-6):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 1e-2
    grad[: n // 8] = torch.randn(n // 8, generator=g) * 1e-9  # exact grad 0: round-off of either sign
    state = None
    if steps_before:
        state = (torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-4)
    noise = grad.abs().max() * rel_noise * torch.randn(n, generator=g)
    ref = _step(p0, state, grad, lr, wd, steps_before)
    cand = _step(p0, state, grad + noise, lr, wd, steps_before)
    return p0, state, grad, noise, ref, cand


@pytest.mark.parametrize("steps_before", [0, 1, 5])
def test_correct_steps_pass_element_by_element(steps_before):
    worst = 0.0
    for seed in range(20):
        _, _, _, _, ref, cand = _pair(seed, steps_before=steps_before)
        v = judge_adam_update(RULE, 1e-3, steps_before + 1, "float32", cand[0], ref[0], cand[1:], ref[1:])
        worst = max(worst, v.worst_ratio)
        if steps_before == 0:  # the first step is ≈ lr·sign(g): the zero-grad elements flip by 2·lr
            assert (cand[0] - ref[0]).abs().max() > 1e-3
    assert worst <= 1.0, worst


def test_bf16_model_copies_pass():
    for seed in range(20):
        _, _, _, _, ref, cand = _pair(seed, steps_before=2)
        v = judge_adam_update(RULE, 1e-3, 3, "bfloat16", cand[0].bfloat16(), ref[0].bfloat16(), cand[1:], ref[1:])
        assert v.worst_ratio <= 1.0, (seed, v)


def test_wrong_steps_fail():
    p0, state, grad, noise, ref, _ = _pair(0, steps_before=2)
    other_lr = _step(p0, state, grad + noise, 1.01e-3, 0.01, 2)
    no_decay = _step(p0, state, grad + noise, 1e-3, 0.0, 2)
    for cand in (other_lr, no_decay):
        v = judge_adam_update(RULE, 1e-3, 3, "float32", cand[0], ref[0], cand[1:], ref[1:])
        assert v.worst_ratio > 10, v
    # moments that do not belong to the update (a step taken with other grads than recorded)
    swapped = _step(p0, state, grad.flip(0), 1e-3, 0.01, 2)
    v = judge_adam_update(RULE, 1e-3, 3, "float32", swapped[0], ref[0], ref[1:], ref[1:])
    assert v.worst_ratio > 10
    # a stale parameter: the update never reached it
    v = judge_adam_update(RULE, 1e-3, 3, "float32", p0, ref[0], ref[1:], ref[1:])
    assert v.worst_ratio > 10


@pytest.mark.parametrize("nan", [False, True])
def test_chunked_verdict_is_the_whole_tensors(monkeypatch, nan):
    """Judged a chunk at a time, the worst element is the one an argmax over the whole tensor
    picks: the first of the largest ratio where it ties in a later chunk, a NaN before any number
    (the first NaN where there are several)."""
    p0, state, grad, noise, ref, _ = _pair(0, steps_before=2)
    cand = [t.clone() for t in _step(p0, state, grad + noise, 1.01e-3, 0.01, 2)]  # another lr: large ratios
    n = cand[0].numel()
    whole = judge_adam_update(RULE, 1e-3, 3, "float32", cand[0], ref[0], cand[1:], ref[1:])
    last = n - 1 - whole.worst_index % 256  # a later chunk, its element at another offset
    twin = [r.clone() for r in ref]
    for c, r in zip(cand, twin):  # the worst element's values again: the same ratio, bit for bit
        c[last], r[last] = c[whole.worst_index], r[whole.worst_index]
    if nan:
        for at in (n - 300, n - 3):
            cand[0][at] = float("nan")
    wanted = judge_adam_update(RULE, 1e-3, 3, "float32", cand[0], twin[0], cand[1:], twin[1:])
    assert wanted.worst_index == (n - 300 if nan else whole.worst_index)
    monkeypatch.setattr(update_rules, "UPDATE_CHUNK", 256)
    chunked = judge_adam_update(RULE, 1e-3, 3, "float32", cand[0], twin[0], cand[1:], twin[1:])
    assert dataclasses.astuple(chunked) == pytest.approx(dataclasses.astuple(wanted), nan_ok=True, rel=0, abs=0)
    assert chunked.worst_index == wanted.worst_index
