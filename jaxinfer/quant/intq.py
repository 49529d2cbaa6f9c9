"""Integer weight-only formats: `int8` (per output channel), `int4_g128_sym`, `int4_g128_asym`.

A weight [*in, *out] with K = prod(in) (the flattened input, row-major like HF's `in_features`):

    int8            values int8 [*in, *out]          scales fp32 [*out]       w = q * s
    int4_g128_sym   values uint8 [*in[:-1], in[-1]/2, *out]  scales fp32 [G, *out]
                    w = (q - 8) * s,  q in 1..15 (symmetric: s = amax/7, q - 8 in -7..7)
    int4_g128_asym  values as above, scales fp32 [G, *out], zeros uint8 [G, *out]
                    w = (q - z) * s,  q, z in 0..15, s = (max - min)/15 over [min(w,0), max(w,0)]

G = ceil(K/128) groups of 128 consecutive inputs (the last one may be partial); the groups lie
along the input, so fused outputs (q/k/v, gate/up) never share a scale. Rounding is to nearest,
ties to even. Nibble order (`pack_nibbles`): byte i of the packed axis holds input 2i in its low
nibble and input 2i+1 in its high nibble. The products of int4_g128_sym (and of nvfp4,
mxfp4, q4_1 and q8_0) run on the weight-only Triton kernel at decode sizes on one GPU
(`w4_kernel_product`; int8's only with backend "triton"); elsewhere int8 runs a dot of its
values in the activation's dtype scaled after, the others dequantize in the graph to the
activation's dtype and run a plain dot.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxinfer.quant.format import QuantizedWeight, WeightFormat, register_format
from jaxinfer.quant.fp8 import blocks_of, check_finite, expand, one_gpu, safe_scale

GROUP = 128


def pack_nibbles(q: jax.Array, axis: int) -> jax.Array:
    """4-bit values (0..15, any int dtype) -> uint8 with `axis` halved: low nibble = even index."""
    q = jnp.moveaxis(q.astype(jnp.uint8), axis, -1)
    q = q.reshape(*q.shape[:-1], -1, 2)
    return jnp.moveaxis(q[..., 0] | (q[..., 1] << 4), -1, axis)


def unpack_nibbles(p: jax.Array, axis: int) -> jax.Array:
    """The inverse of `pack_nibbles`: uint8 with `axis` doubled, values 0..15."""
    p = jnp.moveaxis(p, axis, -1)
    q = jnp.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
    return jnp.moveaxis(q, -1, axis)


def packed_spec(spec, dtype=jnp.uint8):
    """The spec of `spec`'s values packed two per byte along its last input axis."""
    shape = list(spec.shape)
    if shape[spec.in_dims - 1] % 2:
        raise ValueError(f"packing 4-bit values needs an even last input axis, got {spec.shape}")
    shape[spec.in_dims - 1] //= 2
    return dataclasses.replace(spec, shape=tuple(shape), dtype=dtype, init="zeros")


