"""Typed configs: every command's schema (a dataclass) <- a YAML file <- dotted `key=value`
overrides, merged by omegaconf (`load_config`); `schema` makes a dataclass check its own values
with pydantic. Imports nothing of jaxinfer, so that any module can use it."""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar

import pydantic
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic_core import PydanticCustomError

T = TypeVar("T")
# Field types whose values are checked (omegaconf sees the plain int or bool)
Count = Annotated[int, pydantic.Strict(), pydantic.Field(ge=1)]
NonNegative = Annotated[int, pydantic.Strict(), pydantic.Field(ge=0)]
Flag = Annotated[bool, pydantic.Strict()]


def load_config(
    schema: type[T],
    path: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    what: str,
    select: Callable[[DictConfig], Mapping[str, Any]] | None = None,
) -> T:
    """A `schema` instance: its defaults <- the YAML at `path` (None: no file), or the part of
    it `select` picks (it may raise to refuse the file) <- `overrides`. Errors are one-line
    ValueErrors, "invalid {what} config PATH: KEY: what is wrong" (or the schema's own)."""
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


def schema(prefix: str) -> Callable[[type[T]], type[T]]:
    """A dataclass decorator: a pydantic dataclass (still a dataclass to omegaconf and
    `dataclasses`) that checks its fields' types and constraints, then its validators. Its
    ValueError has a clause per error: "KEY=VALUE is invalid: must be ...", "KEY is unknown: the
    keys are ..." (KEY dotted after `prefix`, e.g. "engine."), or a validator's own message."""

    def decorate(cls: type[T]) -> type[T]:
        cls = pydantic.dataclasses.dataclass(cls, config=pydantic.ConfigDict(extra="forbid"))
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs) -> None:
            try:
                init(self, *args, **kwargs)
            except pydantic.ValidationError as e:
                errors = [_clause(cls, prefix, err) for err in e.errors(include_url=False)]
                raise ValueError("; ".join(errors)) from None

        cls.__init__ = __init__
        return cls

    return decorate


def one_of(*allowed: Any) -> pydantic.AfterValidator:
    """A field constraint (`Annotated[str, one_of("a", "b")]`): the value is one of `allowed`."""

    def check(value: Any) -> Any:
        if value not in allowed:
            raise invalid(f"must be one of {', '.join(map(str, allowed))}")
        return value

    return pydantic.AfterValidator(check)


def invalid(why: str) -> PydanticCustomError:
    """The error a field validator raises for a wrong value: "KEY=VALUE is invalid: {why}"."""
    return PydanticCustomError("invalid", "{why}", {"why": why})


def _clause(cls: type, prefix: str, err: dict) -> str:
    """One pydantic error of `cls` as a clause that names its dotted key."""
    loc = [str(part) for part in err["loc"]]
    key = prefix + ".".join(loc)
    if err["type"] == "value_error":  # a validator's own message
        return str(err["ctx"]["error"])
    if err["type"] == "unexpected_keyword_argument":
        for part in loc[:-1]:  # the nested dataclass that has no such field
            cls = typing.get_type_hints(cls)[part]
        return f"{key} is unknown: the keys are {', '.join(sorted(cls.__dataclass_fields__))}"
    return f"{key}={err['input']!r} is invalid: {err['msg'].replace('Input should be', 'must be')}"
