"""FP4 (e2m1) weight-only formats: `nvfp4` (NVIDIA) and `mxfp4` (OCP Microscaling v1.0).

E2M1 (OCP MX v1.0, sec. 5.3.3): 1 sign bit (bit 3), 2 exponent bits biased 1, 1 mantissa bit; no
inf or NaN. Codes 0..7 are +{0, 0.5, 1, 1.5, 2, 3, 4, 6}, codes 8..15 the same negated. Encoding
rounds to nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
3.5 -> 4, 5 -> 4) and saturates at +-6. A weight [*in, *out], K = prod(in) its flattened input:

    values  uint8 [*in[:-1], in[-1]/2, *out]   two codes a byte along the input: input 2i in the
            low nibble, 2i+1 in the high nibble (`intq.pack_nibbles`)
    nvfp4   block_scales e4m3 [ceil(K/16), *out], tensor_scale fp32 [*out[:-1]]
            w = e2m1 * block_scale * tensor_scale, NVIDIA's two-level NVFP4 recipe (16-value
            micro-blocks along the input; ModelOpt's `weight_scale` / `weight_scale_2`):
            tensor_scale = amax / (6 * 448) per logical output (amax over the inputs and the
            last output axis: one per weight when unfused, one per q/k/v head or gate/up of a
            fused weight, so fused HF tensors keep their own `weight_scale_2`), and
            block_scale = e4m3(amax(block) / 6 / tensor_scale)
    mxfp4   scales uint8 [ceil(K/32), *out]: E8M0 biased exponents (code e is 2^(e - 127); 255 is
            NaN and never written); w = e2m1 * 2^(e - 127) with e - 127 =
            floor(log2(amax(block))) - 2 (MX v1.0 sec. 6.3: the element type's emax is 2)

Blocks lie along the input, so fused outputs never share a scale; an all-zero block has scale 1
(mxfp4: code 127; its exponents clip to [-126, 127], so code 0 is never written). nvfp4
dequantizes as (e2m1 * block_scale) * tensor_scale: the first product is exact (2 and 4
significant bits), so w is the three-way product rounded once to fp32. The product dequantizes in
the graph to the activation's dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxinfer.quant.format import QuantizedWeight, WeightFormat, register_format
from jaxinfer.quant.fp8 import E4M3, E4M3_MAX, blocks_of, check_finite, expand, safe_scale, to_e4m3
from jaxinfer.quant.intq import (
    group_spec,
    k_major,
    pack_nibbles,
    packed_spec,
    unpack_nibbles,
    w4_kernel_product,
)

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; 8..15 are their negatives


def e2m1_encode(x: jax.Array) -> jax.Array:
    """float -> e2m1 codes (uint8 0..15), nearest with ties to even, saturating at +-6."""
    a = jnp.abs(x)
    # one step per grid midpoint; `>=` where the tie goes up to an even code, `>` where down
    steps = (a > 0.25, a >= 0.75, a > 1.25, a >= 1.75, a > 2.5, a >= 3.5, a > 5.0)
    code = sum(s.astype(jnp.uint8) for s in steps)
    return code | (jnp.signbit(x).astype(jnp.uint8) << 3)


def e2m1_decode(code: jax.Array) -> jax.Array:
    """e2m1 codes -> float32."""
    mag = jnp.asarray(E2M1_VALUES, jnp.float32)[code & 7]
    return jnp.where(code & 8, -mag, mag)


def e8m0_decode(code: jax.Array) -> jax.Array:
    """E8M0 codes (uint8) -> float32 2^(code - 127), exactly for codes 1..254 (code 0, 2^-127, is
    an fp32 subnormal that XLA's CPU flushes to zero: `quantize` never writes it)."""
    return jnp.ldexp(jnp.float32(1.0), code.astype(jnp.int32) - 127)


@dataclass(frozen=True)
class Fp4(WeightFormat):
    """e2m1 values, one scale per `block` inputs per output: e4m3 times an fp32 tensor scale
    (`kind="nv"`) or an E8M0 power of two (`kind="mx"`)."""

    kind: str = "nv"
    block: int = 16
    backend: str = "auto"  # the product: `intq.w4_kernel_product`, else XLA's

    def part_specs(self, spec) -> dict:
        values = packed_spec(spec)
        if self.kind == "mx":
            return {"values": values, "scales": group_spec(spec, self.block, jnp.uint8, "zeros")}
        tensor = dataclasses.replace(spec, shape=spec.shape[spec.in_dims : -1], dtype=jnp.float32,
                                     axes=spec.axes[spec.in_dims : -1], init="ones",
                                     in_dims=0)  # fmt: skip
        return {"values": values, "block_scales": group_spec(spec, self.block, E4M3),
                "tensor_scale": tensor}  # fmt: skip

    def quantize(self, w: jax.Array, in_dims: int) -> dict[str, jax.Array]:
        check_finite(w, self.name)
        wk = k_major(w.astype(jnp.float32), in_dims)
        amax = jnp.max(jnp.abs(blocks_of(wk, 0, self.block)), axis=1)  # [G, *out]
        if self.kind == "mx":
            _, e = jnp.frexp(amax)  # amax = m 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
            code = jnp.where(amax > 0, jnp.clip(e - 1 - 2 + 127, 1, 254), 127).astype(jnp.uint8)
            arrays = {"scales": code}
        else:
            # one per logical output: the max over the blocks (axis 0) and the last output axis
            tensor_scale = safe_scale(jnp.max(amax, axis=(0, -1)), E2M1_MAX * E4M3_MAX)
            arrays = {"block_scales": to_e4m3(amax / E2M1_MAX / tensor_scale[..., None]),
                      "tensor_scale": tensor_scale}  # fmt: skip
        # The codes must divide by the scales as stored: without the barrier XLA:GPU (excess
        # precision allowed) skips the f32 -> e4m3 -> f32 round trip of the block scales and
        # rounds by the unrounded ones (a few % of codes a step off on the H200).
        arrays = jax.lax.optimization_barrier(arrays)
        block, tensor = self._scales(arrays, wk.shape[0])
        scale = block * tensor
        v = jnp.where(scale > 0, wk / jnp.where(scale > 0, scale, 1.0), 0.0)
        codes = e2m1_encode(jnp.clip(v, -E2M1_MAX, E2M1_MAX)).reshape(w.shape)
        return {"values": pack_nibbles(codes, in_dims - 1), **arrays}

    def _scales(self, arrays: dict, k: int) -> tuple[jax.Array, jax.Array]:
        """(each input's block scale, float32 [K, *out]; the tensor scale broadcastable to it)."""
        if self.kind == "mx":
            return expand(e8m0_decode(arrays["scales"]), 0, self.block, k), jnp.float32(1.0)
        block = expand(arrays["block_scales"].astype(jnp.float32), 0, self.block, k)
        return block, arrays["tensor_scale"][..., None]

    def dequantize(self, qw: QuantizedWeight) -> jax.Array:
        v = e2m1_decode(unpack_nibbles(qw.arrays["values"], qw.in_dims - 1))
        vk = k_major(v, qw.in_dims)
        block, tensor = self._scales(qw.arrays, vk.shape[0])
        return (vk * block * tensor).reshape(v.shape)  # (vk * block) is exact: one rounding

    def matmul(self, x: jax.Array, qw: QuantizedWeight) -> jax.Array:
        y = w4_kernel_product(self, x, qw, self.backend)
        if y is not None:
            return y
        return jnp.tensordot(x, self.dequantize(qw).astype(x.dtype), axes=qw.in_dims)


NVFP4 = register_format(Fp4("nvfp4", kind="nv", block=16))
MXFP4 = register_format(Fp4("mxfp4", kind="mx", block=32))
