"""Loaded first in every rank process: keep megatron-core's import-time warnings (no apex, no
TransformerEngine on CPU) out of the user's terminal unless TTRACE_VERBOSE is set, and give each
line a rank prints to the shared terminal in one write."""

import os
import sys
import warnings


def quiet_warnings() -> None:
    if not os.environ.get("TTRACE_VERBOSE"):
        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)



def whole_lines() -> None:
    """Each line a rank prints reaches the terminal it shares with the other ranks in one write.
    Ranks print beside each other (their progress, an online check's heads-ups); unbuffered
    (PYTHONUNBUFFERED, ``-u``), a print's text and its newline were two writes, and one rank's line
    could land inside another's. Line-buffered, a line is written whole when its newline comes."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(write_through=False, line_buffering=True)
        except (AttributeError, ValueError):  # not a TextIOWrapper (a test's capture): leave it
            pass


quiet_warnings()
