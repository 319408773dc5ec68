"""Coverage: which of the model's parameters a comparison judged, and why the others were not.

A verdict of "equivalent" means nothing about a parameter that was never looked at. The reference
run (one rank: it holds every parameter) lists the model's parameters in ``run.json``
(``parameters``: module, name, module type, elements), and a run may declare parameters it does
not judge with the reason (``unjudged_params``). Here each parameter gets a status from the
comparison's results: judged (its grads, main grad, updated value or optimizer state were
compared) or not judged, with why; and a summary by module type, in parameters and elements.

This module knows nothing about megatron: module types are names, read from ``run.json``.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
from typing import Dict, Iterable, List, Optional, Sequence

from . import keys
from .keys import TensorKey, TensorKind

# the kinds of tensor that are about one parameter
PARAM_KINDS = (TensorKind.PARAM_GRAD, TensorKind.MAIN_GRAD, TensorKind.PARAM, TensorKind.OPTIMIZER_STATE,
               TensorKind.GRAD_NORM_TERM)

FROZEN = "frozen (requires_grad is false): no grad, main grad or update to compare"
NOT_SELECTED = "outside the run's selective recording (record_filter modules)"
NOT_RECORDED = "no tensor of it was recorded on both sides"


def param_of(key: TensorKey) -> Optional[str]:
    """The full parameter name (module.name) a key is about, or None for activations and scalars."""
    if key.kind not in PARAM_KINDS:
        return None
    return f"{key.module}.{keys.param_name_of(key.tensor)}"


def unjudged_params(run: dict) -> Dict[str, str]:
    """``run.json`` ``unjudged_params``: {full parameter name: why}."""
    return {entry["param"]: entry["why"] for entry in run.get("unjudged_params", [])}


@dataclasses.dataclass
class ParamCoverage:
    param: str
    module_type: str
    numel: int
    judged: bool
    tensors: int = 0  # how many of its tensors were compared
    why: str = ""  # why it was not judged


def param_coverage(reference_run: dict, candidate_run: dict, judged_keys: Iterable[TensorKey]) -> List[ParamCoverage]:
    """Every parameter of the reference's list, judged or not (with why)."""
    counts = collections.Counter(p for p in (param_of(k) for k in judged_keys) if p)
    unjudged = dict(unjudged_params(reference_run))
    unjudged.update(unjudged_params(candidate_run))
    patterns = (candidate_run.get("record_filter") or {}).get("modules") or ["*"]
    out = []
    for entry in reference_run.get("parameters", []):
        name = entry["param"]
        n = counts.get(name, 0)
        why = ""
        if not n:
            if name in unjudged:
                why = unjudged[name]
            elif not entry.get("requires_grad", True):
                why = FROZEN
            elif not any(fnmatch.fnmatchcase(entry["module"], p) for p in patterns):
                why = NOT_SELECTED
            else:
                why = NOT_RECORDED
        out.append(ParamCoverage(param=name, module_type=entry["module_type"], numel=int(entry["numel"]),
                                 judged=bool(n), tensors=n, why=why))
    return out


def not_the_models(candidate_run: dict) -> List[dict]:
    """``run.json`` ``unused_params``: parameters a side holds that are not the model's (megatron
    allocates them and no output depends on them), each {param, where, why}: listed, never judged."""
    return list(candidate_run.get("unused_params", []))


def summary(params: Sequence[ParamCoverage], unused: Sequence[dict] = ()) -> dict:
    """The JSON form: totals, by module type, every parameter not judged with why, and the
    parameters a side holds that are not the model's (``not_the_models``)."""
    by_type: Dict[str, Dict[str, int]] = {}
    for p in params:
        row = by_type.setdefault(p.module_type, dict(params=0, params_judged=0, elements=0, elements_judged=0))
        row["params"] += 1
        row["elements"] += p.numel
        if p.judged:
            row["params_judged"] += 1
            row["elements_judged"] += p.numel
    total = dict(params=len(params), params_judged=sum(p.judged for p in params),
                 elements=sum(p.numel for p in params), elements_judged=sum(p.numel for p in params if p.judged))
    return {"total": total, "by_module_type": dict(sorted(by_type.items())),
            "not_judged": [{"param": p.param, "module_type": p.module_type, "why": p.why}
                           for p in params if not p.judged],
            "not_the_models": list(unused)}


def headline(cov: dict) -> str:
    t = cov["total"]
    if not t["params"]:
        return "coverage: the reference lists no parameters (a trace from an older ttrace)"
    return (f"coverage: {t['params_judged']} of {t['params']} parameters judged "
            f"({t['elements_judged']:,} of {t['elements']:,} elements)"
            + (f"; not judged: {len(cov['not_judged'])} (listed with why)" if cov["not_judged"] else ""))
