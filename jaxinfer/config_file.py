"""Typed configs from YAML: every command's schema (a dataclass) <- a YAML file <- dotted
`key=value` overrides, merged by omegaconf. Imports nothing of jaxinfer, so that any module can
load its config through it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


def load_config(
    schema: type[T],
    path: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    what: str,
    select: Callable[[DictConfig], Mapping[str, Any]] | None = None,
) -> T:
    """A `schema` instance: its defaults <- the YAML at `path` (None: no file) <- `overrides`.
    `select` picks what of the file is merged (default: all of it; it may raise to refuse the
    file). Errors are one-line ValueErrors, "invalid {what} config PATH: KEY: what is wrong"
    (the schema's own checks raise their own, which name the key)."""
    check_overrides(overrides)
    where = f" {path}" if path is not None else ""
    try:
        cfg = OmegaConf.structured(schema)
        if path is not None:
            file_cfg = OmegaConf.load(path)
            if not isinstance(file_cfg, DictConfig):
                raise ValueError(f"invalid {what} config {path}: not a YAML mapping")
            cfg = OmegaConf.merge(cfg, select(file_cfg) if select else file_cfg)
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ValueError(f"invalid {what} config{where}: {config_error_message(e)}") from e
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise ValueError(f"invalid {what} config{where}: not YAML: {msg}") from e


def to_yaml(config: Any) -> str:
    """A schema instance as YAML (a results folder's `config.yaml`, `--print-config`)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def check_overrides(overrides: Sequence[str]) -> None:
    """Every override is `dotted.key=value` (omegaconf reads a bare `key` as key=None, and the
    error then says "Incompatible value 'None'"); a ValueError shows the first that is not."""
    for i, arg in enumerate(overrides):
        key, sep, _ = arg.partition("=")
        if sep and key.strip():
            continue
        after = overrides[i + 1] if i + 1 < len(overrides) else None
        guess = sep == "" and after and "=" not in after
        hint = f"; did you mean {arg}={after}?" if guess else ", as in engine.scheduler=static"
        raise ValueError(
            f"override {arg!r} is not key=value: overrides are dotted key=value pairs{hint}"
        )


def config_error_message(e: OmegaConfBaseException) -> str:
    """One line for an omegaconf error (its text adds lines of reference and object types)."""
    msg = (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]
    key = getattr(e, "full_key", None)
    return f"{key}: {msg}" if key else msg
