"""A recipe from a Megatron-LM command line, for ``ttrace plan --megatron-lm-args``.

The inverse of :func:`checkout.training_args`, read off the same tables (``_VALUE_FLAGS``,
``_SWITCH_FLAGS``, ``_PARALLEL_FLAGS``), so a flag ttrace translates one way it reads back the
other. A user planning a check of their own ``pretrain_gpt.py`` run pastes its flags; what sets the
model, the layout, the batch, the dtype and the iterations is read, the flags known to change none
of the recorded bytes (schedules, logging, checkpoints, data paths, fusions) are listed as not read,
and any other flag is refused by name: it may change the model, and a plan that silently ignored it
would describe another run.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ...errors import RecipeError
from .checkout import _PARALLEL_FLAGS, _SWITCH_FLAGS, _VALUE_FLAGS

SOURCE = "Megatron-LM arguments"

# flags that change nothing a check records (their values are read by the training loop, the data
# pipeline, the logger or the checkpointer), by prefix; the plan lists the ones it met
NOT_READ_PREFIXES = (
    "--lr", "--min-lr", "--weight-decay", "--start-weight-decay", "--end-weight-decay", "--clip-grad", "--adam-",
    "--sgd-", "--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--hysteresis",
    "--save", "--load", "--no-load-", "--ckpt-", "--async-save", "--finetune", "--pretrained-checkpoint",
    "--log-", "--tensorboard", "--wandb-", "--timing-log", "--logging-level",
    "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--split", "--mock-data",
    "--tokenizer-", "--vocab-file", "--merge-file", "--dataloader-type", "--num-workers", "--data-cache-path",
    "--eval-", "--exit-duration-in-mins", "--exit-signal-handler", "--distributed-backend",
    "--distributed-timeout-minutes",
    "--hidden-dropout", "--attention-dropout", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
    "--no-persist-layer-norm", "--use-cpu-initialization", "--attention-softmax-in-fp32", "--init-method-std",
    "--norm-epsilon", "--rotary-base", "--rotary-percent", "--max-position-embeddings", "--use-mcore-models",
    "--use-flash-attn", "--attention-backend", "--overlap-grad-reduce", "--seed",
    "--accumulate-allreduce-grads-in-fp32", "--use-checkpoint-args",
    "--manual-gc", "--no-create-attention-mask-in-dataloader", "--profile",
    "--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask",  # mask values, not their bytes
)
_DTYPES = {"--bf16": "bf16", "--fp16": "fp16"}
# ttrace's own flags that do not change what a side records; the others are the plan's own options
TTRACE_NOT_READ = ("--ttrace", "--ttrace-dir", "--ttrace-seed-checkpoint", "--ttrace-role", "--ttrace-lockstep",
                   "--ttrace-page-cache", "--ttrace-map-reference")
_RECOMPUTE = {"--recompute-granularity": "recompute_granularity", "--recompute-method": "recompute_method",
              "--recompute-num-layers": "recompute_num_layers"}


def _tokens(argv: Sequence[str]) -> List[Tuple[str, List[str]]]:
    """(flag, its values) in order; a value is every token up to the next ``--`` flag."""
    out: List[Tuple[str, List[str]]] = []
    for token in argv:
        if token.startswith("--"):
            flag, _, value = token.partition("=")
            out.append((flag, [value] if value else []))
        elif not out:
            raise RecipeError(f"{SOURCE}: {token!r} comes before any flag")
        else:
            out[-1][1].append(token)
    return out


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _one(flag: str, values: List[str]) -> str:
    if len(values) != 1:
        raise RecipeError(f"{SOURCE}: {flag} takes one value, got {values or 'none'}")
    return values[0]


_MODEL_OF = {flag: field for field, flag in _VALUE_FLAGS.items()}
_SWITCH_OF = {flag: field for field, flag in _SWITCH_FLAGS.items()}
_PARALLEL_OF = {flag: field for field, flag in _PARALLEL_FLAGS.items()}


def _model_flag(flag: str, values: List[str], model: Dict, seen: Dict) -> bool:
    """Read one flag of the model's shape into ``model`` (``seen``: what later flags qualify);
    False if it is no model flag."""
    if flag in _MODEL_OF:
        model[_MODEL_OF[flag]] = _number(_one(flag, values))
    elif flag in _SWITCH_OF:
        model[_SWITCH_OF[flag]] = True
    elif flag == "--num-query-groups":
        seen["groups"] = int(_one(flag, values))  # read only with --group-query-attention, as Megatron-LM does
    elif flag == "--group-query-attention":
        seen["gqa"] = True
    elif flag in _RECOMPUTE:
        value = _one(flag, values)
        model[_RECOMPUTE[flag]] = int(value) if flag == "--recompute-num-layers" else value
    elif flag == "--recompute-activations":  # Megatron-LM's shorthand for selective recomputation
        model["recompute_granularity"] = "selective"
    elif flag == "--recompute-modules":
        model["recompute_modules"] = list(values)
    elif flag == "--disable-bias-linear":
        model["add_bias_linear"] = False
    elif flag == "--swiglu":
        model.update(gated_linear_unit=True, activation_func="silu")
    elif flag == "--untie-embeddings-and-output-weights":
        model["share_embeddings_and_output_weights"] = False
    elif flag == "--moe-layer-freq":
        value = _one(flag, values)
        model["moe_layer_freq"] = [int(x) for x in value.strip("[]").split(",")] if value.startswith("[") \
            else int(value)
    elif flag == "--make-vocab-size-divisible-by":
        model["make_vocab_size_divisible_by"] = int(_one(flag, values))
    elif flag == "--transformer-impl":
        if _one(flag, values) != "local":
            raise RecipeError(f"{SOURCE}: --transformer-impl {values[0]}: ttrace traces megatron's local layers "
                              f"only (TransformerEngine's are not recorded); plan with --transformer-impl local")
    else:
        return False
    return True


def recipe_from_args(argv: Sequence[str], world_size: int) -> Tuple[Dict, List[str]]:
    """(raw recipe, flags not read) for the run ``argv`` describes on ``world_size`` ranks.

    Raises RecipeError naming a flag that may change the model and has no reading here, or a
    field the plan needs and the flags do not give (the vocabulary: Megatron-LM takes it from the
    tokenizer, which the plan does not open; pass ``--vocab-size``)."""
    model: Dict = {"share_embeddings_and_output_weights": True}  # Megatron-LM ties them unless told not to
    parallel: Dict = {}
    data: Dict = {}
    optimizer: Dict = {"optimizer": "adam"}
    raw: Dict = dict(name="megatron_lm_args", description=f"planned from {len(argv)} Megatron-LM arguments",
                     dtype="fp32", world_size=world_size)
    seen: Dict = {}
    not_read: List[str] = []
    for flag, values in _tokens(argv):
        if _model_flag(flag, values, model, seen):
            continue
        if flag in _PARALLEL_OF:
            parallel[_PARALLEL_OF[flag]] = int(_one(flag, values))
        elif flag == "--sequence-parallel":
            parallel["sequence_parallel"] = True
        elif flag == "--context-parallel-size":
            parallel["context_parallel_size"] = int(_one(flag, values))
        elif flag == "--overlap-param-gather":
            raw.setdefault("ddp", {})["overlap_param_gather"] = True
        elif flag == "--use-distributed-optimizer":
            optimizer["use_distributed_optimizer"] = True
        elif flag == "--optimizer":
            optimizer["optimizer"] = _one(flag, values)
        elif flag in _DTYPES:
            raw["dtype"] = "fp8" if seen.get("fp8") else _DTYPES[flag]
        elif flag == "--fp8-format":  # FP8 GEMMs in a bf16 run: whichever order the flags come in
            raw["dtype"] = seen["fp8"] = "fp8"
        elif flag in ("--seq-length", "--micro-batch-size", "--global-batch-size", "--vocab-size"):
            data[flag[2:].replace("-", "_")] = int(_one(flag, values))
        elif flag in ("--train-iters", "--exit-interval"):
            seen[flag] = int(_one(flag, values))
        elif flag in TTRACE_NOT_READ or flag.startswith(NOT_READ_PREFIXES):
            not_read.append(flag)
        elif flag.startswith("--ttrace"):
            raise RecipeError(f"{SOURCE}: {flag}: give ttrace plan its own --iters, --modules, --microbatches, "
                              f"--perturb or --online instead")
        else:
            raise RecipeError(f"{SOURCE}: {flag} is not read by `ttrace plan` and may change the model or what "
                              f"is recorded; leave it out to plan without it")
    for flag, field in (("--vocab-size", "vocab_size"), ("--seq-length", "seq_length"),
                        ("--micro-batch-size", "micro_batch_size"), ("--global-batch-size", "global_batch_size")):
        if field not in data:
            raise RecipeError(f"{SOURCE}: give {flag}: the plan needs it"
                              + (" (Megatron-LM reads the vocabulary from the tokenizer, which the plan does not "
                                 "open)" if field == "vocab_size" else ""))
    if "--train-iters" not in seen:
        raise RecipeError(f"{SOURCE}: give --train-iters: the iterations a check records")
    if seen.get("gqa") and seen.get("groups"):
        model["num_query_groups"] = seen["groups"]
    elif seen.get("groups"):
        not_read.append("--num-query-groups (without --group-query-attention Megatron-LM ignores it)")
    iterations = min(seen["--train-iters"], seen.get("--exit-interval") or seen["--train-iters"])
    raw.update(model=model, parallel=parallel, data=dict(data, seed=1), optimizer=optimizer,
               train=dict(iterations=iterations))
    return raw, not_read
