"""Exceptions raised while reading checkpoints.

Both subclass ValueError so callers that only care "the input was bad" can catch one thing, while
the CLI can tell "this model family is not implemented" (UnsupportedModelError) apart from "these
files are broken or incomplete" (CheckpointError).
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory or file is missing, incomplete or inconsistent with its config."""


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model (architecture, RoPE variant, ...) we do not implement."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint was restored without checksums to verify it against (saved before they were
    recorded)."""


def first_line(error: BaseException, limit: int = 300) -> str:
    """`Type: first line` of the innermost explicit cause of `error` (orbax wraps TensorStore's
    useful "OUT_OF_RANGE: Error reading ..." in an exception whose text dumps a multi-kB spec)."""
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    lines = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."
