"""Resolve `EngineConfig.model` to (ModelConfig, params, tokenizer)."""

from __future__ import annotations

import jax

from jaxinfer.assets import REFERENCE_MODELS, reference_model_dir
from jaxinfer.checkpoint import load_hf_model, load_tokenizer
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params


def load_model(model: str, dtype: str = "float32", seed: int = 0):
    if model in REFERENCE_MODELS:
        model = str(reference_model_dir(model))
    if model.startswith("preset:"):
        cfg = preset(model.removeprefix("preset:"), param_dtype=dtype, dtype=dtype)
        return cfg, init_params(cfg, jax.random.key(seed)), None
    cfg, params = load_hf_model(model, dtype=dtype)
    try:
        tokenizer = load_tokenizer(model)
    except ValueError:
        tokenizer = None
    return cfg, params, tokenizer
