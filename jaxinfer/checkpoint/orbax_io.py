"""Save/restore our param tree with orbax, next to the ModelConfig that describes it.

Layout of a saved directory:
    <path>/model_config.json   dataclasses.asdict(ModelConfig), rope_scaling naming its rope_type
    <path>/params/             orbax StandardCheckpointer checkpoint of the param pytree
    <path>/checksums.json      per-array checksums, keyed by param path (`layers[3].w_qkv`)

Restoring targets `abstract_params(cfg, mesh)`, so shapes, dtypes and shardings come from the spec
(the same place random init and HF loading take them from), not from whatever was saved: a
checkpoint saved on one mesh restores onto another. orbax's `StandardCheckpointer` is the stable,
non-experimental pytree API in orbax-checkpoint 0.12 (`orbax.checkpoint.v1` is still experimental).

Integrity: orbax (zstd-compressed zarr chunks without checksums) can restore a file with flipped
bytes as different values without any error, so `save_params` records the checksums of
`integrity.array_stats` (reduced on the device) and `restore_params` recomputes and compares them,
and refuses NaN/inf weights. A checkpoint written before checksums were recorded restores with an
`UnverifiedCheckpointWarning`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxinfer.checkpoint.errors import CheckpointError, UnverifiedCheckpointWarning, first_line
from jaxinfer.checkpoint.integrity import ArrayStats, array_stats, param_path
from jaxinfer.models.config import ROPE_SCALINGS, ModelConfig
from jaxinfer.models.spec import Params, abstract_params

CONFIG_FILE = "model_config.json"
PARAMS_DIR = "params"
CHECKSUMS_FILE = "checksums.json"
CHECKSUMS_FORMAT = 1  # bump when integrity.array_stats changes what it computes


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    data = dataclasses.asdict(cfg)
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type != "llama3":
        # A llama3 dict keeps the form it had when it was the only scaling (no rope_type), so
        # that its checkpoints stay readable by earlier versions; others name their type.
        data["rope_scaling"] = {"rope_type": cfg.rope_scaling.rope_type, **data["rope_scaling"]}
    return data


def config_from_dict(data: dict[str, Any], source: str = CONFIG_FILE) -> ModelConfig:
    """Inverse of `config_to_dict` (JSON turns tuples into lists and nested dataclasses into dicts)."""
    data = dict(data)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CheckpointError(f"{source}: unknown ModelConfig fields {unknown}")
    if data.get("rope_scaling") is not None:
        fields = dict(data["rope_scaling"])
        rope_type = fields.pop("rope_type", "llama3")
        if rope_type not in ROPE_SCALINGS:
            raise CheckpointError(f"{source}: rope_scaling.rope_type={rope_type!r} is unknown; "
                                  f"known: {list(ROPE_SCALINGS)}")  # fmt: skip
        try:
            data["rope_scaling"] = ROPE_SCALINGS[rope_type](**fields)
        except (TypeError, ValueError) as e:
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
    checksums_file = directory / CHECKSUMS_FILE
    if not force and (config_file.exists() or params_dir.exists()):
        raise CheckpointError(
            f"{directory} already holds a checkpoint; pass force=True to overwrite it"
        )
    _check_matches_spec(cfg, params)
    names, arrays = _flat(params)
    stats = array_stats(arrays)
    _refuse_nonfinite(f"params to save to {directory}", names, stats, error=ValueError)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in (config_file, checksums_file):  # never left to describe the new params
        if force and stale.exists():
            stale.unlink()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(params_dir, params, force=force)
        checkpointer.wait_until_finished()
    checksums = {
        name: {"dtype": str(x.dtype), "shape": list(x.shape), **st.checksums()}
        for name, x, st in zip(names, arrays, stats, strict=True)
    }
    _write_json(checksums_file, {"format": CHECKSUMS_FORMAT, "arrays": checksums})
    _write_json(config_file, config_to_dict(cfg))


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
    _check_saved_arrays(directory, target)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(params_dir, target)
    except Exception as e:  # TensorStore raises bare Exceptions with a multi-kB spec dump...
        error = _restore_error(directory, target, e)
    else:
        _verify(directory, params)
        return cfg, params
    raise error from None  # ...that the traceback would print again: the message has its gist


def _write_json(file: Path, data: Any) -> None:
    tmp = file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, file)


def _flat(tree: Any) -> tuple[list[str], list[Any]]:
    """(param paths, leaves) of a param tree; quantized weights contribute one path per array."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [param_path(k) for k, _ in leaves], [x for _, x in leaves]


def _few(names: list[str], n: int = 3) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _refuse_nonfinite(
    where: str, names: list[str], stats: list[ArrayStats], error: type[Exception] = CheckpointError
) -> None:
    bad = [(name, st.nonfinite) for name, st in zip(names, stats, strict=True) if st.nonfinite]
    if bad:
        name, count = bad[0]
        others = f" (also in {_few([b for b, _ in bad[1:]])})" if len(bad) > 1 else ""
        raise error(f"{where}: array {name} holds {count} NaN/inf values{others}")


