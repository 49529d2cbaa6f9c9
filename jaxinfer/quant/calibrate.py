"""Calibration of static activation scales: `fp8_static`'s `input_scale` = max|x| / 448 over
calibration tokens, x the input of each linear.

`calibrate` runs the model's dense `forward` (jitted) over the calibration batches with every
`fp8_static` weight wrapped in the `Observed` format: its matmul is the plain product `x @ w`
(the weight dequantized, or the plain weight not yet quantized) and it sends max|x| to the host
through `jax.debug.callback`, where an `AmaxObserver` keeps the largest per weight. A callback
(not an extra output threaded through every layer) keeps the model's functions unchanged; the
observer is part of the static format, so each calibration traces its own program. The other
weights run as they are given (their own formats): a `fp8_static` linear sees the activations of
the model it will serve in, but for the static layers themselves, which run unquantized.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import forward
from jaxinfer.models.spec import Params, param_specs
from jaxinfer.quant import QuantizedWeight, WeightFormat
from jaxinfer.quant.fp8 import E4M3_MAX, Fp8Static, safe_scale
from jaxinfer.quant.params import quantize_params


@dataclass(eq=False)
class AmaxObserver:
    """max|x| seen per weight path; compared by identity (each calibration has its own)."""

    amax: dict[str, float] = field(default_factory=dict)

    def record(self, path: str, amax: Any) -> None:
        self.amax[path] = max(self.amax.get(path, 0.0), float(amax))


@dataclass(frozen=True)
class Observed(WeightFormat):
    """Calibration only, never stored: arrays {"w": plain weight}; `matmul` reports max|x| under
    `path` to `observer` and returns x @ w."""

    path: str = ""
    observer: AmaxObserver | None = None

    def dequantize(self, qw: QuantizedWeight) -> jax.Array:
        return qw.arrays["w"]

    def matmul(self, x: jax.Array, qw: QuantizedWeight) -> jax.Array:
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
        jax.debug.callback(functools.partial(self.observer.record, self.path), amax)
        return jnp.tensordot(x, qw.arrays["w"].astype(x.dtype), axes=qw.in_dims)


def static_paths(cfg: ModelConfig) -> list[tuple[int, str]]:
    """(layer, name) of every weight `cfg` stores as `fp8_static` (calibrated input scales)."""
    return [
        (i, name)
        for i, layer in enumerate(param_specs(cfg)["layers"])
        for name, spec in layer.items()
        if isinstance(spec, QuantizedWeight) and isinstance(spec.format, Fp8Static)
    ]


def calibrate(cfg: ModelConfig, params: Params, token_batches: Iterable[Any]) -> Params:
    """The params of `cfg` with each `fp8_static` weight's `input_scale` = max|x| / 448 over
    `token_batches` (int token ids [B, L] each, positions from 0) at its input (1 where x is all
    zeros). `params` may be plain (`cfg.plain()`'s) or already in cfg's formats; plain weights
    are quantized here (`quantize_params`). Dynamic formats need no calibration: their weights
    pass through."""
    targets = static_paths(cfg)
    if not targets:
        return quantize_params(cfg, params)
    observer, specs = AmaxObserver(), param_specs(cfg)["layers"]
    observed = {**params, "layers": tuple(dict(layer) for layer in params["layers"])}
    for i, name in targets:
        w = observed["layers"][i][name]
        plain = w.format.dequantize(w) if isinstance(w, QuantizedWeight) else w
        observed["layers"][i][name] = QuantizedWeight(
            {"w": plain},
            Observed("observed", f"layers.{i}.{name}", observer),
            specs[i][name].in_dims,
        )
    run = jax.jit(functools.partial(forward, cfg=cfg.plain()))
    seen = 0
    for tokens in token_batches:
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"calibration batches must be int token ids [B, L], got "
                             f"{tokens.dtype}{list(tokens.shape)}")  # fmt: skip
        run(observed, tokens=jnp.asarray(tokens)).block_until_ready()
        seen += tokens.size
    jax.effects_barrier()  # every callback has reported
    if not seen:
        raise ValueError(f"calibrating {len(targets)} fp8_static weights needs at least one "
                         "calibration token")  # fmt: skip
    out = quantize_params(cfg, params)
    layers = [dict(layer) for layer in out["layers"]]
    for i, name in targets:
        scale = safe_scale(jnp.float32(observer.amax[f"layers.{i}.{name}"]), E4M3_MAX)
        qw = layers[i][name]
        layers[i][name] = qw.replace(arrays={**qw.arrays, "input_scale": scale})
    return {**out, "layers": tuple(layers)}
