"""The fresh interpreter of a side run (:mod:`.side`): ``python -m
ttrace_megatron.adapter.run.side_entry SPEC RESULT`` launches the spec's ranks with megatron-core
imported from the tree first on ``PYTHONPATH`` and writes the outcome as JSON."""

from __future__ import annotations

import json
import os
import sys

from ...errors import BuiltOtherwise, RecipeError, RunFailed
from .side import BUILT, FAILED, OK, REFUSED


def _main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        raw = json.load(f)
    outcome, message, built = OK, "", {}
    try:
        import megatron.core

        got = os.path.abspath(megatron.core.__file__)
        if not got.startswith(os.path.join(raw["tree"], "")):
            raise RunFailed(f"megatron-core was imported from {os.path.dirname(got)}, not from {raw['tree']} "
                            f"(an installed megatron that shadows PYTHONPATH: a .pth file or an egg-link)")
        # imported here, after the check above: a tree that fails to import is a failed run
        from .launch import launch
        from .runner import Probes, RunSpec
        from .session import TraceOptions

        spec = RunSpec(**dict(raw["spec"], trace=TraceOptions(**raw["spec"]["trace"])))
        launch(spec, timeout_s=raw["timeout_s"], probes=Probes(**raw["probes"]))
    except RecipeError as e:
        outcome, message = REFUSED, str(e)
    except BuiltOtherwise as e:
        outcome, message, built = BUILT, str(e), {"problems": e.problems, "side": e.side, "rank": e.rank}
    except RunFailed as e:
        outcome, message = FAILED, str(e)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it as a failed run
        import traceback

        outcome, message = FAILED, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(result_path, "w") as f:
        json.dump({"outcome": outcome, "message": message, **built}, f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
