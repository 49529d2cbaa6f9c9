"""Pure-JAX references for the weight-only matmuls: dequantize in fp32, then one fp32 dot.

The layouts are `jaxinfer.quant`'s (intq, fp4, gguf_formats), restated here so the kernels stay
importable without jaxinfer. A weight [K, N] (K inputs, N outputs):

    4-bit: values uint8 [K/2, N], input 2i in the low nibble of byte i, input 2i+1 in the high one
    int4_g128_sym  scales fp32 [K/128, N]               w = (q - 8) * s
    nvfp4          block_scales e4m3 [K/16, N], tensor_scale fp32 [] or [N]
                                                        w = e2m1(q) * block_scale * tensor_scale
    mxfp4          scales uint8 [K/32, N] (E8M0)        w = e2m1(q) * 2^(e - 127)
    q4_1           d, m float16 [K/32, N]               w = d * q + m
    8-bit: values int8 [K, N]
    int8           scales fp32 [N] (one per output)     w = q * s
    q8_0           d float16 [K/32, N]                  w = d * q

E2M1 codes 0..7 are +{0, 0.5, 1, 1.5, 2, 3, 4, 6}, codes 8..15 the same negated (OCP MX v1.0,
sec. 5.3.3). Every group lies along the input: group g of column n covers inputs
[g * size, (g + 1) * size).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Inputs per entry of a format's grouped parts (None: int8's one scale per output column).
GROUP_SIZES = {"int4_g128_sym": 128, "nvfp4": 16, "mxfp4": 32, "q4_1": 32, "int8": None,
               "q8_0": 32}  # fmt: skip
BITS = {fmt: 8 if fmt in ("int8", "q8_0") else 4 for fmt in GROUP_SIZES}
# The arrays besides `values` each format takes, with their dtypes (nvfp4's `tensor_scale`: one,
# or one per output, applied to the product's fp32 output; int8's `scales`: one per output).
PARTS = {
    "int4_g128_sym": {"scales": jnp.float32},
    "nvfp4": {"block_scales": jnp.float8_e4m3fn, "tensor_scale": jnp.float32},
    "mxfp4": {"scales": jnp.uint8},
    "q4_1": {"d": jnp.float16, "m": jnp.float16},
    "int8": {"scales": jnp.float32},
    "q8_0": {"d": jnp.float16},
}
FORMATS = tuple(GROUP_SIZES)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_codes(values: jax.Array) -> jax.Array:
    """uint8 [K/2, N] -> int32 codes [K, N] (0..15), input 2i from the low nibble of byte i."""
    v = values.astype(jnp.int32)
    return jnp.stack([v & 0xF, v >> 4], axis=1).reshape(-1, values.shape[1])


def _per_input(per_group: jax.Array, size: int) -> jax.Array:
    return jnp.repeat(per_group.astype(jnp.float32), size, axis=0)


def dequantize(values: jax.Array, fmt: str, **parts: jax.Array) -> jax.Array:
    """The fp32 weight [K, N] that `values` and the format's `parts` encode."""
    size = GROUP_SIZES.get(fmt)
    if fmt == "int8":
        return values.astype(jnp.float32) * parts["scales"].astype(jnp.float32)
    if fmt == "q8_0":
        return values.astype(jnp.float32) * _per_input(parts["d"], size)
    q = unpack_codes(values)
    if fmt == "int4_g128_sym":
        return (q - 8).astype(jnp.float32) * _per_input(parts["scales"], size)
    if fmt == "q4_1":
        return _per_input(parts["d"], size) * q.astype(jnp.float32) + _per_input(parts["m"], size)
    mag = jnp.asarray(E2M1_VALUES, jnp.float32)[q & 7]
    e2m1 = jnp.where(q >= 8, -mag, mag)
    if fmt == "nvfp4":
        block = _per_input(parts["block_scales"], size)
        return e2m1 * block * jnp.asarray(parts["tensor_scale"], jnp.float32)
    if fmt == "mxfp4":
        exp = jnp.repeat(parts["scales"].astype(jnp.int32) - 127, size, axis=0)
        return jnp.ldexp(e2m1, exp)
    raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def w4_matmul_ref(x: jax.Array, values: jax.Array, *, fmt: str, **parts: jax.Array) -> jax.Array:
    """x [M, K] @ dequantize(values, fmt, **parts) [K, N] -> fp32 [M, N], all in fp32."""
    w = dequantize(values, fmt, **parts)
    return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
