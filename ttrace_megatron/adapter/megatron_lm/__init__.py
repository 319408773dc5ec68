"""Megatron-LM's own training loop: the ``--ttrace*`` flags and the training-loop API its
``pretrain_gpt.py`` calls (``ttrace.attach``, ``install``), and ``ttrace run --megatron-lm``,
which runs a checkout's ``pretrain_gpt.py`` for both sides of a check."""
