"""What differs between the megatron-core releases ttrace supports, in one place.

ttrace runs on megatron-core 0.16 through 0.19 from one code base. Every place where a release
renamed, moved or removed something ttrace uses is a switch here, commented with the release and
the upstream change that made it; nothing outside this module asks which release is installed.
Each switch tests for the thing itself (an attribute, a parameter) rather than comparing version
numbers, so a development tree between two releases takes the branch its code has.
"""

from __future__ import annotations

import inspect
import contextlib
from typing import Any, Callable, Dict, Optional

# the releases this code base supports: oldest first, newest last (setup.py's range, CI's slice)
SUPPORTED = ("0.16", "0.17", "0.18", "0.19")


def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def local_layer_spec(config, moe: Optional[bool] = None):
    """megatron's local (no TransformerEngine) layer spec for a decoder layer, with the spec-level
    choices read from the config; its MLP is an MoE layer when the config has experts, or as
    ``moe`` says (a HybridModel's ``-`` and ``E`` layers share one config).

    0.17 removed ``moe_use_legacy_grouped_gemm`` from ``get_gpt_layer_local_spec`` together with
    the legacy GroupedMLP ("[Cleanup] Remove the deprecated GroupedMLP", 2caa681a1d, #3410)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # 0.17 on: get_gpt_layer_local_spec(*args, **kwargs) forwards to get_gpt_layer_local_submodules,
    # whose signature is the one that says what the spec takes
    takes = getattr(gpt_layer_specs, "get_gpt_layer_local_submodules", get_gpt_layer_local_spec)
    kwargs: Dict[str, Any] = dict(normalization=config.normalization)
    if _accepts(takes, "moe_use_legacy_grouped_gemm"):  # 0.16
        kwargs["moe_use_legacy_grouped_gemm"] = config.moe_use_legacy_grouped_gemm
    experts = config.num_moe_experts if moe is None or moe else None
    return get_gpt_layer_local_spec(experts, config.moe_grouped_gemm, config.qk_layernorm,
                                    config.multi_latent_attention, **kwargs)


def tap_router_loss_log(callback: Callable[[str, Any], None]) -> Callable[[], None]:
    """Call ``callback(name, value)`` with every loss an MoE router hands to megatron's logging
    (the loss divided by its coefficient), right after megatron's own logging, which always runs
    unchanged. Returns the function that removes the tap.

    0.18 replaced ``save_to_aux_losses_tracker(name, loss, ...)`` (moe_utils, imported by name into
    router.py) with ``get_moe_metrics_tracker().record(name, value, ...)`` ("[main] Refactor and
    Improve MoE Logging", 873678adaf, #3431); both take the name and the value first."""
    from megatron.core.transformer.moe import router as router_module

    if hasattr(router_module, "save_to_aux_losses_tracker"):  # 0.16, 0.17
        name = "save_to_aux_losses_tracker"
        original = router_module.save_to_aux_losses_tracker

        def tapped(loss_name, value, *args, **kwargs):
            original(loss_name, value, *args, **kwargs)
            callback(loss_name, value)
    else:  # 0.18 on
        name = "get_moe_metrics_tracker"
        original = router_module.get_moe_metrics_tracker

        def tapped():
            return _TappedTracker(original(), callback)

    setattr(router_module, name, tapped)

    def remove() -> None:
        if getattr(router_module, name) is tapped:
            setattr(router_module, name, original)

    return remove


class _TappedTracker:
    """megatron's MoE metrics tracker, its ``record`` followed by the tap's callback."""

    def __init__(self, tracker, callback):
        self._tracker, self._callback = tracker, callback

    def record(self, name, value, *args, **kwargs):
        self._tracker.record(name, value, *args, **kwargs)
        self._callback(name, value)

    def __getattr__(self, attr):
        return getattr(self._tracker, attr)


def grads_for_norm_attr(optimizer) -> str:
    """The name of the method through which a megatron optimizer hands its grads to the grad norm.

    0.19 renamed ``get_main_grads_for_grad_norm()`` to ``get_grads_for_grad_norm(grad_norm_group=None)``
    ("Clip mtp grads separately when mtp_detach_heads=True", 5b16c99648, #4116)."""
    return "get_grads_for_grad_norm" if hasattr(optimizer, "get_grads_for_grad_norm") else "get_main_grads_for_grad_norm"


def optimizer_config_overrides(optimizer_config, config) -> Optional[Dict]:
    """The param-group overrides megatron.training hands ``get_megatron_optimizer``, where they are
    not its default: under μP (``use_mup``, 0.19 on: "MuP support", ``get_mup_config_overrides``),
    μP's per-class lr and Adam ε over the standard ones, as Megatron-LM's ``setup_model_and_optimizer``
    merges them (training.py, core_v0.19.0). None: megatron's own default (the standard overrides)."""
    if not getattr(config, "use_mup", False):
        return None
    from megatron.core.optimizer import get_mup_config_overrides, get_standard_config_overrides

    mup = get_mup_config_overrides(config=optimizer_config, mup_width_mult=config.mup_width_mult,
                                   optimizer_type=optimizer_config.optimizer)
    if not mup:
        return None
    return {**(get_standard_config_overrides(config=optimizer_config) or {}), **mup}


def has_hybrid_model() -> bool:
    """Whether the installed megatron-core has ``HybridModel``: 0.18 added
    ``megatron.core.models.hybrid`` (MambaModel renamed: "Rename MambaModel/MambaStack to
    HybridModel/HybridStack", 15e07a2ddf, #4099). Its layers are attention, MLP, MoE, Mamba and GDN layers named by a pattern."""
    import importlib.util

    return importlib.util.find_spec("megatron.core.models.hybrid") is not None


@contextlib.contextmanager
def hybrid_final_norm(norm_class):
    """Build a HybridStack whose final norm is ``norm_class`` instead of TransformerEngine's.

    ``HybridStack.__init__`` (0.18, 0.19: ``megatron/core/models/hybrid/hybrid_block.py``) builds its
    ``final_norm`` with ``TENorm`` whatever the spec says (its comment: the TE spec is used
    "because we had problems getting the non-TE spec working"), so a local-spec HybridModel needs
    TransformerEngine for that one norm. While the model is built, ``TENorm`` in that module is
    the local spec's own norm class, the one GPTModel's local spec builds ``final_layernorm`` with;
    megatron's module is restored after."""
    from megatron.core.models.hybrid import hybrid_block

    original = hybrid_block.TENorm
    hybrid_block.TENorm = norm_class
    try:
        yield
    finally:
        hybrid_block.TENorm = original


def null_tokenizer_vocab_flag(vocab_size: int, release: str) -> int:
    """The ``--vocab-size`` that makes Megatron-LM's NullTokenizer a vocabulary of ``vocab_size``
    tokens, its end-of-document token included, for a checkout of megatron-core ``release``.

    Through 0.17 NullTokenizer(V) is V tokens plus an EOD token (V + 1 in all); from 0.18 it is V
    tokens, the last of them the EOD token ("Enable NullTokenizer for pretraining to reduce I/O
    access", c9dfe34798, #4057). The checkout is another tree than the installed megatron-core, so
    this switch reads its release number; :func:`null_tokenizer` makes the same choice for the
    installed one by what its tokenizer answers."""
    major, minor = (int(x) for x in release.split(".")[:2])
    return vocab_size if (major, minor) >= (0, 18) else vocab_size - 1


def null_tokenizer(vocab_size: int):
    """megatron-core's NullTokenizer whose vocabulary, its end-of-document token included, is
    ``vocab_size`` tokens: what Megatron-LM's ``--tokenizer-type NullTokenizer`` builds for the
    recipe's vocabulary (:func:`null_tokenizer_vocab_flag`), made with
    ``MegatronTokenizer.from_pretrained`` from metadata alone.

    0.17 renamed the tokenizer library ``null`` to ``null-text`` (beside ``null-multimodal``) and
    split the library list into text and vision ones ("fully remove legacy tokenizer system",
    3257093930, #2946). 0.18 made NullTokenizer(V) V tokens with the EOD token last, where it had
    been V tokens plus the EOD token (c9dfe34798, #4057): the tokenizer is asked for V and, where it
    answers V + 1, built again for V − 1."""
    from megatron.core.tokenizers import MegatronTokenizer, megatron_tokenizer

    library = "null-text" if hasattr(megatron_tokenizer, "TEXT_LIBRARIES") else "null"  # 0.17 on / 0.16
    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=vocab_size)
    if tokenizer.vocab_size == vocab_size + 1:  # through 0.17: the EOD token comes on top
        tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=vocab_size - 1)
    return tokenizer


