"""Resolve `EngineConfig.model` to (ModelConfig, params, tokenizer)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax

from jaxinfer.assets import REFERENCE_MODELS, reference_model_dir
from jaxinfer.checkpoint import load_hf_model, load_tokenizer
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params


def load_model(model: str, dtype: str = "float32", seed: int = 0, mesh=None):
    """(ModelConfig, params, tokenizer or None) of `EngineConfig.model`; params are created or
    loaded straight onto `mesh` (by their logical axes) when given, else the default device."""
    if model in REFERENCE_MODELS:
        model = str(reference_model_dir(model))
    if model.startswith("preset:"):
        cfg = preset(model.removeprefix("preset:"), param_dtype=dtype, dtype=dtype)
        return cfg, init_params(cfg, jax.random.key(seed), mesh), None
    tokenizer = model_tokenizer(model)  # first: a broken tokenizer.json fails before the weights
    cfg, params = load_hf_model(model, dtype=dtype, mesh=mesh)
    return cfg, params, tokenizer


def model_tokenizer(model: str):
    """The tokenizer of `EngineConfig.model`, loaded without weights or a device: None for presets
    and for a checkpoint directory without a tokenizer.json (prompts must then be token ids). A
    tokenizer.json that cannot be read is a CheckpointError naming it and the reason."""
    if model in REFERENCE_MODELS:
        model = str(reference_model_dir(model))
    if model.startswith("preset:"):
        return None
    file = Path(model) / "tokenizer.json"
    if not os.path.lexists(file):  # (a dangling symlink is there, and unreadable)
        others = [
            f for f in ("tokenizer.model", "tokenizer_config.json") if (file.parent / f).exists()
        ]
        if others:
            warnings.warn(
                f"{file.parent} has {' and '.join(others)} but no tokenizer.json, the only "
                "tokenizer file jaxinfer reads: loading it without a tokenizer (prompts must be "
                "token ids)",
                stacklevel=2,
            )
        return None
    return load_tokenizer(file)


def model_vocab_size(model: str) -> int:
    """The vocabulary size of `EngineConfig.model`, read without loading weights or touching a
    device (a preset's shape, or the checkpoint's config.json)."""
    import json
    from pathlib import Path

    if model.startswith("preset:"):
        return preset(model.removeprefix("preset:")).vocab_size
    path = Path(reference_model_dir(model) if model in REFERENCE_MODELS else model) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model {model!r}: cannot read {path}: {e}") from e
    hf = hf.get("text_config", hf)
    if "vocab_size" not in hf:
        raise ValueError(f"model {model!r}: {path} has no vocab_size")
    return int(hf["vocab_size"])
