"""An online check's verdicts as TensorBoard / W&B scalars while the candidate trains.

Each rank judges its own shards (``online.OnlineComparer``); after every iteration the ranks'
summaries (:class:`~ttrace_megatron.scalars.IterationScalars`, a few hundred bytes) are gathered on
the rank that holds the writers, merged, and written there at the iteration's step:

* under Megatron-LM, through its own ``get_tensorboard_writer()`` and ``get_wandb_writer()``, which
  Megatron-LM creates on the last rank when ``--tensorboard-dir`` or ``--wandb-project`` is given;
* under ttrace's own runner (``ttrace run --online --tensorboard DIR``), through a
  ``SummaryWriter`` of its own on the last rank.

Every rank takes part in every gather, on a gloo group of its own created by every rank when the
session starts, so no rank runs a collective the others skip, and the model's groups and numerics
are untouched. Whether to gather is decided from the arguments, which every rank holds alike.
"""

from __future__ import annotations

from typing import Callable, List, Optional

from ...scalars import IterationScalars, merge, write


def megatron_lm_writers() -> List:
    """Megatron-LM's TensorBoard and W&B writers on this rank (none on the ranks without them)."""
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:
        return []
    return [w for w in (get_tensorboard_writer(), get_wandb_writer()) if w is not None]


class OwnWriter:
    """ttrace's own ``SummaryWriter`` in ``log_dir``, made on first use (on the writing rank only),
    and closed with the session; Megatron-LM's writers are Megatron-LM's to close."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.made: List = []

    def __call__(self) -> List:
        if not self.made:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self.made.append(SummaryWriter(log_dir=self.log_dir))
        return self.made

    def close(self) -> None:
        for writer in self.made:
            writer.close()


class LiveScalars:
    """Gathers the ranks' iteration summaries on ``dst`` and writes them through ``writers()``."""

    def __init__(self, comparer, writers: Callable[[], List], own: Optional[OwnWriter] = None):
        import torch.distributed as dist

        self.comparer = comparer
        self.writers = writers
        self.own = own  # the writer this session made, closed with it
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.dst = self.world - 1  # where Megatron-LM keeps its writers
        # every rank creates the group (a collective of the default group), at the same point
        self.group = dist.new_group(backend="gloo") if self.distributed else None

    def end_iteration(self, iteration: int) -> Optional[IterationScalars]:
        import torch.distributed as dist

        mine = self.comparer.last_scalars
        if mine is None or mine.iteration != iteration:
            mine = IterationScalars(iteration, {}, {}, 0, "")
        parts = [mine]
        if self.distributed:
            gathered = [None] * self.world if self.rank == self.dst else None
            dist.gather_object(mine.to_json(), gathered, dst=self.dst, group=self.group)
            if self.rank != self.dst:
                return None
            parts = [IterationScalars(**p) for p in gathered]
        merged = merge(parts)
        for writer in self.writers():
            write(writer, merged, live=True)
            if hasattr(writer, "flush"):
                writer.flush()
        return merged

    def close(self) -> None:
        if self.own is not None:
            self.own.close()
