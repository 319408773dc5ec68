"""A run on a given megatron-core source tree (``ttrace run --candidate-megatron PATH``).

A Megatron developer checks a branch against a trusted release: one side imports megatron-core
from a checkout or a patched copy, the other from the installed package (or another tree). One
interpreter can hold one ``megatron`` package, and the CPU workers fork from a server that has
imported it, so a side on another tree runs in a fresh interpreter whose ``PYTHONPATH`` puts the
tree first; the run is the same :func:`.launch.launch` there. The spec travels as JSON, and the
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

from ..errors import RecipeError, RunFailed
from .integration import TraceOptions

OK, REFUSED, FAILED = "ok", "refused", "failed"


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
    import ttrace_megatron

    tree = check_tree(spec.megatron)
    here = os.path.dirname(os.path.dirname(os.path.abspath(ttrace_megatron.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tree, here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with tempfile.TemporaryDirectory(prefix="ttrace-side-") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump({"spec": dataclasses.asdict(dataclasses.replace(spec, megatron=None)),
                       "probes": dataclasses.asdict(probes), "timeout_s": timeout_s, "tree": tree}, f)
        try:
            subprocess.run([sys.executable, "-m", "ttrace_megatron.adapter.side", spec_path, result_path], env=env,
                           timeout=None if timeout_s is None else timeout_s + 120, check=False)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"the {spec.role} run on {tree} did not finish within {timeout_s:.0f} s") from None
        if not os.path.exists(result_path):
            raise RunFailed(f"the {spec.role} run on {tree} ended without a result (its interpreter died)")
        with open(result_path) as f:
            result = json.load(f)
    if result["outcome"] == REFUSED:
        raise RecipeError(result["message"])
    if result["outcome"] == FAILED:
        raise RunFailed(result["message"])


def _main(spec_path: str, result_path: str) -> None:
    from .runner import Probes, RunSpec

    with open(spec_path) as f:
        raw = json.load(f)
    outcome, message = OK, ""
    try:
        import megatron.core

        got = os.path.abspath(megatron.core.__file__)
        if not got.startswith(os.path.join(raw["tree"], "")):
            raise RunFailed(f"megatron-core was imported from {os.path.dirname(got)}, not from {raw['tree']} "
                            f"(an installed megatron that shadows PYTHONPATH: a .pth file or an egg-link)")
        spec = RunSpec(**dict(raw["spec"], trace=TraceOptions(**raw["spec"]["trace"])))
        from .launch import launch

        launch(spec, timeout_s=raw["timeout_s"], probes=Probes(**raw["probes"]))
    except RecipeError as e:
        outcome, message = REFUSED, str(e)
    except RunFailed as e:
        outcome, message = FAILED, str(e)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it as a failed run
        import traceback

        outcome, message = FAILED, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(result_path, "w") as f:
        json.dump({"outcome": outcome, "message": message}, f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
