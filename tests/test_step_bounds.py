"""The step's scalars (step_bounds) and the grad norm's fp64 twin (adapter recorder): the pieces of
the derivation in docs/tolerance.md, "The grad norm and what the clip coefficient scales"."""

import math

import pytest
import torch

from ttrace_megatron import keys
from ttrace_megatron.adapter.record.recorder import _GradNormTwin
from ttrace_megatron.keys import TensorKey
from ttrace_megatron.step_bounds import StepBounds
from ttrace_megatron.tolerance import ToleranceConfig

EPS32 = torch.finfo(torch.float32).eps
RUN = {"parameters": [{"param": f"p{i}", "numel": 1000, "requires_grad": True} for i in range(2)],
       "update_rule": {"kind": "adam", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}}


def _key(tensor, iteration=1, module=keys.OPTIMIZER_MODULE, phase=keys.OPTIMIZER):
    return TensorKey(iteration, -1, module, phase, tensor)


def _main_grad(i, iteration=1):
    return _key(keys.main_grad("weight"), iteration, module=f"m{i}", phase=keys.MAIN_GRAD)


def test_the_twin_is_judged_by_the_grads_difference_and_the_norm_by_its_measured_roundoff_too():
    b = StepBounds(RUN, num_layers=2, tol_config=ToleranceConfig())
    # two main grads of norms 3 and 4 (total 5), differing by 0.3 ε and 0.4 ε of themselves
    b.note(_main_grad(0), 0.3 * EPS32, 3.0)
    b.note(_main_grad(1), 0.4 * EPS32, 4.0)
    grads = math.sqrt((0.9 * EPS32) ** 2 + (1.6 * EPS32) ** 2) / 5.0
    twin = b.bound(_key(keys.GRAD_NORM_FP64), "float32", 1024, 5.0, 0.0, 0.0)
    assert twin.tolerance_eps == pytest.approx(grads / EPS32, rel=1e-3)
    norm = b.bound(_key(keys.GRAD_NORM), "float32", 1024, 5.0, 100 * EPS32 * 5.0, -50 * EPS32 * 5.0)
    assert norm.tolerance_eps == pytest.approx(grads / EPS32 + 150, rel=1e-3)
    assert "own round-off measured" in norm.source
    clip = b.bound(_key(keys.CLIP_COEFFICIENT), "float32", 1024, 0.2, 0.0, 0.0)
    assert clip.tolerance_eps == norm.tolerance_eps


def test_without_every_main_grad_the_largest_analytic_bound_stands_in():
    b = StepBounds(RUN, num_layers=2, tol_config=ToleranceConfig())
    b.note(_main_grad(0), 0.0, 3.0)  # one of the two parameters compared
    twin = b.bound(_key(keys.GRAD_NORM_FP64), "float32", 1024, 5.0, 0.0, 0.0)
    assert "1 of 2 main grads compared" in twin.source and twin.tolerance_eps > 100


def test_a_norm_without_measured_roundoff_keeps_the_analytic_bound():
    b = StepBounds(RUN, num_layers=2, tol_config=ToleranceConfig())
    assert b.bound(_key(keys.GRAD_NORM), "float32", 1024, 5.0, 0.0, 0.0) is None
    assert b.bound(_key(keys.STEP_COUNT), "float32", 1024, 5.0, 0.0, 0.0) is None


def test_moments_carry_the_clip_error_and_the_new_terms_cancellation():
    b = StepBounds(RUN, num_layers=2, tol_config=ToleranceConfig())
    b.note(_key(keys.CLIP_COEFFICIENT, 2), 30 * EPS32, 0.5)
    m = _key(keys.optimizer_state("weight", keys.EXP_AVG), 2, module="m0")
    v = _key(keys.optimizer_state("weight", keys.EXP_AVG_SQ), 2, module="m0")
    assert [t for t, _ in b.added(m)] == [30 * EPS32]
    assert [t for t, _ in b.added(v)] == [60 * EPS32]  # the second moment sums squares
    assert b.carried(m, 2.0) == 1.0  # the previous moment was not judged
    b.note(_key(keys.optimizer_state("weight", keys.EXP_AVG), 1, module="m0"), 0.0, 4.0)
    assert b.carried(m, 2.0) == pytest.approx((2.0 + 0.9 * 4.0) / 2.0)
    assert b.carried(v, 2.0) == 1.0


def test_twin_explains_one_call_and_a_chained_optimizers_root_sum_square():
    one = _GradNormTwin()
    one.calls = [(5.0, 5.001)]
    assert one.explain(5.0) == (5.001, pytest.approx(0.001))
    chained = _GradNormTwin()
    chained.calls = [(3.0, 3.001), (4.0, 3.999), (3.0, 3.001)]  # a third call the step did not combine
    twin, roundoff = chained.explain(math.sqrt(3.0 ** 2 + 4.0 ** 2))
    assert twin == pytest.approx(math.sqrt(3.001 ** 2 + 3.999 ** 2))
    assert roundoff == pytest.approx(0.003)  # every call's round-off counts: a sound bound
    assert chained.explain(7.5) == (None, pytest.approx(0.003))  # no combination reproduces it


