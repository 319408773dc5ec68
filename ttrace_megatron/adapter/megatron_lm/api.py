"""The training-loop API: what Megatron-LM's ``pretrain_gpt.py`` / ``training.py`` call.

Two ways in, both no-ops unless ``--ttrace`` is given:

* **the patch** (``patches/``, fewer than 10 lines)::

      extra_args_provider=ttrace.extra_args_provider(<existing provider or None>)   # pretrain_gpt.py
      ttrace.attach(model, optimizer, config)       # pretrain(), after setup_model_and_optimizer
      ttrace.begin_iteration(iteration + 1)         # train(), before train_step
      ttrace.end_iteration(iteration + 1, loss_dict, grad_norm, skipped_iter)   # after train_step
      ttrace.flush()                                # end of train() (atexit covers sys.exit)

* **zero edits to training.py**: ``ttrace.install()`` once in ``pretrain_gpt.py`` before
  ``pretrain(...)``. It wraps ``megatron.training.training.setup_model_and_optimizer`` and
  ``train_step``, which ``pretrain``/``train`` look up by name at call time.

Iterations are numbered from 1, as Megatron-LM logs them (``iteration + 1`` inside ``train()``).
``attach`` takes the objects ``pretrain`` holds: a list of model chunks (``DDP(Float16Module(
GPTModel))``) and the optimizer from ``get_megatron_optimizer`` (a ``ChainedOptimizer``).
It writes nothing to the run: hooks copy tensors, the optimizer wrapper calls the original
``step`` and records around it, and no hook issues a collective.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ...errors import RecipeError
from ...recipe import SEED_INIT_MEGATRON
from ..run.session import TraceOptions, begin_iteration, end_iteration, flush  # noqa: F401  (the API)
from .arguments import extra_args_provider  # noqa: F401  (the API)

__all__ = ["TraceOptions", "attach", "begin_iteration", "end_iteration", "extra_args_provider", "flush", "install"]


def _megatron_args():
    """Megatron-LM's parsed arguments, or None outside Megatron-LM (megatron.training absent)."""
    try:
        from megatron.training import get_args
    except ImportError:
        return None
    try:
        return get_args()
    except (AssertionError, AttributeError):
        return None  # megatron.training present, arguments not parsed (a megatron-core-only loop)


def model_facts(chunks: List, config, args: Any = None, *, logical_vocab_size: Optional[int] = None,
                tokens_per_microbatch: Optional[int] = None, tokens_per_iteration: Optional[int] = None):
    """:class:`..record.layouts.ModelFacts` of a Megatron-LM run (its arguments give the batch sizes), or of
    a megatron-core loop that passes them."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from ..record.layouts import model_facts as build_facts
    from ..recipe.naming import unwrap

    if logical_vocab_size is None and args is not None and hasattr(args, "padded_vocab_size"):
        logical_vocab_size = _tokenizer_vocab_size()  # Megatron-LM pads its tokenizer's vocabulary
    if logical_vocab_size is None:
        # the padded vocabulary: from the embedding (first stage) or the output layer (last stage)
        logical_vocab_size = 0
        for chunk in chunks:
            model = unwrap(chunk)
            embedding = next((m for m in model.modules() if isinstance(m, VocabParallelEmbedding)), None)
            output_layer = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
            if embedding is not None:
                logical_vocab_size = int(embedding.num_embeddings)
            elif output_layer is not None:
                logical_vocab_size = int(output_layer.output_size)
    if tokens_per_microbatch is None or tokens_per_iteration is None:
        if args is None or not hasattr(args, "seq_length"):
            raise RecipeError("ttrace.attach needs tokens_per_microbatch and tokens_per_iteration outside Megatron-LM")
        tokens_per_microbatch = args.micro_batch_size * args.seq_length
        tokens_per_iteration = args.global_batch_size * args.seq_length
    seq_length = int(getattr(args, "seq_length", 0) or 0) if args is not None else 0
    return build_facts(chunks, config, vocab_size=logical_vocab_size, tokens_per_microbatch=tokens_per_microbatch,
                       tokens_per_iteration=tokens_per_iteration, seq_length=seq_length)


def _tokenizer_vocab_size() -> Optional[int]:
    """The vocabulary of Megatron-LM's tokenizer (its ``get_tokenizer()``), before the padding to a
    multiple of ``--make-vocab-size-divisible-by`` × TP; None where there is none."""
    try:
        from megatron.training import get_tokenizer

        return int(get_tokenizer().vocab_size)
    except Exception:  # no Megatron-LM training package, or no tokenizer built
        return None


def training_signature(args: Any) -> Dict[str, Any]:
    """What Megatron-LM's arguments say about the data and the loop (see :func:`..recipe.build.model_signature`)."""
    if args is None:
        return {}
    names = {"seed": "seed", "seq_length": "seq_length", "micro_batch_size": "micro_batch_size",
             "global_batch_size": "global_batch_size", "iterations": "train_iters", "lr_decay_style": "lr_decay_style",
             "lr_warmup_iters": "lr_warmup_iters", "lr_decay_iters": "lr_decay_iters"}
    out = {k: getattr(args, a, None) for k, a in names.items()}
    # the tokens: Megatron-LM's mock dataset (which ttrace's runner can build too, data.source
    # megatron_mock) or a dataset of the user's, named by its paths
    out["data_source"] = "megatron_mock" if getattr(args, "mock_data", False) else \
        "megatron_data:" + ",".join(map(str, getattr(args, "data_path", None) or []))
    for switch in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask"):
        out[switch] = bool(getattr(args, switch, False))
    out["masked_share"] = 0.0  # Megatron-LM's loop masks only with its dataset's own mask
    out["document_length"] = 0  # and trains on its dataset's own documents
    out["padded_share"] = 0.0  # pretrain_gpt.py hands the model no padding mask
    out["distinct_tokens"] = False  # its dataset's tokens are its own
    out["seed_init"] = getattr(args, "ttrace_seed_init", None) or SEED_INIT_MEGATRON
    return out


