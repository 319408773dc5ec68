"""Bugs injected at run time into a candidate, for tests and the bug zoo. Never edits files.

Each bug is a function that patches the already-built model (its module instances, or the
megatron function it calls), registered under its name by :func:`bug`. A bug that acts on chosen
modules takes a module pattern (``NAME:MODULE_PATTERN`` on the command line, the registered default
otherwise); a bug that acts on the whole run takes none and refuses one, so a pattern is never
accepted and ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Callable, Dict, List, Optional

import torch

from ..recipe import compat
from ..recipe.naming import canonical_parameters, named_modules

# a file the zoo's benchmarks name: a bug whose place the layout decides (which parameters a
# distributed-optimizer shard holds) appends where it acted, one JSON line per rank, so the replay's
# culprit is judged against where the bug really acted, not against a name written for one layout
TOUCHED_ENV = "TTRACE_ZOO_TOUCHED"


@dataclasses.dataclass(frozen=True)
class Bug:
    name: str
    inject: Callable
    default_pattern: Optional[str]  # None: the bug acts on the whole run and takes no pattern
    at_build: bool = False  # patches how megatron builds the model: injected before the build, takes no chunks

    @property
    def doc(self) -> str:
        return (self.inject.__doc__ or "").strip()


BUGS: Dict[str, Bug] = {}


def bug(default_pattern: Optional[str] = None, *, at_build: bool = False):
    """Register a bug under its function's name. With ``default_pattern`` it is called as
    ``fn(chunks, pattern)``; without, as ``fn(chunks)``, and a pattern given for it is refused.
    ``at_build``: it patches megatron's model building, is called as ``fn()`` before the build and
    takes no pattern."""
    def register(fn: Callable) -> Callable:
        if fn.__name__ in BUGS:
            raise ValueError(f"bug {fn.__name__!r} registered twice")
        BUGS[fn.__name__] = Bug(fn.__name__, fn, default_pattern, at_build)
        return fn
    return register


def _modules(chunks, pattern: str, cls):
    found = named_modules(chunks, pattern, cls)
    if not found and _pipeline_size() == 1:  # a pipeline stage may hold none of the matching layers
        raise ValueError(f"bug injection: no {cls.__name__} matches {pattern!r}")
    return found


def _pipeline_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def _param_modules(chunks) -> Dict[int, str]:
    """id(parameter) -> the canonical name of its module (``naming.canonical_parameters``)."""
    return {id(param): module_name for chunk in chunks for module_name, _, _, param in canonical_parameters(chunk)}


def _report_touched(bug_name: str, modules) -> None:
    """Append the modules ``bug_name`` acted on to the file :data:`TOUCHED_ENV` names (nothing
    without it)."""
    path = os.environ.get(TOUCHED_ENV)
    if not path:
        return
    from megatron.core import parallel_state

    line = json.dumps({"bug": bug_name, "rank": torch.distributed.get_rank(),
                       "dp_rank": parallel_state.get_data_parallel_rank(), "modules": sorted(set(modules))})
    with open(path, "a") as f:
        f.write(line + "\n")


def _model_and_shard_params(optimizer):
    """(model parameter, its main-parameter shard) for every parameter a DistributedOptimizer steps."""
    pairs = ((optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
             (optimizer.model_fp32_groups, optimizer.shard_fp32_groups))
    return [(m, s) for model_groups, shard_groups in pairs
            for model_group, shard_group in zip(model_groups, shard_groups)
            for m, s in zip(model_group, shard_group)]


def _during_forward(module, layers_attr: str, replacement):
    """Swap a function in megatron's layers module while this module's forward runs."""
    from megatron.core.tensor_parallel import layers as tp_layers

    original_forward = module.forward

    @functools.wraps(original_forward)
    def forward(*args, **kwargs):
        saved = getattr(tp_layers, layers_attr)
        setattr(tp_layers, layers_attr, replacement)
        try:
            return original_forward(*args, **kwargs)
        finally:
            setattr(tp_layers, layers_attr, saved)

    module.forward = forward


@bug(default_pattern="*linear_fc2")
def row_allreduce_dropped(chunks, pattern: str) -> None:
    """RowParallelLinear forgets to sum its partial outputs over TP (forward)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.tensor_parallel.mappings import _split_along_first_dim

    for _, module in _modules(chunks, pattern, RowParallelLinear):
        if module.sequence_parallel:
            _during_forward(module, "reduce_scatter_to_sequence_parallel_region",
                            lambda x, group=None, **kw: _split_along_first_dim(x, group=group))
        else:
            _during_forward(module, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)


