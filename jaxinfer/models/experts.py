"""The routed experts over rows: sort the (token, choice) rows by expert, run the experts'
SwiGLU as grouped matmuls, unsort and sum each token's rows with their weights. The MoE block
(`jaxinfer.models.moe`) runs them on one device (`routed_experts`, or `invariant_routed_experts`
under batch-invariant numerics), expert parallelism (`jaxinfer.parallel.expert`) on each
device's share of the rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.invariant import ROW_TILE, opaque_count
from pallas_kernels.moe.grouped_mgpu import grouped_matmul_mgpu
from pallas_kernels.moe.reference import grouped_matmul_ref


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                   backend: str = "xla") -> jax.Array:  # fmt: skip
    """lhs [R, K] (rows sorted by group) @ rhs [G, K, N] per group -> [R, N] in lhs's dtype, fp32
    accumulation; rows past sum(group_sizes) are zero. `backend`: "xla" or "pallas" (the
    kernel; interpreted off a GPU)."""
    rhs = rhs.astype(lhs.dtype)
    if backend == "pallas":
        return grouped_matmul_mgpu(lhs, rhs, group_sizes)
    return grouped_matmul_ref(lhs, rhs, group_sizes).astype(lhs.dtype)


def expert_ffn(xs: jax.Array, sizes: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
               backend: str = "xla") -> jax.Array:  # fmt: skip
    """SwiGLU of rows xs [R, E] sorted by expert (sizes [X] rows each) with stacked weights
    w_gate_up [X, E, 2, F], w_down [X, F, E] -> [R, E]; `backend` of the grouped matmuls."""
    x, e, _, f = w_gate_up.shape
    gate_up = grouped_matmul(xs, w_gate_up.reshape(x, e, 2 * f), sizes, backend)
    act = jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]
    return grouped_matmul(act, w_down, sizes, backend)


def sort_rows(experts: jax.Array, num_experts: int):
    """(order, sorted expert ids, sizes [X]) of the flattened (token, choice) rows of experts
    [T, k]; an id of `num_experts` (no expert) sorts last and is in no group."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, flat[order], jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def unsort(y_sorted: jax.Array, order: jax.Array) -> jax.Array:
    """Rows y_sorted[i] = y[order[i]] back in their first order: y. The inverse permutation is
    an int scatter of one id per row, then the rows move by a gather: XLA:GPU runs a scatter of
    whole rows far slower than a gather (docs/decisions.md, "MoE `combine`")."""
    n = order.shape[0]
    inverse = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    return y_sorted[inverse]


def combine(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Rows y_sorted [T * k, E] in `order` back to tokens: sum_j weights[t, j] * y[t, j] -> [T, E]
    fp32."""
    t, k = weights.shape
    y = unsort(y_sorted, order).reshape(t, k, -1)
    return jnp.einsum("tk,tke->te", weights, y.astype(jnp.float32))


def routed_experts(h: jax.Array, weights: jax.Array, experts: jax.Array, w_gate_up: jax.Array,
                   w_down: jax.Array, backend: str = "xla") -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """(sum of each token's experts' outputs, weighted [T, E] fp32, rows per expert [X] int32)
    on one device; experts [T, k] may hold X (no expert) for padding tokens."""
    k = experts.shape[1]
    order, _, sizes = sort_rows(experts, w_gate_up.shape[0])
    y = expert_ffn(h[order // k], sizes, w_gate_up, w_down, backend)
    return combine(y, order, weights), sizes


def invariant_routed_experts(h: jax.Array, weights: jax.Array, experts: jax.Array,
                             w_gate_up: jax.Array, w_down: jax.Array,
                             tile: int = ROW_TILE) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """`routed_experts` with each (token, choice) row's output a fixed function of that row
    (batch-invariant numerics; on one device, the xla backend).

    A grouped matmul over rows sorted by expert reduces each row in a way that depends on how
    many rows each group has (the kernel tiles the groups). Here each expert's rows are laid out
    in whole tiles of `tile` rows (an expert's last tile zero-padded, as a block-aligned MoE
    layout does), and one loop runs every tile through its expert's SwiGLU: every product is
    [tile, E] @ [E, 2F] and [tile, F] @ [F, E], whatever the batch. The tiles are at most
    ceil(T * k / tile) + X (each expert pads at most one); the unused ones run on zeros. Each
    token's k outputs are summed in choice order (elementwise, fp32).
    """
    t, k = experts.shape
    x, e, _, f = w_gate_up.shape
    order, sorted_ids, sizes = sort_rows(experts, x)
    tiles_of = (sizes + tile - 1) // tile  # [X]
    first_tile = jnp.cumsum(tiles_of) - tiles_of
    first_row = jnp.cumsum(sizes) - sizes
    expert = jnp.minimum(sorted_ids, x - 1)
    rank = jnp.arange(t * k) - first_row[expert]
    num_tiles = -(-(t * k) // tile) + x
    # each sorted row's slot in the tiles; rows of no expert (padding tokens) go nowhere
    slot = jnp.where(sorted_ids < x, first_tile[expert] * tile + rank, num_tiles * tile)
    xs = jnp.zeros((num_tiles * tile, e), h.dtype).at[slot].set(h[order // k], mode="drop")
    tile_expert = jnp.searchsorted(jnp.cumsum(tiles_of), jnp.arange(num_tiles), side="right",
                                   method="compare_all")  # fmt: skip
    tile_expert = jnp.minimum(tile_expert, x - 1)

    def swiglu(args):
        rows, i = args  # [tile, E], the tile's expert
        gu = w_gate_up[i].reshape(e, 2 * f).astype(rows.dtype)
        gate_up = jnp.dot(rows, gu, preferred_element_type=jnp.float32).astype(rows.dtype)
        act = jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]
        down = w_down[i].astype(rows.dtype)
        return jnp.dot(act, down, preferred_element_type=jnp.float32).astype(rows.dtype)

    def body(i, ys):  # a loop of one compiled body whatever the tiles (see `opaque_count`)
        rows = lax.dynamic_index_in_dim(xs_tiles, i, keepdims=False)
        return lax.dynamic_update_index_in_dim(ys, swiglu((rows, tile_expert[i])), i, 0)

    xs_tiles = xs.reshape(num_tiles, tile, e)
    ys = lax.fori_loop(0, opaque_count(num_tiles), body, jnp.zeros_like(xs_tiles)).reshape(-1, e)
    y = unsort(ys[jnp.minimum(slot, num_tiles * tile - 1)], order).reshape(t, k, e)
    out = weights[:, 0, None] * y[:, 0].astype(jnp.float32)
    for j in range(1, k):  # a fixed order, elementwise
        out = out + weights[:, j, None] * y[:, j].astype(jnp.float32)
    return out, sizes
