"""megatron-core on a machine without GPUs: the CUDA assumptions shimmed for gloo, and
TransformerEngine's FP8 GEMMs emulated for megatron's local linears."""
