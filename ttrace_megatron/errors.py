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
        self.message = message
        self.path = path
        self.rank = rank
        self.tensor = tensor

    def __reduce__(self):
        """Whole across processes (compare's workers raise it in the parent): file, rank and tensor kept."""
        return _rebuild, (type(self), self.message, self.path, self.rank, self.tensor)


def _rebuild(cls, message, path, rank, tensor):
    return cls(message, path=path, rank=rank, tensor=tensor)


class RecipeError(ValueError):
    """A recipe with unknown keys or values that cannot run (exit status 2 in the CLI)."""


class ConfigMismatchError(TraceError):
    """Reference and candidate traces were produced from different models or data."""


class RunFailed(RuntimeError):
    """A reference or candidate rank failed or timed out (exit status 2 in the CLI)."""


class BuiltOtherwise(RuntimeError):
    """megatron built a model other than the one a valid recipe describes: not bad input but a
    finding about megatron (a FAIL, exit status 1), localized to the build. ``problems``: what
    differs, each "module: what the recipe asks for, what was built"."""

    def __init__(self, problems, *, side: Optional[str] = None, rank: Optional[int] = None):
        self.problems = list(problems)
        self.side, self.rank = side, rank
        where = " ".join(x for x in (side and f"the {side}'s", rank is not None and f"rank {rank}") if x)
        super().__init__(f"the model megatron built{' on ' + where if where else ''} is not the model the recipe "
                         f"describes: " + "; ".join(self.problems[:5])
                         + (f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""))

    @property
    def module(self) -> str:
        """The module of the first problem (the text before its first colon)."""
        return self.problems[0].split(":", 1)[0] if self.problems else "model"