@bug(default_pattern="*linear_qkv")
def column_dgrad_allreduce_dropped(chunks, pattern: str) -> None:
    """ColumnParallelLinear skips the all-reduce of its input grad over TP (backward): each rank
    keeps the dgrad of its own output columns. Without sequence parallelism only (with SP the
    dgrad is reduce-scattered instead)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    for name, module in _modules(chunks, pattern, ColumnParallelLinear):
        if module.sequence_parallel:
            raise ValueError(f"bug injection: {name} runs with sequence parallelism; its dgrad is not all-reduced")
        # megatron all-reduces the dgrad either inside the linear's autograd function or, when
        # that is off, in the backward of copy_to_tensor_model_parallel_region: drop both
        module.allreduce_dgrad = False
        _during_forward(module, "copy_to_tensor_model_parallel_region", lambda x, group=None: x)


@bug(default_pattern="*layernorm")
def sp_norm_grad_not_reduced(chunks, pattern: str) -> None:
    """Under SP, norm weights lose their ``sequence_parallel`` tag, so finalize_model_grads does
    not sum their grads over TP (each rank keeps the grad of its own sequence shard)."""
    found = 0
    for _, module in named_modules(chunks, pattern):
        for p in module.parameters(recurse=False):
            if getattr(p, "sequence_parallel", False):
                p.sequence_parallel = False
                found += 1
    if not found:
        raise ValueError(f"bug injection: no sequence-parallel parameter under {pattern!r}")


@bug(default_pattern="*word_embeddings")
def embedding_mask_missing(chunks, pattern: str) -> None:
    """VocabParallelEmbedding forgets to zero the rows of tokens another TP rank owns."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    for _, module in _modules(chunks, pattern, VocabParallelEmbedding):
        if module.tp_group.size() == 1:
            continue
        original = module.forward

        def forward(input_, _module=module, _original=original):
            clamped = (input_ - _module.vocab_start_index).clamp(0, _module.num_embeddings_per_partition - 1)
            shifted = clamped + _module.vocab_start_index
            return _original(shifted)

        module.forward = forward


@bug()
def dp_grad_not_averaged(chunks) -> None:
    """DDP sums main grads over data-parallel ranks without the 1/dp scale (a loss or grad scaled
    wrongly by dp): every main grad is dp times too large."""
    found = 0
    for chunk in chunks:
        for buffer in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            if buffer.gradient_scaling_factor != 1.0:
                buffer.gradient_scaling_factor = 1.0
                for bucket in buffer.buckets:
                    bucket.gradient_scaling_factor = 1.0
                found += 1
    if not found:
        raise ValueError("bug injection: dp_grad_not_averaged needs data parallelism (DP > 1)")


def _dp_rank_1_batches(name: str, change: Callable) -> None:
    """Hand DP rank 1 each microbatch as ``change(batch)`` makes it: a data-path bug on one rank of
    ttrace's runner (Megatron-LM's loop builds its batches in pretrain_gpt.get_batch)."""
    from megatron.core import parallel_state

    from ..recipe import data

    if parallel_state.get_data_parallel_world_size() < 2:
        raise ValueError(f"bug injection: {name} needs data parallelism (DP > 1)")
    if parallel_state.get_data_parallel_rank() != 1:
        return
    original = data.microbatches

    def microbatches(*args, **kwargs):
        for j, batch in original(*args, **kwargs):
            yield j, change(batch)

    data.microbatches = microbatches


@bug()
def loss_mask_dropped_on_dp_rank_1(chunks) -> None:
    """The data pipeline hands DP rank 1 its microbatches without their loss mask (all ones: a
    broadcast that forgets the mask, a collate function that rebuilds it on one rank): that rank
    trains on the prompt and end-of-document tokens the others leave out. Silent: the loss stays
    finite, only its value and the grads of DP rank 1's microbatches change."""
    _dp_rank_1_batches("loss_mask_dropped_on_dp_rank_1",
                       lambda batch: batch._replace(loss_mask=torch.ones_like(batch.loss_mask)))


@bug()
def document_mask_dropped_on_dp_rank_1(chunks) -> None:
    """Packed documents (reset_attention_mask): the data pipeline hands DP rank 1 its microbatches
    without their attention mask, so that rank's attention is only causal and each token attends to
    the documents before its own. Silent: shapes, losses and grads stay finite."""

    def unmasked(batch):
        if batch.attention_mask is None:
            raise ValueError("bug injection: document_mask_dropped_on_dp_rank_1 needs reset_attention_mask")
        return batch._replace(attention_mask=None)

    _dp_rank_1_batches("document_mask_dropped_on_dp_rank_1", unmasked)


@bug()
def grad_norm_counts_tp_replicas(chunks) -> None:
    """The grad norm counts TP-replicated parameters (norms, row-parallel biases) on every TP rank
    instead of once: the BLOOM class of bug. Clipping then scales every update wrongly."""
    from megatron.core import tensor_parallel

    tensor_parallel.param_is_not_tensor_parallel_duplicate = lambda param, *args, **kwargs: True


