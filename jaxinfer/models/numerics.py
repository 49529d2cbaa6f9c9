"""How a step orders its reductions: `Numerics`, a static config the model functions and the
sampler take, and the row reductions that depend on it.

Default numerics are XLA's own: fastest, but a row's bits depend on the batch's shape (XLA picks
kernels and vectorisation by it). `batch_invariant` numerics compute every row alone in a fixed
order (`pallas_kernels.invariant`), so a request's logits, logprobs and greedy tokens are the
same bits whatever else is scheduled with it: engine.batch_invariant, docs/batch_invariance.md.
Each op that reduces reads the mode: `layers.linear` (every matmul), the RMSNorms, attention
(`dispatch.paged_attention`), the MoE router and experts, and the sampler's softmaxes.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.invariant import fixed_order_cumsum, fixed_order_sum


@dataclass(frozen=True)
class Numerics:
    """Static (part of a jitted step's key). `batch_invariant`: each row's result is a fixed
    function of that row (module docstring)."""

    batch_invariant: bool = False
    # Batch-invariant on a GPU: plain bf16/f16 matmuls run the invariant GEMM kernel
    # (`pallas_kernels.matmul.invariant_mgpu`), whose bits do not depend on the row count.
    gpu: bool = False


DEFAULT_NUMERICS = Numerics()
BATCH_INVARIANT = Numerics(batch_invariant=True)


def row_sum(x: jax.Array, numerics: Numerics, keepdims: bool = False) -> jax.Array:
    """Sum over the last axis."""
    if numerics.batch_invariant:
        return fixed_order_sum(x, -1, keepdims)
    return jnp.sum(x, axis=-1, keepdims=keepdims)


def row_mean(x: jax.Array, numerics: Numerics) -> jax.Array:
    """Mean over the last axis."""
    if numerics.batch_invariant:
        return fixed_order_sum(x, -1) / x.shape[-1]
    return jnp.mean(x, axis=-1)


def softmax(x: jax.Array, numerics: Numerics) -> jax.Array:
    """Softmax over the last axis (a row of -inf but one finite entry is fine; all -inf is not)."""
    if not numerics.batch_invariant:
        return jax.nn.softmax(x, axis=-1)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))  # (a max is exact in any order)
    return e / fixed_order_sum(e, -1, keepdims=True)


def log_softmax(x: jax.Array, numerics: Numerics) -> jax.Array:
    """Log-softmax over the last axis, in jax.nn.log_softmax's form."""
    if not numerics.batch_invariant:
        return jax.nn.log_softmax(x, axis=-1)
    shifted = x - jnp.max(x, axis=-1, keepdims=True)
    return shifted - jnp.log(fixed_order_sum(jnp.exp(shifted), -1, keepdims=True))


def cumsum(x: jax.Array, numerics: Numerics) -> jax.Array:
    """Inclusive prefix sums over the last axis."""
    if numerics.batch_invariant:
        return fixed_order_cumsum(x, -1)
    return jnp.cumsum(x, axis=-1)
