"""MoE routing: each router's top-k choice recorded, and followed from the reference when asked.

A router picks each token's top-k experts from its scores. Two correct runs compute those scores
with different round-off, so a token whose k-th and (k+1)-th scores are within round-off of each
other (a near-tie) may go to another expert in the candidate. Nothing is wrong, yet from there the
two runs disagree by a whole expert's output on that token: every later tensor of the layer, and
every later layer, differs by far more than round-off (bf16 makes near-ties common).

So the choice is judged on its own, and not by what follows from it:

* every router's scores (what the top-k is taken on) and its choice (a 0/1 map over tokens ×
  experts) are recorded per microbatch (``keys.TOPK_SCORES``, ``keys.TOPK_CHOICE``); the
  comparison (``selection.judge_topk_choice``) accepts a different choice only where each side's
  choice is the top k of its own scores — the flip is then explained by the scores' differences,
  which are judged under their own tolerance — and fails a choice that is not;
* when the candidate runs in lock-step (or is a localization replay), it *follows* the
  reference's choice: on each token where its own choice differs, the reference's experts are
  taken, weighted by the candidate's own scores. Everything after the router then sees the tokens
  the reference saw. Tokens whose choice agrees keep the candidate's own indices, in its own order:
  with no flip, the run is bitwise the run without following.

With a capacity factor and megatron's default drop policy (``probs``), each expert then keeps the
tokens with its highest routing probabilities up to its capacity: a second top-k, over the tokens of
each expert's column, with near-ties of its own. It is recorded (``keys.CAPACITY_SCORES``, the
probabilities the drop is taken on; ``keys.CAPACITY_CHOICE``, the capacity mask), judged by the same
rule along that axis, and followed the same way: where the candidate's mask differs, the
reference's is applied to the candidate's own probabilities. (The ``position`` policy keeps the
first tokens routed to each expert: nothing round-off can flip once the top-k choice agrees.)
The load-balancing losses count the tokens per expert by a top-k of their own (of the normalized
scores, without the expert bias): a flip there moves one token's count to another expert, and the
loss's grad on every token's score for both. It is recorded (``keys.BALANCING_SCORES``,
``keys.BALANCING_CHOICE``), judged and followed the same way.

The tap sits in megatron's own hook for this, the router's ``router_replay`` slot, which
``topk_routing_with_score_function`` consults around its top-k (megatron-core ≥ 0.16). It always
calls megatron's top-k first; a ``RouterReplay`` the user installed runs inside it, unchanged.
Routing it cannot see — sinkhorn, the fused TE kernel, group-limited top-k (not a plain top k of
the scores) — is listed in the run's ``not_recorded`` by :func:`unobserved_routing`.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ... import keys
from .layouts import Site, is_router
from ..recipe.naming import canonical_module_names


QUANTILE_BALANCING = "quantile_balancing"  # megatron-core 0.19's routing by a per-expert bias (qb_beta)


def unobserved_routing(config) -> Optional[str]:
    """Why the routers' choices of this model cannot be recorded, or None when they can."""
    if getattr(config, "num_moe_experts", None) is None:
        return None
    balancing = getattr(config, "moe_router_load_balancing_type", "")
    balancing = balancing if isinstance(balancing, list) else [balancing]
    if "sinkhorn" in balancing:
        return "moe_router_load_balancing_type=sinkhorn routes outside megatron's top-k hook"
    if QUANTILE_BALANCING in balancing and not callable(getattr(_router_module(), TOPK_FUNCTION, None)):
        return (f"moe_router_load_balancing_type={QUANTILE_BALANCING} picks each token's experts from its scores "
                f"minus a per-expert bias and hands them to megatron's {TOPK_FUNCTION}, which this megatron-core's "
                f"router module does not have")
    if getattr(config, "moe_router_fusion", False):
        return "moe_router_fusion: TE's fused top-k kernel has no hook"
    if getattr(config, "moe_router_group_topk", None):
        return "moe_router_group_topk: a group-limited choice is not the top k of the scores"
    module = _router_module()
    missing = [f"{field} needs megatron's router.{function}, which this megatron-core does not have"
               for field, function, needed in (
                   ("moe_expert_capacity_factor with moe_token_drop_policy=probs", TOKEN_DROPPING,
                    drops_by_probs(config)),
                   ("the load-balancing loss", BALANCING_MAP, balances_load(config)))
               if needed and not callable(getattr(module, function, None))]
    return "; ".join(missing) or None


# megatron's functions ``Router.routing`` calls after its top-k (megatron-core 0.16 looks them up in
# its router module): the capacity drop, and the routing map the load-balancing loss counts
TOKEN_DROPPING = "apply_router_token_dropping"
BALANCING_MAP = "compute_routing_scores_for_aux_loss"
# and the top-k function quantile balancing (0.19) hands its own choice to as ``precomputed_indices``,
# past the ``router_replay`` hook: the choice is taken there
TOPK_FUNCTION = "topk_routing_with_score_function"