def test_the_twin_squares_a_grad_larger_than_its_host_piece_whole(monkeypatch):
    """On a host the twin squares a grad in pieces of NORM_PIECE_HOST elements (a buffer that stays
    in cache): every piece, the last partial one included, counts, to fp64 round-off."""
    from ttrace_megatron.adapter.record.recorder import NORM_PIECE_HOST

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)  # one rank
    torch.manual_seed(0)
    grads = [torch.randn(3 * NORM_PIECE_HOST + 5), torch.randn(7)]
    twin = _GradNormTwin()
    twin.observe(grads, 2.0, None, torch.tensor(1.0))
    exact = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    # fp64 sums of ~800k squares in two orders: ~1e-14 apart (a piece left out: ~1e-1; fp32: ~1e-7)
    assert twin.calls[0] == (1.0, pytest.approx(exact, rel=1e-12))


def test_terms_come_from_the_calls_that_make_the_steps_norm():
    """A ChainedOptimizer's norm is √Σ over its parts' calls; a later call (a part clipping by its own
    norm) is not counted again. A parameter this rank did not count takes the axes of its kind's call."""
    dense, expert, replica = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    twin = _GradNormTwin()
    twin.calls = [(3.0, 3.0), (4.0, 4.0), (3.0, 3.0)]
    twin.call_terms = [({dense: 9.0}, ("tp", "pp"), False), ({expert: 16.0}, ("etp", "pp"), True),
                       ({dense: 9.0}, ("tp", "pp"), False)]
    terms, axes_of = twin.terms_of(5.0)
    assert terms == {dense: 9.0, expert: 16.0}
    assert axes_of(replica, False) == ("tp", "pp") and axes_of(replica, True) == ("etp", "pp")
    terms, _ = twin.terms_of(7.5)  # no combination reproduces it: every call
    assert terms[dense] == 18.0


@pytest.mark.parametrize("decoupled", [True, False])
def test_reclipping_the_reference_takes_the_coefficients_difference_out_of_adams_moments(decoupled):
    """Two AdamW (or Adam with coupled weight decay) steps from the same state on the same grads,
    clipped by coefficients 0.3 % apart: re-clipped, the reference's first moment (and with decoupled
    weight decay its second) equals the candidate's to fp32 round-off; unclipped it differs by the
    coefficients' difference."""
    from ttrace_megatron.step_bounds import reclip_delta, reclippable

    torch.manual_seed(0)
    rule = {"kind": "adam", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "decoupled_weight_decay": decoupled}
    p0, g = torch.randn(4096), torch.randn(4096)
    states = {}
    for side, clip in (("ref", 0.5), ("cand", 0.5 * (1 + 3e-3))):
        p = torch.nn.Parameter(p0.clone())
        opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([p], lr=1e-3, weight_decay=0.01)
        p.grad = torch.ones_like(g)  # a first step to give the moments a history, as in iteration 2
        opt.step()
        p.grad = clip * g
        opt.step()
        states[side] = opt.state[p]
    for state in ("exp_avg", "exp_avg_sq"):
        ref, cand = states["ref"][state], states["cand"][state]
        before = float((cand - ref).norm() / ref.norm())
        if not reclippable(state, rule):
            assert state == "exp_avg_sq" and not decoupled
            continue
        fixed = ref.double() + reclip_delta(state, rule, g, 0.5 * (1 + 3e-3), 0.5)
        after = float((cand.double() - fixed).norm() / fixed.norm())
        assert before > 1e-4 and after < 4 * EPS32, (state, before, after)


def test_a_parameters_term_of_the_norm_is_judged_by_its_own_main_grads_error():
    """|‖g_c‖² − ‖g_r‖²| ≤ (2 + e)·e·‖g_r‖² with e the main grad's measured relative error (+ u32)."""
    b = StepBounds(RUN, num_layers=2, tol_config=ToleranceConfig())
    b.note(_main_grad(0), 3 * EPS32, 3.0)
    term = b.bound(_key(keys.grad_norm_term("weight"), module="m0"), "float32", 1024, 9.0, 0.0, 0.0)
    e = 3 * EPS32 + 2.0 ** -24
    assert term.tolerance_eps == pytest.approx((2 + e) * e / EPS32, rel=1e-3)
    assert "measured error" in term.source
    # a main grad not compared: its largest analytic bound stands in
    other = b.bound(_key(keys.grad_norm_term("weight"), module="m1"), "float32", 1024, 9.0, 0.0, 0.0)
    assert "not compared" in other.source and other.tolerance_eps > term.tolerance_eps
    # a parameter counted twice is off by 100 % of its term: far outside, whatever the model's size
    assert 1.0 / EPS32 > 1e5 * term.tolerance_eps


def test_a_term_adds_up_over_the_axes_its_norm_reduced_over_and_is_a_replica_elsewhere():
    from ttrace_megatron.adapter.record.layouts import grad_norm_term_layout
    from ttrace_megatron.placement import Layout, Partial, RangeShard, Replicate, Shard

    main = Layout((Replicate("dp"), Shard(0, "tp")), (8, 4), scale=4.0)
    term = grad_norm_term_layout(main, ("tp", "pp"))  # megatron's model-parallel group: DP replicas
    assert term.placements == (Replicate("dp"), Partial("tp")) and term.logical_shape == (1,) and term.scale == 1.0
    distopt = Layout((Replicate("tp"), RangeShard("dp", (0, 10, 32), (8, 4))), (8, 4))
    assert grad_norm_term_layout(distopt, ("tp", "dp", "pp")).placements == (Partial("tp"), Partial("dp"))
    assert keys.kind_of(keys.OPTIMIZER, keys.grad_norm_term("weight")) is keys.TensorKind.GRAD_NORM_TERM
    assert keys.param_name_of(keys.grad_norm_term("bias")) == "bias"
