"""Checkpoint I/O: Hugging Face safetensors in and out, orbax save/restore of our param trees."""

from jaxinfer.checkpoint.errors import CheckpointError, UnsupportedModelError
from jaxinfer.checkpoint.hf_config import SUPPORTED_ARCHITECTURES, config_from_hf
from jaxinfer.checkpoint.hf_loader import (
    load_hf_config,
    load_hf_model,
    load_hf_params,
    load_tokenizer,
)
from jaxinfer.checkpoint.hf_saver import config_to_hf, save_hf_model
from jaxinfer.checkpoint.orbax_io import restore_params, save_params

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "UnsupportedModelError",
    "config_from_hf",
    "config_to_hf",
    "load_hf_config",
    "load_hf_model",
    "load_hf_params",
    "load_tokenizer",
    "restore_params",
    "save_hf_model",
    "save_params",
]
