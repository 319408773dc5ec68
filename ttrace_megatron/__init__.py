"""ttrace_megatron: differential testing of Megatron-LM distributed training (TTrace).

A distributed candidate run and a single-device reference run record the same logical tensors;
placements merge the candidate's shards, and per-tensor tolerances tell round-off from bugs.
"""

__version__ = "0.1.0"

# the training-loop API (no-ops unless --ttrace): see ttrace_megatron.adapter.integration
from .adapter.integration import (TraceOptions, attach, begin_iteration, end_iteration,  # noqa: E402
                                  extra_args_provider, flush, install)

__all__ = ["TraceOptions", "attach", "begin_iteration", "end_iteration", "extra_args_provider", "flush", "install"]
