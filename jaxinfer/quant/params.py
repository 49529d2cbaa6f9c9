"""The params of a config that names its formats, from plain params: every weight quantized by
its format on the device (`jaxinfer.quant.transform.quantize` is the recipe-level entry point)."""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.spec import Params, is_spec, param_specs, spec_shardings
from jaxinfer.quant import QuantizedWeight


def quantize_params(cfg: ModelConfig, params: Params, mesh: Any = None) -> Params:
    """The params of `cfg` from plain ones (those of `cfg.plain()`): every weight whose spec is a
    `QuantizedWeight` is quantized by its format, on the device (placed on `mesh` by its arrays'
    logical axes when given); a weight already in its spec's format and the rest pass through."""

    def one(spec, w):
        if not isinstance(spec, QuantizedWeight):
            return w
        if isinstance(w, QuantizedWeight):
            if (w.format, w.in_dims) != (spec.format, spec.in_dims):
                raise ValueError(f"a weight stored as {w.format.name} cannot be quantized to "
                                 f"{spec.format.name}: pass plain params")  # fmt: skip
            return w
        shardings = None if mesh is None else tuple(spec_shardings(spec.arrays, mesh).items())
        return QuantizedWeight(_quantizer(spec.format, spec.in_dims, shardings)(w), spec.format,
                               spec.in_dims)  # fmt: skip

    leaf = lambda x: is_spec(x) or isinstance(x, QuantizedWeight)  # noqa: E731
    return jax.tree.map(one, param_specs(cfg), params, is_leaf=leaf)


@functools.lru_cache(maxsize=256)
def _quantizer(fmt, in_dims: int, shardings: tuple | None):
    """One jitted quantize per (format, in_dims, placement): the layers' weights share them."""
    out = None if shardings is None else dict(shardings)
    return jax.jit(functools.partial(fmt.quantize, in_dims=in_dims), out_shardings=out)
