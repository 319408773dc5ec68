"""A run on a given megatron-core source tree (``ttrace run --candidate-megatron PATH``).

A Megatron developer checks a branch against a trusted release: one side imports megatron-core
from a checkout or a patched copy, the other from the installed package (or another tree). One
interpreter can hold one ``megatron`` package, and the CPU workers fork from a server that has
imported it, so a side on another tree runs in a fresh interpreter whose ``PYTHONPATH`` puts the
tree first; the run is the same :func:`.launch.launch` there
(:mod:`.side_entry`). The spec travels as JSON, and the
outcome comes back as JSON: a refusal stays a refusal, a failure a failure. ``run.json`` records
which megatron-core each side imported (``versions``: its version and path).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Optional

from ...about import SOURCE_ROOT
from ...errors import BuiltOtherwise, RecipeError, RunFailed

OK, REFUSED, FAILED, BUILT = "ok", "refused", "failed", "built"


def check_tree(path: str, flag: str = "--candidate-megatron") -> str:
    """The absolute path of a megatron-core source tree: a directory holding ``megatron/core``."""
    tree = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(os.path.join(tree, "megatron", "core", "__init__.py")):
        raise RecipeError(f"{flag} {path}: not a megatron-core source tree (no megatron/core/__init__.py under "
                          f"{tree}); give a Megatron-LM checkout or a copy of an installed megatron-core's parent "
                          f"directory")
    return tree


def launch_on_tree(spec, timeout_s: Optional[float], probes) -> None:
    """Run ``spec`` with megatron-core imported from ``spec.megatron``."""
    tree = check_tree(spec.megatron)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tree, SOURCE_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with tempfile.TemporaryDirectory(prefix="ttrace-side-") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump({"spec": dataclasses.asdict(dataclasses.replace(spec, megatron=None)),
                       "probes": dataclasses.asdict(probes), "timeout_s": timeout_s, "tree": tree}, f)
        try:
            subprocess.run([sys.executable, "-m", "ttrace_megatron.adapter.run.side_entry", spec_path, result_path], env=env,
                           timeout=None if timeout_s is None else timeout_s + 120, check=False)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"the {spec.role} run on {tree} did not finish within {timeout_s:.0f} s") from None
        if not os.path.exists(result_path):
            raise RunFailed(f"the {spec.role} run on {tree} ended without a result (its interpreter died)")
        with open(result_path) as f:
            result = json.load(f)
    if result["outcome"] == REFUSED:
        raise RecipeError(result["message"])
    if result["outcome"] == BUILT:
        raise BuiltOtherwise(result["problems"], side=result["side"], rank=result["rank"])
    if result["outcome"] == FAILED:
        raise RunFailed(result["message"])
