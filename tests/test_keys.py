"""The tensor-key protocol (keys.py), and the package's layering as docs/layout.md states it."""

import os
import re
import subprocess
import sys

import pytest

from ttrace_megatron import keys
from ttrace_megatron.keys import TensorKey, TensorKind

from conftest import REPO


def test_every_constructor_is_classified_back():
    cases = [
        (keys.FORWARD, keys.INPUT, TensorKind.INPUT),
        (keys.FORWARD, keys.OUTPUT, TensorKind.OUTPUT),
        (keys.BACKWARD, keys.GRAD_INPUT, TensorKind.GRAD_INPUT),
        (keys.BACKWARD, keys.GRAD_OUTPUT, TensorKind.GRAD_OUTPUT),
        (keys.BACKWARD, keys.param_grad("weight"), TensorKind.PARAM_GRAD),
        (keys.MAIN_GRAD, keys.main_grad("bias"), TensorKind.MAIN_GRAD),
        (keys.OPTIMIZER, keys.updated_param("weight"), TensorKind.PARAM),
        (keys.OPTIMIZER, keys.GRAD_NORM, TensorKind.OPTIMIZER_SCALAR),
        (keys.OPTIMIZER, keys.CLIP_COEFFICIENT, TensorKind.OPTIMIZER_SCALAR),
        (keys.FORWARD, keys.PER_TOKEN_LOSS, TensorKind.LOSS),
        (keys.FORWARD, "load_balancing_loss", TensorKind.AUX_LOSS),
        (keys.FORWARD, keys.amax(keys.INPUT), TensorKind.AMAX),
        (keys.BACKWARD, keys.amax(keys.GRAD_OUTPUT), TensorKind.AMAX),
    ]
    for phase, tensor, kind in cases:
        assert keys.kind_of(phase, tensor) is kind, (phase, tensor)
    assert keys.param_name_of(keys.main_grad("bias")) == "bias"
    assert keys.param_name_of(keys.param_grad("weight")) == "weight"
    assert keys.operand_kind(keys.WEIGHT) is TensorKind.PARAM


def test_unknown_names_are_errors_not_defaults():
    for phase, tensor in ((keys.FORWARD, "weight.grad"), (keys.MAIN_GRAD, "weight"), ("sideways", "input"),
                          (keys.BACKWARD, "output")):
        with pytest.raises(ValueError):
            keys.kind_of(phase, tensor)
    with pytest.raises(ValueError):
        keys.amax("bias")


def test_arrivals_labels_and_the_grad_a_main_grad_is_reduced_from():
    k = TensorKey(2, -1, "decoder.layers.0.mlp.linear_fc1", keys.MAIN_GRAD, keys.main_grad("weight"))
    g = keys.microbatch_grad_key(k, 3)
    assert (g.phase, g.tensor, g.microbatch, g.iteration) == (keys.BACKWARD, "weight.grad", 3, 2)
    assert keys.phase_label(k) == "grad reduction" and keys.phase_label(g) == "backward (wgrad)"
    arrive = TensorKey(1, 0, "m", keys.BACKWARD, keys.GRAD_OUTPUT)
    assert keys.is_arrival(arrive) and keys.phase_label(arrive) == "backward (arrival)"
    assert not keys.is_arrival(TensorKey(1, 0, "m", keys.BACKWARD, keys.GRAD_INPUT))
    assert keys.phase_label(TensorKey(1, 0, keys.LOSS_MODULE, keys.FORWARD, keys.PER_TOKEN_LOSS)) == "forward (loss)"
    assert keys.phase_label(TensorKey(1, -1, "m", keys.OPTIMIZER, "weight")) == "optimizer"


def _layout_table():
    """(module path, knows megatron?) rows of docs/layout.md's table."""
    text = open(os.path.join(REPO, "docs", "layout.md")).read()
    section = text.split("# Layout of the code", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`ttrace_megatron/"):
            paths = re.findall(r"`([^`]+)`", cells[0])
            folder = os.path.dirname(paths[0])
            for path in paths:  # later names in a cell are in the first one's folder
                rows.append((path if "/" in path else f"{folder}/{path}", cells[2]))
    return rows


def test_layout_table_matches_the_imports():
    """Every module docs/layout.md says knows nothing of megatron imports neither megatron nor the
    adapter; every module of the package is in the table."""
    rows = _layout_table()
    listed = {p for p, _ in rows}
    package = os.path.join(REPO, "ttrace_megatron")
    on_disk = {os.path.relpath(os.path.join(d, f), REPO) for d, _, fs in os.walk(package) for f in fs
               if f.endswith(".py") and f != "__init__.py"}
    assert on_disk <= listed, f"modules missing from docs/layout.md's table: {sorted(on_disk - listed)}"
    assert listed <= on_disk, f"docs/layout.md's table names modules that do not exist: {sorted(listed - on_disk)}"
    core = [p for p, knows in rows if knows.startswith("no")]
    assert len(core) >= 8
    modules = [p[:-3].replace("/", ".") for p in core]
    probe = ("import sys, importlib\n"
             f"for name in {modules!r}:\n"
             "    importlib.import_module(name)\n"
             "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'megatron' or "
             "m.startswith('ttrace_megatron.adapter'))\n"
             "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout
