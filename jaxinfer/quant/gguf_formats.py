"""GGUF's `q8_0` and `q4_1` as weight formats: llama.cpp's blocks of 32 along the input axis.

The block layouts and their dequantization formulas are `jaxinfer.quant.ggml`'s (`Q8_0`:
x = d * q, q int8; `Q4_1`: x = d * q + m, q 0..15; d and m float16 per block); this module stores
them transposed to the model's [*in, *out] orientation (K = prod(in), G = K/32 blocks a column):

    q8_0   values int8 [*in, *out]                          d float16 [G, *out]
    q4_1   values uint8 [*in[:-1], in[-1]/2, *out]          d, m float16 [G, *out]
           (two quants a byte along the input, input 2i in the low nibble: `intq.pack_nibbles`,
           not GGUF's in-block order, which `from_gguf_components` converts from)

`quantize` is bit-exact with llama.cpp's reference quantizers, all in float32:
`quantize_row_q8_0_ref`: d = amax / 127 (a division), id = 1.0f / d (0 where d is 0),
q = roundf(x * id), ties away from zero; `quantize_row_q4_1_ref`: d = (max - min) / 15,
id = 1.0f / d (0 where d is 0), q = min(15, (int8_t)((x - min) * id + 0.5f)), truncating.
The stored d and m are GGML_FP32_TO_FP16 (round to nearest even) of the float32 d and min; the
quants use the float32 id, not one from the rounded d.
`from_gguf_components` makes a stored GGUF tensor one of these formats without dequantizing it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.quant.format import QuantizedWeight, WeightFormat, register_format
from jaxinfer.quant.fp8 import blocks_of, check_finite, safe_scale
from jaxinfer.quant.ggml import GGML_TYPES, Components
from jaxinfer.quant.intq import (
    group_spec,
    k_major,
    pack_nibbles,
    packed_spec,
    unpack_nibbles,
    w4_kernel_product,
)

QK = 32  # llama.cpp's QK8_0 = QK4_1


@dataclass(frozen=True)
class GgufBlocks(WeightFormat):
    """A GGML block type (`type_name` in `ggml.GGML_TYPES`: Q8_0 or Q4_1) as a weight format."""

    type_name: str = "Q8_0"
    backend: str = "auto"  # the product: `intq.w4_kernel_product`, else XLA's

    @property
    def _min(self) -> bool:
        return self.type_name == "Q4_1"

    def part_specs(self, spec) -> dict:
        if math.prod(spec.shape[: spec.in_dims]) % QK:
            raise ValueError(f"{self.name}: the input ({spec.shape}, {spec.in_dims} input axes) "
                             f"must be a multiple of {QK}")  # fmt: skip
        d = group_spec(spec, QK, jnp.float16, "normal", spec.scale / (8 if self._min else 32))
        if not self._min:
            return {"values": dataclasses.replace(spec, dtype=jnp.int8, scale=32.0), "d": d}
        m = group_spec(spec, QK, jnp.float16, "normal", spec.scale)
        return {"values": packed_spec(spec), "d": d, "m": m}

    def quantize(self, w: jax.Array, in_dims: int) -> dict[str, jax.Array]:
        check_finite(w, self.name)
        if math.prod(w.shape[:in_dims]) % QK:
            raise ValueError(f"{self.name}: the input of a {w.shape} weight is not a multiple "
                             f"of {QK}")  # fmt: skip
        b = blocks_of(k_major(w.astype(jnp.float32), in_dims), 0, QK)  # [G, 32, *out]
        if self._min:
            lo, hi = b.min(axis=1), b.max(axis=1)
            d, inv = self._scale(hi - lo, 15.0)
            q = jnp.minimum(15, jnp.trunc((b - lo[:, None]) * inv + 0.5)).reshape(w.shape)
            return {"values": pack_nibbles(q, in_dims - 1), "d": d, "m": lo.astype(jnp.float16)}
        d, inv = self._scale(jnp.max(jnp.abs(b), axis=1), 127.0)
        v = b * inv
        t = jnp.trunc(v)  # C's roundf, ties away from zero (floor(|v| + 0.5) rounds 0.49999997 up)
        q = t + jnp.sign(v) * (jnp.abs(v - t) >= 0.5)
        return {"values": q.astype(jnp.int8).reshape(w.shape), "d": d}

    @staticmethod
    def _scale(span: jax.Array, qmax: float) -> tuple[jax.Array, jax.Array]:
        """(float16(d), 1/d [G, 1, *out]) for the float32 d = span / qmax (0 for a flat block)."""
        d = safe_scale(span, qmax)  # 1 where span is 0: never divides by 0
        inv = jnp.where(span > 0, 1 / d, 0.0)[:, None]
        return jnp.where(span > 0, d, 0.0).astype(jnp.float16), inv

    def dequantize(self, qw: QuantizedWeight) -> jax.Array:
        values = qw.arrays["values"]
        q = unpack_nibbles(values, qw.in_dims - 1) if self._min else values
        shape = q.shape
        # ggml's components: [N, G, 32] quants, [N, G] d (and m), float32 scales
        qk = k_major(q, qw.in_dims).reshape(-1, QK, math.prod(shape[qw.in_dims :]))
        comps = {"q": jnp.transpose(qk, (2, 0, 1))}
        for name in ("d", "m") if self._min else ("d",):
            comps[name] = qw.arrays[name].astype(jnp.float32).reshape(qk.shape[0], -1).T
        x = GGML_TYPES[self.type_name].values(comps)  # [N, G, 32]
        return jnp.transpose(x, (1, 2, 0)).reshape(shape)

    def matmul(self, x: jax.Array, qw: QuantizedWeight) -> jax.Array:
        y = w4_kernel_product(self, x, qw, self.backend)
        if y is not None:
            return y
        return jnp.tensordot(x, self.dequantize(qw).astype(x.dtype), axes=qw.in_dims)


Q8_0 = register_format(GgufBlocks("q8_0", "Q8_0"))
Q4_1 = register_format(GgufBlocks("q4_1", "Q4_1"))
_BY_TYPE = {"Q8_0": Q8_0, "Q4_1": Q4_1}


def format_of_type(type_name: Any) -> GgufBlocks | None:
    """The weight format that stores GGML type `type_name` (a name or `gguf.GGMLQuantizationType`)
    as it is, bit for bit (Q8_0: q8_0, Q4_1: q4_1); None for a type that has none."""
    return _BY_TYPE.get(getattr(type_name, "name", type_name))


def from_gguf_components(
    components: Components, type_name: Any, shape: tuple[int, ...], in_dims: int = 1
) -> QuantizedWeight:
    """A weight of logical shape [*in, *out] from `ggml.unpack`'s components of its GGUF tensor.

    The GGUF tensor is stored [*out, K] (numpy order: one row per output, `ne0` = K the flattened
    input, as HF's [out_features, in_features]), so its components are q [N, K/32, 32] and
    d (and m) [N, K/32] with N = prod(out) in row-major order. The quants and float16 scales
    are moved over bit for bit: the weight dequantizes to what `ggml.dequantize` gives,
    transposed.
    """
    name = getattr(type_name, "name", type_name)
    if name not in _BY_TYPE:
        raise ValueError(f"GGML type {name!r} has no weight format; have: {', '.join(_BY_TYPE)}")
    fmt = _BY_TYPE[name]
    shape = tuple(int(n) for n in shape)
    n = math.prod(shape[in_dims:])
    q = np.asarray(components["q"])
    if q.shape != (n, math.prod(shape[:in_dims]) // QK, QK):
        raise ValueError(f"{name} components q {q.shape} do not fit a weight of shape {shape}")
    q = q.reshape(n, -1).T.reshape(shape)  # [*in, *out]
    arrays = {"values": np.asarray(pack_nibbles(q, in_dims - 1)) if fmt._min else q.astype(np.int8)}
    for part in ("d", "m") if fmt._min else ("d",):
        c = np.asarray(components[part]).reshape(n, -1).T  # float32 of float16: exact back
        arrays[part] = jnp.asarray(c.astype(np.float16).reshape(-1, *shape[in_dims:]))
    arrays["values"] = jnp.asarray(arrays["values"])
    return QuantizedWeight(arrays, fmt, in_dims)
