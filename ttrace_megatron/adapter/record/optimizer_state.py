"""What megatron-core's optimizer holds for each model parameter: its main parameter, its state,
and the lr and weight decay its param group applied.

megatron wraps a torch optimizer in one of three classes, each keeping the main (fp32) copy of a
model parameter its own way:

* ``FP32Optimizer``: the model parameter itself;
* ``Float16OptimizerWithFloat16Params`` (bf16/fp16): an fp32 copy of the whole parameter
  (``float16_groups`` ↔ ``fp32_from_float16_groups``; fp32 parameters are their own main copy);
* ``DistributedOptimizer``: the fp32 copy of this rank's owned range only, flattened
  (``model_float16_groups`` ↔ ``shard_fp32_from_float16_groups``, ``model_fp32_groups`` ↔
  ``shard_fp32_groups``): the range :func:`.layouts.distributed_optimizer_ranges` gives.

A ``ChainedOptimizer`` chains several (dense and expert parameters). The torch optimizer's state
for a parameter is keyed by its main parameter: ``exp_avg``, ``exp_avg_sq`` and ``step`` for Adam,
``momentum_buffer`` for SGD with momentum.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ... import keys


@dataclasses.dataclass
class MainParam:
    """The optimizer's view of one model parameter on this rank."""

    main: torch.Tensor  # the fp32 master copy (the parameter itself, a copy, or the owned range)
    optimizer: torch.optim.Optimizer  # the torch optimizer that steps it
    distinct: bool  # the main copy holds other values than the model parameter (fp32 of a bf16 parameter)

    def states(self) -> Dict[str, torch.Tensor]:
        """The recorded states: the main copy (where distinct) and the torch optimizer's tensors."""
        state = self.optimizer.state.get(self.main, {})
        out = {name: state[name] for name in (keys.EXP_AVG, keys.EXP_AVG_SQ, keys.MOMENTUM_BUFFER)
               if isinstance(state.get(name), torch.Tensor)}
        if self.distinct:
            out[keys.MAIN_PARAM] = self.main
        return out


def expected_states(optimizer_config, param: torch.Tensor) -> Tuple[str, ...]:
    """The states every rank records for ``param``: a rank of the distributed optimizer that owns
    none of it records them empty, so the ranges of all ranks merge."""
    names: Tuple[str, ...] = ()
    if optimizer_config.optimizer == "adam":
        names = (keys.EXP_AVG, keys.EXP_AVG_SQ)
    elif optimizer_config.optimizer == "sgd" and optimizer_config.sgd_momentum:
        names = (keys.MOMENTUM_BUFFER,)
    if param.dtype != torch.float32:
        names += (keys.MAIN_PARAM,)
    return names


# the fields of a megatron param group that say which settings it applies, whatever the layout
# (not is_expert_parallel: expert parameters have a group of their own only with EP > 1)
GROUP_FIELDS = ("wd_mult", "lr_mult", "is_decoupled_lr")


def _own_settings(group: dict, optimizer_config) -> Dict[str, float]:
    """What a group sets apart from the optimizer's config: its own peak lr and Adam ε (μP's
    overrides, 0.19 on: ``get_mup_config_overrides``); empty for megatron's standard groups."""
    if optimizer_config is None:
        return {}
    own = {}
    if "max_lr" in group and group["max_lr"] != optimizer_config.lr:
        own["max_lr"] = group["max_lr"]
    if optimizer_config.optimizer == "adam" and "eps" in group and group["eps"] != optimizer_config.adam_eps:
        own[keys.ADAM_EPS] = group["eps"]
    return own


def group_name(group: dict, optimizer_config=None) -> str:
    """A run-independent name of a param group, e.g. ``group[wd_mult=0.0,lr_mult=1.0]``; with the
    optimizer's config, a group's own peak lr and ε too (``group[...,max_lr=0.0005,eps=5e-09]``)."""
    fields = [f"{f}={group[f]}" for f in GROUP_FIELDS if f in group]
    fields += [f"{f}={v}" for f, v in _own_settings(group, optimizer_config).items()]
    return f"group[{','.join(fields)}]"