def attach(model, optimizer, config, *, options: Optional[TraceOptions] = None, args: Any = None,
           facts=None, signature: Optional[Dict[str, Any]] = None, run_info: Optional[Dict[str, Any]] = None):
    """Start recording ``model`` (a chunk or a list of chunks) and ``optimizer``: a
    :class:`..run.session.Session`, or None without ``--ttrace``.

    Options come from ``options`` or else from Megatron-LM's ``--ttrace*`` arguments. Raises
    RecipeError before training starts for parallel modes that cannot be traced yet. ``facts`` and
    ``signature`` (:func:`..recipe.build.model_signature`) are read from the model, the optimizer
    and Megatron-LM's arguments unless the caller gives them (a loop that describes the model as
    it built it, before anything patched it).
    """
    from ..recipe.build import model_signature
    from ..run import session

    if args is None and options is None:
        args = _megatron_args()
    options = options or TraceOptions.from_args(args)
    if not options.enabled:
        return None
    chunks = session.as_chunks(model)
    session.check_traceable(config, chunks, options)
    facts = facts or model_facts(chunks, config, args)
    if signature is None and session.global_rank() == 0:
        signature = model_signature(chunks, config, getattr(optimizer, "config", None), facts,
                                    training_signature(args))
    return session.start(chunks, optimizer, config, options, facts, signature, run_info)


# ------------------------------------------------------------------------------------------------
# zero-edit install


def install(training_module=None) -> None:
    """Wrap Megatron-LM's ``setup_model_and_optimizer`` and ``train_step`` by name.

    ``pretrain`` and ``train`` look both up as module globals of ``megatron.training.training`` at
    call time, so replacing them there is enough. Arguments are parsed inside ``pretrain``, so the
    wrappers decide at call time whether ``--ttrace`` is on.
    """
    if training_module is None:
        import megatron.training.training as training_module
    if getattr(training_module, "_ttrace_installed", False):
        return
    setup = training_module.setup_model_and_optimizer
    train_step = training_module.train_step

    def setup_model_and_optimizer(*args, **kwargs):
        result = setup(*args, **kwargs)
        model, optimizer = result[0], result[1]
        from megatron.core.utils import get_model_config

        attach(model, optimizer, get_model_config(model[0] if isinstance(model, (list, tuple)) else model))
        return result

    def traced_train_step(*args, **kwargs):
        iteration = kwargs.get("iteration")
        if iteration is None:
            margs = _megatron_args()
            iteration = getattr(margs, "curr_iteration", 0) if margs is not None else 0
        begin_iteration(iteration + 1)
        result = train_step(*args, **kwargs)
        end_iteration(iteration + 1)
        return result

    training_module.setup_model_and_optimizer = setup_model_and_optimizer
    training_module.train_step = traced_train_step
    training_module._ttrace_installed = True
