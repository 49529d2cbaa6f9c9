"""Building blocks of the decoder: the linear op, RMSNorm, RoPE. Pure functions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import (
    DynamicRopeScaling,
    LinearRopeScaling,
    Llama3RopeScaling,
    LongRopeScaling,
    ModelConfig,
    YarnRopeScaling,
)
from jaxinfer.models.numerics import DEFAULT_NUMERICS, Numerics, row_mean
from jaxinfer.quant import QuantizedWeight
from pallas_kernels.invariant import row_tiled
from pallas_kernels.matmul.invariant_mgpu import invariant_matmul_mgpu
from pallas_kernels.matmul.invariant_mgpu import unfit_reason as invariant_unfit


def linear(x: jax.Array, w: jax.Array | QuantizedWeight, in_dims: int = 1,
           numerics: Numerics = DEFAULT_NUMERICS) -> jax.Array:  # fmt: skip
    """x [..., *in] @ w [*in, *out] -> [..., *out], contracting x's last `in_dims` axes with w's
    first: every matmul of the model goes through here (QKV, O, gate/up, down, the LM head; an
    MoE's router and shared expert). `w` is a plain array or a `QuantizedWeight`, whose format
    computes the product, so a new number format is a new format, not a change to the model.

    Batch-invariant `numerics`: the product runs over fixed tiles of rows (`row_tiled`), so each
    row's bits do not depend on how many rows the batch has; a format's product must then be
    row-wise (per-token activation scales, as every shipped format's are). With `numerics.gpu`,
    a plain bf16/f16 weight runs the invariant GEMM kernel instead (`invariant_mgpu`: a fixed K
    order in one launch, not a loop over tiles); other weights and shapes take the row tiles."""
    if numerics.batch_invariant:
        lead = x.shape[: x.ndim - in_dims]
        rows = x.reshape(-1, *x.shape[x.ndim - in_dims :])
        k = math.prod(rows.shape[1:])
        if (numerics.gpu and not isinstance(w, QuantizedWeight) and w.dtype == x.dtype
                and invariant_unfit(x.dtype, k, w.size // k) is None):  # fmt: skip
            out_dims = w.shape[in_dims:]
            y = invariant_matmul_mgpu(rows.reshape(-1, k), w.reshape(k, -1), interpret=False)
            return y.reshape(*lead, *out_dims)
        y = row_tiled(lambda tile: _product(tile, w, in_dims), rows)
        return y.reshape(*lead, *y.shape[1:])
    return _product(x, w, in_dims)


def _product(x: jax.Array, w: jax.Array | QuantizedWeight, in_dims: int) -> jax.Array:
    if isinstance(w, QuantizedWeight):
        return w.format.matmul(x, w)
    return jnp.tensordot(x, w, axes=in_dims)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float,
             numerics: Numerics = DEFAULT_NUMERICS) -> jax.Array:  # fmt: skip
    """RMSNorm in fp32, cast back to x.dtype before the weight multiply (as HF Llama/Qwen do)."""
    xf = x.astype(jnp.float32) * rms_scale(x, eps, numerics)[..., None]
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def rms_scale(x: jax.Array, eps: float, numerics: Numerics = DEFAULT_NUMERICS) -> jax.Array:
    """1 / RMS(x) over the last axis, fp32 [...]: RMSNorm(x) = weight * x * rms_scale(x)."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(row_mean(xf * xf, numerics) + eps)


def deferred_rms_norm(x: jax.Array, weight: jax.Array, eps: float,
                      numerics: Numerics = DEFAULT_NUMERICS) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """RMSNorm split for a following matmul: (x * weight, row scale [...] fp32).

    A matmul of the normed rows equals the matmul of `x * weight` with its output rows scaled:
    `rms_norm(x) @ W == row_scale[..., None] * ((x * weight) @ W)`. Applied after the projection
    (`scale_rows`), the scale lands in the elementwise fusions that consume the projection; what
    is left of the norm is a reduce to one scalar per row, cheaper than writing the normed rows.
    Measured faster than the up-front norm (docs/decisions.md).
    """
    return x * weight.astype(x.dtype), rms_scale(x, eps, numerics)


def scale_rows(y: jax.Array, row_scale: jax.Array | None, row_dims: int) -> jax.Array:
    """y [..., *feature dims] times row_scale [...] (None: unchanged); `row_dims` feature axes."""
    if row_scale is None:
        return y
    s = row_scale.reshape(row_scale.shape + (1,) * row_dims)
    return (y.astype(jnp.float32) * s).astype(y.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] in fp32 of cfg's RoPE (transformers' ROPE_INIT_FUNCTIONS).

    Host-side numpy, computed at trace time: every variant is a constant of the traced step.
    """
    d, rs = cfg.head_dim, cfg.rope_scaling
    exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)  # 2i/d
    theta = cfg.rope_theta
    if isinstance(rs, DynamicRopeScaling):
        # transformers' NTK-aware base theta * (factor * seq_len / L - (factor - 1))^(d / (d - 2)),
        # L = max_position_embeddings, at seq_len = factor * L (see DynamicRopeScaling).
        theta *= (rs.factor * rs.factor - (rs.factor - 1)) ** (d / (d - 2))
    pos_freqs = (np.float32(theta) ** exponents).astype(np.float32)  # theta ** (2i/d)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if isinstance(rs, LinearRopeScaling):
        return (inv_freq / np.float32(rs.factor)).astype(np.float32)
    if isinstance(rs, YarnRopeScaling):
        return _yarn_inv_freq(pos_freqs, rs, d, theta)
    if isinstance(rs, LongRopeScaling):
        long = cfg.max_position_embeddings > rs.original_max_position_embeddings
        factors = np.asarray(rs.long_factor if long else rs.short_factor, np.float32)
        return (np.float32(1.0) / (factors * pos_freqs)).astype(np.float32)
    if isinstance(rs, Llama3RopeScaling):
        return _llama3_inv_freq(inv_freq, rs)
    return inv_freq


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor on cos and sin (transformers' `attention_scaling`): 1 but for YaRN and LongRoPE.

    Scaling both q's and k's rotations by it scales the attention logits by its square.
    """
    rs = cfg.rope_scaling
    if isinstance(rs, YarnRopeScaling):
        if rs.attention_factor is not None:
            return rs.attention_factor
        if rs.mscale and rs.mscale_all_dim:  # DeepSeek: as transformers, only when both are set
            return _yarn_mscale(rs.factor, rs.mscale) / _yarn_mscale(rs.factor, rs.mscale_all_dim)
        return _yarn_mscale(rs.factor)
    if isinstance(rs, LongRopeScaling):
        if rs.attention_factor is not None:
            return rs.attention_factor
        if rs.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(rs.factor) / math.log(rs.original_max_position_embeddings))
    return 1.0


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's sqrt(1/t) = 0.1 ln(s) + 1 (arXiv:2309.00071 eq. 22), times DeepSeek's mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(pos_freqs: np.ndarray, rs: YarnRopeScaling, d: int, theta: float) -> np.ndarray:
    """NTK-by-parts (arXiv:2309.00071 sec. 3.2): dimensions that turn more than `beta_fast` times
    over the original context keep their frequency, fewer than `beta_slow` times are divided by
    `factor`, and a linear ramp over the dimension index blends the two between."""
    orig = rs.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times over orig
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(rs.beta_fast), dim_of(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # (transformers: avoids dividing by zero)
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (original frequency), 0: interpolate
    extrapolated = np.float32(1.0) / pos_freqs
    interpolated = np.float32(1.0) / (np.float32(rs.factor) * pos_freqs)
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


def _llama3_inv_freq(inv_freq: np.ndarray, rs: Llama3RopeScaling) -> np.ndarray:
    """Llama 3.1 scaling (Meta's reference `apply_scaling`): wavelengths longer than
    `original_max / low_freq_factor` are divided by `factor`, shorter than
    `original_max / high_freq_factor` are kept, and the band between is interpolated."""
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(rs.factor), inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, attention_factor: float = 1.0
) -> jax.Array:
    """Rotate x [..., heads, head_dim] by its positions [...] (HF's rotate-half convention), cos
    and sin scaled by the static `attention_factor` (`rope_attention_factor`) in fp32."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [..., d/2]
    cos = jnp.cos(angles)
    if attention_factor != 1.0:  # (plain RoPE traces no multiply)
        cos = cos * np.float32(attention_factor)
    cos = cos[..., None, None, :].astype(x.dtype)  # [..., 1, 1, d/2]
    sin = jnp.sin(angles)[..., None, None, :]
    signs = np.array([[-attention_factor], [attention_factor]], np.float32)
    sin = (sin * jnp.asarray(signs)).astype(x.dtype)  # [..., 1, 2, d/2]
    # Halves as an axis of 2: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). Reversing that axis
    # (not splitting and concatenating) keeps it one elementwise fusion: a concatenate was its
    # own kernel on the GPU, twice per layer.
    xh = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    return (xh * cos + xh[..., ::-1, :] * sin).reshape(x.shape)