def group_settings(optimizer) -> Dict[str, Dict[str, float]]:
    """The lr and weight decay each param group applied in the step that just ran. megatron aligns
    the groups across ranks (a rank may hold a group without parameters), so every rank reports
    every group: replicas."""
    out: Dict[str, Dict[str, float]] = {}
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_optimizer = getattr(opt, "optimizer", None)
        if torch_optimizer is None:
            continue
        for group in torch_optimizer.param_groups:
            name = group_name(group, getattr(opt, "config", None))
            settings = {keys.LR: float(group.get("lr", 0.0)), keys.WEIGHT_DECAY: float(group.get("weight_decay", 0.0))}
            if keys.ADAM_EPS in _own_settings(group, getattr(opt, "config", None)):
                settings[keys.ADAM_EPS] = float(group["eps"])
            if out.setdefault(name, settings) != settings:
                # two groups of one name (dense and expert) that applied different settings: both
                # are reported, the second under a name the reference does not have
                out[f"{name}[{len(out)}]"] = settings
    return out


def _pairs(opt) -> Iterator[Tuple[torch.nn.Parameter, torch.Tensor]]:
    if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        yield from zip(itertools.chain(*opt.model_float16_groups), itertools.chain(*opt.shard_fp32_from_float16_groups))
        yield from zip(itertools.chain(*opt.model_fp32_groups), itertools.chain(*opt.shard_fp32_groups))
    elif hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        yield from zip(itertools.chain(*opt.float16_groups), itertools.chain(*opt.fp32_from_float16_groups))
        for p in itertools.chain(*opt.fp32_from_fp32_groups):
            yield p, p
    else:  # FP32Optimizer
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                yield p, p


def main_params(optimizer) -> Dict[torch.nn.Parameter, MainParam]:
    """model parameter -> its :class:`MainParam`, for every parameter this rank's optimizer steps."""
    out: Dict[torch.nn.Parameter, MainParam] = {}
    inner: List = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        torch_optimizer = getattr(opt, "optimizer", None)
        if torch_optimizer is None or getattr(opt, "is_stub_optimizer", False):
            continue
        for model_param, main in _pairs(opt):
            out[model_param] = MainParam(main, torch_optimizer, main.dtype != model_param.dtype)
    return out


def step_count(mains: Dict[torch.nn.Parameter, MainParam]) -> Optional[float]:
    """Adam's step count after the step (the same for every parameter), or None (SGD, or no
    parameter on this rank). ``mains``: :func:`main_params`."""
    for param in mains.values():
        step = param.optimizer.state.get(param.main, {}).get("step")
        if step is not None:
            return float(step)
    return None


def update_rule(optimizer_config) -> dict:
    """The update rule and its constants, for judging the step (``ttrace_megatron.update_rules``)."""
    if optimizer_config.optimizer == "adam":
        return {"kind": "adam", "beta1": optimizer_config.adam_beta1, "beta2": optimizer_config.adam_beta2,
                "eps": optimizer_config.adam_eps, "decoupled_weight_decay": bool(optimizer_config.decoupled_weight_decay)}
    return {"kind": optimizer_config.optimizer, "momentum": optimizer_config.sgd_momentum}


def param_groups_by_name(optimizer, chunks) -> Dict[str, str]:
    """canonical parameter name -> the name of its param group (:func:`group_name`), for the
    parameters this rank's optimizer steps."""
    from ..recipe.naming import all_parameters, full_param_name

    mains = main_params(optimizer)
    # each part's own config names its groups, as group_settings names them
    configs = {id(getattr(opt, "optimizer", None)): getattr(opt, "config", None)
               for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]}
    out = {}
    for mname, pname, _, param in all_parameters(chunks):
        main = mains.get(param)
        group = None
        if main is not None:
            group = next((g for g in main.optimizer.param_groups if any(p is main.main for p in g["params"])), None)
        if group is not None:
            out[full_param_name(mname, pname)] = group_name(group, configs.get(id(main.optimizer)))
    return out


def grad_scaler(optimizer):
    """megatron's grad scaler of an optimizer (the first part's of a ChainedOptimizer, which all
    share one scale), None without loss scaling (fp32, bf16 without a constant loss_scale)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return getattr(parts[0], "grad_scaler", None)


def loss_scale(optimizer) -> float:
    """The scale the next backward's loss is multiplied by (``optimizer.scale_loss``); 1 without a
    grad scaler."""
    scaler = grad_scaler(optimizer)
    return 1.0 if scaler is None else float(scaler.scale)