def balances_by_quantile(config) -> bool:
    """Whether the router picks experts by quantile balancing: top-k of the scores minus ``qb_beta``,
    a per-expert bias megatron updates once a global batch (an EMA of the scores' column quantiles,
    averaged over DP, ``finalize_model_grads._update_router_qb_beta``)."""
    kinds = getattr(config, "moe_router_load_balancing_type", "none")
    return QUANTILE_BALANCING in (kinds if isinstance(kinds, list) else [kinds])


def drops_by_probs(config) -> bool:
    """Whether the router drops tokens at capacity by their probabilities (a choice round-off can flip)."""
    return (getattr(config, "moe_expert_capacity_factor", None) is not None
            and getattr(config, "moe_token_drop_policy", "probs") == "probs")


def balances_load(config) -> bool:
    """Whether a load-balancing loss counts the tokens per expert (its own top-k of the scores)."""
    kinds = getattr(config, "moe_router_load_balancing_type", "none")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return any(k in ("aux_loss", "seq_aux_loss", "global_aux_loss") for k in kinds)


def _router_module():
    from megatron.core.transformer.moe import router

    return router


class _RouterFunctionHooks:
    """Wraps megatron's token-dropping and load-balancing-map functions in its router module while
    a tap needs them: the tap whose router is routing now (``active``, pushed around
    ``Router.routing``) sees each selection and may replace it. Installed once for all taps, removed
    with the last; with no active tap they are megatron's functions, unchanged."""

    def __init__(self):
        self.module = _router_module()
        self.originals = {name: getattr(self.module, name) for name in (TOKEN_DROPPING, BALANCING_MAP, TOPK_FUNCTION)
                          if callable(getattr(self.module, name, None))}
        self.wrappers = {TOKEN_DROPPING: self.token_dropping, BALANCING_MAP: self.balancing_map,
                         TOPK_FUNCTION: self.precomputed_topk}
        self.active: List["RoutingTap"] = []
        self.users = 0
        for name in self.originals:
            setattr(self.module, name, self.wrappers[name])

    def token_dropping(self, routing_probs, routing_map, router_topk, capacity_factor, drop_policy="probs",
                       pad_to_capacity=False):
        original = self.originals[TOKEN_DROPPING]
        out = original(routing_probs, routing_map, router_topk, capacity_factor, drop_policy, pad_to_capacity)
        if not self.active or drop_policy != "probs":
            return out

        def capacity_mask():
            if pad_to_capacity:
                return out[1]
            # the mask before it is and-ed with the routing map: megatron's own selection, asked for
            # once more padded to capacity (then its map is the mask), on detached inputs
            with torch.no_grad():
                return original(routing_probs.detach(), routing_map, router_topk, capacity_factor, drop_policy,
                                True)[1]

        mask = self.active[-1].selection(keys.CAPACITY_CHOICE, routing_probs, capacity_mask)
        if mask is None:
            return out
        final_map = mask if pad_to_capacity else torch.logical_and(routing_map, mask)
        return routing_probs * final_map, final_map

    def precomputed_topk(self, logits, topk, *args, precomputed_indices=None, **kwargs):
        """megatron's top-k routing; a choice made before it (quantile balancing's, handed in as
        ``precomputed_indices``) goes through the active tap as megatron's own top-k does through
        ``router_replay``: recorded with the scores it is the top k of (the logits minus ``qb_beta``),
        and the reference's taken where the candidate follows and differs."""
        original = self.originals[TOPK_FUNCTION]
        if precomputed_indices is None or not self.active:  # megatron's call as it was (0.16 has no such argument)
            extra = {} if precomputed_indices is None else {"precomputed_indices": precomputed_indices}
            return original(logits, topk, *args, **kwargs, **extra)
        # megatron consults no RouterReplay on this path, and neither does the tap: observed, not replayed
        scores = logits.detach().float() - self.active[-1].router.qb_beta
        _, indices = self.active[-1].observe(scores, topk, scores.gather(1, precomputed_indices), precomputed_indices)
        return original(logits, topk, *args, precomputed_indices=indices, **kwargs)

    def balancing_map(self, logits, topk, score_function, *args, **kwargs):
        routing_map, scores = self.originals[BALANCING_MAP](logits, topk, score_function, *args, **kwargs)
        if not self.active:
            return routing_map, scores
        followed = self.active[-1].selection(keys.BALANCING_CHOICE, scores, lambda: routing_map)
        return (routing_map if followed is None else followed), scores

    def remove(self) -> None:
        self.users -= 1
        if self.users > 0:
            return
        for name, original in self.originals.items():
            if getattr(self.module, name) is self.wrappers[name]:
                setattr(self.module, name, original)
        global _HOOKS
        _HOOKS = None


_HOOKS: Optional[_RouterFunctionHooks] = None


def _router_function_hooks() -> _RouterFunctionHooks:
    global _HOOKS
    if _HOOKS is None:
        _HOOKS = _RouterFunctionHooks()
    _HOOKS.users += 1
    return _HOOKS


