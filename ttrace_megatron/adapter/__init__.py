"""Everything that knows megatron, in rooms along the data path.

A recipe becomes a model (``recipe``); hooks record its tensors with their placements
(``record``); on a machine without GPUs, megatron-core runs on a shim and FP8 GEMMs are emulated
(``cpu``); known bugs are injected into a candidate (``zoo``); ranks are launched and a session
drives the loop: recording, lock-step, replay, perturbation, the seed checkpoint (``run``);
Megatron-LM's own ``pretrain_gpt.py`` is traced through ``--ttrace`` or run by ``--megatron-lm``
(``megatron_lm``).

``ROOMS`` is their order: a room imports only the rooms before it, and the comparison core
(placement, trace_store, tolerance, compare, report) imports none (``tests/test_import_graph.py``).
"""

ROOMS = ("recipe", "record", "cpu", "zoo", "run", "megatron_lm")
