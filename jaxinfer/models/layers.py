"""Building blocks of the decoder: the linear op, RMSNorm, RoPE. Pure functions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.quant import QuantizedWeight


def linear(x: jax.Array, w: jax.Array | QuantizedWeight, in_dims: int = 1) -> jax.Array:
    """x [..., *in] @ w [*in, *out] -> [..., *out], contracting x's last `in_dims` axes with w's
    first: every matmul of the model goes through here (QKV, O, gate/up, down, the LM head; an
    MoE's router and experts). `w` is a plain array or a `QuantizedWeight`, whose format
    computes the product, so a new number format is a new format, not a change to the model."""
    if isinstance(w, QuantizedWeight):
        return w.format.matmul(x, w)
    return jnp.tensordot(x, w, axes=in_dims)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32, cast back to x.dtype before the weight multiply (as HF Llama/Qwen do)."""
    xf = x.astype(jnp.float32) * rms_scale(x, eps)[..., None]
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
    """1 / RMS(x) over the last axis, fp32 [...]: RMSNorm(x) = weight * x * rms_scale(x)."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)


def deferred_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """RMSNorm split for a following matmul: (x * weight, row scale [...] fp32).

    A matmul of the normed rows equals the matmul of `x * weight` with its output rows scaled:
    `rms_norm(x) @ W == row_scale[..., None] * ((x * weight) @ W)`. Applied after the projection
    (`scale_rows`), the scale lands in the elementwise fusions that consume the projection; what
    is left of the norm is a reduce to one scalar per row, cheaper than writing the normed rows.
    Faster 8B decode steps on the H200 than the up-front norm (`experiments/results/h200/
    e2e_llama3_8b_decode_only.json` vs `e2e_llama3_8b_decode_only_no_deferred_norm.json`).
    """
    return x * weight.astype(x.dtype), rms_scale(x, eps)


def scale_rows(y: jax.Array, row_scale: jax.Array | None, row_dims: int) -> jax.Array:
    """y [..., *feature dims] times row_scale [...] (None: unchanged); `row_dims` feature axes."""
    if row_scale is None:
        return y
    s = row_scale.reshape(row_scale.shape + (1,) * row_dims)
    return (y.astype(jnp.float32) * s).astype(y.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] in fp32, with Llama 3.1 frequency scaling when configured.

    Llama 3.1 scaling (Meta's reference `apply_scaling`): wavelengths longer than
    `original_max / low_freq_factor` are divided by `factor`, shorter than
    `original_max / high_freq_factor` are kept, and the band between is interpolated.
    """
    d = cfg.head_dim
    exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [..., heads, head_dim] by its positions [...] (HF's rotate-half convention)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [..., d/2]
    cos = jnp.cos(angles)[..., None, None, :].astype(x.dtype)  # [..., 1, 1, d/2]
    sin = jnp.sin(angles)[..., None, None, :]
    sin = (sin * jnp.array([[-1.0], [1.0]], jnp.float32)).astype(x.dtype)  # [..., 1, 2, d/2]
    # Halves as an axis of 2: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). Reversing that axis
    # (not splitting and concatenating) keeps it one elementwise fusion: a concatenate was its
    # own kernel on the GPU, twice per layer.
    xh = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    return (xh * cos + xh[..., ::-1, :] * sin).reshape(x.shape)
