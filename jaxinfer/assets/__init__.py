"""Files shipped with the package: the stdlib BPE tokenizer and the CPU-trained reference models."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
REFERENCE_MODELS = ("tiny", "tiny-draft")


def reference_model_dir(name: str) -> Path:
    """HF-format directory of a shipped reference model (`tiny`, `tiny-draft`)."""
    path = ASSETS / "models" / name
    if name not in REFERENCE_MODELS or not (path / "config.json").exists():
        raise ValueError(f"no shipped reference model {name!r}; shipped: {REFERENCE_MODELS}")
    return path
