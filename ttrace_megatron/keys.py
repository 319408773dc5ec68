"""Tensor keys: the names under which tensors are recorded, and what each name means.

A recorded tensor is identified by a :class:`TensorKey` (iteration, global microbatch, canonical
module name, phase, tensor name). The tensor names form a small protocol shared by the recorder,
the replayer, the perturbation run, the comparison and the report; every writer builds names with
the constructors below and every reader classifies them with :func:`kind_of` and the predicates,
so renaming one changes it everywhere at once — tolerances (reduction lengths) and culprits
(arrivals, phase labels) included.

Knows nothing about megatron.
"""

from __future__ import annotations

import dataclasses
import enum

# ---- phases
FORWARD = "forward"
BACKWARD = "backward"
MAIN_GRAD = "main_grad"  # param.main_grad once the grads are reduced
OPTIMIZER = "optimizer"  # the step's scalars and the updated parameters
PHASES = (FORWARD, BACKWARD, MAIN_GRAD, OPTIMIZER)

# ---- module names of tensors that belong to no module
LOSS_MODULE = "loss"
OPTIMIZER_MODULE = "optimizer"

# ---- tensor names
INPUT = "input"  # a module's first input (forward)
OUTPUT = "output"  # a module's first output (forward)
# the same output as activation recomputation computed it again inside the backward (the candidate's
# alone: the reference keeps its activations), judged against the reference's output
RECOMPUTED_OUTPUT = "recomputed_output"
GRAD_INPUT = "grad_input"  # the grad w.r.t. a module's input: its dgrad (backward)
GRAD_OUTPUT = "grad_output"  # the grad arriving at a module's output (backward)
PER_TOKEN_LOSS = "per_token_loss"
# the loss mask the model was handed with its labels ([b, s], 1 where a token carries loss): the data
# path's decision which tokens count, judged like the loss it masks (phase forward, module loss)
LOSS_MASK = "loss_mask"
# the padding mask the model was handed ([b, s], 1 on padding): what an MoE router leaves out
PADDING_MASK = "padding_mask"
# data the run is handed, not computed: two correct runs agree exactly (judged with no tolerance)
EXACT_DATA = (LOSS_MASK, PADDING_MASK)
GRAD_NORM = "grad_norm"
# the same norm of the same grads over the same groups, computed in fp64 beside megatron's fp32 kernel:
# what the grad norm would be without its own round-off (its difference from GRAD_NORM is that round-off)
GRAD_NORM_FP64 = "grad_norm_fp64"
CLIP_COEFFICIENT = "clip_coefficient"
STEP_COUNT = "step_count"  # the optimizer's step count after the step (Adam's bias correction)
OPTIMIZER_SCALARS = (GRAD_NORM, GRAD_NORM_FP64, CLIP_COEFFICIENT, STEP_COUNT)
# the optimizer's state of a parameter after the step (phase optimizer): ``{param}.{name}``
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
MOMENTUM_BUFFER = "momentum_buffer"
MAIN_PARAM = "main_param"  # the fp32 master copy, where it is not the parameter itself
OPTIMIZER_STATES = (EXP_AVG, EXP_AVG_SQ, MOMENTUM_BUFFER, MAIN_PARAM)
# what the step applied to a param group (module optimizer, phase optimizer): ``{group}.{name}``
LR = "lr"
WEIGHT_DECAY = "weight_decay"
ADAM_EPS = "eps"  # recorded for a group whose Adam ε is not the optimizer's (μP's hidden matrices: ε / width)
STEP_SETTINGS = (LR, WEIGHT_DECAY, ADAM_EPS)
# a parameter's share of the step's grad norm (module: the parameter's, phase optimizer):
# ``{param}.grad_norm_sq``, the sum of the squares of its main grad as the norm counted them,
# over every rank (a rank that holds it and does not count it contributes 0)
GRAD_NORM_SQ = "grad_norm_sq"
# what a loss-scaled (fp16) step decided (module optimizer, phase optimizer): the scale its grads
# were computed at, and whether it skipped the update (1) because a grad was not finite. Set, not
# reduced: two correct runs agree exactly
LOSS_SCALE = "loss_scale"
STEP_SKIPPED = "step_skipped"
STEP_DECISIONS = (LOSS_SCALE, STEP_SKIPPED)
# a top-k selection (an MoE router's): the scores it is taken on, and the choice as a 0/1 map over them
TOPK_SCORES = "topk_scores"
TOPK_CHOICE = "topk_choice"
# a second selection on the same [tokens, experts] map: the tokens each expert keeps at its capacity
# (the top ``capacity`` of a column of routing probabilities), and those probabilities
CAPACITY_SCORES = "capacity_scores"
CAPACITY_CHOICE = "capacity_choice"
# per choice: the scores it is taken on, and the axis its top-k runs along (1: each token picks
# among the experts; 0: each expert picks among the tokens)
# and the load-balancing loss's own top-k (the tokens per expert it counts), on its own scores
BALANCING_SCORES = "balancing_scores"
BALANCING_CHOICE = "balancing_choice"
SELECTION_SCORES_OF = {TOPK_CHOICE: TOPK_SCORES, CAPACITY_CHOICE: CAPACITY_SCORES, BALANCING_CHOICE: BALANCING_SCORES}
SELECTION_AXIS = {TOPK_CHOICE: 1, CAPACITY_CHOICE: 0, BALANCING_CHOICE: 1}
WEIGHT = "weight"  # a GEMM's weight operand (with INPUT and GRAD_OUTPUT, the operands an amax summarizes)

