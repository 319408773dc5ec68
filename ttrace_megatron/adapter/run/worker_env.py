"""Loaded first in every rank process: keep megatron-core's import-time warnings (no apex, no
TransformerEngine on CPU) out of the user's terminal unless TTRACE_VERBOSE is set."""

import os
import warnings


def quiet_warnings() -> None:
    if not os.environ.get("TTRACE_VERBOSE"):
        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)


quiet_warnings()
