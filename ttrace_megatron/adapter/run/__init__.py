"""A check's runs: the tracing session a training loop attaches (recording, lock-step, replay,
perturbation, the seed checkpoint), ttrace's own training loop for a recipe, and the rank
processes that run it, on the installed megatron-core or another source tree."""