_GRAD_SUFFIX = ".grad"
_MAIN_GRAD_SUFFIX = ".main_grad"
_AMAX_SUFFIX = "_amax"
_AUX_LOSS_SUFFIX = "_loss"


class TensorKind(enum.Enum):
    """What a recorded tensor is, read from its phase and name."""

    INPUT = "input"
    OUTPUT = "output"
    GRAD_INPUT = "grad_input"
    GRAD_OUTPUT = "grad_output"
    PARAM_GRAD = "param_grad"  # a parameter's grad of one microbatch
    MAIN_GRAD = "main_grad"  # a parameter's reduced grad
    PARAM = "param"  # a parameter's value after the optimizer step
    OPTIMIZER_STATE = "optimizer_state"  # exp_avg, exp_avg_sq, momentum buffer, fp32 main param after the step
    STEP_SETTING = "step_setting"  # the lr and weight decay the step applied to a param group
    OPTIMIZER_SCALAR = "optimizer_scalar"  # grad norm, clip coefficient
    LOSS = "loss"  # the per-token loss
    AUX_LOSS = "aux_loss"  # an MoE router's load-balancing or z-loss
    AMAX = "amax"  # an FP8 GEMM operand's amax: a statistic of that operand
    SELECTION_SCORES = "selection_scores"  # what a top-k selection is taken on, per token
    SELECTION = "selection"  # a top-k choice: 1 where chosen, 0 elsewhere; judged by its scores
    GRAD_NORM_TERM = "grad_norm_term"  # one parameter's ‖main grad‖² as the step's grad norm counted it


_ACTIVATIONS = {(FORWARD, INPUT): TensorKind.INPUT, (FORWARD, OUTPUT): TensorKind.OUTPUT,
                (FORWARD, RECOMPUTED_OUTPUT): TensorKind.OUTPUT,
                (BACKWARD, GRAD_INPUT): TensorKind.GRAD_INPUT, (BACKWARD, GRAD_OUTPUT): TensorKind.GRAD_OUTPUT}

# the kind of a GEMM operand an amax summarizes (fp8 emulation: input, weight, grad_output)
_OPERAND_KINDS = {INPUT: TensorKind.INPUT, WEIGHT: TensorKind.PARAM, GRAD_OUTPUT: TensorKind.GRAD_OUTPUT}


