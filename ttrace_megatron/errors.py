"""Errors for bad input. Each names the file, the rank and the tensor it is about."""

from __future__ import annotations

from typing import Optional


class TraceError(Exception):
    """A trace that cannot be read or compared as it is (exit status 2 in the CLI)."""

    def __init__(self, message: str, *, path: Optional[str] = None, rank: Optional[int] = None,
                 tensor: Optional[str] = None):
        parts = [message]
        if path is not None:
            parts.append(f"file: {path}")
        if rank is not None:
            parts.append(f"rank: {rank}")
        if tensor is not None:
            parts.append(f"tensor: {tensor}")
        super().__init__("; ".join(parts))
        self.path = path
        self.rank = rank
        self.tensor = tensor


class RecipeError(ValueError):
    """A recipe with unknown keys or values that cannot run (exit status 2 in the CLI)."""


class ConfigMismatchError(TraceError):
    """Reference and candidate traces were produced from different models or data."""


class RunFailed(RuntimeError):
    """A reference or candidate rank failed or timed out (exit status 2 in the CLI)."""
