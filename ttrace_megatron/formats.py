"""Number formats: machine epsilon and unit roundoff of the formats training uses.

ε (``eps``) is the gap between 1 and the next representable number, ``2**-m`` for ``m`` stored
mantissa bits; it is the unit errors are reported in, as in the TTrace paper and in
``torch.finfo(dtype).eps``. Round-to-nearest has a unit roundoff ``u = ε / 2``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict


@dataclasses.dataclass(frozen=True)
class NumberFormat:
    name: str
    mantissa_bits: int
    max_value: float
    # the gap between representable numbers below the smallest normal one: there rounding errs by up
    # to half of it whatever the value's size (fp16's 2^-24 ≈ 6e-8 matters for small weights)
    smallest_subnormal: float = 0.0

    @property
    def eps(self) -> float:
        return 2.0 ** -self.mantissa_bits

    @property
    def unit_roundoff(self) -> float:
        return self.eps / 2


FORMATS: Dict[str, NumberFormat] = {f.name: f for f in (
    NumberFormat("float64", 52, 1.7976931348623157e308, 2.0 ** -1074),
    NumberFormat("float32", 23, 3.4028234663852886e38, 2.0 ** -149),
    NumberFormat("tf32", 10, 3.4028234663852886e38, 2.0 ** -136),
    NumberFormat("bfloat16", 7, 3.3895313892515355e38, 2.0 ** -133),
    NumberFormat("float16", 10, 65504.0, 2.0 ** -24),
    NumberFormat("float8_e4m3fn", 3, 448.0, 2.0 ** -9),
    NumberFormat("float8_e5m2", 2, 57344.0, 2.0 ** -16),
)}

_ALIASES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "float": "float32", "double": "float64"}


def number_format(name: str) -> NumberFormat:
    """The format called ``name`` (a torch dtype name such as ``bfloat16`` or an alias like ``bf16``)."""
    key = str(name).replace("torch.", "")
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise KeyError(f"unknown number format {name!r}; known: {sorted(FORMATS)}")
    return FORMATS[key]


def report_format(compute_dtype: str) -> NumberFormat:
    """The format whose ε errors of a tensor computed in ``compute_dtype`` are reported in.

    FP8 GEMMs accumulate in fp32 and store bf16 outputs, so FP8 recipes are judged in ε_bf16, as
    the TTrace paper does.
    """
    fmt = number_format(compute_dtype)
    return FORMATS["bfloat16"] if fmt.name.startswith("float8") else fmt