@dataclasses.dataclass(frozen=True)
class TensorKey:
    """Run-independent identity of a logical tensor."""

    iteration: int
    microbatch: int  # global microbatch id; -1 for per-iteration tensors (main_grad, optimizer)
    module: str  # canonical module name: no wrapper prefixes, global layer numbers
    phase: str  # one of PHASES
    tensor: str  # built by the constructors of this module

    def __str__(self) -> str:
        mb = "" if self.microbatch < 0 else f" mb{self.microbatch}"
        return f"it{self.iteration}{mb} {self.module} [{self.phase}] {self.tensor}"

    @property
    def kind(self) -> TensorKind:
        return kind_of(self.phase, self.tensor)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(obj: dict) -> "TensorKey":
        return TensorKey(int(obj["iteration"]), int(obj["microbatch"]), str(obj["module"]),
                         str(obj["phase"]), str(obj["tensor"]))


# ---- constructors


def param_grad(param_name: str) -> str:
    """The per-microbatch grad of parameter ``param_name`` (phase backward)."""
    return param_name + _GRAD_SUFFIX


def main_grad(param_name: str) -> str:
    """The reduced grad of parameter ``param_name`` (phase main_grad)."""
    return param_name + _MAIN_GRAD_SUFFIX


def updated_param(param_name: str) -> str:
    """The value of parameter ``param_name`` after the step (phase optimizer)."""
    return param_name


def optimizer_state(param_name: str, state: str) -> str:
    """The optimizer's ``state`` of a parameter after the step (phase optimizer)."""
    if state not in OPTIMIZER_STATES:
        raise ValueError(f"not an optimizer state: {state!r}")
    return f"{param_name}.{state}"


def step_setting(group: str, setting: str) -> str:
    """What the step applied to a param group: its lr, weight decay or Adam ε (module optimizer)."""
    if setting not in STEP_SETTINGS:
        raise ValueError(f"not a step setting: {setting!r}")
    return f"{group}.{setting}"


def grad_norm_term(param_name: str) -> str:
    """A parameter's term of the step's grad norm (phase optimizer): ``{param}.grad_norm_sq``."""
    return f"{param_name}.{GRAD_NORM_SQ}"


def amax(operand: str) -> str:
    """The amax of a GEMM operand (``input``, ``weight``, ``grad_output``)."""
    if operand not in _OPERAND_KINDS:
        raise ValueError(f"not a GEMM operand: {operand!r}")
    return operand + _AMAX_SUFFIX



# ---- readers


def kind_of(phase: str, tensor: str) -> TensorKind:
    """Classify a recorded name; unknown names are an error, never a silent default."""
    activation = _ACTIVATIONS.get((phase, tensor))
    if activation is not None:
        return activation
    if tensor.endswith(_AMAX_SUFFIX) and tensor[:-len(_AMAX_SUFFIX)] in _OPERAND_KINDS:
        return TensorKind.AMAX
    if phase == BACKWARD and tensor.endswith(_GRAD_SUFFIX):
        return TensorKind.PARAM_GRAD
    if phase == MAIN_GRAD and tensor.endswith(_MAIN_GRAD_SUFFIX):
        return TensorKind.MAIN_GRAD
    if phase == OPTIMIZER:
        if tensor in STEP_DECISIONS:
            return TensorKind.STEP_SETTING
        if tensor in OPTIMIZER_SCALARS:
            return TensorKind.OPTIMIZER_SCALAR
        suffix = tensor.rpartition(".")[2] if "." in tensor else ""
        if suffix == GRAD_NORM_SQ:
            return TensorKind.GRAD_NORM_TERM
        if suffix in OPTIMIZER_STATES:
            return TensorKind.OPTIMIZER_STATE
        if suffix in STEP_SETTINGS:
            return TensorKind.STEP_SETTING
        return TensorKind.PARAM
    if phase == FORWARD and tensor in (PER_TOKEN_LOSS, LOSS_MASK, PADDING_MASK):
        return TensorKind.LOSS
    if phase == FORWARD and tensor in SELECTION_SCORES_OF.values():
        return TensorKind.SELECTION_SCORES
    if phase == FORWARD and tensor in SELECTION_SCORES_OF:
        return TensorKind.SELECTION
    if phase == FORWARD and tensor.endswith(_AUX_LOSS_SUFFIX):
        return TensorKind.AUX_LOSS
    raise ValueError(f"unknown recorded tensor {tensor!r} in phase {phase!r}")


