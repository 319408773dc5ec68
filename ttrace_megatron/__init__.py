"""ttrace_megatron: differential testing of Megatron-LM distributed training (TTrace).

A distributed candidate run and a single-device reference run record the same logical tensors;
placements merge the candidate's shards, and per-tensor tolerances tell round-off from bugs.
"""

__version__ = "0.1.0"
