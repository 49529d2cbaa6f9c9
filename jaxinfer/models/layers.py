"""Building blocks of the dense decoder: RMSNorm, RoPE, SwiGLU FFN. Pure functions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig


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
    On the H200 (8B decode) XLA still runs that reduce as its own kernel, and the steps were
    0.01-0.10 ms faster than with the up-front norm (`experiments/results/h200/
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


def dense_ffn(
    cfg: ModelConfig, p: dict, x: jax.Array, row_scale: jax.Array | None = None
) -> jax.Array:
    """SwiGLU: down(silu(h @ gate) * (h @ up)) of h = x * row_scale, gate and up as one matmul with
    the fused `w_gate_up` [E, 2, F]; the row scale is applied to that matmul's output."""
    gate_up = scale_rows(jnp.einsum("...e,egf->...gf", x, p["w_gate_up"]), row_scale, 2)
    if cfg.mlp_bias:
        gate_up = gate_up + p["b_gate_up"]
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    out = (jax.nn.silu(gate) * up) @ p["w_down"]
    if cfg.mlp_bias:
        out = out + p["b_down"]
    return out


# The FFN of a layer is looked up by `cfg.ffn`; an MoE block registers here with the same signature
# `(cfg, p, x, row_scale)`: its input is the normed hidden `x * row_scale[..., None]` (see
# `deferred_rms_norm`); a block whose first op is not a row-wise matmul (a router's softmax over
# experts is one) multiplies it in first.
FFN_BLOCKS = {"dense": dense_ffn}