def param_name_of(tensor: str) -> str:
    """The parameter a PARAM_GRAD / MAIN_GRAD / PARAM / OPTIMIZER_STATE / GRAD_NORM_TERM name is about."""
    for suffix in (_MAIN_GRAD_SUFFIX, _GRAD_SUFFIX):
        if tensor.endswith(suffix):
            return tensor[:-len(suffix)]
    head, _, tail = tensor.rpartition(".")
    if head and (tail in OPTIMIZER_STATES or tail == GRAD_NORM_SQ):
        return head
    return tensor


def sibling(key: TensorKey, tensor: str) -> TensorKey:
    """Another tensor of the same module, iteration, microbatch and phase."""
    return dataclasses.replace(key, tensor=tensor)



def operand_kind(operand: str) -> TensorKind:
    """What an FP8 GEMM operand is: ``weight`` is a parameter, ``input``/``grad_output`` activations."""
    return _OPERAND_KINDS[operand]


def microbatch_grad_key(main_grad_key: TensorKey, microbatch: int) -> TensorKey:
    """The per-microbatch grad a main grad is reduced from."""
    return dataclasses.replace(main_grad_key, microbatch=microbatch, phase=BACKWARD,
                               tensor=param_grad(param_name_of(main_grad_key.tensor)))


def is_arrival(key: TensorKey) -> bool:
    """What arrives at a module (its input in forward, its output-grad in backward), as opposed to
    what the module computes. A localization replay substitutes these."""
    return key.kind in (TensorKind.INPUT, TensorKind.GRAD_OUTPUT)


def is_updated_value(key: TensorKey) -> bool:
    """A parameter's value after the step: the model parameter, or its fp32 main copy."""
    return key.kind is TensorKind.PARAM or (key.kind is TensorKind.OPTIMIZER_STATE
                                            and key.tensor.endswith("." + MAIN_PARAM))


def value_power(key: TensorKey) -> int:
    """The power of the reduced value a tensor accumulates: 2 for Adam's second moment (a running
    sum of squared grads), 1 otherwise."""
    return 2 if key.kind is TensorKind.OPTIMIZER_STATE and key.tensor.endswith("." + EXP_AVG_SQ) else 1


def is_exact_data(key: TensorKey) -> bool:
    """A mask the model was handed (loss or padding mask): data, equal in two correct runs to the
    last bit, so any difference is a bug, whatever the dtype's round-off."""
    return key.phase == FORWARD and key.tensor in EXACT_DATA


def reference_key(key: TensorKey) -> TensorKey:
    """The key the reference records a candidate's tensor under: a recomputed output is the output
    of the same call (the reference does not recompute)."""
    if key.phase == FORWARD and key.tensor == RECOMPUTED_OUTPUT:
        return dataclasses.replace(key, tensor=OUTPUT)
    return key


def is_per_microbatch(key: TensorKey) -> bool:
    return key.microbatch >= 0


_PHASE_LABELS = {TensorKind.LOSS: "forward (loss)", TensorKind.GRAD_INPUT: "backward (dgrad)",
                 TensorKind.PARAM_GRAD: "backward (wgrad)", TensorKind.INPUT: "forward (arrival)",
                 TensorKind.GRAD_OUTPUT: "backward (arrival)", TensorKind.MAIN_GRAD: "grad reduction"}


def phase_label(key: TensorKey) -> str:
    """forward / backward (dgrad) / backward (wgrad) / grad reduction / optimizer, for reports."""
    return _PHASE_LABELS.get(key.kind, key.phase)
