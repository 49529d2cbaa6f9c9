"""The paged KV cache and the page table, both pytrees threaded through jitted steps.

Invariants a caller must keep (the host block manager does):
- Page `SCRATCH_PAGE` (0) is never owned by a sequence. Padding batch slots and page-table entries
  past a sequence's length point at it, and padding tokens write their K/V there.
- A page is owned by (or, with prefix sharing, refcounted among) the sequences whose rows list it;
  attention reads a sequence's keys only below its `seq_len`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxinfer.models.config import ModelConfig
from jaxinfer.parallel.sharding import DEFAULT_RULES, named_sharding

SCRATCH_PAGE = 0
KV_AXES = ("layers", "pages", None, "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Per-layer K/V page pools, stored stacked: [num_layers, num_pages, page_size, Hkv, D].

    Stacking costs nothing at read time (attention gathers pages of layer `l` directly) and lets
    both layer loops (`unrolled` and `scan`) update the pools in place when the cache is donated.
    """

    k_pages: jax.Array
    v_pages: jax.Array

    @property
    def num_layers(self) -> int:
        return self.k_pages.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PageTable:
    """Which pages hold each batch slot's context, and how long that context is.

    `page_ids`: [S, pages_per_seq] int32; `seq_lens`: [S] int32, the context length after this
    step's new tokens are written. Padding slots have length 0 and only SCRATCH_PAGE entries.
    """

    page_ids: jax.Array
    seq_lens: jax.Array


def init_kv_cache(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: str | jnp.dtype | None = None,
    mesh=None,
    rules=DEFAULT_RULES,
) -> KVCache:
    """Zeroed pools allocated on the device; page 0 is the scratch page (so usable pages = n-1)."""
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(dtype or cfg.dtype)
    sharding = named_sharding(mesh, KV_AXES, shape, rules) if mesh is not None else None

    def zeros():
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    out = None if sharding is None else KVCache(sharding, sharding)
    return jax.jit(zeros, out_shardings=out)()


def token_slots(
    page_table: PageTable, query_start_loc: jax.Array, positions: jax.Array, page_size: int
) -> tuple[jax.Array, jax.Array]:
    """(page id, offset in page) where each token's K/V is written; padding tokens -> scratch."""
    num_tokens = positions.shape[0]
    num_seqs = page_table.page_ids.shape[0]
    t = jnp.arange(num_tokens)
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right")  # S for padding tokens
    valid = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    block = jnp.clip(positions // page_size, 0, page_table.page_ids.shape[1] - 1)
    page = jnp.where(valid, page_table.page_ids[seq, block], SCRATCH_PAGE)
    offset = jnp.where(valid, positions % page_size, t % page_size)
    return page.astype(jnp.int32), offset.astype(jnp.int32)


def write_kv(
    kv: KVCache,
    layer: int | jax.Array,
    k: jax.Array,
    v: jax.Array,
    page: jax.Array,
    offset: jax.Array,
) -> KVCache:
    """Scatter new K/V [T, Hkv, D] of layer `layer` into their slots (in place when donated)."""
    return KVCache(
        kv.k_pages.at[layer, page, offset].set(k.astype(kv.k_pages.dtype)),
        kv.v_pages.at[layer, page, offset].set(v.astype(kv.v_pages.dtype)),
    )
