"""Imported by the fork server alone, first of its preload (``fork_server.server_preload``): when the
server exits (its parent gone), the interpreter's teardown of torch and megatron-core is skipped.

Why. The server holds its parent's stdout and stderr (the ranks it forks print there), so a shell
that pipes ``ttrace run`` (``| tee``, a CI log) waits for the server's exit after the verdict, and
the teardown of what it preloaded took ~1.3 s of that on the development VM. Every atexit handler
registered after this one (by the preloaded modules) still runs first; the server holds no file of
its own. The processes it forks never run it: each ends with ``os._exit``. Knows nothing about
megatron.
"""

import atexit
import os
import sys


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


atexit.register(_exit_now)
