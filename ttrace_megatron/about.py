"""What the package is and where it lives: its version, and the directory that holds it (a
checkout's root, where ``patches/`` is; a side run puts it on ``PYTHONPATH``)."""

import os

__version__ = "0.1.0"

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
