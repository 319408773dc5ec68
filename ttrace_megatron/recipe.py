"""Recipes: YAML files whose keys are megatron-core's own field names.

``model:`` holds TransformerConfig fields (plus the GPTModel arguments listed in
``GPT_MODEL_KEYS``), ``parallel:`` the candidate's ModelParallelConfig fields, ``optimizer:``
OptimizerConfig fields, ``ddp:`` DistributedDataParallelConfig fields. Those sections are checked against megatron-core's dataclasses by
the adapter (:func:`ttrace_megatron.adapter.recipe.config.validate_recipe`); this module checks
everything else. Unknown keys are errors that name the key.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional

import yaml

from .errors import RecipeError

DTYPES = ("fp32", "bf16", "fp16", "fp8")
# where the seed checkpoint's weights come from: megatron's initialization, or redrawn so that a
# layout's bugs show (adapter.run.sensitize: O(1) activations, peaked attention, non-zero biases)
SEED_INIT_MEGATRON, SEED_INIT_SENSITIZED = "megatron", "sensitized"
SEED_INITS = (SEED_INIT_MEGATRON, SEED_INIT_SENSITIZED)
TOP_LEVEL_KEYS = ("name", "description", "model", "parallel", "world_size", "optimizer", "ddp", "data", "train",
                  "dtype", "tolerance")


@dataclasses.dataclass
class DataConfig:
    seed: int = 1234
    vocab_size: int = 256  # the logical vocabulary (before megatron pads it)
    seq_length: int = 32
    micro_batch_size: int = 2
    global_batch_size: int = 4
    # where the tokens come from: SYNTHETIC (ttrace's own: i.i.d. tokens drawn from the seed, one
    # sample per sequence) or MEGATRON_MOCK (megatron-core's MockGPTDataset, what Megatron-LM's
    # --mock-data trains on); None: synthetic in ttrace's runner, Megatron-LM's own data with --megatron-lm
    source: Optional[str] = None
    # MEGATRON_INDEXED only: the prefix of a megatron indexed dataset (PREFIX.bin / PREFIX.idx), relative
    # to the recipe's directory unless absolute
    path: Optional[str] = None
    # Megatron-LM's --eod-mask-loss: the end-of-document token (the tokenizer's last, NullTokenizer's
    # EOD) carries no loss, as megatron's GPTDataset masks it
    eod_mask_loss: bool = False
    # synthetic data only: the mean share of each sample's tokens masked out of the loss, as a prompt
    # prefix whose length every sample draws (0 … 2 × share of the sequence, at least one token left):
    # the valid-token counts differ between microbatches and DP ranks on purpose
    masked_share: float = 0.0
    # packed documents, as Megatron-LM's --reset-position-ids and --reset-attention-mask: each
    # document of a sample (ended by the EOD token) starts again at position 0 and attends only to
    # itself (megatron's GPTDataset builds the positions and the [s, s] mask)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    # synthetic data only: the mean length of the documents packed into a sample (an EOD token ends
    # each); 0: documents end only where the drawn token happens to be EOD
    document_length: int = 0
    # synthetic data only: the mean share of each sample that is padding (a tail of drawn length, at
    # least one real token left): no loss, and handed to the model as its padding_mask, which an MoE
    # router's aux loss, z-loss and expert-bias counts leave out (megatron-core's GPTModel.forward)
    padded_share: float = 0.0
    # synthetic data only: no token repeats within a sample (each a random draw without replacement
    # from the vocabulary less its EOD token), so a bug that moves a position's activation onto
    # another position never lands on an equal one (issue #36's sensitizing data)
    distinct_tokens: bool = False


SYNTHETIC, MEGATRON_MOCK, MEGATRON_INDEXED = "synthetic", "megatron_mock", "megatron_indexed"
DATA_SOURCES = (SYNTHETIC, MEGATRON_MOCK, MEGATRON_INDEXED)


@dataclasses.dataclass
class TrainConfig:
    iterations: int = 1
    frozen: List[str] = dataclasses.field(default_factory=list)  # fnmatch patterns of param names
    # the lr and weight-decay schedule, as Megatron-LM's arguments of these names set it (its
    # OptimizerParamScheduler, which also applies megatron's param groups: no weight decay on
    # biases and norms); lr and min_lr are the optimizer's
    lr_decay_style: str = "linear"
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None  # None: the iterations
    weight_decay_incr_style: str = "constant"
    start_weight_decay: Optional[float] = None  # None: the optimizer's weight_decay
    end_weight_decay: Optional[float] = None
    # the starting point every side loads from the reference's seed checkpoint (SEED_INITS)
    seed_init: str = SEED_INIT_MEGATRON


@dataclasses.dataclass
class ToleranceOptions:
    # run the reference a second time with round-off-sized noise and bound each tensor by what the
    # noise moves it, too (adapter.run.perturb): for recipes whose round-off is amplified (FP8
    # quantization, bf16, a key norm's bias). Unset: on for dtype bf16 and fp8 and for qk_layernorm
    # with LayerNorm, off otherwise.
    perturbation: Optional[bool] = None


@dataclasses.dataclass
class Recipe:
    name: str
    model: Dict[str, Any]
    parallel: Dict[str, Any]
    world_size: int
    optimizer: Dict[str, Any]
    data: DataConfig
    train: TrainConfig
    dtype: str = "fp32"
    description: str = ""
    source: str = "<embedded>"
    tolerance: ToleranceOptions = dataclasses.field(default_factory=ToleranceOptions)
    ddp: Dict[str, Any] = dataclasses.field(default_factory=dict)  # DistributedDataParallelConfig fields

    def to_json(self) -> dict:
        return {"name": self.name, "model": self.model, "parallel": self.parallel, "world_size": self.world_size,
                "optimizer": self.optimizer, "ddp": self.ddp, "data": dataclasses.asdict(self.data),
                "train": dataclasses.asdict(self.train), "dtype": self.dtype,
                "tolerance": dataclasses.asdict(self.tolerance)}


def _section(raw: dict, cls, where: str):
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: '{cls.__name__}' section must be a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise RecipeError(f"{where}: unknown key '{key}' (known: {', '.join(sorted(names))})")
    obj = cls(**raw)
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        if f.type in ("int",) and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise RecipeError(f"{where}: '{f.name}' must be a non-negative integer, got {value!r}")
    return obj


def recipe_from_dict(raw: Any, source: str = "<embedded>") -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: a recipe is a YAML mapping")
    for key in raw:
        if key not in TOP_LEVEL_KEYS:
            raise RecipeError(f"{source}: unknown key '{key}' (known: {', '.join(TOP_LEVEL_KEYS)})")
    for key in ("model", "parallel", "optimizer", "ddp"):
        if not isinstance(raw.get(key, {}) or {}, dict):
            raise RecipeError(f"{source}: '{key}' must be a mapping")
    dtype = raw.get("dtype", "fp32")
    if dtype not in DTYPES:
        raise RecipeError(f"{source}: dtype must be one of {DTYPES}, got {dtype!r}")
    world = raw.get("world_size", 1)
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise RecipeError(f"{source}: world_size must be a positive integer, got {world!r}")
    data = _section(raw.get("data"), DataConfig, f"{source}: data")
    train = _section(raw.get("train"), TrainConfig, f"{source}: train")
    tolerance = _section(raw.get("tolerance"), ToleranceOptions, f"{source}: tolerance")
    if tolerance.perturbation is None:
        # FP8 quantization turns round-off into whole quantization steps where an element crosses a
        # rounding boundary, and bf16's backward near the loss carries more round-off than the
        # analytic bound allows (a GPT-3-like recipe: 101 analytic-only false positives over 5 seeds):
        # the analytic bound alone flags clean FP8 and bf16 runs (BENCHMARKS.md). A key
        # norm with a bias (qk_layernorm with LayerNorm) has a grad that is a sum cancelling almost
        # entirely (softmax ignores a shift of every key; only rotary embeddings break it), whose
        # round-off is relative to its terms, not to it: the noise run measures that
        model = raw.get("model") or {}
        key_norm_bias = bool(model.get("qk_layernorm")) and model.get("normalization", "LayerNorm") == "LayerNorm"
        tolerance.perturbation = dtype in ("bf16", "fp16", "fp8") or key_norm_bias
    if not isinstance(tolerance.perturbation, bool):
        raise RecipeError(f"{source}: tolerance: 'perturbation' must be true or false")
    if train.seed_init not in SEED_INITS:
        raise RecipeError(f"{source}: train: 'seed_init' must be one of {SEED_INITS}, got {train.seed_init!r}")
    if train.iterations < 1:
        raise RecipeError(f"{source}: train: 'iterations' must be at least 1")
    if not isinstance(train.frozen, list) or not all(isinstance(p, str) for p in train.frozen):
        raise RecipeError(f"{source}: train: 'frozen' must be a list of parameter-name patterns")
    if data.source is not None and data.source not in DATA_SOURCES:
        raise RecipeError(f"{source}: data: 'source' must be one of {DATA_SOURCES}, got {data.source!r}")
    if data.distinct_tokens and data.source in (MEGATRON_MOCK, MEGATRON_INDEXED):
        raise RecipeError(f"{source}: data: 'distinct_tokens' shapes ttrace's synthetic data; {data.source}'s "
                          f"tokens are its own")
    if data.distinct_tokens and data.vocab_size - 1 < data.seq_length + 1:
        raise RecipeError(f"{source}: data: 'distinct_tokens' needs vocab_size - 1 (the EOD token left out) ≥ "
                          f"seq_length + 1 tokens, got vocab_size {data.vocab_size}, seq_length {data.seq_length}")
    for switch in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask", "distinct_tokens"):
        if not isinstance(getattr(data, switch), bool):
            raise RecipeError(f"{source}: data: '{switch}' must be true or false")
    if isinstance(data.document_length, bool) or not isinstance(data.document_length, int) or data.document_length < 0:
        raise RecipeError(f"{source}: data: 'document_length' must be a whole number of tokens ≥ 0, got "
                          f"{data.document_length!r}")
    if data.document_length and data.source in (MEGATRON_MOCK, MEGATRON_INDEXED):
        raise RecipeError(f"{source}: data: 'document_length' shapes ttrace's synthetic data; {data.source}'s "
                          f"documents are its own")
    for share in ("masked_share", "padded_share"):
        value = getattr(data, share)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 0.5:
            raise RecipeError(f"{source}: data: '{share}' must be a number in [0, 0.5), got {value!r}")
        if value and data.source in (MEGATRON_MOCK, MEGATRON_INDEXED):
            raise RecipeError(f"{source}: data: '{share}' shapes ttrace's synthetic data; {data.source}'s mask is "
                              f"megatron's own (eod_mask_loss)")
    if (data.source == MEGATRON_INDEXED) != bool(data.path):
        raise RecipeError(f"{source}: data: 'path' (an indexed dataset's prefix) goes with source "
                          f"'{MEGATRON_INDEXED}', and that source needs one")
    if data.global_batch_size % data.micro_batch_size:
        raise RecipeError(f"{source}: data: global_batch_size {data.global_batch_size} is not a multiple of "
                          f"micro_batch_size {data.micro_batch_size}")
    name = raw.get("name") or os.path.splitext(os.path.basename(source))[0]
    return Recipe(name=str(name), model=dict(raw.get("model") or {}), parallel=dict(raw.get("parallel") or {}),
                  world_size=world, optimizer=dict(raw.get("optimizer") or {}), data=data, train=train,
                  dtype=dtype, description=str(raw.get("description", "")), source=source, tolerance=tolerance,
                  ddp=dict(raw.get("ddp") or {}))


# where a check keeps its fp32 twin's traces, beside the recipe's own (``--out``)
FP32_TWIN = "fp32_twin"


def fp32_twin(recipe: Recipe) -> Optional[Recipe]:
    """The recipe's fp32 twin: the same model, layout, data, optimizer and schedule in fp32 (no
    Float16Module, no FP8, no loss scaling), or None for an fp32 recipe.

    Most bugs of a parallel layout are in its logic (a wrong group, scale, offset or stride), not in
    its dtype, and fp32 separates them from round-off by 10³–10⁵× where bf16 may not separate them
    at all (issue #36: a √2 error in attention's softmax scale moves a near-uniform attention by less
    than bf16's round-off). The twin is judged under fp32 bounds; the recipe's own pair then covers
    only what is dtype-specific. Its tolerance options are fp32's defaults (the perturbation estimate
    only for a key norm with a bias), not the low-precision recipe's."""
    if recipe.dtype == "fp32":
        return None
    raw = recipe.to_json()
    raw.update(dtype="fp32", tolerance={})
    return recipe_from_dict(raw, source=f"{recipe.source} (fp32 twin)")


def load_recipe(path: str) -> Recipe:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise RecipeError(f"{path}: cannot read recipe ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({e})") from None
    return recipe_from_dict(raw, source=path)


# The embedded default: what `ttrace run` with no recipe runs (a tiny llama-style GPT on CPU,
# single-device reference vs. TP=2 with sequence parallelism).
DEFAULT_RECIPE = {
    "name": "tiny_gpt_tp2_sp",
    "description": "tiny llama-style GPT (RMSNorm, SwiGLU, GQA, RoPE): TP=1 reference vs TP=2 + SP candidate",
    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 128, "normalization": "RMSNorm", "gated_linear_unit": True,
              "activation_func": "silu",
              "add_bias_linear": False},
    "parallel": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "world_size": 2,
    "optimizer": {"optimizer": "adam", "lr": 0.001},
    "data": {"seed": 1234, "vocab_size": 250, "seq_length": 32, "micro_batch_size": 2, "global_batch_size": 4},
    "train": {"iterations": 3},
    "dtype": "fp32",
}


def default_recipe() -> Recipe:
    return recipe_from_dict(DEFAULT_RECIPE)
