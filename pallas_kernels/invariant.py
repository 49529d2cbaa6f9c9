"""Batch-invariant building blocks in pure JAX: a row's result is a fixed function of that row,
whatever the other rows are, how many there are, and where the row sits among them.

XLA picks a dot's kernel and tiling, and a reduction's vectorisation, from the whole operand's
shape. Measured on XLA CPU in float32: a matmul's row 0 rounds differently for M = 1, for
2 <= M < 64 and again from M = 64; a row sum over 576 elements differs between fewer than 8 rows
and more. So the same request computed inside a larger batch gives other logits in the last
bits. Two levers write the order into the program instead:

- `fixed_order_sum`: a sum as a tree of elementwise adds (halving a zero-padded power of two).
  Each add is one IEEE operation on one element, so no backend can reorder it. Zero padding is
  exact: padding to a larger power of two only adds `x + 0` at the tree's first levels, so the
  sum of a row with trailing zeros (masked keys, padding) is the sum without them.
- `row_tiled`: a row-wise function applied to fixed tiles of `ROW_TILE` rows (a loop over
  [M / tile, tile, ...], M padded up), so every product the backend computes has one shape,
  whatever M. Measured on XLA CPU: a matmul over 8-row tiles gives each row bit for bit the
  same result for M in 1..256 and at any position within its tile. The function must be
  row-wise (a row's output reads only that row: per-token activation scales are, a per-tensor
  scale is not).

These are the CPU forms (docs/batch_invariance.md); a GPU gets its own (a GEMM with a fixed K
tiling and no split-K, an attention kernel with fixed context splits).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

ROW_TILE = 8  # rows per tile of `row_tiled`


def fixed_order_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """The sum of x over `axis` in a fixed order: halving a power-of-two tree of elementwise adds
    (x zero-padded to the next power of two). The result depends only on the row's values and
    their positions along `axis`, and trailing zeros do not change it."""
    axis = axis % x.ndim
    n = x.shape[axis]
    size = 1 << max(n - 1, 0).bit_length()
    if size != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, size - n)
        x = jnp.pad(x, pad)
    while x.shape[axis] > 1:
        half = x.shape[axis] // 2
        x = lax.slice_in_dim(x, 0, half, axis=axis) + lax.slice_in_dim(x, half, 2 * half, axis=axis)
    return x if keepdims else jnp.squeeze(x, axis)


def fixed_order_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Inclusive prefix sums over `axis` by `lax.associative_scan` (slices and elementwise adds:
    its order is fixed by the axis' length, not chosen by the backend)."""
    return lax.associative_scan(jnp.add, x, axis=axis % x.ndim)


def opaque_count(n: int) -> jax.Array:
    """The loop bound `n` as a value XLA cannot see through (an optimization barrier): a loop to
    it stays a loop of one compiled body. With a known trip count XLA:GPU inlines a loop of one
    iteration (then simplifies the slicing of the padded rows, so the product's shape follows
    M) and may unroll a short one (then merges its products over one weight into one dot of all
    the rows): either way a row's bits followed the batch (measured on the H200)."""
    return lax.optimization_barrier(jnp.int32(n))


def row_tiled(fn: Callable[..., jax.Array], *xs: jax.Array, tile: int = ROW_TILE) -> jax.Array:
    """fn applied to tiles of `tile` rows of xs (arrays with one leading row axis M), one tile
    per iteration of a loop over [ceil(M / tile), tile, ...] (the last tile zero-padded): every
    call of fn sees one shape, so a row-wise fn gives each row the same bits whatever M. Returns
    fn's output [M, ...].

    The loop body must compile the same for every M: its trip count is opaque to XLA
    (`opaque_count`), and the stacked tiles carry one zero tile more than the loop reads, so
    their tiles' axis is never of size 1 (XLA simplifies the slicing of such an axis: on XLA
    CPU, `fp8_block`'s product over a multi-axis weight gave a row other bits for M <= 8 than
    for M > 8)."""
    m = xs[0].shape[0]
    tiles = -(-m // tile)

    def split(x):  # (one more zero tile than the loop reads: see the docstring)
        x = jnp.pad(x, [(0, (tiles + 1) * tile - m)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(tiles + 1, tile, *x.shape[1:])

    parts = tuple(split(x) for x in xs)
    one = jax.eval_shape(fn, *(p[0] for p in parts))

    def body(i, out):
        y = fn(*(lax.dynamic_index_in_dim(p, i, keepdims=False) for p in parts))
        return lax.dynamic_update_index_in_dim(out, y, i, 0)

    out = jnp.zeros((tiles, *one.shape), one.dtype)
    out = lax.fori_loop(0, opaque_count(tiles), body, out)
    return out.reshape(tiles * tile, *out.shape[2:])[:m]
