"""How each 4-bit format turns a code and its group's scales into a value, inside the kernel.

One `W4Decode` per format is the kernel's only format-specific part (`w4_mgpu` is one kernel for
all of them). Everything here is elementwise jnp on register arrays: int32 codes (0..15) and fp32
per-group rows already broadcast to the codes' shape, so it lowers for Mosaic GPU and runs under
the interpreter alike. The arithmetic decodes are independent of `reference.py`'s table lookups,
so the tests compare two ways of reading a format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.matmul.reference import GROUP_SIZES, PARTS


@dataclass(frozen=True)
class W4Decode:
    """`group` inputs share one entry of each of `grouped` (arrays [K/group, N], streamed with
    the values); `to_f32(name, raw)` makes a row of one of them fp32; `value(codes, rows)` is the
    weight (fp32) of int32 codes given each grouped part's fp32 row broadcast to their shape;
    `output_scale` names a scalar part that multiplies the product (nvfp4's tensor scale)."""

    name: str
    group: int
    grouped: tuple[tuple[str, jnp.dtype], ...]
    to_f32: Callable[[str, jax.Array], jax.Array]
    value: Callable[[jax.Array, dict[str, jax.Array]], jax.Array]
    output_scale: str | None = None


def e2m1(codes: jax.Array) -> jax.Array:
    """E2M1 codes -> fp32 arithmetically: exponent e = bits 1..2, mantissa bit 0, sign bit 3;
    |v| = (2 * [e > 0] + mantissa) * 2^(max(e, 1) - 2)."""
    e = (codes >> 1) & 3
    mant = (codes & 1).astype(jnp.float32)
    lead = jnp.where(e > 0, 2.0, 0.0)
    pow2 = jnp.where(e == 3, 2.0, jnp.where(e == 2, 1.0, 0.5))
    mag = (lead + mant) * pow2
    return jnp.where(codes >= 8, -mag, mag)


def e8m0(codes: jax.Array) -> jax.Array:
    """E8M0 biased exponents (uint8) -> fp32 2^(e - 127) by placing e in the fp32 exponent field
    (code 0 gives 0, not 2^-127: formats never write it)."""
    return lax.bitcast_convert_type(codes.astype(jnp.int32) << 23, jnp.float32)


def _to_f32(name: str, raw: jax.Array) -> jax.Array:
    if raw.dtype == jnp.float8_e4m3fn:  # Hopper converts e4m3 to f16 only (then exactly to f32)
        return raw.astype(jnp.float16).astype(jnp.float32)
    if raw.dtype == jnp.uint8:
        return e8m0(raw)
    return raw.astype(jnp.float32)


DECODERS = {
    "int4_g128_sym": W4Decode(
        "int4_g128_sym",
        GROUP_SIZES["int4_g128_sym"],
        (("scales", jnp.float32),),
        _to_f32,
        lambda q, r: (q - 8).astype(jnp.float32) * r["scales"],
    ),
    "nvfp4": W4Decode(
        "nvfp4",
        GROUP_SIZES["nvfp4"],
        (("block_scales", jnp.float8_e4m3fn),),
        _to_f32,
        lambda q, r: e2m1(q) * r["block_scales"],
        output_scale="tensor_scale",
    ),
    "mxfp4": W4Decode(
        "mxfp4",
        GROUP_SIZES["mxfp4"],
        (("scales", jnp.uint8),),
        _to_f32,
        lambda q, r: e2m1(q) * r["scales"],
    ),
    "q4_1": W4Decode(
        "q4_1",
        GROUP_SIZES["q4_1"],
        (("d", jnp.float16), ("m", jnp.float16)),
        _to_f32,
        lambda q, r: r["d"] * q.astype(jnp.float32) + r["m"],
    ),
}
assert all(set(PARTS[f]) == {n for n, _ in d.grouped} | {d.output_scale} - {None}
           for f, d in DECODERS.items())  # fmt: skip
