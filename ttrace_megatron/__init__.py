"""ttrace_megatron: differential testing of Megatron-LM distributed training (TTrace).

A distributed candidate run and a single-device reference run record the same logical tensors;
placements merge the candidate's shards, and per-tensor tolerances tell round-off from bugs.

The training-loop API (``attach``, ``begin_iteration``, ...: no-ops unless ``--ttrace``) lives in
:mod:`ttrace_megatron.adapter.megatron_lm.api` and is loaded on first use of one of these names, so
importing the comparison core (``ttrace_megatron.compare``, ``.placement``, ...) loads no adapter.
"""

from .about import __version__  # noqa: F401

__all__ = ["TraceOptions", "attach", "begin_iteration", "end_iteration", "extra_args_provider", "flush", "install"]


def __getattr__(name):
    if name in __all__:
        from .adapter.megatron_lm import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