class RoutingTap:
    """One router's top-k hook (megatron's ``router_replay`` slot). ``follow`` is set by the
    lock-step and the replay: the reference's values, sliced to this rank."""

    def __init__(self, recorder, name: str, router: torch.nn.Module):
        self.recorder = recorder
        self.site = Site(name, router)
        self.router = router
        self.inner = router.router_replay  # a RouterReplay the user installed, or None
        self.follow = None  # replay.ReferenceValues
        self.followed_tokens = 0
        router.router_replay = self
        self.functions = None
        if drops_by_probs(router.config) or balances_load(router.config) or balances_by_quantile(router.config):
            # the capacity drop and the load-balancing map run inside Router.routing, after the
            # top-k: this router is the active one around it
            self.functions = _router_function_hooks()
            routing = router.routing

            def routing_with_tap(*args, **kwargs):
                self.functions.active.append(self)
                try:
                    return routing(*args, **kwargs)
                finally:
                    self.functions.active.pop()

            router.routing = routing_with_tap

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None, default_compute_topk: Callable = None):
        if self.inner is not None:
            values, indices = self.inner.get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        else:
            values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if group_topk:
            return values, indices
        return self.observe(scores, topk, values, indices)

    def observe(self, scores: torch.Tensor, topk: int, values: torch.Tensor, indices: torch.Tensor):
        """The choice ``indices`` (its ``values``), the top ``topk`` of ``scores``: recorded, and where
        the candidate follows, the reference's experts taken on the tokens whose choice differs."""
        rec = self.recorder
        clock = rec.clock
        if not clock.in_iteration:
            return values, indices
        # a recomputed router (activation recomputation) routes again inside the backward: its choice was
        # recorded when it first ran; it follows the reference again, as it did then
        key, record, recompute = rec.tap_key(self.site.module_name, keys.TOPK_CHOICE, self.site.module)
        if not record and self.follow is None:
            return values, indices  # nothing asked of this router now: no map built
        choice = torch.zeros_like(scores, dtype=torch.float32).scatter(1, indices, 1.0)
        if record:
            rec._add(keys.sibling(key, keys.TOPK_SCORES), scores.detach(), self.site)
            rec._add(key, choice, self.site)
        if self.follow is None:
            return values, indices
        reference = self.follow.shard(key, rec.layouts.of(key, self.site, tuple(choice.shape)), choice)
        if reference is None:
            return values, indices
        differ = (reference != choice).any(dim=1)
        if not bool(differ.any()):
            return values, indices
        rows = differ.nonzero().squeeze(1)
        # the reference's experts on those tokens, best first by the candidate's own scores
        theirs = reference[rows] > 0.5
        ranked = torch.where(theirs, scores[rows].detach(), torch.full_like(scores[rows], float("-inf")))
        picked = ranked.topk(topk, dim=1).indices
        indices = indices.clone()
        indices[rows] = picked
        values = torch.where(differ.unsqueeze(1), scores.gather(1, indices), values)
        self.followed_tokens += 0 if recompute else int(rows.numel())
        return values, indices

    def selection(self, choice_name: str, scores: torch.Tensor,
                  choice: Callable[[], torch.Tensor]) -> Optional[torch.Tensor]:
        """A selection after the top-k (``keys.CAPACITY_CHOICE``: the tokens each expert keeps;
        ``keys.BALANCING_CHOICE``: the load-balancing loss's own top-k), a 0/1 map over this router's
        [tokens, experts]: recorded with the scores it is taken on, and the reference's map
        returned where the candidate follows and its own differs (None: keep megatron's result)."""
        rec = self.recorder
        clock = rec.clock
        if not clock.in_iteration:
            return None
        key, record, recompute = rec.tap_key(self.site.module_name, choice_name, self.site.module)
        if not record and self.follow is None:
            return None
        mine = choice()
        if record:
            rec._add(keys.sibling(key, keys.SELECTION_SCORES_OF[choice_name]), scores.detach(), self.site)
            rec._add(key, mine.float(), self.site)
        if self.follow is None:
            return None
        reference = self.follow.shard(key, rec.layouts.of(key, self.site, tuple(mine.shape)), mine.float())
        if reference is None:
            return None
        reference = reference > 0.5
        differ = (reference != mine).any(dim=1)
        if not bool(differ.any()):
            return None
        self.followed_tokens += 0 if recompute else int(differ.sum())
        return reference.to(mine.dtype)

    def remove(self) -> None:
        if self.router.router_replay is self:
            self.router.router_replay = self.inner
        if self.functions is not None:
            self.router.__dict__.pop("routing", None)
            self.functions.remove()
            self.functions = None


def attach_routing_taps(recorder, chunks: List[torch.nn.Module]) -> List[RoutingTap]:
    """A tap on every router of these chunks whose choices can be observed."""
    taps = []
    for chunk in chunks:
        for module, name in canonical_module_names(chunk).items():
            if is_router(module) and hasattr(module, "router_replay") and unobserved_routing(module.config) is None:
                taps.append(RoutingTap(recorder, name, module))
    return taps
