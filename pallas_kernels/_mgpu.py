"""Building blocks the Mosaic GPU kernels share: swizzled shared-memory buffers, a wgmma dot, and
the launch and output store of a split-K GEMM."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat

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


def store_tile(acc, o_s, out, m0, n0, k_blk, *, split: bool, dtype, wait: bool = True) -> None:
    """A program's [rows, cols] fp32 result `acc` through the staging buffer `o_s` into `out`
    at (m0, n0): as `dtype`, or with `split` as fp32 partials into `out[k_blk]`. The store is
    waited for unless `wait` is False (a persistent program's next tile then waits only until
    `o_s` was read, and the program ends with `plgpu.wait_smem_to_gmem(0)`)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous store from o_s read it
    o_s[...] = acc if split else acc.astype(dtype)
    plgpu.commit_smem()
    tile = (pl.ds(m0, o_s.shape[0]), pl.ds(n0, o_s.shape[1]))
    plgpu.copy_smem_to_gmem(o_s, out.at[(k_blk, *tile) if split else tile])
    if wait:
        plgpu.wait_smem_to_gmem(0)


def split_k_kernel(body, *, m_pad: int, n: int, tile_m: int, tile_n: int, k_splits: int,
                   out_dtype, scratch, interpret: bool, num_threads: int | None = None,
                   programs: int | None = None):  # fmt: skip
    """`plgpu.kernel` of a GEMM over grid (m_pad / tile_m, n / tile_n) named ("m", "n"): one
    output [m_pad, n] of `out_dtype`, or with k_splits > 1 a third axis "k" and fp32 partials
    [k_splits, m_pad, n] (one per split), under the GPU interpreter when `interpret`;
    `num_threads` warpgroups per program (axis "wg") when given. With `programs`, the grid is
    instead that many persistent programs (axis "p") that share the tiles out themselves."""
    out_shape, grid, names = (m_pad, n), (m_pad // tile_m, n // tile_n), ("m", "n")
    if k_splits > 1:
        out_shape, grid, names = (k_splits, *out_shape), (*grid, k_splits), (*names, "k")
        out_dtype = jnp.float32
    if programs is not None:
        grid, names = (programs,), ("p",)
    kwargs = dict(out_type=(jax.ShapeDtypeStruct(out_shape, out_dtype),), scratch_types=scratch,
                  grid=grid, grid_names=names)  # fmt: skip
    if num_threads is not None:
        kwargs.update(num_threads=num_threads, thread_name="wg")
    if interpret:
        kwargs["interpret"] = _compat.gpu_interpret_params()
    return plgpu.kernel(body, **kwargs)
