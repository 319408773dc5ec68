"""The bug zoo: every injected bug, end to end and localized (the second table of BENCHMARKS.md).

The bugs themselves are run-time patches in ``ttrace_megatron/adapter/zoo/bugs.py`` (never edits of
installed files); the list of (recipe, bug, expected module, expected phase) and the runner live in
``benchmarks/margins.py``, which also produces the clean-recipe table. This entry point runs the
zoo alone:

    python benchmarks/bugzoo/run.py [--dtypes fp32 bf16 fp8] [--recipes gpt_tp2 ...]
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import margins  # noqa: E402

if __name__ == "__main__":
    sys.argv[1:1] = ["--bugs-only"]
    margins.main()
