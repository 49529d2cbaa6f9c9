"""Quantize a model: its plain params into the formats a recipe names, rounding to nearest.

    from jaxinfer.quant.transform import quantize

    qcfg, qparams = quantize(cfg, params, weights="fp8_block",
                             recipe={"layers.0.*": None, "layers.*.w_down": "int8"})

- `weights`: the format of each linear weight of the decoder layers that no recipe pattern
  matches (a key of `jaxinfer.quant.WEIGHT_FORMATS`; None: plain), `ModelConfig.weight_format`;
- `recipe`: {pattern: format or None}, fnmatch patterns over a weight's path "layers.{i}.{name}"
  (names: `w_qkv`, `wo`, `w_gate_up`, `w_down`), the first matching pattern wins
  (`ModelConfig.weight_formats`);
- `calibration`: token batches [B, L] run through the plain model to set the activation scales
  of `fp8_static` weights (`jaxinfer.quant.calibrate`); needed when the recipe has any.

The embedding, LM head, norms and biases always stay plain. A pattern that names only those, a
pattern that matches no weight and an unknown format are refused with the pattern named. Every
weight is quantized on the device by its format's `quantize` (round to nearest, one compiled
program per format, shape and placement); the static activation scales are the only values
fitted to data (no GPTQ/AWQ-style rounding).

`quantize_params(cfg, params)` (`jaxinfer.quant.params`) is the step below: the params of a config
that already names its formats, from plain params (or ones partly in those formats already).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.spec import Params
from jaxinfer.quant import WEIGHT_FORMATS
from jaxinfer.quant.calibrate import calibrate, static_paths
from jaxinfer.quant.params import quantize_params

Recipe = Mapping[str, Any] | Iterable[tuple[str, str | None]]


def quantize(
    cfg: ModelConfig,
    params: Params,
    weights: str | None = "fp8_block",
    recipe: Recipe | None = None,
    *,
    calibration: Iterable[Any] | None = None,
    mesh: Any = None,
) -> tuple[ModelConfig, Params]:
    """(config, params) of the plain model (cfg, params) with its layers' linear weights in
    `weights`, or in the format of the first `recipe` pattern they match; see the module
    docstring. `calibration` (token batches) sets `fp8_static` activation scales."""
    if cfg.has_formats:
        raise ValueError("quantize takes a plain model, but cfg already stores weights in "
                         f"formats (weight_format={cfg.weight_format!r}, weight_formats="
                         f"{cfg.weight_formats!r}): pass cfg.plain() and plain params")  # fmt: skip
    weights = None if weights in (None, "none") else weights
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ValueError(f"quantize: weights={weights!r} is unknown; known: "
                         f"{sorted(WEIGHT_FORMATS)} or None")  # fmt: skip
    qcfg = cfg.replace(weight_format=weights, weight_formats=recipe_entries(recipe or {}))
    if static_paths(qcfg):
        if calibration is None:
            raise ValueError("quantize: fp8_static weights need calibration token batches "
                             "(calibration=[tokens [B, L], ...]) for their activation scales")  # fmt: skip
        return qcfg, calibrate(qcfg, params, calibration)
    return qcfg, quantize_params(qcfg, params, mesh)


def recipe_entries(recipe: Recipe, key: str = "recipe") -> tuple[tuple[str, str | None], ...]:
    """A recipe as `ModelConfig.weight_formats` pairs, in order: a mapping {pattern: format}
    (nested mappings join their keys with ".", as a dotted command-line override writes
    "layers.*.w_down" into nested keys) or (pattern, format) pairs; format None or "none" keeps
    the weight plain. Formats are checked here, patterns against the model by
    `models.spec.param_specs`."""
    if isinstance(recipe, Mapping):
        pairs: list[tuple[Any, Any]] = []

        def walk(prefix: str, m: Mapping) -> None:
            for k, v in m.items():
                path = f"{prefix}.{k}" if prefix else str(k)
                if isinstance(v, Mapping):
                    walk(path, v)
                else:
                    pairs.append((path, v))

        walk("", recipe)
    else:
        pairs = list(recipe)
    entries = []
    for entry in pairs:
        if not isinstance(entry, list | tuple) or len(entry) != 2 or not isinstance(entry[0], str):
            raise ValueError(f"{key}: {entry!r} is not a (pattern, format) pair")
        pattern, fmt = entry
        fmt = None if fmt in (None, "none") else fmt
        if fmt is not None and fmt not in WEIGHT_FORMATS:
            raise ValueError(f"{key}.{pattern}={fmt!r} is unknown: a format is one of "
                             f"{', '.join(sorted(WEIGHT_FORMATS))} or none")  # fmt: skip
        entries.append((pattern, fmt))
    return tuple(entries)
