"""Resolve `EngineConfig.model` to (ModelConfig, params, tokenizer), its chat template, and the
facts a run checks before loading weights.

A model is a shipped name (`tiny`), a registry name (`smollm2`), `preset:NAME` (random weights),
a Hugging Face directory, or a `.gguf` file. `EngineConfig.quant` applies to any of them: the
plain model is loaded (a preset's random weights drawn plain, so formats store real values) and
its layer weights quantized (`quantize_model`), except that a GGUF file's Q8_0 / Q4_1 blocks are
taken as stored when the format asked for is the file's own (`weights: gguf`: each weight's).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import jax
import numpy as np

from jaxinfer.assets import model_path
from jaxinfer.checkpoint import load_hf_config, load_hf_model, load_tokenizer
from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.checkpoint.gguf_io import (
    gguf_tokenizer,
    is_gguf,
    load_gguf_model,
    load_gguf_params,
    open_gguf,
)
from jaxinfer.engine.config import CalibrationConfig, QuantConfig, resolve_dtype
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import Params, check_recipe, init_params
from jaxinfer.quant.calibrate import calibrate, static_paths
from jaxinfer.quant.transform import quantize_params


def load_model(model: str, dtype: str = "auto", seed: int = 0, mesh=None,
               quant: QuantConfig | None = None):  # fmt: skip
    """(ModelConfig, params, tokenizer or None) of `EngineConfig.model`; params are created or
    loaded straight onto `mesh` (by their logical axes) when given, else the default device.
    With `quant` (`EngineConfig.quant`) the layers' weights are in its formats; its recipe is
    checked against the model's config before any weight is read."""
    quant = quant if quant is not None and quant.active else None
    dtype = resolve_dtype(dtype)
    if model.startswith("preset:"):
        cfg = preset(model.removeprefix("preset:"), param_dtype=dtype, dtype=dtype)
        qcfg = cfg if quant is None else quantized_config(quant, model, cfg)
        params = init_params(cfg, jax.random.key(seed), mesh)
        if quant is not None:
            params = _quantized(quant, qcfg, params, None, seed, mesh)
        return qcfg, params, None
    path = model_path(model)
    tokenizer = model_tokenizer(model)  # first: a broken tokenizer fails before the weights
    if quant is None:
        load = load_gguf_model if is_gguf(path) else load_hf_model
        cfg, params = load(path, dtype=dtype, mesh=mesh)
        return cfg, params, tokenizer
    if is_gguf(path):
        file = open_gguf(path)
        qcfg = quantized_config(quant, model, file.model_config(dtype=dtype), file)
        params = load_gguf_params(file, qcfg, mesh)  # (its own blocks where the format is theirs)
        return qcfg, _quantized(quant, qcfg, params, tokenizer, seed, mesh), tokenizer
    qcfg = quantized_config(quant, model, load_hf_config(path, dtype=dtype))
    _, params = load_hf_model(path, dtype=dtype, mesh=mesh)
    return qcfg, _quantized(quant, qcfg, params, tokenizer, seed, mesh), tokenizer


def quantize_model(quant: QuantConfig, model: str, cfg: ModelConfig, params: Params,
                   tokenizer=None, seed: int = 0, mesh=None) -> tuple[ModelConfig, Params]:  # fmt: skip
    """The plain model (cfg, params) of `EngineConfig.model` `model` in `quant`'s formats."""
    qcfg = quantized_config(quant, model, cfg)
    return qcfg, _quantized(quant, qcfg, params, tokenizer, seed, mesh)


def _quantized(quant: QuantConfig, cfg: ModelConfig, params: Params, tokenizer, seed: int, mesh):
    """params (plain, or partly in `cfg`'s formats) in `cfg`'s formats: rounded to nearest on the
    device, `fp8_static` activation scales calibrated on `quant.calibration`'s tokens."""
    if static_paths(cfg):
        batches = calibration_batches(quant.calibration, cfg, tokenizer, seed)
        params = calibrate(cfg, params, batches)
    return quantize_params(cfg, params, mesh)


def quantize_for_engine(config, cfg: ModelConfig, params: Params, tokenizer=None,
                        mesh=None) -> tuple[ModelConfig, Params]:  # fmt: skip
    """What an `Engine` given the plain model (cfg, params) does with `config.quant`
    (EngineConfig): `quantize_model`, but for the plain model of a GGUF `config.model`, which is
    loaded again with the quantization so that its blocks are taken as stored (pass
    `load_model(..., quant=config.quant)` to load it once)."""
    model = config.model
    path = None if model.startswith("preset:") else model_path(model)
    if (path is not None and is_gguf(path)
            and open_gguf(path).model_config(dtype=config.dtype) == cfg):  # fmt: skip
        cfg, params, _ = load_model(model, config.dtype, config.seed, mesh, config.quant)
        return cfg, params
    return quantize_model(config.quant, model, cfg, params, tokenizer, config.seed, mesh)


def quantized_config(quant: QuantConfig, model: str, cfg: ModelConfig, file=None) -> ModelConfig:
    """`cfg` (plain) with `quant`'s formats: `weights` the default, the recipe's patterns first;
    with `weights: gguf`, GGUF file `file`'s own format of each weight (`native_recipe`) after
    the recipe. A recipe pattern the model refuses is a ValueError naming engine.quant.recipe."""
    weights = None if quant.weights == "none" else quant.weights
    entries = tuple(quant.recipe.items())
    if weights == "gguf":
        if file is None:
            raise ValueError(f"engine.quant.weights=gguf takes each weight's format from a GGUF "
                             f"file; engine.model={model!r} is not one")  # fmt: skip
        weights, native = file.native_recipe(cfg)
        entries += native
    try:
        qcfg = cfg.replace(weight_format=weights, weight_formats=entries)
        check_recipe(qcfg)
        return qcfg
    except ValueError as e:
        reason = str(e).split(": ", 1)[-1]
        raise ValueError(f"engine.quant.recipe (engine.model={model!r}): {reason}") from None


def calibration_batches(c: CalibrationConfig, cfg: ModelConfig, tokenizer=None,
                        seed: int = 0) -> list[np.ndarray]:  # fmt: skip
    """`c.num_tokens` token ids as batches [B, seq_len] (the rest one shorter sequence): the
    tokens of `c.text_file`, or random ids drawn with `seed` when it is None."""
    if c.text_file is None:
        ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, c.num_tokens)
    else:
        if tokenizer is None:
            raise ValueError(f"engine.quant.calibration.text_file={c.text_file!r} needs the "
                             "model's tokenizer, and the model has none")  # fmt: skip
        try:
            text = Path(c.text_file).read_text()
        except OSError as e:
            raise ValueError(f"engine.quant.calibration.text_file: cannot read it: {e}") from None
        ids = np.asarray(tokenizer.encode(text).ids[: c.num_tokens], np.int64)
        if not ids.size:
            raise ValueError(f"engine.quant.calibration.text_file={c.text_file!r} has no tokens")
    seq_len = min(c.seq_len, cfg.max_context)
    full = len(ids) // seq_len * seq_len
    batches = [ids[:full].reshape(-1, seq_len)] if full else []
    return batches + ([ids[full:][None, :]] if full < len(ids) else [])


def model_config(model: str, dtype: str = "auto") -> ModelConfig:
    """The ModelConfig of `EngineConfig.model`, read without weights (a device only for dtype
    "auto": `resolve_dtype`)."""
    dtype = resolve_dtype(dtype)
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