def mtp_transformer_layer(layer):
    """A MultiTokenPredictionLayer's transformer layer: ``transformer_layer`` in 0.16, renamed
    ``mtp_model_layer`` by 0.19 (which may also hold a HybridStack there); its recorded tensors are
    named after the attribute, so both sides of a comparison on one release agree."""
    inner = getattr(layer, "transformer_layer", None)
    return inner if inner is not None else layer.mtp_model_layer


def mtp_layers_numbered_after_the_decoder() -> bool:
    """Whether this megatron-core numbers an MTP depth's transformer layer after the decoder's layers
    (0.16: ``num_layers + k``) rather than by its own depth (0.19's ``mtp_model_layer``), read off
    MultiTokenPredictionLayer's source without building one."""
    import inspect

    from megatron.core.transformer import multi_token_prediction

    return "mtp_model_layer" not in inspect.getsource(multi_token_prediction.MultiTokenPredictionLayer)


def mtp_layer_number(layer, num_layers: int, depth_index: int):
    """(how, the number) megatron gives MTP depth ``depth_index + 1``'s transformer layer: after the
    decoder's layers in 0.16 (``num_layers + k``); its own number ``k`` by 0.19 ("MTP inner layers use
    their own layer numbering", ``MultiTokenPredictionLayer.__init__``). Attention reads it (NoPE,
    sliding windows, query-key layer scaling), the same way in reference and candidate."""
    if getattr(layer, "transformer_layer", None) is not None:
        return "after the decoder's num_layers", num_layers + depth_index + 1
    return "the MTP layer's own, 0.19's numbering", depth_index + 1


def ltor_masks_and_position_ids(tokens, eod_token: int, *, reset_position_ids: bool, reset_attention_mask: bool,
                                eod_mask_loss: bool, create_attention_mask: bool):
    """(attention_mask, loss_mask, position_ids) of one sample as megatron's GPTDataset builds them
    (``megatron/core/datasets/gpt_dataset.py`` ``_get_ltor_masks_and_position_ids``, the same at
    0.16 through 0.19): the attention mask [1, s, s], True where a query may not see a key."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    return _get_ltor_masks_and_position_ids(tokens, eod_token, reset_position_ids, reset_attention_mask,
                                            eod_mask_loss, create_attention_mask)
