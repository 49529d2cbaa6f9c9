"""References for the grouped matmul (the MoE expert matmul): `jax.lax.ragged_dot` in fp32, and an
independent numpy oracle for tests.

Semantics (lax.ragged_dot's): lhs [M, K] has its rows sorted by group; rows
[offset_g, offset_g + group_sizes[g]) (offset_g = group_sizes[:g].sum()) multiply rhs[g] [K, N];
rows from sum(group_sizes) on give zeros, and groups reaching past row M are cut at M.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def grouped_matmul_ref(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs [M, K] @ rhs[group of the row] [G, K, N] -> fp32 [M, N], by `lax.ragged_dot`."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


def row_groups(group_sizes, m: int) -> np.ndarray:
    """int [M]: the group of each row, -1 for rows past sum(group_sizes)."""
    sizes = np.maximum(np.asarray(group_sizes, np.int64), 0)
    groups = np.repeat(np.arange(len(sizes)), sizes)[:m]
    return np.concatenate([groups, np.full(m - len(groups), -1)])


def grouped_matmul_oracle(lhs, rhs, group_sizes) -> np.ndarray:
    """The same product in float64 numpy, through a one-hot row -> group matrix: every row times
    every group's weight, the one-hot picking its own (small shapes only: it does G full products)."""
    x = np.asarray(lhs, np.float64)
    w = np.asarray(rhs, np.float64)
    groups = row_groups(group_sizes, x.shape[0])
    one_hot = groups[:, None] == np.arange(w.shape[0])[None, :]  # [M, G]; all False past the end
    return np.einsum("mg,gmn->mn", one_hot, np.einsum("mk,gkn->gmn", x, w))