@bug(default_pattern="*linear_fc1")
def gated_mlp_halves_swapped(chunks, pattern: str) -> None:
    """A gated MLP's fused fc1 holds [gate; up] per rank (partition_stride 2); a converter that
    writes [up; gate] instead swaps SwiGLU's two inputs. Applied to the loaded weights."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    for name, module in _modules(chunks, pattern, ColumnParallelLinear):
        if getattr(module.weight, "partition_stride", 1) != 2:
            raise ValueError(f"bug injection: {name} is not a fused gated-MLP fc1 (partition_stride 2)")
        with torch.no_grad():
            for p in (module.weight, getattr(module, "bias", None)):
                if p is not None:
                    gate, up = p.data.chunk(2, dim=0)
                    p.data.copy_(torch.cat([up, gate], dim=0))


@bug(default_pattern="*linear_qkv")
def qkv_groups_reversed(chunks, pattern: str) -> None:
    """A fused QKV weight written with its query groups in the wrong order within each rank's
    shard (a checkpoint converter's layout bug). Applied to the loaded weights."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    for name, module in _modules(chunks, pattern, ColumnParallelLinear):
        groups = module.config.num_query_groups // module.tp_group.size()
        if groups < 2:
            raise ValueError(f"bug injection: {name} holds one query group per rank; nothing to reorder")
        with torch.no_grad():
            for p in (module.weight, getattr(module, "bias", None)):
                if p is not None:
                    shaped = p.data.view(groups, -1, *p.shape[1:])
                    p.data.copy_(shaped.flip(0).reshape(p.shape))


@bug()
def cross_entropy_mask_missing(chunks) -> None:
    """Vocab-parallel cross entropy forgets to zero the target logit on ranks that do not own the
    target token: every other rank adds its own logit at the clamped index to the sum."""
    from megatron.core.tensor_parallel import cross_entropy

    original = cross_entropy.VocabParallelCrossEntropy.calculate_predicted_logits

    def calculate_predicted_logits(*args, **kwargs):
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = original(*args, **kwargs)
        flat = exp_logits.view(-1, exp_logits.size(-1))  # exp of the max-shifted logits
        leaked = torch.log(flat[torch.arange(flat.size(0), device=flat.device), masked_target_1d])
        predicted_logits = torch.where(target_mask, leaked.view_as(predicted_logits), predicted_logits)
        return target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits

    cross_entropy.VocabParallelCrossEntropy.calculate_predicted_logits = staticmethod(calculate_predicted_logits)


@bug()
def cross_entropy_grad_into_padding(chunks) -> None:
    """Vocab-parallel cross entropy's backward writes into the last logit column of the last TP
    rank: with a padded vocabulary, a padding logit, so its effect lands only in the output layer's
    padding rows (their grad, their moments, their update) and in the grad norm."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import cross_entropy

    original = cross_entropy.VocabParallelCrossEntropy.calculate_gradients

    def calculate_gradients(*args, **kwargs):
        grad_input = original(*args, **kwargs)
        if ps.get_tensor_model_parallel_rank() == ps.get_tensor_model_parallel_world_size() - 1:
            grad_input[..., -1] -= grad_input.abs().amax(dim=-1)
        return grad_input

    cross_entropy.VocabParallelCrossEntropy.calculate_gradients = staticmethod(calculate_gradients)


@bug()
def recompute_input_shards_swapped(chunks) -> None:
    """Activation recomputation with ``distribute_saved_activations``: each TP rank keeps 1/TP of a
    checkpointed layer's input and the backward gathers the pieces again, here in the wrong order
    (rolled by one rank). The recomputed forward then runs on another input than the first: its
    values were right, its grads are not."""
    from megatron.core.tensor_parallel import random as tp_random

    original = tp_random.gather_split_1d_tensor

    def gather_split_1d_tensor(tensor):
        gathered = original(tensor)
        return torch.roll(gathered, shifts=tensor.numel())  # rank r's piece where rank r + 1's belongs

    tp_random.gather_split_1d_tensor = gather_split_1d_tensor


@bug()
def attention_layer_number_stage_local(chunks) -> None:
    """Every attention numbers itself within its pipeline chunk (1, 2, ...) instead of by its global
    layer number: what depends on the layer's number (which layers are NoPE, ``no_rope_freq``;
    which use a sliding window) is right on the first stage and wrong on the others."""
    from megatron.core.transformer.attention import Attention

    for chunk in chunks:
        attentions = [m for m in chunk.modules() if isinstance(m, Attention)]
        first = min((a.layer_number for a in attentions), default=1)
        for attention in attentions:
            attention.layer_number = attention.layer_number - first + 1


@bug(default_pattern="*core_attention")
def softmax_scale_from_partition_head_dim(chunks, pattern: str) -> None:
    """Core attention's softmax scale is computed from the head dimension of this rank's partition
    (the partition's projection size over all heads: head_dim / TP) instead of the whole head's, so
    at TP > 1 every attention score is √TP too large (issue #36). At megatron's initialization the
    scores are near zero and the attention nearly uniform: the error moves its output by less than
    bf16's round-off."""
    import math

    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    tp = parallel_state.get_tensor_model_parallel_world_size()
    for _, module in _modules(chunks, pattern, DotProductAttention):
        module.softmax_scale *= math.sqrt(tp)


@bug()
def softmax_offsets_on_the_wrong_heads(chunks) -> None:
    """Attention sinks (``softmax_type: learnable``): each rank's per-head softmax offsets are applied
    to its heads in reverse order, as a head-sharded parameter indexed against another head order
    would be."""
    from megatron.core.fusions import fused_softmax

    original = fused_softmax.FusedScaleMaskSoftmax.forward_torch_softmax

    def forward_torch_softmax(self, input, mask, softmax_offset=None):
        if softmax_offset is not None:
            softmax_offset = softmax_offset.flip(0)
        return original(self, input, mask, softmax_offset)

    fused_softmax.FusedScaleMaskSoftmax.forward_torch_softmax = forward_torch_softmax


@bug()
def mtp_projection_gather_reduces_grad(chunks) -> None:
    """Multi-token prediction under TP: the MTP layer gathers its projection's column-parallel
    output with ``all_gather_last_dim_from_tensor_parallel_region``, whose backward is a
    reduce-scatter, instead of ``gather_from_tensor_model_parallel_region`` (backward: a split).
    The gathered hidden states' grad, the same on every TP rank, is summed over them: the
    projection and everything upstream of it get TP times their grad. megatron-core shipped this
    and fixed it (the comment in ``MultiTokenPredictionLayer._concat_embeddings``)."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer import multi_token_prediction

    multi_token_prediction.gather_from_tensor_model_parallel_region = \
        mappings.all_gather_last_dim_from_tensor_parallel_region


@bug()
def mtp_loss_scale_ignores_microbatches(chunks) -> None:
    """Multi-token prediction: the MTP depths' loss enters the backward at the scale of the whole
    loss (``MTPLossAutoScaler``'s scale left at 1) instead of the main loss's 1/num_microbatches,
    so the MTP grads grow with the microbatches a rank runs: a layout with fewer of them (more
    DP ranks) trains with another MTP weight than the reference."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    MTPLossAutoScaler.set_loss_scale = staticmethod(lambda scale: None)
    MTPLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)


@bug()
def grad_scaler_state_on_rank0_only(chunks) -> None:
    """fp16's dynamic loss scaler: only global rank 0 holds the scale the run should train at (as
    when a checkpoint's grad-scaler state is restored on rank 0 alone); every other rank starts
    from half of it. Each rank scales its own copy of the loss by its own scale, the TP and DP
    reductions mix grads at different scales, and each rank unscales by its own: no overflow, no
    error, grads off by up to 2×."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    original = DynamicGradScaler.__init__

    def init(self, initial_scale, *args, **kwargs):
        if torch.distributed.get_rank() != 0:
            initial_scale = initial_scale / 2
        original(self, initial_scale, *args, **kwargs)

    DynamicGradScaler.__init__ = init


@bug(at_build=True)
def vpp_layer_offset_off_by_one_stage() -> None:
    """With virtual pipeline stages, the layer offset of every chunk after the first is computed
    for the next pipeline rank: every layer is still built once, but chunk v of rank p holds the
    layers megatron's split gives chunk v of rank p + 1 (mod PP). Names, weights from the seed
    checkpoint and the pipeline all follow the wrong numbers, so the run trains another model."""
    from megatron.core.transformer import transformer_block, transformer_layer

    original = transformer_layer.get_transformer_layer_offset

    def get_transformer_layer_offset(config, vp_stage=None, pp_rank=None):
        if vp_stage:
            from megatron.core import parallel_state

            pp = config.pipeline_model_parallel_size
            rank = parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
            pp_rank = (rank + 1) % pp
        return original(config, vp_stage, pp_rank)

    transformer_layer.get_transformer_layer_offset = get_transformer_layer_offset
    transformer_block.get_transformer_layer_offset = get_transformer_layer_offset


@bug(at_build=True)
def hybrid_segment_offset_from_next_stage() -> None:
    """A HybridModel under virtual pipelining numbers the layers of every chunk after the first
    from the next pipeline rank's offset: each chunk builds its own segment's layers, but under
    the numbers of another stage's, so names, weights from the seed checkpoint and layer-numbered
    behaviour (NoPE, windows) follow the wrong layers."""
    from megatron.core.models.hybrid import hybrid_layer_allocation

    original = hybrid_layer_allocation.select_pipeline_segment

    def select_pipeline_segment(main_pattern, pp_group, vp_stage, *args, **kwargs):
        layers, offset = original(main_pattern, pp_group, vp_stage, *args, **kwargs)
        if vp_stage and pp_group is not None and pp_group.size() > 1:
            segments = main_pattern.split("|")
            index = vp_stage * pp_group.size() + (pp_group.rank() + 1) % pp_group.size()
            offset = sum(len(s) for s in segments[:index])
        return layers, offset

    hybrid_layer_allocation.select_pipeline_segment = select_pipeline_segment  # HybridModel imports it when built


@bug()
def distopt_grad_shard_offset(chunks) -> None:
    """The distributed optimizer reads each parameter's owned range of the reduced grad buffer one
    element off (a shard-offset bug, like a bucket offset applied twice): the grad reduction is
    right, the step uses shifted grads. Every parameter's shard is shifted: each one is where it
    acts (reported to :data:`TOUCHED_ENV`)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not any(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False) for c in chunks):
        raise ValueError("bug injection: distopt_grad_shard_offset needs the distributed optimizer")
    names = _param_modules(chunks)
    reported = []

    def copy_model_grads_to_main_grads(self):
        pairs = _model_and_shard_params(self)
        for model_param, shard_param in pairs:
            owned = self._get_model_param_range_map(model_param)["param"]
            shifted = model_param.main_grad.view(-1).roll(-1)  # the bug: one element off
            shard_param.grad = shifted[owned.start:owned.end].float()
        if not reported:
            reported.append(True)
            _report_touched("distopt_grad_shard_offset", (names[id(m)] for m, s in pairs if s.numel()))

    DistributedOptimizer._copy_model_grads_to_main_grads = copy_model_grads_to_main_grads


@bug()
def tied_embedding_grads_not_synced(chunks) -> None:
    """With tied embeddings and PP > 1, finalize_model_grads skips the all-reduce of the word
    embedding grads over the embedding group (first and last stage): each stage's copy steps on its
    own share of the grad and the copies drift apart."""
    import importlib

    from megatron.core import parallel_state

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the module, not the function
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        raise ValueError("bug injection: tied_embedding_grads_not_synced needs PP > 1")
    finalize._allreduce_word_embedding_grads = lambda *args, **kwargs: None


@bug()
def vpp_batched_p2p_at_pp2(chunks) -> None:
    """Virtual pipelining at PP = 2 with batched p2p (``batch_p2p_comm=True``, no overlap): the
    previous and the next stage are the same rank, the batched sends to it pair FIFO with the
    receives, and an activation and a grad travelling in opposite directions are swapped. A real
    megatron-core configuration bug (Megatron-LM issues #750, #1450), not a code edit."""
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    if len(chunks) < 2 or config.pipeline_model_parallel_size != 2:
        raise ValueError("bug injection: vpp_batched_p2p_at_pp2 needs virtual pipelining with PP = 2")
    config.batch_p2p_comm, config.overlap_p2p_comm = True, False


@bug()
def expert_grads_scaled_by_edp(chunks) -> None:
    """Expert grads are averaged over the expert-DP group instead of the whole DP group: with
    EP over DP ranks an expert sees the tokens of dp/edp ranks, so its grad must still be scaled by
    1/dp (megatron pre-scales expert buckets by edp/dp); this scales it by 1/edp."""
    found = 0
    for chunk in chunks:
        for buffer in getattr(chunk, "expert_parallel_buffers", None) or []:
            factor = 1.0 / buffer.data_parallel_group.size()
            if buffer.gradient_scaling_factor != factor:
                buffer.gradient_scaling_factor = factor
                for bucket in buffer.buckets:
                    bucket.gradient_scaling_factor = factor
                found += 1
    if not found:
        raise ValueError("bug injection: expert_grads_scaled_by_edp needs expert parallelism over DP ranks (EDP < DP)")


@bug()
def moe_aux_loss_scaled_by_tp(chunks) -> None:
    """The router's load-balancing loss is summed over the TP ranks instead of averaged: its
    coefficient is effectively TP times too large, so the router's weight grads are wrong."""
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    if not config.num_moe_experts or config.tensor_model_parallel_size == 1:
        raise ValueError("bug injection: moe_aux_loss_scaled_by_tp needs MoE with TP > 1")
    config.moe_aux_loss_coeff *= config.tensor_model_parallel_size


@bug()
def router_ignores_padding_mask_on_ep_rank_1(chunks) -> None:
    """The MoE routers of expert-parallel rank 1 are not handed the padding mask (a layer that
    drops the keyword on its way down): their load-balancing loss, z-loss and expert-bias counts
    take the padding tokens for real ones. Silent: only the auxiliary losses' values and grads
    change."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
    if not routers or parallel_state.get_expert_model_parallel_world_size() < 2:
        raise ValueError("bug injection: router_ignores_padding_mask_on_ep_rank_1 needs MoE with EP > 1")
    if parallel_state.get_expert_model_parallel_rank() != 1:
        return
    for router in routers:
        original = router.routing
        router.routing = functools.partial(lambda fn, logits, padding_mask=None: fn(logits), original)


@bug()
def qk_layernorm_grads_not_reduced(chunks) -> None:
    """The grad finalization sums the TP-partial grads of sequence-parallel parameters only and
    forgets the q/k layernorms (each TP rank normalizes its own heads): without SP their grads stay
    each rank's partial sum. megatron-core sums them by name when ``qk_layernorm`` is set; the bug
    is that check missing."""
    import importlib

    module = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the package exports
    original = module._allreduce_non_tensor_model_parallel_grads  # a function of the same name

    def without_qk_norms(model, config, *args, **kwargs):
        saved, config.qk_layernorm = config.qk_layernorm, False
        try:
            return original(model, config, *args, **kwargs)
        finally:
            config.qk_layernorm = saved

    module._allreduce_non_tensor_model_parallel_grads = without_qk_norms


@bug("*.mlp.router")
def router_topk_skips_best(chunks, pattern: str) -> None:
    """The router's top-k is one position off: it takes the k+1 best experts and drops the first,
    as a slice meant to drop a shared expert would (``[:, 1:]``): every token skips its best expert."""
    from megatron.core.transformer.moe.router import Router

    class _SkipsBest:
        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            values, indices = default_compute_topk(scores, topk + 1, num_groups=num_groups, group_topk=group_topk)
            return values[:, 1:], indices[:, 1:]

    for _, router in _modules(chunks, pattern, Router):
        router.router_replay = _SkipsBest()


@bug()
def capacity_keeps_least_probable(chunks) -> None:
    """At capacity, each expert keeps its least probable routed tokens instead of its most probable
    (the drop's top-k taken on the wrong side: ``largest=False``, or probabilities negated)."""
    from megatron.core.transformer.moe import router

    original = router.apply_router_token_dropping

    def keeps_least_probable(routing_probs, routing_map, router_topk, capacity_factor, drop_policy="probs",
                             pad_to_capacity=False):
        if drop_policy != "probs":
            return original(routing_probs, routing_map, router_topk, capacity_factor, drop_policy, pad_to_capacity)
        inverted = torch.where(routing_map, 2.0 - routing_probs, torch.zeros_like(routing_probs))
        mask = original(inverted, routing_map, router_topk, capacity_factor, drop_policy, True)[1]
        final_map = mask if pad_to_capacity else torch.logical_and(routing_map, mask)
        return routing_probs * final_map, final_map

    router.apply_router_token_dropping = keeps_least_probable


@bug()
def expert_tp_partials_not_reduced(chunks) -> None:
    """With expert-TP, the alltoall dispatcher's combine forgets to sum the experts' partial outputs
    over the expert-TP ranks: each rank keeps its own partial sum of its tokens."""
    from megatron.core.transformer.moe import token_dispatcher

    def split_without_sum(x, group=None, input_split_sizes=None, **kwargs):
        rank, size = group.rank(), group.size()
        sizes = input_split_sizes or [x.shape[0] // size] * size
        return torch.split(x, sizes, dim=0)[rank].contiguous()

    token_dispatcher.reduce_scatter_to_sequence_parallel_region = split_without_sum


@bug(default_pattern="*linear_qkv")
def fp8_amax_wrong_group(chunks, pattern: str) -> None:
    """FP8: a linear reduces the amax of its sequence-parallel input over the data-parallel group
    instead of the tensor-parallel group that shards it, so TP ranks quantize their shards of one
    logical tensor with different scales (Megatron-LM's amax-reduction-group class of bugs). Needs a
    recipe with dtype fp8 (``fp8_emulation``)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from ..record import layouts

    for name, module in _modules(chunks, pattern, ColumnParallelLinear):
        emulated = getattr(module, "_ttrace_fp8", None)
        if emulated is None:
            raise ValueError(f"bug injection: {name} does not run FP8 GEMMs (a recipe with dtype fp8 is needed)")
        if not module.sequence_parallel:
            raise ValueError(f"bug injection: {name} runs without sequence parallelism; its input is not sharded")
        emulated.groups = dict(emulated.groups, input=[layouts.axis_group(layouts.DP)])


@bug()
def mup_output_mult_from_partition_width(chunks) -> None:
    """μP (0.19 on): the logit multiplier 1/width_mult computed from the TP partition's hidden size
    (hidden / TP) instead of the model's, so every logit is TP× too large: the per-partition-size class
    of bug (cf. ``softmax_scale_from_partition_head_dim``), where μP's multipliers live."""
    from megatron.core import parallel_state

    from ..recipe.naming import unwrap

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        raise ValueError("bug injection: mup_output_mult_from_partition_width needs TP > 1 (at TP 1 the partition is "
                         "the model)")
    found = False
    for chunk in chunks:
        model = unwrap(chunk)
        if not getattr(model.config, "use_mup", False) or not hasattr(model, "_scale_logits"):
            continue
        found = True
        original = model._scale_logits

        def scale(logits, original=original):
            return original(logits) * tp

        model._scale_logits = scale
    if not found:
        raise ValueError("bug injection: no μP model (model: use_mup, megatron-core 0.19 on)")


@bug(default_pattern="*linear_fc2")
def nonfinite_output_on_rank_1(chunks, pattern: str) -> None:
    """A NaN from the candidate's own computation: on global rank 1, the first element of the
    matching RowParallelLinear's output becomes NaN in every forward (an overflowing kernel, a
    division by zero on one GPU). Not a layout bug: the fault ttrace must report as a FAIL naming
    the first tensor that holds it, not as an error (issue #38)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    if dist.get_world_size() < 2:
        raise ValueError("bug injection: nonfinite_output_on_rank_1 needs a candidate of 2 ranks or more")
    if dist.get_rank() != 1:
        return
    for _, module in _modules(chunks, pattern, RowParallelLinear):
        def poison(module, inputs, output):
            out, bias = output
            out = out.clone()
            out.view(-1)[0] = float("nan")
            return out, bias

        module.register_forward_hook(poison)


def _entry(spec: str):
    name, has_pattern, pattern = spec.partition(":")
    if name not in BUGS:
        raise ValueError(f"unknown bug {name!r}; known: {', '.join(sorted(BUGS))}")
    return BUGS[name], has_pattern, pattern


def inject_before_build(spec: str) -> None:
    """Inject ``spec`` now if it patches how megatron builds the model (else :func:`inject` does,
    after the build)."""
    entry, has_pattern, pattern = _entry(spec)
    if entry.at_build:
        if has_pattern:
            raise ValueError(f"bug {entry.name!r} patches the build and takes no module pattern (got {pattern!r})")
        entry.inject()


def inject(chunks: List[torch.nn.Module], spec: str) -> None:
    """Inject ``NAME`` or ``NAME:MODULE_PATTERN`` into the candidate's model (a bug that patches the
    build was injected before it, by :func:`inject_before_build`)."""
    entry, has_pattern, pattern = _entry(spec)
    name = entry.name
    if entry.at_build:
        return
    if entry.default_pattern is None:
        if has_pattern:
            raise ValueError(f"bug {name!r} acts on the whole run and takes no module pattern (got {pattern!r})")
        entry.inject(chunks)
    else:
        entry.inject(chunks, pattern or entry.default_pattern)


# ---- the optimizer (issue #16): bugs in the step, judged under Adam


@bug()
def clip_applied_twice(chunks) -> None:
    """Gradient clipping scales the grads by the clip coefficient twice (a clip inside a loop over
    chained optimizers that also clips outside it): the step uses grads scaled by c² instead of c.
    Adam's update hardly changes (it normalizes), its moments do."""
    from megatron.core.optimizer import optimizer as optimizer_module

    original = optimizer_module.clip_grad_by_total_norm_fp32

    def twice(parameters, max_norm, total_norm, *args, **kwargs):
        original(parameters, max_norm, total_norm, *args, **kwargs)
        return original(parameters, max_norm, total_norm, *args, **kwargs)

    optimizer_module.clip_grad_by_total_norm_fp32 = twice


@bug()
def weight_decay_ignores_param_groups(chunks) -> None:
    """The lr scheduler sets every param group's weight decay without its ``wd_mult``: biases and
    norms, which megatron's default groups exempt, decay too."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def step(self, increment: int) -> None:
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group)
            group["weight_decay"] = self.get_wd(group)  # the bug: no wd_mult

    OptimizerParamScheduler.step = step


@bug()
def lr_schedule_skipped_on_one_rank(chunks) -> None:
    """One rank (global rank 1) skips the lr scheduler's step: from the second iteration on it
    steps with the previous iteration's lr while the others decay it."""
    import torch.distributed as dist
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise ValueError("bug injection: lr_schedule_skipped_on_one_rank needs two ranks or more")
    original = OptimizerParamScheduler.step

    def step(self, increment: int) -> None:
        if increment > 0 and dist.get_rank() == 1:
            return
        original(self, increment)

    OptimizerParamScheduler.step = step


@bug()
def param_allgather_skipped(chunks) -> None:
    """The distributed optimizer updates each rank's owned range of the parameters but skips the
    all-gather that sends it to the other DP ranks: every rank's copy of a parameter is stale
    outside its own range, and the next forward runs on them."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    if not any(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False) for c in chunks):
        raise ValueError("bug injection: param_allgather_skipped needs the distributed optimizer")
    DistributedOptimizer.step_with_ready_grads = MixedPrecisionOptimizer.step_with_ready_grads


@bug("embedding.word_embeddings")
def param_gather_hook_missing(chunks, pattern: str) -> None:
    """overlap_param_gather: the matching modules run without DDP's forward pre-hook, the one that
    waits for (and first dispatches) the all-gather of their parameters' bucket. The first module
    of a bucket then runs on its stale copy (each DP rank's own range updated, the rest a step
    old), and the gather arrives for the modules after it."""
    found = False
    for chunk in chunks:
        handles = getattr(chunk, "remove_forward_pre_hook_handles", None)
        if not getattr(getattr(chunk, "ddp_config", None), "overlap_param_gather", False) or handles is None:
            continue
        for _, module in named_modules([chunk], pattern):
            if module in handles:
                handles.pop(module).remove()
                found = True
    if not found:
        raise ValueError(f"bug injection: param_gather_hook_missing needs overlap_param_gather and a module "
                         f"with DDP's forward pre-hook matching {pattern!r}")


@bug()
def adam_state_stepped_on_wrong_shard(chunks) -> None:
    """The distributed optimizer on DP rank 1 hands two of its main-parameter shards each other's
    grads: their Adam moments and updates accumulate the wrong shard's gradient. Which two depends on
    the shard layout (the first two of the same shape): their modules are reported to
    :data:`TOUCHED_ENV`."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not any(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False) for c in chunks):
        raise ValueError("bug injection: adam_state_stepped_on_wrong_shard needs the distributed optimizer")
    original = DistributedOptimizer._copy_model_grads_to_main_grads
    names = _param_modules(chunks)
    reported = []

    def copy_model_grads_to_main_grads(self):
        original(self)
        if parallel_state.get_data_parallel_rank() != 1:
            return
        by_shape = {}
        for model_param, shard in _model_and_shard_params(self):
            if shard.grad is not None:
                by_shape.setdefault(tuple(shard.shape), []).append((model_param, shard))
        pair = next((ps for ps in by_shape.values() if len(ps) >= 2), None)
        if pair is not None:
            (m0, s0), (m1, s1) = pair[:2]
            s0.grad, s1.grad = s1.grad, s0.grad
            if not reported:
                reported.append(True)
                _report_touched("adam_state_stepped_on_wrong_shard", (names[id(m0)], names[id(m1)]))

    DistributedOptimizer._copy_model_grads_to_main_grads = copy_model_grads_to_main_grads


_MISSING = object()


@bug()
def grad_norm_misses_expert_ranks(chunks) -> None:
    """The grad norm leaves out the expert parameters' grads (the expert optimizer's contribution
    is dropped, as when the norm is reduced over a group that has no expert ranks): clipping then
    uses too small a norm."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    original = ChainedOptimizer.get_grad_norm

    def get_grad_norm(self):
        experts = [o for o in self.chained_optimizers  # the optimizer of megatron's expert-parallel groups
                   if any(g.get("is_expert_parallel") for g in getattr(getattr(o, "optimizer", None), "param_groups", []))]
        saved = [(o, compat.grads_for_norm_attr(o)) for o in experts]
        saved = [(o, attr, o.__dict__.get(attr, _MISSING)) for o, attr in saved]
        for o, attr, _ in saved:
            setattr(o, attr, lambda *args, **kwargs: [])
        try:
            return original(self)
        finally:
            for o, attr, before in saved:
                if before is _MISSING:
                    delattr(o, attr)  # the class's method again
                else:
                    setattr(o, attr, before)

    ChainedOptimizer.get_grad_norm = get_grad_norm


@bug()
def qb_beta_not_averaged_over_dp(chunks) -> None:
    """Quantile balancing's once-a-global-batch update of the per-expert bias (0.19,
    ``finalize_model_grads._update_router_qb_beta``) skips its average over DP: each DP rank's
    ``qb_beta`` follows the quantiles of its own microbatches, and the routers' replicas choose by
    different biases from the second iteration on."""
    import importlib

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    original = getattr(finalize, "_update_router_qb_beta", None)
    if original is None:
        raise ValueError("bug injection: qb_beta_not_averaged_over_dp needs megatron-core's quantile balancing (0.19)")

    def update_router_qb_beta(model, config, dp_cp_group=None):
        all_reduce = torch.distributed.all_reduce
        torch.distributed.all_reduce = lambda *args, **kwargs: None  # the bug: no average over DP
        try:
            return original(model, config, dp_cp_group=dp_cp_group)
        finally:
            torch.distributed.all_reduce = all_reduce

    finalize._update_router_qb_beta = update_router_qb_beta


@bug()
def qb_quantile_over_the_rank_shard(chunks) -> None:
    """Quantile balancing (0.19) takes each expert's quantile over this rank's shard of the sequence,
    its all-gather over TP×CP left out (as with no TP×CP group): under sequence parallelism each TP
    rank's ``qb_beta`` follows its own tokens, and the router's replicas choose by different biases
    from the second iteration on."""
    from megatron.core.transformer.moe.router import Router

    routers = [router for _, router in _modules(chunks, "*", Router) if hasattr(router, "quantile_balancing")]
    if not routers:
        raise ValueError("bug injection: qb_quantile_over_the_rank_shard needs megatron-core's quantile balancing "
                         "(0.19)")
    for router in routers:
        original = router.quantile_balancing

        def quantile_balancing(logits, original=original, router=router):
            group = router.tp_cp_group
            router.tp_cp_group = None  # the bug: no gather, the rank's own rows
            try:
                return original(logits)
            finally:
                router.tp_cp_group = group

        router.quantile_balancing = quantile_balancing


@bug(default_pattern="*self_attention")
def gathered_linear_pieces_reversed(chunks, pattern: str) -> None:
    """A heterogeneous layer's linear replacement (``replace_with_linear``, megatron's
    ColumnParallelLinearGathered) concatenates its TP pieces in reverse rank order when it gathers
    them (a wrong rank-to-piece map): the output's hidden columns are permuted by blocks of h/TP,
    and the backward, following the forward, hands each rank the grad of another rank's columns."""
    import importlib

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    replacements = importlib.import_module("megatron.core.transformer.heterogeneous.linear_replacements")
    gather = replacements.gather_from_tensor_model_parallel_region

    def reversed_gather(x):
        from megatron.core import parallel_state

        pieces = gather(x).chunk(parallel_state.get_tensor_model_parallel_world_size(), dim=-1)
        return torch.cat(pieces[::-1], dim=-1)

    found = [(n, m) for n, m in _modules(chunks, pattern, ColumnParallelLinear)
             if type(m).__name__ == "ColumnParallelLinearGathered"]
    if not found and _pipeline_size() == 1:
        raise ValueError(f"bug injection: no linear replacement (replace_with_linear) matches {pattern!r}")
    for _, module in found:
        original_forward = module.forward

        @functools.wraps(original_forward)
        def forward(*args, _original=original_forward, **kwargs):
            replacements.gather_from_tensor_model_parallel_region = reversed_gather
            try:
                return _original(*args, **kwargs)
            finally:
                replacements.gather_from_tensor_model_parallel_region = gather

        module.forward = forward