def group_spec(spec, group: int, dtype, init="ones", scale=1.0):
    """The spec of one value per `group` inputs per output: [ceil(K/group), *out]."""
    k = math.prod(spec.shape[: spec.in_dims])
    axes = (spec.axes[0] if spec.in_dims == 1 else None, *spec.axes[spec.in_dims :])
    shape = (-(-k // group), *spec.shape[spec.in_dims :])
    return dataclasses.replace(spec, shape=shape, dtype=dtype, axes=axes, init=init,
                               scale=scale, in_dims=0)  # fmt: skip


# The weight-only formats' "auto" backend: the Triton kernel up to this many tokens (H100, 8B
# shapes: int4 0.56-0.62x bf16's dot at m <= 16, 0.8x at 64, where XLA's product, which
# dequantizes the whole weight each call, is slower still: h100/quant_matmul_e2m1.json,
# quant_matmul_m32_64_configs.json; docs/decisions.md).
W4_KERNEL_MAX_ROWS = 64
BACKENDS = ("auto", "triton", "xla")


def w4_kernel_product(fmt: WeightFormat, x: jax.Array, qw: QuantizedWeight,
                      backend: str) -> jax.Array | None:  # fmt: skip
    """x @ qw on a weight-only kernel (`pallas_kernels.matmul.w4_matmul`, under its interpreter
    on a CPU) when `backend` picks it, else None (the format's XLA product). "triton" (the Pallas
    Triton kernel): every product of at most the kernel's `MAX_M` tokens, an error where the
    kernel cannot run it (x's dtype, the sizes); more tokens (a prefill step) take XLA's
    product. "auto": the kernel for bf16 x of at most `W4_KERNEL_MAX_ROWS` tokens on
    `one_gpu()`, shapes the kernel takes."""
    if backend not in BACKENDS:
        raise ValueError(f"{fmt.name}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "xla":
        return None
    from pallas_kernels.matmul.reference import BITS, PARTS
    from pallas_kernels.matmul.w4_triton import MAX_M, SIZE_MULTIPLE, TILE_K, sizes_fit

    values = qw.arrays["values"]  # 4 bits: [*in[:-1], in[-1]/2, *out]; 8 bits: [*in, *out]
    lead, out = x.shape[: x.ndim - qw.in_dims], values.shape[qw.in_dims :]
    k, n = math.prod(x.shape[x.ndim - qw.in_dims :]), math.prod(out)
    rows = math.prod(lead)
    names = PARTS.get(fmt.name, {})
    fits = bool(names) and x.dtype == jnp.bfloat16 and sizes_fit(fmt.name, k, n)
    if not 1 <= rows <= (MAX_M if backend == "triton" else W4_KERNEL_MAX_ROWS):
        return None
    if backend == "triton" and not fits:
        raise ValueError(f"{fmt.name}: the {backend} backend takes the formats {sorted(PARTS)} with "
                         f"bf16 x, K and N multiples of {SIZE_MULTIPLE} (K of {TILE_K} for "
                         f"int4_g128_sym), K >= {TILE_K}; got x {x.dtype} {list(x.shape)}, "
                         f"output {list(out)}")  # fmt: skip
    if backend == "auto" and not (fits and one_gpu()):
        return None
    from pallas_kernels.matmul import w4_matmul

    parts = {}
    for name in names:
        a = qw.arrays[name]
        if name == "tensor_scale":  # nvfp4: one per logical output [*out[:-1]], applied per column
            a = jnp.broadcast_to(a[..., None], out)
        # int8's scales [*out] and nvfp4's tensor scale -> [N]; group parts [G, *out] -> [G, N]
        parts[name] = a.reshape(n) if a.shape == out else a.reshape(-1, n)
    y = w4_matmul(x.reshape(rows, k), values.reshape(k * BITS[fmt.name] // 8, n), fmt=fmt.name,
                  backend="triton", **parts)  # fmt: skip
    return y.reshape(*lead, *out).astype(x.dtype)


def k_major(w: jax.Array, in_dims: int) -> jax.Array:
    """[*in, *out] -> [K, *out]."""
    return w.reshape(-1, *w.shape[in_dims:])


@dataclass(frozen=True)
class Int8(WeightFormat):
    """int8 values, one fp32 scale per output channel (symmetric, amax/127)."""

    # the product: "auto" is XLA's (below), faster than the kernel at the engine's decode rows
    # (8-128 on the H200's 8B shapes, 27.9-53.4 us vs the Triton kernel's 27.5-40.7:
    # h200/quant_matmul_int8_rows.json, w4_triton_probe.json); "triton" puts it on the kernel
    # (`w4_kernel_product`)
    backend: str = "auto"

    def part_specs(self, spec) -> dict:
        out, axes = spec.shape[spec.in_dims :], spec.axes[spec.in_dims :]
        scales = dataclasses.replace(spec, shape=out, dtype=jnp.float32, axes=axes,
                                     init="normal", scale=spec.scale / 32, in_dims=0)  # fmt: skip
        return {"values": dataclasses.replace(spec, dtype=jnp.int8, scale=32.0), "scales": scales}

    def quantize(self, w: jax.Array, in_dims: int) -> dict[str, jax.Array]:
        check_finite(w, self.name)
        wf = w.astype(jnp.float32)
        s = safe_scale(jnp.max(jnp.abs(wf), axis=tuple(range(in_dims))), 127.0)
        return {"values": jnp.clip(jnp.round(wf / s), -127, 127).astype(jnp.int8), "scales": s}

    def dequantize(self, qw: QuantizedWeight) -> jax.Array:
        return qw.arrays["values"].astype(jnp.float32) * qw.arrays["scales"]

    def matmul(self, x: jax.Array, qw: QuantizedWeight) -> jax.Array:
        y = None if self.backend == "auto" else w4_kernel_product(self, x, qw, self.backend)
        if y is not None:
            return y
        # the per-output scales after the dot: XLA's GEMM then reads the int8 values as they are
        # stored (2.4-3.7x faster on an H100 than a dot of the dequantized weight,
        # experiments/results/h100/quant_matmul_native.json)
        q = qw.arrays["values"].astype(x.dtype)  # exact: |q| <= 127
        y = jnp.tensordot(x, q, axes=qw.in_dims, preferred_element_type=jnp.float32)
        return (y * qw.arrays["scales"]).astype(x.dtype)


@dataclass(frozen=True)
class Int4(WeightFormat):
    """4-bit integers packed two per byte, one scale (and with `asym`, one zero point) per
    `group` inputs per output."""

    asym: bool = False
    group: int = GROUP
    backend: str = "auto"  # the product: `w4_kernel_product` (sym only), else XLA's

    def part_specs(self, spec) -> dict:
        # random init: q = 0 decodes to -8 * s (sym) or 0 (asym), s ~ N(0, spec.scale / 8)
        scales = group_spec(spec, self.group, jnp.float32, "normal", spec.scale / 8)
        specs = {"values": packed_spec(spec), "scales": scales}
        if self.asym:
            specs["zeros"] = group_spec(spec, self.group, jnp.uint8, "zeros")
        return specs

    def quantize(self, w: jax.Array, in_dims: int) -> dict[str, jax.Array]:
        check_finite(w, self.name)
        wf = k_major(w.astype(jnp.float32), in_dims)
        g = blocks_of(wf, 0, self.group)  # [G, group, *out]
        if self.asym:
            lo, hi = jnp.minimum(g.min(axis=1), 0.0), jnp.maximum(g.max(axis=1), 0.0)
            s = safe_scale(hi - lo, 15.0)
            z = jnp.clip(jnp.round(-lo / s), 0, 15)
            q = jnp.clip(jnp.round(wf / self._full(s, wf)) + self._full(z, wf), 0, 15)
        else:
            s = safe_scale(jnp.max(jnp.abs(g), axis=1), 7.0)
            q = jnp.clip(jnp.round(wf / self._full(s, wf)), -7, 7) + 8
        out = {"values": pack_nibbles(q.reshape(w.shape), in_dims - 1), "scales": s}
        if self.asym:
            out["zeros"] = z.astype(jnp.uint8)
        return out

    def _full(self, per_group: jax.Array, wk: jax.Array) -> jax.Array:
        return expand(per_group, 0, self.group, wk.shape[0])

    def dequantize(self, qw: QuantizedWeight) -> jax.Array:
        q = unpack_nibbles(qw.arrays["values"], qw.in_dims - 1)
        qk = k_major(q, qw.in_dims).astype(jnp.float32)
        z = self._full(qw.arrays["zeros"], qk) if self.asym else 8
        return ((qk - z) * self._full(qw.arrays["scales"], qk)).reshape(q.shape)

    def matmul(self, x: jax.Array, qw: QuantizedWeight) -> jax.Array:
        y = w4_kernel_product(self, x, qw, self.backend)
        if y is not None:
            return y
        return jnp.tensordot(x, self.dequantize(qw).astype(x.dtype), axes=qw.in_dims)


INT8 = register_format(Int8("int8"))
INT4_G128_SYM = register_format(Int4("int4_g128_sym"))
INT4_G128_ASYM = register_format(Int4("int4_g128_asym", asym=True))
