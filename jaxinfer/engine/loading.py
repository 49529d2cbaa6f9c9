"""Resolve `EngineConfig.model` to (ModelConfig, params, tokenizer), its chat template, and the
facts a run checks before loading weights.

A model is a shipped name (`tiny`), a registry name (`smollm2`), `preset:NAME` (random weights),
a Hugging Face directory, or a `.gguf` file.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import jax

from jaxinfer.assets import model_path
from jaxinfer.checkpoint import load_hf_config, load_hf_model, load_tokenizer
from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.checkpoint.gguf_io import gguf_tokenizer, is_gguf, load_gguf_model, open_gguf
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params


def load_model(model: str, dtype: str = "float32", seed: int = 0, mesh=None):
    """(ModelConfig, params, tokenizer or None) of `EngineConfig.model`; params are created or
    loaded straight onto `mesh` (by their logical axes) when given, else the default device."""
    if model.startswith("preset:"):
        cfg = preset(model.removeprefix("preset:"), param_dtype=dtype, dtype=dtype)
        return cfg, init_params(cfg, jax.random.key(seed), mesh), None
    path = model_path(model)
    tokenizer = model_tokenizer(model)  # first: a broken tokenizer fails before the weights
    load = load_gguf_model if is_gguf(path) else load_hf_model
    cfg, params = load(path, dtype=dtype, mesh=mesh)
    return cfg, params, tokenizer


def model_config(model: str, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of `EngineConfig.model`, read without weights or a device."""
    if model.startswith("preset:"):
        return preset(model.removeprefix("preset:"), param_dtype=dtype, dtype=dtype)
    path = model_path(model)
    if is_gguf(path):
        return open_gguf(path).model_config(dtype=dtype)
    return load_hf_config(path, dtype=dtype)


def model_tokenizer(model: str):
    """The tokenizer of `EngineConfig.model`, loaded without weights or a device: None for presets
    and for a checkpoint directory without a tokenizer.json (prompts must then be token ids). A
    tokenizer that cannot be read is a CheckpointError naming the file and the reason."""
    if model.startswith("preset:"):
        return None
    path = model_path(model)
    if is_gguf(path):
        return gguf_tokenizer(path)
    file = Path(path) / "tokenizer.json"
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


def model_chat_template(model: str) -> str | None:
    """The model's chat template (Jinja): a GGUF file's `tokenizer.chat_template`, or a HF
    directory's `chat_template.jinja` or tokenizer_config.json `chat_template`; None if it has
    none."""
    if model.startswith("preset:"):
        return None
    path = Path(model_path(model))
    if is_gguf(path):
        return open_gguf(path).chat_template()
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except ValueError as e:
        raise CheckpointError(f"cannot read {config}: {e}") from None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def model_vocab_size(model: str) -> int:
    """The vocabulary size of `EngineConfig.model`, read without loading weights or touching a
    device (a preset's shape, or the checkpoint's config)."""
    try:
        return model_config(model).vocab_size
    except CheckpointError as e:
        raise ValueError(f"model {model!r}: {e}") from e
