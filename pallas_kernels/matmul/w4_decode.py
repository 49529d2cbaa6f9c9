"""How each weight-only format turns a code and its group's scales into a value, in the kernel.

One `W4Decode` per format is the kernel's only format-specific part (`w4_triton` is one kernel
for all of them, 4-bit and 8-bit). Everything here is elementwise jnp on register arrays: int32
codes (0..15 for 4 bits, -128..127 for 8) and fp32 per-group rows already broadcast to the codes'
shape, so it lowers for Triton and runs under the interpreter alike. The arithmetic decodes are
independent of `reference.py`'s table lookups, so the tests compare two ways of reading a format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.matmul.reference import BITS, GROUP_SIZES, PARTS


@dataclass(frozen=True)
class W4Decode:
    """`name` is the format's (its `bits` per code come from `reference.BITS`); `group` inputs share
    one entry of each of `grouped` (arrays [K/group, N], streamed with the values); `to_f32(name,
    raw)` makes a row of one of them fp32; `value(codes, rows)` is the weight (fp32) of int32 codes
    given each grouped part's fp32 row broadcast to their shape; `output_scale` names a part, one
    scalar or one per output, that multiplies the product (nvfp4's tensor scale, int8's channel
    scales)."""

    name: str
    group: int | None
    grouped: tuple[tuple[str, jnp.dtype], ...]
    to_f32: Callable[[str, jax.Array], jax.Array]
    value: Callable[[jax.Array, dict[str, jax.Array]], jax.Array]
    output_scale: str | None = None
    # A grouped part whose group is the kernel's whole K step (128 inputs): it scales the step's
    # product row by row instead of every decoded value, and `value` leaves it out.
    step_scale: str | None = None

    @property
    def bits(self) -> int:  # per code: 4 (two a byte) or 8 (int8)
        return BITS[self.name]


# fp32 2^23: with an integer 0 <= i < 2^23 OR-ed into its (zero) mantissa it is 2^23 + i exactly
_MAGIC = 0x4B000000


def int_value(codes: jax.Array, minus: int = 0) -> jax.Array:
    """fp32 `codes - minus` for int32 codes >= 0 (below 2^23): the codes OR-ed into 2^23's
    mantissa, then 2^23 + minus subtracted: one integer and one float op, exact, no int-to-float
    conversion. It made the Triton kernel 2-10% faster at m <= 16 than conversions did
    (experiments/results/h200/w4_triton_probe.json, f32magic vs cvt)."""
    bits = codes | _MAGIC
    return lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(2**23 + minus)


# 2 |v| of the E2M1 magnitudes 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6), one per nibble of an int32
# (nibble i for code i): 0xC8643210 read as a signed int32
_E2M1_TWICE = 0xC8643210 - (1 << 32)


def e2m1_twice(codes: jax.Array) -> jax.Array:
    """2 x the E2M1 value of int32 codes (0..15), fp32: the magnitude's nibble of a constant
    shifted out (4 integer ops, no selects; the arithmetic shift's sign bits are masked off),
    made fp32 (`int_value`), and the code's sign bit (3) moved to fp32's sign bit (31). The 1/2
    goes into the group scales (`_half_scales`), which are per group, not per value."""
    twice = (jnp.full(codes.shape, _E2M1_TWICE, jnp.int32) >> ((codes & 7) << 2)) & 0xF
    bits = lax.bitcast_convert_type(int_value(twice), jnp.int32)
    return lax.bitcast_convert_type(bits | ((codes & 8) << 28), jnp.float32)


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


def _half_scales(name: str, raw: jax.Array) -> jax.Array:
    """A group scale of an E2M1 format, halved: `e2m1_twice` decodes 2 x the value (exact: a
    power of two)."""
    return 0.5 * _to_f32(name, raw)


DECODERS = {
    "int4_g128_sym": W4Decode(
        "int4_g128_sym",
        GROUP_SIZES["int4_g128_sym"],
        (("scales", jnp.float32),),
        _to_f32,
        lambda q, r: int_value(q, 8),
        step_scale="scales",
    ),
    "nvfp4": W4Decode(
        "nvfp4",
        GROUP_SIZES["nvfp4"],
        (("block_scales", jnp.float8_e4m3fn),),
        _half_scales,
        lambda q, r: e2m1_twice(q) * r["block_scales"],
        output_scale="tensor_scale",
    ),
    "mxfp4": W4Decode(
        "mxfp4",
        GROUP_SIZES["mxfp4"],
        (("scales", jnp.uint8),),
        _half_scales,
        lambda q, r: e2m1_twice(q) * r["scales"],
    ),
    "q4_1": W4Decode(
        "q4_1",
        GROUP_SIZES["q4_1"],
        (("d", jnp.float16), ("m", jnp.float16)),
        _to_f32,
        lambda q, r: r["d"] * int_value(q) + r["m"],
    ),
    "int8": W4Decode(
        "int8",
        GROUP_SIZES["int8"],
        (),
        _to_f32,
        lambda q, r: int_value(q + 128, 128),
        output_scale="scales",
    ),
    "q8_0": W4Decode(
        "q8_0",
        GROUP_SIZES["q8_0"],
        (("d", jnp.float16),),
        _to_f32,
        lambda q, r: r["d"] * int_value(q + 128, 128),
    ),
}
assert all(set(PARTS[f]) == {n for n, _ in d.grouped} | {d.output_scale} - {None}
           for f, d in DECODERS.items())  # fmt: skip
assert all(d.name == f for f, d in DECODERS.items())
assert all(d.step_scale is None or (d.group == 128 and d.step_scale in dict(d.grouped))
           for d in DECODERS.values())  # fmt: skip
