"""Building blocks the Mosaic GPU kernels share: swizzled shared-memory buffers and a wgmma dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # wgmma M


def swizzled_smem(shape, dtype):
    """A shared-memory buffer in the layout TMA and wgmma want: (8 rows, swizzle bytes) tiles."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, shape[-1] * itemsize)
    return plgpu.SMEM(
        shape,
        dtype,
        transforms=(
            plgpu.TilingTransform((8, swizzle // itemsize)),
            plgpu.SwizzleTransform(swizzle),
        ),
    )


def wgmma_dot(a, b_ref, *, interpret: bool, transpose_b: bool = False) -> jax.Array:
    """a [64, k] @ b (or a @ b.T) into a fresh fp32 [64, n] accumulator with wgmma; `a` a ref or
    an array, `b_ref` a shared-memory ref.

    The GPU interpreter's wgmma takes neither register operands nor transposed refs, so under it
    the product is a plain dot of the same values (everything around it is interpreted).
    """
    cols = b_ref.shape[0] if transpose_b else b_ref.shape[1]
    if interpret:
        av = a[...] if not isinstance(a, jax.Array) else a
        dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
        return lax.dot_general(av, b_ref[...], dims, preferred_element_type=jnp.float32)
    b = plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((ROWS, cols), jnp.float32))