def _check_saved_arrays(directory: Path, target: Any) -> None:
    """Refuse a checkpoint whose saved arrays (names, shapes, dtypes in orbax's metadata) are not
    the ones `model_config.json` describes; orbax would say so in a multi-line tree diff, or
    silently cast a dtype. Metadata that cannot be read is left to the restore to report: orbax
    reads it from files (`_sharding`) that a restore onto a given target does not need."""
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            saved_tree = checkpointer.metadata(directory / PARAMS_DIR).item_metadata
        names, leaves = _flat(saved_tree)
        saved = {n: (tuple(x.shape), str(x.dtype)) for n, x in zip(names, leaves, strict=True)}
    except Exception:  # orbax/TensorStore errors of damaged metadata files
        return
    if not saved:  # what orbax returns (with a logged warning) when it cannot read the metadata
        return
    names, leaves = _flat(target)
    wanted = {n: (tuple(x.shape), str(x.dtype)) for n, x in zip(names, leaves, strict=True)}
    missing = [n for n in wanted if n not in saved]
    extra = [n for n in saved if n not in wanted]
    differ = [
        f"{n} is {saved[n][1]}{list(saved[n][0])}, not {wanted[n][1]}{list(wanted[n][0])}"
        for n in wanted
        if n in saved and saved[n] != wanted[n]
    ]
    if missing or extra or differ:
        problems = [
            f"not saved: {_few(missing)}" if missing else "",
            f"saved but not in the config: {_few(extra)}" if extra else "",
            f"saved {_few(differ)}" if differ else "",
        ]
        raise CheckpointError(
            f"checkpoint {directory}: {CONFIG_FILE} does not describe the saved params ("
            + "; ".join(p for p in problems if p)
            + ")"
        )


def _restore_error(directory: Path, target: Any, error: Exception) -> CheckpointError:
    """A CheckpointError naming the arrays orbax cannot read, found by restoring them one by one
    (only on this error path: it reads the checkpoint again)."""
    params_dir = directory / PARAMS_DIR
    try:
        unreadable = _unreadable_arrays(params_dir, target)
    except Exception:  # the diagnosis is best effort; the cause is reported either way
        unreadable = []
    if not unreadable:
        return CheckpointError(
            f"cannot restore {params_dir} into {CONFIG_FILE}'s spec\ncause: {first_line(error)}"
        )
    names = [name for name, _ in unreadable]
    if len(names) == len(jax.tree.leaves(target)) > 1:
        which = f"none of its {len(names)} arrays can be read"
    else:
        others = f" (also unreadable: {_few(names[1:])})" if len(names) > 1 else ""
        which = f"array {names[0]} is unreadable{others}"
    return CheckpointError(
        f"cannot restore checkpoint {directory}: {which}; its files under {PARAMS_DIR}/ are "
        f"truncated or damaged\ncause: {unreadable[0][1]}"
    )


def _unreadable_arrays(params_dir: Path, target: Any) -> list[tuple[str, str]]:
    """(param path, first line of the error) of each array of `target` that fails to restore on
    its own."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    skip = ocp.PLACEHOLDER  # StandardCheckpointer cannot skip leaves; PyTreeCheckpointer can
    out = []
    with ocp.PyTreeCheckpointer() as checkpointer:
        for i, (keypath, leaf) in enumerate(leaves):
            item = treedef.unflatten([leaf if j == i else skip for j in range(len(leaves))])
            restore_args = treedef.unflatten(
                [
                    ocp.ArrayRestoreArgs(sharding=leaf.sharding, global_shape=leaf.shape,
                                         dtype=leaf.dtype) if j == i else skip
                    for j in range(len(leaves))
                ]
            )  # fmt: skip
            try:
                checkpointer.restore(
                    params_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
                )
            except Exception as e:  # any failure makes the array unreadable
                out.append((param_path(keypath), first_line(e)))
    return out


def _verify(directory: Path, params: Params) -> None:
    """Compare the restored arrays with checksums.json, then refuse NaN/inf weights."""
    names, arrays = _flat(params)
    stats = array_stats(arrays)
    file = directory / CHECKSUMS_FILE
    if not file.exists():
        warnings.warn(
            f"{directory} has no {CHECKSUMS_FILE} (saved before checksums were recorded): its "
            "arrays are restored unverified; save it again to record them",
            UnverifiedCheckpointWarning,
            stacklevel=3,
        )
    else:
        _check_checksums(file, names, arrays, stats)
    _refuse_nonfinite(f"checkpoint {directory}", names, stats)


def _check_checksums(file: Path, names: list[str], arrays: list[Any], stats: list[ArrayStats]):
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {file}: {first_line(e)}") from e
    recorded = data.get("arrays") if isinstance(data, dict) else None
    if not isinstance(recorded, dict) or data.get("format") != CHECKSUMS_FORMAT:
        raise CheckpointError(
            f"{file} is not a checksums file of format {CHECKSUMS_FORMAT} "
            '({"format": 1, "arrays": {param path: {"dtype", "shape", "sum", "weighted_sum"}}})'
        )
    missing = [n for n in names if n not in recorded]
    extra = sorted(set(recorded) - set(names))
    if missing or extra:
        raise CheckpointError(
            f"{file} does not list the arrays of the checkpoint: "
            f"missing {_few(missing) or 'none'}; not in the params {_few(extra) or 'none'}"
        )
    for name, x, st in zip(names, arrays, stats, strict=True):
        want = recorded[name] if isinstance(recorded[name], dict) else {}
        dtype, shape = str(x.dtype), list(x.shape)
        if (want.get("dtype"), want.get("shape")) != (dtype, shape):
            raise CheckpointError(
                f"array {name} was restored as {dtype}{shape} but {file} recorded it as "
                f"{want.get('dtype')}{want.get('shape')}: {CONFIG_FILE} no longer describes the "
                "saved params"
            )
        have = st.checksums()
        if {k: want.get(k) for k in have} != have:
            raise CheckpointError(
                f"checkpoint {file.parent}: array {name} does not match its checksum in {file} "
                f"(sum {have['sum']}, recorded {want.get('sum')}): its files under {PARAMS_DIR}/ "
                "are corrupted"
            )
