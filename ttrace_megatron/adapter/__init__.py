"""Everything that knows megatron-core: configs, placement inference, recording hooks, runs.

The comparison core (placement, trace_store, tolerance, compare, report) never imports this.
"""
