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
