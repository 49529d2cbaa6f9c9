"""Quantize a model's plain params into the formats its spec names (`ModelConfig.weight_format`)."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.spec import Params, is_spec, param_specs, spec_shardings
from jaxinfer.quant import QuantizedWeight


def quantize_params(cfg: ModelConfig, params: Params, mesh: Any = None) -> Params:
    """The params of `cfg` from plain ones (those of `cfg.replace(weight_format=None)`): every
    weight whose spec is a `QuantizedWeight` is quantized by its format, on the device (placed on
    `mesh` by its arrays' logical axes when given); the rest is passed through."""

    def one(spec, w):
        if not isinstance(spec, QuantizedWeight):
            return w
        shardings = None if mesh is None else spec_shardings(spec.arrays, mesh)
        quantize = jax.jit(partial(spec.format.quantize, in_dims=spec.in_dims),
                           out_shardings=shardings)  # fmt: skip
        return QuantizedWeight(quantize(w), spec.format, spec.in_dims)

    leaf = lambda x: is_spec(x) or isinstance(x, QuantizedWeight)  # noqa: E731
    return jax.tree.map(one, param_specs(cfg), params, is_leaf=leaf)
