"""Online compare: each candidate rank judges its own shards against the reference while it runs.

The candidate never writes tensors. For every recorded tensor, a rank slices the reference's
logical tensor to its own shard (the same :func:`~ttrace_megatron.placement.slice_logical` that
builds the seed checkpoint) and keeps only sums: ``Σ(cand − ref)²`` and ``Σ ref²`` over the
positions that are part of the logical tensor (padding excluded), the non-finite counts, and a
digest of its shard. :func:`combine_online` adds the sums of the distinct shards, which gives
the same relative Frobenius error as merging the shards first; replicas are checked by digest.
No rank talks to another: the combination happens after the run, from the per-rank files.

A partial sum (a :class:`~ttrace_megatron.placement.Partial` placement) cannot be judged on one
rank; such tensors are listed as skipped. The reduced value they feed (``main_grad``) is judged.
A scalar partial sum (each parameter's term of the grad norm) is kept whole, 8 bytes a rank: the
pieces are added up after the run and judged like any scalar (:func:`_scalar_partial`).
A lock-stepped Adam run's updated values are judged element by element against both sides'
moments (``compare.UpdateCheck``) on each rank, over the elements it holds the moments of (a
distributed optimizer's range), and the worst element over the ranks decides. A top-k choice (an MoE
router's) is judged by both sides' scores (``selection``) on each rank, over the rows it holds whole
(a token's choice of experts, or an expert's column of tokens), against the reference's choice and
scores sliced alike; the rows add up over the ranks and the worst near-tie decides, as the merged
choice's judgement would. (Rows split over ranks cannot be judged apart: such a choice is skipped.)

Knows nothing about megatron.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from .compare import (FAIL, FIRST_STEP, OVERFLOW_PHASES, Cancellation, Comparison, Reclip, ShardSums, TensorResult,
                      UpdateCheck, UpdateVerdict, apply_choice_verdict, apply_update_verdict, blank_shard_sums,
                      check_compatible, combine_shards, decide, group_records, in_lockstep, in_order, logical_tensor,
                      missing_reference, not_recorded_by, overflowed_iterations, piece_norm, recorded_by_choice,
                      record_order, reference_order, reference_piece, reference_piece_source, relative_from_sums,
                      replica_note, shard_positions, sliced_shard_sums, with_recomputed_aliases)
from .allocator import keep_freed_memory
from .errors import TraceError
from .placement import (Coords, Layout, Partial, PlacementError, RangeShard, Shard, logical_mask, owned_piece,
                        with_scale)
from .scalars import IterationScalars, iteration_scalars, scalar_row
from .streaming import BufferPool, MappedSource, MemorySource
from .step_bounds import StepBounds, main_grad_key, reclippable, state_of
from .tolerance import ToleranceConfig
from . import coverage, keys, selection
from .keys import TensorKey, TensorKind
from .update_rules import AdamRule
from .trace_store import (RUN_FILE, TraceReader, atomic_write_text, read_json, release_iteration,
                          wait_for_iteration)

ONLINE_FILE = "online.json"
_RANK_DIR = "rank-{:05d}"


_VALUES, _JUDGED = "values", "judged"  # a held step's updated values waiting for its moments; how many were judged


class OnlineComparer:
    """A recording sink with the :class:`~ttrace_megatron.trace_store.TraceWriter` interface
    (``active``, ``add``, ``flush``, ``close``) that keeps verdict sums instead of tensors."""

    def __init__(self, reference_dir: str, trace_dir: str, rank: int, coords: Coords, *, lockstep: bool = False,
                 world_size: int = 1, mapped: bool = False, streamed: bool = False, reader: Optional[int] = None):
        keep_freed_memory()  # this rank judges chunk by chunk as it trains (allocator's docstring)
        # streamed: the reference is written one iteration at a time beside this run (trace_store.Turns):
        # each iteration is read once whole, and let go at this rank's flush of it
        self.streamed = streamed
        self.rank, self.world_size = rank, world_size
        self._reader = rank if reader is None else reader  # streamed: whose release mark this rank writes
        if streamed:
            wait_for_iteration(reference_dir, 1)
        # mapped: the reference is read through memory maps of its files (TraceReader), where no one
        # writes it while this rank reads it
        self.reference = TraceReader(reference_dir, mapped=mapped, allow_incomplete=streamed)
        if not streamed:
            self.reference.prefetch()  # read while this rank builds its model and runs its first layers
        # the reference's checksums are checked once a check, not once a rank: each rank checks its
        # share of the files (at close, those it did not open before; streamed, an iteration's at its
        # flush) and trusts the others' ranks
        self._verify_share = self.reference.share_verification(
            rank, world_size, self.reference.iteration_files(1) if streamed else None)
        self._verified: List[Tuple[str, int, int]] = []  # streamed: what this rank verified, iteration by iteration
        self._ready = 1 if streamed else math.inf  # the last iteration of the reference indexed here
        self._reference_groups = group_records(self.reference)
        # in lock-step under Adam an updated value is judged element by element against both sides'
        # moments (compare.UpdateCheck): on each rank, over the elements it holds the moments of
        # free-running, only the first step starts both sides from the same (seed) parameters: the
        # later ones are not judged (combine_online lists them as diverged, as offline)
        rule = AdamRule.from_run(self.reference.run)
        self.lockstep = lockstep
        self.update_check = None if rule is None else UpdateCheck(rule, self.reference, self._reference_groups, None,
                                                                  None, ToleranceConfig(), lockstep=lockstep)
        # (iteration, module, parameter) -> the pieces of its step seen so far: tensor and layout of
        # each moment, and the updated values' (entry index, tensor, layout) waiting for them
        self._steps: Dict[Tuple[int, str, str], Dict[str, tuple]] = {}
        # (iteration, module, parameter) -> how many updated values the reference recorded of its step:
        # once this rank has judged that many, none is to come, and the step's moments are given back
        # then, not at the iteration's flush (held until then, both sides' moments of every parameter
        # were 4× the rank's parameters in host memory; now the pool keeps about four buffers of each
        # size of piece, one layer's read into again by the next)
        self._values_of = self._count_values()
        # a top-k choice's scores (this rank's piece, the reference's slice of it) until the choice comes
        self._scores: Dict[TensorKey, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._reclip = Reclip(self.reference, self._reference_groups)
        self._pool = BufferPool()  # what a step holds until judged, in memory held before (streaming.BufferPool)
        self._grad: tuple = (None, None, None, None)  # (main grad key, layout, shape, this rank's piece)
        self._clips: Dict[int, float] = {}
        self.coords = {k: (int(v[0]), int(v[1])) for k, v in coords.items()}
        self.dir = os.path.join(trace_dir, _RANK_DIR.format(rank))
        self.entries: List[ShardSums] = []
        self._texts: Dict[int, Tuple[ShardSums, str]] = {}  # entry index -> (the entry, its JSON as last written)
        self._warned = 0
        self._order = reference_order(self._reference_groups)
        self.last_scalars: Optional[IterationScalars] = None  # this rank's shards of the last flushed iteration
        self.failed: Optional[str] = None
        os.makedirs(self.dir, exist_ok=True)
        self._write(complete=False)

    @property
    def active(self) -> bool:
        return self.failed is None

    def _count_values(self, new_keys=None) -> Dict[Tuple[int, str, str], int]:
        """How many updated values the reference recorded of each step (``_values_of``); with
        ``new_keys``, those counts updated by keys not grouped before (a streamed reload's)."""
        values: Dict[Tuple[int, str, str], int] = {} if new_keys is None else self._values_of
        for k in self._reference_groups if new_keys is None else new_keys:
            if keys.is_updated_value(k):
                slot = (k.iteration, k.module, keys.param_name_of(k.tensor))
                values[slot] = values.get(slot, 0) + 1
        return values

    def ensure(self, iteration: int) -> None:
        """Streamed: wait until the reference holds ``iteration`` whole, then index it (the groups
        are updated in place: the update check, the re-clip and lock-step read the same dict)."""
        if iteration <= self._ready:
            return
        wait_for_iteration(self.reference.dir, iteration)
        appended = self.reference.reload()
        if appended is None:  # (a record listed before changed: all again)
            groups = group_records(self.reference)
            self._reference_groups.clear()
            self._reference_groups.update(groups)
            self._values_of = self._count_values()
            self._order = reference_order(self._reference_groups)
        else:  # the new records only, each key's pieces in group_records' order (by rank, then seq)
            new_keys = []
            for rt, rec in appended:
                pieces = self._reference_groups.setdefault(rec.key, [])
                pieces.append((rt, rec))
                if len(pieces) > 1:
                    pieces.sort(key=lambda piece: (piece[0].rank, piece[1].seq))
                else:
                    new_keys.append(rec.key)
                # (reference_order's, a piece at a time: a key's order is its first piece's)
                self._order[rec.key] = min(self._order.get(rec.key, math.inf), record_order(rt, rec))
            self._values_of = self._count_values(new_keys)
        self._verify_share = self.reference.share_verification(self.rank, self.world_size,
                                                               self.reference.iteration_files(iteration))
        self._ready = iteration

    def _let_go(self, iteration: int) -> None:
        """Streamed, at this rank's flush of ``iteration``: its share of the iteration's files checked
        against their checksums (a later iteration overwrites some), what it opened of them let go,
        and the iteration released to the reference's writer (also where the check failed: the
        writer must not wait for a rank that will never judge again; the results say why)."""
        files = self.reference.iteration_files(iteration)
        try:
            self.reference.verify(self._verify_share)
            self._verified += self.reference.fingerprints(self._verify_share)
        except TraceError as e:
            if self.failed is None:
                self.failed = f"the reference is damaged: {e}"
                self._write(complete=False)
        self._verify_share = []
        self.reference.forget(files)
        release_iteration(self.reference.dir, self._reader, iteration)

    def add(self, key: TensorKey, tensor: torch.Tensor, layout: Layout, *, depth: int = 0,
            compute_dtype=None, reduction: int = 0, arrival: bool = False, statistic_of: str = "",
            roundoff: float = 0.0) -> None:
        if self.streamed and key.iteration > self._ready:
            self.ensure(key.iteration)
        if not self.active:
            return
        if key.module == keys.OPTIMIZER_MODULE and key.tensor == keys.CLIP_COEFFICIENT:
            self._clips[key.iteration] = float(tensor.reshape(-1)[0])  # this rank's own, for re-clipping
        entry, reference = self._judge_shard(key, tensor.detach(), layout)
        if key.kind is TensorKind.SELECTION_SCORES and entry.status == "ok":
            self._scores[key] = (tensor.detach().to("cpu", copy=True), reference)
        elif key.kind is TensorKind.SELECTION:
            entry = self._judge_choice(entry, tensor.detach(), layout, reference)
        self.entries.append(dataclasses.replace(entry, roundoff=roundoff) if roundoff else entry)
        if entry.status == "ok" and self._checks_step(key):
            self._step_piece(key, tensor.detach(), layout, reference, len(self.entries) - 1)

    def _step_piece(self, key: TensorKey, tensor: torch.Tensor, layout: Layout, reference: torch.Tensor,
                    index: int) -> None:
        """Keep a moment or an updated value of a step (this rank's piece, and the reference's slice
        of it) until the step's both moments are here, then judge its updated values element by
        element (:meth:`_judge_update`)."""
        name = keys.param_name_of(key.tensor)
        moment = key.kind is TensorKind.OPTIMIZER_STATE and key.tensor in (
            keys.optimizer_state(name, keys.EXP_AVG), keys.optimizer_state(name, keys.EXP_AVG_SQ))
        if not moment and not keys.is_updated_value(key):
            return
        # one host copy of the piece (the run goes on changing its own), the reference sliced alike
        piece = (self._pool.copy(tensor), reference, layout)
        slot = (key.iteration, key.module, name)
        step = self._steps.setdefault(slot, {_VALUES: [], _JUDGED: 0})
        if moment:
            step[key.tensor.rpartition(".")[2]] = piece
        else:
            step[_VALUES].append((index, *piece))
        if keys.EXP_AVG in step and keys.EXP_AVG_SQ in step:
            for index, value, ref_value, _ in step[_VALUES]:
                self._judge_update(index, (value, ref_value), step[keys.EXP_AVG], step[keys.EXP_AVG_SQ])
                self._pool.give(value, ref_value)
            step[_JUDGED] += len(step[_VALUES])
            step[_VALUES] = []
            if step[_JUDGED] >= self._values_of.get(slot, math.inf):  # every value of the step judged
                self._give_step(self._steps.pop(slot))

    def _give_step(self, held: dict) -> None:
        """A step's buffers back to the pool: its values not judged, and its moments (the next
        parameter's step reads into them)."""
        for _, value, ref_value, _ in held[_VALUES]:
            self._pool.give(value, ref_value)
        for name, item in held.items():
            if name not in (_VALUES, _JUDGED):
                self._pool.give(item[0], item[1])

    def _judge_update(self, index: int, value, exp_avg, exp_avg_sq) -> None:
        """The element-wise Adam check of one updated value on this rank: the elements it holds the
        moments of (a distributed optimizer's range of a whole parameter, or the parameter's shard),
        the reference's at the same positions; the verdict goes on the value's entry. ``value`` and
        each moment: (this rank's piece, the reference's slice of it[, layout])."""
        entry = self.entries[index]
        moments_layout = exp_avg[2]
        local = tuple(exp_avg[0].shape)
        try:  # the value's piece is the whole shard where the moments hold a range of it
            mine, ref_value = (v if tuple(v.shape) == local else owned_piece(v, moments_layout, self.coords)
                               for v in value)
        except PlacementError as e:
            self.entries[index] = dataclasses.replace(entry, update_detail=f"this rank's piece does not fit: {e}")
            return
        mask = logical_mask(moments_layout, self.coords, local)
        flat = [t.reshape(-1) if mask is None else t.reshape(-1)[mask.reshape(-1)]
                for t in (mine, exp_avg[0], exp_avg_sq[0], ref_value, exp_avg[1], exp_avg_sq[1])]
        verdict, detail = self.update_check.element_wise(entry.key, flat[0], flat[3], (flat[1], flat[2]),
                                                         (flat[4], flat[5]), str(mine.dtype).replace("torch.", ""))
        if verdict is None:
            self.entries[index] = dataclasses.replace(entry, update_detail=detail)
            return
        self.entries[index] = dataclasses.replace(
            entry, update_ratio=verdict.worst_ratio, update_index=verdict.worst_index,
            update_residual=verdict.residual, update_slack=verdict.slack, update_k=self.update_check.k,
            update_detail=detail)

    def _judge_shard(self, key: TensorKey, cand: torch.Tensor, layout: Layout
                     ) -> Tuple[ShardSums, Optional[torch.Tensor]]:
        """The rank's sums for ``key``, and the reference's piece of it as this rank stores it, as
        recorded (before any re-clip; None where none was read), which the element-wise update check
        and a top-k choice's judgement reuse. Only that piece of the reference is read
        (``reference_piece``)."""
        pieces = self._reference_groups.get(keys.reference_key(key))
        if pieces is None:
            return missing_reference(key, cand, layout, self.coords), None
        if any(isinstance(p, Partial) for p in layout.placements):
            scalar = cand.numel() == 1 and math.prod(layout.logical_shape) == 1
            return ShardSums(**dict(blank_shard_sums(key, cand, layout, self.coords), status="partial",
                                    detail="a partial sum; judge it offline", partial_norm=piece_norm(cand, layout),
                                    partial_value=float(cand.reshape(-1)[0].double()) / layout.scale if scalar else None,
                                    partial_position={p.axis: tuple(self.coords[p.axis]) for p in layout.placements
                                                      if isinstance(p, Partial)})), None
        local = tuple(cand.shape)
        recorded = None  # the reference's piece as recorded (before any re-clip)

        def piece():  # the reference's piece, re-clipped where the step needs it (a chunk at a time)
            nonlocal recorded
            reclips = self._reclips(key)
            source = reference_piece_source(self.reference, pieces, layout, self.coords, local)
            if source is not None and not self._keeps(key) and not reclips:
                # summed a chunk at a time, never held whole
                return source if layout.scale == 1.0 else MappedSource([source], lambda t: with_scale(t, layout))
            raw = (reference_piece(self.reference, pieces, layout, self.coords, local, scaled=False) if source is None
                   else self._pool.read(source))
            recorded = with_scale(raw, layout)
            if not reclips:
                return recorded
            grad = self._main_grad_piece(key, layout, local)
            reclipped = self._reclip.chunked(key, self._clips[key.iteration])
            return MappedSource([MemorySource(raw), MemorySource(grad.reshape(raw.shape))],
                                lambda state, g: with_scale(reclipped(state, g), layout))

        try:
            sums = sliced_shard_sums(key, cand, layout, self.coords, pieces[0][1].layout.logical_shape, piece)
        except PlacementError as e:
            raise TraceError(f"cannot slice the reference to this rank's shard: {e}", path=self.reference.dir,
                             rank=self.rank, tensor=str(key)) from None
        return sums, recorded

    def _main_grad_piece(self, key: TensorKey, layout: Layout, local: Tuple[int, ...]) -> torch.Tensor:
        """The reference's main grad of a state's parameter, at the state's positions on this rank
        (a parameter's states come one after another: the last one read is kept)."""
        grad_key = main_grad_key(key)
        if self._grad[:3] != (grad_key, layout, local):
            self._grad = (grad_key, layout, local, reference_piece(self.reference, self._reference_groups[grad_key],
                                                                   layout, self.coords, local, scaled=False))
        return self._grad[3]

    def _judge_choice(self, entry: ShardSums, choice: torch.Tensor, layout: Layout,
                      reference: Optional[torch.Tensor]) -> ShardSums:
        """A top-k choice's piece judged by the scores each side took it on (``selection.judge_along``),
        over the rows this rank holds whole: the reference's choice and scores sliced to the piece."""
        scores = self._scores.pop(keys.sibling(entry.key, keys.SELECTION_SCORES_OF[entry.key.tensor]), None)
        if entry.status != "ok":
            return entry
        axis = keys.SELECTION_AXIS[entry.key.tensor]
        why = _rows_split(layout, axis, choice.dim())
        if why is None and logical_mask(layout, self.coords, tuple(choice.shape)) is not None:
            why = "its piece holds padding"
        if why is not None:
            return dataclasses.replace(entry, status="partial",
                                       detail=f"a top-k choice whose rows are not whole on a rank ({why}): "
                                              "judged offline only")
        if scores is None:
            return dataclasses.replace(entry, choice_detail="no scores recorded with it on this rank")
        mine = choice.to("cpu", copy=True)
        v, _ = selection.judge_along(mine, reference, scores[0], scores[1], axis)
        return dataclasses.replace(entry, choice_rows=v.tokens, choice_flipped=v.flipped, choice_ratio=v.worst_ratio,
                                   choice_row=v.worst_token, choice_problem=v.problem, choice_detail="judged")

    def _keeps(self, key: TensorKey) -> bool:
        """Whether the reference's piece of ``key`` is kept past its sums: a top-k choice's and its
        scores (judged together), a moment's or an updated value's where its step is checked
        element by element (:meth:`_step_piece`)."""
        if key.kind in (TensorKind.SELECTION, TensorKind.SELECTION_SCORES):
            return True
        return self._checks_step(key) and (key.kind is TensorKind.OPTIMIZER_STATE or keys.is_updated_value(key))

    def _checks_step(self, key: TensorKey) -> bool:
        """Whether ``key``'s iteration's step is checked element by element here: under Adam, every
        step in lock-step, else only the first (both sides start it from the same parameters)."""
        return self.update_check is not None and (self.lockstep or key.iteration == FIRST_STEP)

    def _reclips(self, key: TensorKey) -> bool:
        """As ``StepBounds.reclipped`` decides it at the combination: a state its rule can re-clip,
        whose iteration's coefficients differ, whose reference main grad is recorded."""
        if key.kind is not TensorKind.OPTIMIZER_STATE or not reclippable(state_of(key), self._reclip.rule):
            return False
        mine = self._clips.get(key.iteration)
        theirs = Reclip.clip(self.reference, self._reference_groups, key.iteration)
        return (mine is not None and theirs is not None and mine != theirs
                and main_grad_key(key) in self._reference_groups)

    def flush(self, iteration: int) -> None:
        for key in [k for k in self._scores if k.iteration <= iteration]:  # scores whose choice never came
            del self._scores[key]
        for step in [k for k in self._steps if k[0] <= iteration]:  # values whose moments never came
            held = self._steps.pop(step)
            for index, _, _, _ in held[_VALUES]:
                self.entries[index] = dataclasses.replace(self.entries[index],
                                                          update_detail="no moments recorded on this rank")
            self._give_step(held)
        self._write(complete=False)
        self._warn_live(iteration)
        if self.streamed and iteration >= 1:
            self._let_go(iteration)

    def _warn_live(self, iteration: int) -> None:
        """A heads-up while training runs: this rank's shards that exceed their tolerance (printed),
        and its shards' scalars of the iteration (``last_scalars``, for TensorBoard and W&B).

        A shard's own relative error is not the logical tensor's (``combine_online`` gives the
        verdict), but a bug large enough to matter shows on the shards that carry it.
        """
        num_layers = int(self.reference.run.get("num_layers", 0))
        judged = []
        # free-running under Adam, nothing after the first step is judged (the weights diverged)
        diverged = not self.lockstep and self.update_check is not None and iteration > FIRST_STEP
        for e in ([] if diverged else self.entries[self._warned:]):
            if e.status != "ok" or e.key.iteration != iteration or e.ref_sq == 0.0 or e.update_detail:
                continue  # (an updated value: judged by its element-wise check, in the combination)
            if e.key.kind is TensorKind.SELECTION:  # judged by its scores, not its relative error
                if e.choice_problem:
                    print(f"[ttrace] rank {self.rank} iteration {iteration}: {e.key.module} {e.key.tensor}: "
                          f"{e.choice_problem}", flush=True)
                continue
            ref_key = keys.reference_key(e.key)  # a recomputed output is judged against the reference's output
            rec = self._reference_groups[ref_key][0][1]
            judged.append(decide(e.key, rec, num_layers, self._order.get(ref_key, math.inf),
                                 ToleranceConfig(), e.logical_shape, math.sqrt(e.diff_sq / e.ref_sq),
                                 "non-finite values" if e.candidate_nonfinite else ""))
        self._warned = len(self.entries)
        rows = iteration_scalars((scalar_row(r) for r in judged), num_layers)
        self.last_scalars = rows[0] if rows else IterationScalars(iteration, {}, {}, 0, "")
        above = sorted((r for r in judged if r.verdict == FAIL), key=lambda r: r.order)
        if above:
            r = above[0]
            print(f"[ttrace] rank {self.rank} iteration {iteration}: {len(above)} shard(s) above tolerance; first: "
                  f"{r.key.module} [{r.key.phase}] {r.key.tensor} {r.error_eps:.3g} ε > {r.tolerance_eps:.3g} ε on "
                  f"this rank's shard (the verdict: ttrace report <trace dir>)", flush=True)

    def close(self) -> None:
        if self.streamed:  # each iteration's share was verified at its flush
            if self.failed is None:
                self._write(complete=True, verified=self._verified)
            return
        try:
            self.reference.verify(self._verify_share)
        except TraceError as e:  # the combination names it: the results are not complete
            self.failed = f"the reference is damaged: {e}"
            self._write(complete=False)
            return
        self._write(complete=True, verified=self.reference.fingerprints(self._verify_share))

    def abandon(self, reason: str) -> None:
        """The run stopped mid-iteration: the results stay marked incomplete."""
        if self.failed is None:
            self.failed = reason
        self._write(complete=False)

    def _write(self, complete: bool, verified: Sequence[Tuple[str, int, int]] = ()) -> None:
        """online.json anew (written at every flush, so a stopped run leaves what it judged): each
        entry's JSON is kept from the last write until the entry is replaced. ``verified``: the
        reference's files this rank checked against their checksums (path, bytes, mtime in ns),
        which the combination then trusts as it trusts a file it hashed itself."""
        texts = []
        for i, e in enumerate(self.entries):
            kept = self._texts.get(i)
            if kept is None or kept[0] is not e:
                kept = self._texts[i] = (e, json.dumps(e.to_json(), separators=(",", ":")))
            texts.append(kept[1])
        head = json.dumps({"rank": self.rank, "coords": self.coords, "complete": complete,
                           "reference": os.path.abspath(self.reference.dir), "failure": self.failed,
                           "verified": [list(f) for f in verified]},
                          separators=(",", ":"))
        try:
            atomic_write_text(os.path.join(self.dir, ONLINE_FILE), head[:-1] + ',"entries":[' + ",".join(texts) + "]}")
        except OSError as e:
            if self.failed is None:
                self.failed = f"{type(e).__name__}: {e}"
                print(f"[ttrace] rank {self.rank}: online compare stopped: {self.failed}", flush=True)


def overwritable(key: TensorKey, layout: Layout) -> bool:
    """Whether :func:`combine_online` never reads this record of the reference once the run is
    over, so that a reference written one iteration at a time (``trace_store.Turns``) may write the
    next iteration's bytes over it: a matrix's per-microbatch grads, optimizer states and updated
    values (at the 50M rung 1.05 GB of an iteration's 1.35). It reads scalars (each parameter's
    grad-norm term, ``step_skipped``, the clip coefficient, lr and step count), main grads (their
    norms: ``Cancellation``), output-grads and a bias's grads (``BiasTerms``), top-k choices and
    their scores: all kept, as are a vector's grads and states (a bias's, a norm's). A matrix is
    told by its logical shape: a distributed optimizer records its state as a flat range."""
    return len(layout.logical_shape) >= 2 and (key.kind in (TensorKind.PARAM_GRAD, TensorKind.OPTIMIZER_STATE)
                                               or keys.is_updated_value(key))


def has_online_results(trace_dir: str) -> bool:
    return os.path.exists(os.path.join(trace_dir, _RANK_DIR.format(0), ONLINE_FILE))


def _read_rank(trace_dir: str, rank: int, verified: Optional[Set[Tuple[str, int, int]]] = None) -> List[ShardSums]:
    """A rank's entries; the reference files it verified are added to ``verified``."""
    path = os.path.join(trace_dir, _RANK_DIR.format(rank), ONLINE_FILE)
    if not os.path.exists(path):
        raise TraceError("no online results (missing rank)", path=path, rank=rank)
    obj = read_json(path, rank)
    try:
        if obj.get("rank") != rank:
            raise TraceError(f"file says rank {obj.get('rank')!r}", path=path, rank=rank)
        if not obj.get("complete"):
            why = obj.get("failure") or "the rank did not close its online compare (stopped or killed mid-run)"
            raise TraceError(f"incomplete online results: {why}", path=path, rank=rank)
        if verified is not None:
            verified.update((str(p), int(n), int(t)) for p, n, t in obj.get("verified", ()))
        return [ShardSums.from_json(e) for e in obj["entries"]]
    except TraceError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise TraceError(f"malformed online results ({type(e).__name__}: {e})", path=path, rank=rank) from None


def _scalar_partial(key: TensorKey, entries: List[Tuple[int, ShardSums]], reference: torch.Tensor,
                    where: str) -> Tuple[ShardSums, List[str]]:
    """A scalar partial sum's pieces added up (the lowest rank's copy where replicas hold the same
    position, as a merge takes it; replicas that differ are noted) and judged against the
    reference: one piece, as the offline compare judges the merged tensor."""
    positions: Dict[Tuple, List[Tuple[int, ShardSums]]] = {}
    for rank, e in entries:
        positions.setdefault(tuple(sorted(e.partial_position.items())), []).append((rank, e))
    sizes = dict(entries[0][1].partial_position)
    if len(positions) != math.prod(size for _, size in sizes.values()):
        raise TraceError(f"the candidate's pieces of a partial sum cover {len(positions)} of "
                         f"{math.prod(size for _, size in sizes.values())} positions", path=where, tensor=str(key))
    notes = []
    total = 0.0
    for _, copies in sorted(positions.items()):
        if len({e.partial_value for _, e in copies}) > 1:
            notes.append(replica_note("candidate", sorted(r for r, _ in copies)))
        total += min(copies, key=lambda c: c[0])[1].partial_value
    ref = float(reference.reshape(-1)[0].double())
    finite = math.isfinite(total) and math.isfinite(ref)
    first = entries[0][1]
    sums = dataclasses.replace(first, status="ok", shard={}, diff_sq=(total - ref) ** 2 if finite else 0.0,
                               ref_sq=ref ** 2 if finite else 0.0, compared=1 if finite else 0,
                               candidate_nonfinite=0 if math.isfinite(total) else 1,
                               reference_nonfinite=0 if math.isfinite(ref) else 1,
                               same_nonfinite=math.isfinite(total) == math.isfinite(ref))
    return sums, notes


def perturbation_online(perturbed_dir: str, reference_dir: str) -> Dict[TensorKey, float]:
    """How far the perturbation-estimate run moved each tensor from the reference (its relative
    error, as ``compare.perturbation_observed`` measures it), from that run's own online sums: a
    one-rank run holds each tensor whole, so its sums are the logical tensor's. A scalar partial
    sum (a grad-norm term) is measured against the reference's value; inf where the noise changed
    a shape. So the perturbation estimate needs no tensor written either."""
    run = read_json(os.path.join(perturbed_dir, RUN_FILE), rank=None)
    if not isinstance(run, dict) or not run.get("perturbation_seed"):
        raise TraceError("not a perturbation run (run.json has no perturbation_seed)", path=perturbed_dir)
    ref = TraceReader(reference_dir)
    check_compatible(ref.run, run, perturbed_dir)
    ref_groups = group_records(ref)
    moved: Dict[TensorKey, float] = {}
    for rank in range(int(run.get("world_size", 1))):
        for e in _read_rank(perturbed_dir, rank):
            if e.status == "shape":
                moved[e.key] = math.inf
            elif e.status == "ok":
                moved[e.key] = relative_from_sums(e.diff_sq, e.ref_sq)
            elif e.status == "partial" and e.partial_value is not None and e.key in ref_groups:
                value = float(logical_tensor(ref, ref_groups[e.key]).tensor.reshape(-1)[0].double())
                moved[e.key] = relative_from_sums((e.partial_value - value) ** 2, value ** 2)
    return moved


def _observed(moved: Optional[Dict[TensorKey, float]], key: TensorKey, statistic_of: str) -> Optional[float]:
    """The perturbation's movement of ``key`` (None without a perturbation run or where it did not
    record the key); a statistic (an amax) takes its operand's movement where that is larger, as
    ``compare.statistic_observed``."""
    if moved is None or key not in moved:
        return None
    observed = moved[key]
    if statistic_of:
        source = moved.get(dataclasses.replace(key, tensor=statistic_of), 0.0)
        observed = max(observed, source if math.isfinite(source) else 0.0)
    return observed


def _with_update_verdict(result: TensorResult, entries: List[Tuple[int, ShardSums]],
                         tol_config: ToleranceConfig, how: str) -> TensorResult:
    """An updated value's verdict from its pieces' element-wise checks (``OnlineComparer._judge_update``):
    the worst element over the ranks, its ratio taken to the comparison's k; the relative-error verdict
    where no piece was checked, or with the reason where one could not be."""
    tried = [(rank, e) for rank, e in entries if e.update_detail]
    if not tried:
        return result
    unchecked = [e for _, e in tried if e.update_ratio is None] + [e for _, e in entries if not e.update_detail]
    if unchecked:
        return apply_update_verdict(result, None, unchecked[0].update_detail or "a piece was not checked", how)
    rank, worst = max(tried, key=lambda re: (re[1].update_ratio, re[1].update_index >= 0))  # ties: a checked element
    scale = worst.update_k / tol_config.k  # the slack is k times the step's round-off
    verdict = UpdateVerdict(worst.update_ratio * scale, worst.update_index, worst.update_residual,
                            worst.update_slack / scale)
    return apply_update_verdict(result, verdict, worst.update_detail, how, where=f" of rank {rank}'s piece")


def _rows_split(layout: Layout, axis: int, ndim: int) -> Optional[str]:
    """Why the rows of a choice taken along ``axis`` are not whole on one rank (None: they are)."""
    if layout.permute is not None and list(layout.permute) != sorted(layout.permute):
        return "stored in another dim order"
    for p in layout.placements:
        if isinstance(p, RangeShard) or (isinstance(p, Shard) and p.dim % ndim == axis % ndim):
            return f"split along the choice's axis over {p.axis}"
    return None


def _with_choice_verdict(result: TensorResult, entries: List[Tuple[int, ShardSums]]) -> TensorResult:
    """A top-k choice's verdict from its pieces' judgements (``OnlineComparer._judge_choice``): the
    rows of each distinct piece (the lowest rank's copy, as a merge takes it) added up, the worst
    near-tie over them, the first problem in rank order; a piece not judged fails the choice, as
    offline where no scores were recorded."""
    unjudged = [(rank, e) for rank, e in entries if e.choice_ratio is None]
    if unjudged:
        rank, e = unjudged[0]
        return dataclasses.replace(result, verdict=FAIL, reason=result.reason or (
            f"top-k choice not judged: rank {rank}: {e.choice_detail or 'no scores recorded'}"))
    # each position's lowest-rank copy, as a merge takes it
    pieces = sorted((min(copies, key=lambda re: re[0]) for copies in shard_positions(entries).values()),
                    key=lambda re: re[0])
    problems = [(rank, e) for rank, e in sorted(entries, key=lambda re: re[0]) if e.choice_problem]
    rank, worst = max(pieces, key=lambda re: (re[1].choice_flipped > 0, re[1].choice_ratio))
    problem = f"{problems[0][1].choice_problem} on rank {problems[0][0]}'s piece" if problems else ""
    v = selection.ChoiceVerdict(sum(e.choice_rows for _, e in pieces), sum(e.choice_flipped for _, e in pieces),
                                worst.choice_ratio if worst.choice_flipped else 0.0,
                                worst.choice_row if worst.choice_flipped else -1, problem)
    row = "column" if keys.SELECTION_AXIS[result.key.tensor] == 0 else "token"
    return apply_choice_verdict(result, v, row, where=f" of rank {rank}'s piece")


def online_reference_of(candidate_dir: str, cand_run: dict) -> str:
    """The reference an online candidate judged against: the directory its ``run.json`` names, or
    where that is gone, the ``reference`` beside the candidate whose run id it judged against
    (``ttrace run`` holds its reference in memory and moves a failing check's under ``--out``)."""
    run_path = os.path.join(candidate_dir, RUN_FILE)
    named = cand_run.get("online_reference")
    if not named:
        raise TraceError("the run does not name its online reference", path=run_path)
    if os.path.isdir(named):
        return named
    wanted = cand_run.get("online_reference_id") or cand_run.get("lockstep_reference_id")
    beside = os.path.join(os.path.dirname(os.path.abspath(candidate_dir)), "reference")
    if wanted and os.path.isfile(os.path.join(beside, RUN_FILE)):
        run = read_json(os.path.join(beside, RUN_FILE), rank=None)
        if isinstance(run, dict) and run.get("run_id") == wanted:
            return beside
    raise TraceError(f"its online reference {named} is gone (a check that held it in memory or streamed it removed "
                     "it once judged; a failing streamed check's reference under --out is the reference run again, up "
                     "to the failing iteration, a run of its own; the check's report.json holds the verdict)",
                     path=run_path)


def combine_online(candidate_dir: str, reference_dir: Optional[str] = None, *,
                   tol_config: ToleranceConfig = ToleranceConfig(), perturbed: Optional[str] = None,
                   progress: Optional[Callable[[int, int], None]] = None) -> Comparison:
    """Add up the ranks' shard sums into one :class:`~ttrace_megatron.compare.Comparison`;
    ``perturbed``: a perturbation-estimate run that compared online against the same reference
    (:func:`perturbation_online`), whose movements widen the tolerances as offline; ``progress``:
    called with (keys combined, keys) as ``compare_traces`` calls it."""
    cand_run = read_json(os.path.join(candidate_dir, RUN_FILE), rank=None)
    if not isinstance(cand_run, dict) or not isinstance(cand_run.get("world_size"), int):
        raise TraceError("run description lacks 'world_size'", path=os.path.join(candidate_dir, RUN_FILE))
    reference_dir = reference_dir or online_reference_of(candidate_dir, cand_run)
    ref = TraceReader(reference_dir)
    check_compatible(ref.run, cand_run, candidate_dir)
    num_layers = int(ref.run.get("num_layers", 0))
    ref_groups = group_records(ref)
    by_key: Dict[TensorKey, List[Tuple[int, ShardSums]]] = {}
    for rank in range(cand_run["world_size"]):
        # what the ranks checked of the reference is not hashed again here (a file changed since is)
        for entry in _read_rank(candidate_dir, rank, ref.verified):
            by_key.setdefault(entry.key, []).append((rank, entry))
    with_recomputed_aliases(ref_groups, by_key)
    order = reference_order(ref_groups)

    results: List[TensorResult] = []
    skipped: List[TensorKey] = []
    unjudged_params = {**coverage.unjudged_params(ref.run), **coverage.unjudged_params(cand_run)}
    unjudged = in_order((k for k in by_key if k in ref_groups and coverage.param_of(k) in unjudged_params), order)
    # as offline: free-running (or lock-stepped with another reference) under Adam, what comes after
    # the first step has no round-off bound (compare.FREE_RUNNING); online keeps no previous
    # parameters to judge a later update from, so every later key is listed as diverged
    lockstep = in_lockstep(ref.run, cand_run, ref.dir)
    free = AdamRule.from_run(ref.run) is not None and not lockstep
    diverged = in_order((k for k in by_key if free and k in ref_groups and k.iteration > FIRST_STEP
                         and k not in set(unjudged)), order)
    how = "lock-step" if lockstep else "not in lock-step, first iteration: both from the seed checkpoint"
    judged = set(by_key) - set(unjudged) - set(diverged)
    missing_in_reference = sorted((k for k, es in by_key.items() if es[0][1].status == "missing_reference"), key=str)
    cancellations = Cancellation(ref, ref_groups)  # as compare_traces keeps them
    step_bounds = StepBounds(ref.run, num_layers, tol_config, has_reference=lambda k: k in ref_groups)
    overflowed = overflowed_iterations(ref, ref_groups)
    moved = perturbation_online(perturbed, ref.dir) if perturbed else None
    todo = in_order((k for k in judged if k in ref_groups), order)
    for done, key in enumerate(todo):
        if progress is not None:
            progress(done, len(todo))
        entries = by_key[key]
        observed = _observed(moved, key, ref_groups[key][0][1].statistic_of)
        if entries and all(e.status == "partial" and e.partial_value is not None for _, e in entries):
            scalar, notes = _scalar_partial(key, entries, logical_tensor(ref, ref_groups[key]).tensor, candidate_dir)
            results.append(combine_shards(key, [(entries[0][0], scalar)], ref_groups[key][0][1], num_layers,
                                          order[key], tol_config, candidate_dir, notes, observed=observed,
                                          step=step_bounds))
            continue
        if any(e.status == "partial" for _, e in entries):
            cancellations.note_partial(key, sum(e.partial_norm for _, e in entries))  # for its main grad
            skipped.append(key)
            continue
        cancellation = 1.0
        if cancellations.needs_reference(key):
            reference = logical_tensor(ref, ref_groups[key]).tensor if cancellations.reads_reference(key) else None
            cancellation = cancellations.factor(key, reference)
        result = combine_shards(key, entries, ref_groups[key][0][1], num_layers, order[key], tol_config,
                                candidate_dir, observed=observed, cancellation=cancellation, step=step_bounds,
                                overflowed=key.phase in OVERFLOW_PHASES and key.iteration in overflowed)
        if key.kind is TensorKind.SELECTION:
            results.append(_with_choice_verdict(result, entries))
            continue
        results.append(_with_update_verdict(result, entries, tol_config, how) if math.isfinite(result.error)
                       else result)
    if progress is not None:
        progress(len(todo), len(todo))
    # as offline: a key the candidate's selection left out is not missing, and one its layout cannot
    # record (run.json's not_recorded) is skipped
    absent = sorted((k for k in ref_groups if k not in by_key and recorded_by_choice(cand_run, k)), key=lambda k: order[k])
    skipped += [k for k in absent if not_recorded_by(cand_run, k)]
    missing_in_candidate = [k for k in absent if not not_recorded_by(cand_run, k)]
    return Comparison(reference_dir, candidate_dir, results, missing_in_candidate, missing_in_reference,
                      ref.run, cand_run, skipped=skipped, unjudged=unjudged, diverged=diverged)
