"""FP8 (e4m3) weight formats, W8A8: `fp8_tensor`, `fp8_channel`, `fp8_block`, `fp8_static`.

Values are OCP FP8 E4M3 (`float8_e4m3fn`: 1 sign, 4 exponent bits biased 7, 3 mantissa bits; no
infinities, S.1111.111 is NaN, largest finite 448, smallest normal 2^-6, subnormals k * 2^-9).
A weight of logical shape [*in, *out] is stored K-major: `values` e4m3 [*out, *in] (each output's
K = prod(in) inputs contiguous, as Hugging Face's FP8 checkpoints store `weight` [out, in]), and
fp32 `scales` with w[i, o] ~= values[o, i] * scale:

    fp8_tensor   scales [*out[:-1]]                          one per logical output
    fp8_channel  scales [*out]                               one per output channel
    fp8_block    scales [*out[:-1], ceil(N/128), ceil(K/128)]  one per 128x128 block (HF's
                                                             `weight_scale_inv` layout)
    fp8_static   scales [*out], input_scale []               per channel, one calibrated
                                                             activation scale (`Fp8Static`)

K = prod(in) is the flattened input (row-major, as HF's `in_features`), N the last output axis.
K-major is the layout Hopper's FP8 tensor cores read (fp8 wgmma takes both operands K-minor), so
cuBLASLt's FP8 GEMM and our block-scaled kernel read the stored array as it is: with [K, N]
storage XLA moved the whole weight on every call at decode sizes (docs/decisions.md).
A fused weight's leading output axes index its logical outputs (w_qkv [E, Hkv, G + 2, D]: each
query, key and value head; w_gate_up [E, 2, F]: gate and up), so no scale is shared across q/k/v
or gate/up: fp8_tensor keeps one scale per logical output (one per weight when unfused, out =
[N]), and fp8_block's blocks never cross a fused axis. Partial edge blocks are allowed, as in
DeepSeek-V3's `weight_scale_inv` (DeepSeek-V3 technical report, sec. 3.3.2). Scales are amax/448
(an all-zero block has scale 1). Activations are quantized at run time the same way: per token
(fp8_tensor, fp8_channel) or per token per 128 input channels (fp8_block, "1x128"), and the
product is an fp8 x fp8 `dot_general` accumulated in fp32 with the scales applied after it (the
form XLA lowers to a cuBLASLt FP8 GEMM on Hopper).

The helpers below the formats (finite check, flattening, edge-padded blocks) are shared by the
other modules of `jaxinfer.quant`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.quant.format import QuantizedWeight, WeightFormat, register_format

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
KERNEL_MIN_ROWS = 8  # fp8_block's "auto" backend: the Pallas kernel from this many tokens


def check_finite(w: jax.Array, fmt: str) -> None:
    """Refuse a weight holding inf or NaN (its scale would poison a whole block).

    A concrete array raises ValueError here; under `jit` the check runs on the device and the
    same ValueError surfaces from the callback as a runtime error carrying its message."""

    def refuse(ok) -> None:
        if not bool(ok):
            raise ValueError(f"{fmt}: the weight holds inf or NaN; refusing to quantize it")

    ok = jnp.all(jnp.isfinite(w))
    if isinstance(ok, jax.core.Tracer):
        jax.debug.callback(refuse, ok)
    else:
        refuse(ok)


def blocks_of(x: jax.Array, axis: int, size: int) -> jax.Array:
    """x with `axis` split into [ceil(n/size), size], the last block zero-padded."""
    axis %= x.ndim
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -x.shape[axis] % size)
    x = jnp.pad(x, pad)
    return x.reshape(*x.shape[:axis], -1, size, *x.shape[axis + 1 :])


def expand(s: jax.Array, axis: int, size: int, n: int) -> jax.Array:
    """Per-block values along `axis` repeated to `n` elements (the inverse of `blocks_of`)."""
    return jax.lax.slice_in_dim(jnp.repeat(s, size, axis=axis), 0, n, axis=axis % s.ndim)


def safe_scale(amax: jax.Array, qmax: float) -> jax.Array:
    """amax / qmax correctly rounded in float32 on every backend, or 1 where the block is all zeros
    (so values stay 0, never NaN).

    Neither backend divides exactly on its own: XLA rewrites a division by a constant into a
    multiplication by the rounded reciprocal, and XLA:GPU's division (PTX div.full) may be 2 ulp
    off. So the quotient q is corrected once by its exact residual r = amax - q * qmax: q splits
    into a high half (low 12 mantissa bits cleared) and the rest, each with at most 12 significant
    bits, so with a qmax of at most 12 significant bits (checked) both products and both
    subtractions are exact.
    q + r / qmax then rounds to the true quotient: that lies at least ulp / (2 * 2^12) from a
    rounding midpoint (qmax's odd part cannot make amax a midpoint times qmax), far more than the
    correction's own error. (Not below quotients of about 2^-100, where the correction is a
    subnormal, which XLA:CPU flushes to zero.)
    """
    mantissa, _ = math.frexp(qmax)
    if qmax <= 0 or (mantissa * 2**12) % 1:
        raise ValueError(f"safe_scale: qmax {qmax} must be positive with <= 12 significant bits")
    amax = jnp.asarray(amax, jnp.float32)
    s = corrected_quotient(amax, amax / jnp.float32(qmax), qmax)
    return jnp.where(amax > 0, s, 1.0)


def corrected_quotient(a: jax.Array, q: jax.Array, qmax: float) -> jax.Array:
    """a / qmax correctly rounded, from a float32 quotient q within a few ulp of it (see
    `safe_scale`; q where the correction is not finite)."""
    q_hi = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(q, jnp.uint32) & jnp.uint32(0xFFFFF000), jnp.float32
    )
    r = (a - q_hi * jnp.float32(qmax)) - (q - q_hi) * jnp.float32(qmax)
    s = q + r * jnp.float32(1 / qmax)
    return jnp.where(jnp.isfinite(s), s, q)


def to_e4m3(x: jax.Array) -> jax.Array:
    """Round to nearest even, clipped to the finite range (x / (amax/448) may round past 448)."""
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def quantize_activations(x: jax.Array, block: int | None) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (e4m3 [T, K], fp32 scales [T, 1] or [T, ceil(K/block)]): per token amax/448,
    over all K (`block=None`) or per `block` input channels. Run time, inside every FP8 product:
    the scale is left to XLA's reciprocal multiply (within an ulp of amax/448, which no stored
    value depends on), with no barrier between the amax and the scaling for fusion to stop at."""
    xf = x.astype(jnp.float32)
    if block is None:
        amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    else:
        amax = jnp.max(jnp.abs(blocks_of(xf, -1, block)), axis=-1)
    s = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    return to_e4m3(xf / (s if block is None else expand(s, -1, block, x.shape[-1]))), s


