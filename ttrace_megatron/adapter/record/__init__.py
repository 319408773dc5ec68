"""A model's tensors into a trace: one hook dispatcher per run, the layout (placement) of every
recorded key, the recorder (activations, grads, loss, grad norm, optimizer state), the MoE
routers' choices and what megatron's optimizers hold per parameter."""