@bug(at_build=True)
def heterogeneous_block_config_off_by_one() -> None:
    """A heterogeneous model reads each layer's block config one layer late (its global layer
    number taken as 0-based in ``get_config_for_layer``): every layer gets the next one's query
    groups and MLP width (the last wraps to the first), while the layer spec still gives it its own
    kinds of sublayer. A valid recipe built as another model: the build check's finding."""
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

    original = HeterogeneousTransformerConfig.get_config_for_layer

    def get_config_for_layer(self, layer_number):
        return original(self, layer_number % len(self.per_block_parameters) + 1)

    HeterogeneousTransformerConfig.get_config_for_layer = get_config_for_layer


@bug()
def adam_step_doubled_on_rank_1(chunks) -> None:
    """Global rank 1 moves each parameter it steps twice as far as Adam's update (the step applied
    twice, its moments updated once): the moments, the lr and every setting are right, and only the
    updated values show it, on the elements that rank steps."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise ValueError("bug injection: adam_step_doubled_on_rank_1 needs two ranks or more")
    import megatron.core.optimizer as megatron_optimizer

    if getattr(megatron_optimizer, "Adam", None) is not torch.optim.AdamW:  # TE's or apex's fused Adam: not patched
        raise ValueError("bug injection: adam_step_doubled_on_rank_1 patches torch's AdamW, which this megatron-core "
                         "does not use for Adam")
    original = torch.optim.AdamW.step

    @torch.no_grad()
    def step(self, *args, **kwargs):
        before = [[p.detach().clone() for p in group["params"]] for group in self.param_groups]
        loss = original(self, *args, **kwargs)
        if dist.get_rank() == 1:
            for group, olds in zip(self.param_groups, before):
                for p, old in zip(group["params"], olds):
                    p.add_(p - old)
        return loss

    torch.optim.AdamW.step = step
