"""Save/restore our param tree with orbax, next to the ModelConfig that describes it.

Layout of a saved directory:
    <path>/model_config.json   dataclasses.asdict(ModelConfig)
    <path>/params/             orbax StandardCheckpointer checkpoint of the param pytree

Restoring targets `abstract_params(cfg, mesh)`, so shapes, dtypes and shardings come from the spec
(the same place random init and HF loading take them from), not from whatever was saved: a
checkpoint saved on one mesh restores onto another. orbax's `StandardCheckpointer` is the stable,
non-experimental pytree API in orbax-checkpoint 0.12 (`orbax.checkpoint.v1` is still experimental).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.models.config import Llama3RopeScaling, ModelConfig
from jaxinfer.models.spec import Params, abstract_params

CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict[str, Any], source: str = CONFIG_FILE) -> ModelConfig:
    """Inverse of `config_to_dict` (JSON turns tuples into lists and nested dataclasses into dicts)."""
    data = dict(data)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CheckpointError(f"{source}: unknown ModelConfig fields {unknown}")
    if data.get("rope_scaling") is not None:
        try:
            data["rope_scaling"] = Llama3RopeScaling(**data["rope_scaling"])
        except TypeError as e:
            raise CheckpointError(f"{source}: bad rope_scaling: {e}") from e
    if "eos_token_ids" in data:
        data["eos_token_ids"] = tuple(data["eos_token_ids"])
    try:
        return ModelConfig(**data)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from e


def _check_matches_spec(cfg: ModelConfig, params: Params) -> None:
    """Refuse to write a checkpoint that `restore_params` could not read back into `cfg`'s spec."""
    expected = abstract_params(cfg)
    if jax.tree.structure(expected) != jax.tree.structure(params):
        raise ValueError(
            "params do not have the tree structure of param_specs(cfg): "
            f"expected {jax.tree.structure(expected)}, got {jax.tree.structure(params)}"
        )
    for (path, want), have in zip(
        jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(params), strict=True
    ):
        if tuple(have.shape) != want.shape or have.dtype != want.dtype:
            raise ValueError(
                f"param {jax.tree_util.keystr(path)} is {have.dtype}{list(have.shape)}, "
                f"cfg expects {want.dtype}{list(want.shape)}"
            )


def save_params(
    path: str | os.PathLike[str], cfg: ModelConfig, params: Params, *, force: bool = False
) -> None:
    """Write `params` and `cfg` under directory `path` (created if needed).

    An existing checkpoint there is an error unless `force=True`, which replaces it (other files in
    the directory are left alone). The config is written after the params so that a crash mid-save
    never leaves a directory that looks complete.
    """
    directory = Path(path).absolute()  # orbax requires absolute paths
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory} exists and is not a directory")
    config_file, params_dir = directory / CONFIG_FILE, directory / PARAMS_DIR
    if not force and (config_file.exists() or params_dir.exists()):
        raise CheckpointError(
            f"{directory} already holds a checkpoint; pass force=True to overwrite it"
        )
    _check_matches_spec(cfg, params)
    directory.mkdir(parents=True, exist_ok=True)
    if force and config_file.exists():
        config_file.unlink()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(params_dir, params, force=force)
        checkpointer.wait_until_finished()
    tmp = config_file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    os.replace(tmp, config_file)


def restore_params(path: str | os.PathLike[str], mesh: Any = None) -> tuple[ModelConfig, Params]:
    """(cfg, params) saved by `save_params`, placed on `mesh` (default: the first device)."""
    directory = Path(path).absolute()
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    config_file, params_dir = directory / CONFIG_FILE, directory / PARAMS_DIR
    if not config_file.exists():
        raise CheckpointError(f"{config_file} does not exist")
    if not params_dir.is_dir():
        raise CheckpointError(f"{params_dir} does not exist")
    try:
        data = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {config_file}: {e}") from e
    cfg = config_from_dict(data, str(config_file))
    target = abstract_params(cfg, mesh)
    if mesh is None:
        # Without a sharding orbax restores numpy arrays; we want device arrays.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), target
        )
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(params_dir, target)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise CheckpointError(f"cannot restore {params_dir} into {CONFIG_FILE}'s spec: {e}") from e
    return cfg, params