def k_major_spec(spec, dtype) -> Any:
    """The ParamSpec of `spec`'s weight [*in, *out] stored K-major, [*out, *in], in `dtype`."""
    n = spec.in_dims
    return dataclasses.replace(spec, shape=(*spec.shape[n:], *spec.shape[:n]), dtype=dtype,
                               axes=(*spec.axes[n:], *spec.axes[:n]), in_dims=0)  # fmt: skip


def to_k_major(w: jax.Array, in_dims: int) -> jax.Array:
    """w [*in, *out] -> [*out, *in] (done once, when a weight is quantized)."""
    return jnp.transpose(w, (*range(in_dims, w.ndim), *range(in_dims)))


def from_k_major(v: jax.Array, in_dims: int) -> jax.Array:
    """v [*out, *in] -> [*in, *out]."""
    return jnp.transpose(v, (*range(v.ndim - in_dims, v.ndim), *range(v.ndim - in_dims)))


def _part_specs(spec, scales_shape, scales_axes) -> dict:
    return {
        "values": k_major_spec(spec, E4M3),
        "scales": dataclasses.replace(
            spec, shape=scales_shape, dtype=jnp.float32, axes=scales_axes, init="ones", in_dims=0
        ),
    }


def fp8_dot(xq: jax.Array, values: jax.Array) -> jax.Array:
    """e4m3 [T, K] x e4m3 K-major [N, K] -> fp32 [T, N]: both operands contract their last axis,
    the form cuBLASLt's FP8 GEMM takes without moving either."""
    dims = (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(xq, values, dims, preferred_element_type=jnp.float32)


def one_gpu() -> bool:
    """Whether this process runs on exactly one GPU: where a format's "auto" backend may take a
    Mosaic GPU kernel (GSPMD cannot partition its call)."""
    return jax.default_backend() == "gpu" and jax.device_count() == 1


def _flat(x: jax.Array, qw: QuantizedWeight) -> tuple[jax.Array, jax.Array, tuple, tuple]:
    """(x as [T, K], values as [N, K], x's leading shape, the logical output shape)."""
    values = qw.arrays["values"]
    n_out = values.ndim - qw.in_dims
    lead, out = x.shape[: x.ndim - qw.in_dims], values.shape[:n_out]
    k = math.prod(values.shape[n_out:])
    return x.reshape(-1, k), values.reshape(-1, k), lead, out


@dataclass(frozen=True)
class Fp8Scaled(WeightFormat):
    """e4m3 values, one fp32 scale per logical output (`per_channel=False`: over the inputs and
    the last output axis) or per output channel."""

    per_channel: bool = False

    def part_specs(self, spec) -> dict:
        out, axes = spec.shape[spec.in_dims :], spec.axes[spec.in_dims :]
        if not self.per_channel:  # one per logical output: all but the last output axis
            out, axes = out[:-1], axes[:-1]
        return _part_specs(spec, out, axes)

    def quantize(self, w: jax.Array, in_dims: int) -> dict[str, jax.Array]:
        check_finite(w, self.name)
        wf = w.astype(jnp.float32)
        over = tuple(range(in_dims)) if self.per_channel else (*range(in_dims), w.ndim - 1)
        scales = safe_scale(jnp.max(jnp.abs(wf), axis=over), E4M3_MAX)
        values = to_e4m3(wf / self._per_output(scales))
        return {"values": to_k_major(values, in_dims), "scales": scales}

    def _per_output(self, scales: jax.Array) -> jax.Array:
        """The scales broadcastable against [*in, *out]."""
        return scales if self.per_channel else scales[..., None]

    def dequantize(self, qw: QuantizedWeight) -> jax.Array:
        values = from_k_major(qw.arrays["values"], qw.in_dims)
        return values.astype(jnp.float32) * self._per_output(qw.arrays["scales"])

    def matmul(self, x: jax.Array, qw: QuantizedWeight) -> jax.Array:
        x2, values, lead, out = _flat(x, qw)
        xq, sx = quantize_activations(x2, None)
        sw = jnp.broadcast_to(self._per_output(qw.arrays["scales"]), out).reshape(-1)
        y = fp8_dot(xq, values) * sx * sw
        return y.reshape(*lead, *out).astype(x.dtype)


@dataclass(frozen=True)
class Fp8Block(WeightFormat):
    """e4m3 values, one fp32 scale per `block` x `block` block of (N, K); 1 x `block`
    activation scales.

    The product runs on `backend`: "pallas", our block-scaled Mosaic GPU GEMM
    (`pallas_kernels.matmul.fp8_block_mgpu`, on a CPU under its interpreter), which reads the
    stored values and scales as they are; "xla", one fp8 `dot_general` per 128-input block with
    the fp32 partials scaled and summed (runs anywhere; the oracle); "auto", the kernel for
    products of at least `KERNEL_MIN_ROWS` tokens wherever it applies (128-wide blocks, K and the
    last output axis multiples of 128) on a process with one GPU, XLA elsewhere. At one token
    XLA's dots measured faster end to end, at 8 tokens the kernel (docs/decisions.md). GSPMD
    cannot partition a Mosaic GPU call, so a sharded model keeps XLA's product until its linears
    run under `shard_map`. `k_splits` is the kernel's split-K factor (None: the kernel's `choose_k_splits`
    picks one per product, splitting K where few output tiles would leave most SMs idle), and
    `tile_layout` its output tiles, "m" [128, 128] or "n" [64, 256] (None: its own choice by
    the token count)."""

    block: int = BLOCK
    backend: str = "auto"
    k_splits: int | None = None
    tile_layout: str | None = None

    def part_specs(self, spec) -> dict:
        k = math.prod(spec.shape[: spec.in_dims])
        out, out_axes = spec.shape[spec.in_dims :], spec.axes[spec.in_dims :]
        shape = (*out[:-1], -(-out[-1] // self.block), -(-k // self.block))
        axes = (*out_axes, spec.axes[0] if spec.in_dims == 1 else None)
        return _part_specs(spec, shape, axes)

    def quantize(self, w: jax.Array, in_dims: int) -> dict[str, jax.Array]:
        check_finite(w, self.name)
        wt = to_k_major(w.astype(jnp.float32), in_dims)  # [*out, *in]
        out = wt.shape[: w.ndim - in_dims]
        w2 = wt.reshape(*out, -1)  # [*out, K]
        b = blocks_of(blocks_of(jnp.abs(w2), -2, self.block), -1, self.block)
        scales = safe_scale(jnp.max(b, axis=(-3, -1)), E4M3_MAX)  # [*out[:-1], NB, KB]
        values = to_e4m3(w2 / self._expand(scales, w2.shape))
        return {"values": values.reshape(wt.shape), "scales": scales}

    def _expand(self, scales: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """[*out[:-1], NB, KB] block scales -> one per element of [*out, K]."""
        return expand(expand(scales, -2, self.block, shape[-2]), -1, self.block, shape[-1])

    def dequantize(self, qw: QuantizedWeight) -> jax.Array:
        values = qw.arrays["values"]
        v2 = values.reshape(*values.shape[: values.ndim - qw.in_dims], -1).astype(jnp.float32)
        w = (v2 * self._expand(qw.arrays["scales"], v2.shape)).reshape(values.shape)
        return from_k_major(w, qw.in_dims)

    def matmul(self, x: jax.Array, qw: QuantizedWeight) -> jax.Array:
        x2, values, lead, out = _flat(x, qw)
        scales = qw.arrays["scales"]
        kb = scales.shape[-1]
        xq, sx = quantize_activations(x2, self.block)  # sx [T, KB]
        if self._on_kernel(values.shape, out[-1], x2.shape[0]):
            from pallas_kernels.matmul.fp8_block_mgpu import fp8_block_matmul_mgpu, pack_scales

            y = fp8_block_matmul_mgpu(
                xq,
                sx,
                values,
                pack_scales(scales.reshape(-1, kb)),
                k_splits=self.k_splits,
                tile_layout=self.tile_layout,
            )
            return y.reshape(*lead, *out).astype(x.dtype)
        xb = blocks_of(xq, 1, self.block)  # [T, KB, 128] (zero-padded: adds nothing)
        wb = blocks_of(values, 1, self.block)  # [N, KB, 128]
        dims = (((2,), (2,)), ((1,), (1,)))
        partial = jax.lax.dot_general(xb, wb, dims, preferred_element_type=jnp.float32)
        sw = expand(scales, -2, self.block, out[-1]).reshape(-1, kb).T  # [KB, N]
        y = jnp.sum(partial * sx.T[:, :, None] * sw[:, None, :], axis=0)  # over the K blocks
        return y.reshape(*lead, *out).astype(x.dtype)

    def _on_kernel(self, nk: tuple[int, int], n_last: int, rows: int) -> bool:
        """Whether this product runs on the Pallas kernel (see the class docstring)."""
        if self.backend not in ("auto", "pallas", "xla"):
            raise ValueError(f"{self.name}: backend must be auto, pallas or xla, got "
                             f"{self.backend!r}")  # fmt: skip
        fits = self.block == BLOCK and nk[1] % BLOCK == 0 and n_last % BLOCK == 0
        if self.backend == "pallas" and not fits:
            raise ValueError(f"{self.name}: the pallas backend needs {BLOCK}-wide blocks and K "
                             f"and the last output axis multiples of {BLOCK}; got block "
                             f"{self.block}, [N, K] = {list(nk)}, last output axis {n_last}")  # fmt: skip
        if self.backend == "auto":
            return fits and one_gpu() and rows >= KERNEL_MIN_ROWS
        return self.backend == "pallas"


FP8_TENSOR = register_format(Fp8Scaled("fp8_tensor"))
FP8_CHANNEL = register_format(Fp8Scaled("fp8_channel", per_channel=True))
FP8_BLOCK = register_format(Fp8Block("fp8_block"))


@dataclass(frozen=True)
class Fp8Static(WeightFormat):
    """`fp8_static`: e4m3 values with one fp32 scale per output channel (`scales` [*out]) and ONE
    static fp32 activation scale per linear (`input_scale` []), vLLM's "static" FP8 scheme.

    The product divides x by `input_scale`, clips to +-448 and casts to e4m3 (no per-token amax
    at run time), then runs the fp8 x fp8 dot with both scales applied after it. `quantize` sets
    input_scale = 1 (x cast as it is); `jaxinfer.quant.calibrate` sets it to max|x| / 448 over
    calibration tokens run through the plain model.
    """

    def part_specs(self, spec) -> dict:
        out, axes = spec.shape[spec.in_dims :], spec.axes[spec.in_dims :]
        scale = dict(dtype=jnp.float32, init="ones", in_dims=0)
        return {
            "values": k_major_spec(spec, E4M3),
            "scales": dataclasses.replace(spec, shape=out, axes=axes, **scale),
            "input_scale": dataclasses.replace(spec, shape=(), axes=(), **scale),
        }

    def quantize(self, w: jax.Array, in_dims: int) -> dict[str, jax.Array]:
        check_finite(w, self.name)
        wf = w.astype(jnp.float32)
        scales = safe_scale(jnp.max(jnp.abs(wf), axis=tuple(range(in_dims))), E4M3_MAX)
        return {"values": to_k_major(to_e4m3(wf / scales), in_dims), "scales": scales,
                "input_scale": jnp.ones((), jnp.float32)}  # fmt: skip

    def dequantize(self, qw: QuantizedWeight) -> jax.Array:
        values = from_k_major(qw.arrays["values"], qw.in_dims)
        return values.astype(jnp.float32) * qw.arrays["scales"]

    def matmul(self, x: jax.Array, qw: QuantizedWeight) -> jax.Array:
        x2, values, lead, out = _flat(x, qw)
        sx = qw.arrays["input_scale"]
        xq = to_e4m3(x2.astype(jnp.float32) / sx)
        y = fp8_dot(xq, values) * (sx * qw.arrays["scales"].reshape(-1))
        return y.reshape(*lead, *out).astype(x.dtype)


FP8_STATIC = register_format(Fp8Static("fp8_static"))
