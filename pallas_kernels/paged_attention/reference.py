"""Pure-JAX ragged paged attention: the oracle every paged-attention kernel is tested against.

Layout and conventions (shared with the kernels):

- `q`: [T, Hq, D] query tokens of all sequences, flattened; sequence `s` owns rows
  `query_start_loc[s]:query_start_loc[s+1]`. Rows past `query_start_loc[-1]` are padding.
- `k_pages`, `v_pages`: [num_pages, page_size, Hkv, D] page pools (one layer's).
- `page_table`: [S, pages_per_seq] int32 page ids; entry `j` of row `s` holds keys
  `j*page_size .. (j+1)*page_size - 1` of sequence `s`.
- `seq_lens`: [S] int32 context length *including* this step's new tokens, which are the last
  `q_len` positions of the sequence. A prefill chunk and a decode token are the same thing with
  different `q_len`, so one call handles a batch mixing both.
- `k_scales`, `v_scales` (FP8 pages only): [num_pages, Hkv] float32; a page's value is
  `float32(page) * scale[page, head]` (see `fp8.py`). Only gathered pages are dequantized.
- `v_page_offset` (static int, default 0): V's page for a table entry `p` is `p + v_page_offset`
  (K's is `p`), so K and V may share one pool: the model's cache keeps a page's K and V side by
  side and passes the same pool twice with offset 1 (`jaxinfer.kv.cache`). Scales follow the
  same ids.

Isolation: keys at positions >= seq_len are zeroed before use, so pages a sequence does not own
(or poisoned padding) cannot reach its output, not even as NaN * 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    max_q_len: int,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    v_page_offset: int = 0,
) -> jax.Array:
    """Causal GQA attention of each sequence's new tokens over its paged context.

    `max_q_len` (static) bounds the new tokens of any one sequence. With 1 (decode-only) each
    sequence's keys are gathered once; otherwise each query row gathers its own sequence's keys.
    Returns [T, Hq, D] in q.dtype; padding rows are zero. Softmax and accumulation in fp32.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    _, pages_per_seq = page_table.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) not a multiple of kv heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    max_kv = pages_per_seq * page_size
    scale = head_dim**-0.5 if sm_scale is None else sm_scale

    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    kv_pos = jnp.arange(max_kv)
    if max_q_len == 1:
        out = _seq_major_decode(q, k_pages, v_pages, k_scales, v_scales, page_table, seq_lens,
                                q_lens, query_start_loc, scale, soft_cap, sliding_window,
                                v_page_offset)  # fmt: skip
        return out.astype(q.dtype)

    # Token-major: every query row gathers its own sequence's keys. Work is T x L, whatever the
    # mix of prefill chunks and decodes (padding queries per sequence to max_q_len would cost
    # S x max_q_len x L, which explodes for mixed batches).
    t = jnp.arange(num_tokens)
    seq, valid = token_sequences(query_start_loc, num_tokens)
    q_pos = seq_lens[seq] - q_lens[seq] + (t - query_start_loc[seq])  # [T]
    kv_valid = (kv_pos[None, :] < seq_lens[seq][:, None]) & valid[:, None]  # [T, L]
    k = jnp.where(kv_valid[:, :, None, None], _gather(k_pages, k_scales, page_table[seq]), 0.0)
    v_ids = page_table[seq] + v_page_offset
    v = jnp.where(kv_valid[:, :, None, None], _gather(v_pages, v_scales, v_ids), 0.0)
    mask = kv_valid & (kv_pos[None, :] <= q_pos[:, None])
    if sliding_window is not None:
        mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("thgd,tkhd->thgk", qg, k) * scale
    probs = _masked_softmax(scores, mask[:, None, None, :], soft_cap)
    out = jnp.einsum("thgk,tkhd->thgd", probs, v).reshape(num_tokens, num_q_heads, head_dim)
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)


def _gather(pages, scales, ids):
    """Pages `ids` [N, pages_per_seq] as float32 keys [N, pages_per_seq * page_size, Hkv, D]."""
    x = pages[ids].astype(jnp.float32)
    if scales is not None:
        x = x * scales[ids][:, :, None, :, None]
    return x.reshape(ids.shape[0], -1, *pages.shape[2:])


def token_sequences(query_start_loc: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Each query row's sequence (clamped to a real index) and whether the row is a real token.

    A comparison search: jnp's default binary search is a device while loop on GPU (~100 us).
    """
    num_seqs = query_start_loc.shape[0] - 1
    t = jnp.arange(num_tokens)
    seq = jnp.searchsorted(query_start_loc[1:], t, side="right", method="compare_all")
    return jnp.minimum(seq, num_seqs - 1), seq < num_seqs


def _masked_softmax(scores, mask, soft_cap):
    """Softmax over the last axis in fp32; fully masked rows give zeros, never NaN."""
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    return probs / jnp.where(denom == 0.0, 1.0, denom)


def _seq_major_decode(q, k_pages, v_pages, k_scales, v_scales, page_table, seq_lens, q_lens,
                      query_start_loc, scale, soft_cap, sliding_window, v_page_offset):  # fmt: skip
    """Decode-only batches (at most one new token per sequence): gather each sequence's keys once."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    group = num_q_heads // num_kv_heads
    max_kv = pages_per_seq * page_size
    kv_pos = jnp.arange(max_kv)
    rows = query_start_loc[:-1]
    has_q = q_lens > 0
    qs = q[jnp.clip(rows, 0, num_tokens - 1)].astype(jnp.float32)  # [S, Hq, D]
    qs = qs.reshape(num_seqs, num_kv_heads, group, head_dim)
    kv_valid = kv_pos[None, :] < seq_lens[:, None]  # [S, L]
    k = jnp.where(kv_valid[:, :, None, None], _gather(k_pages, k_scales, page_table), 0.0)
    v_ids = page_table + v_page_offset
    v = jnp.where(kv_valid[:, :, None, None], _gather(v_pages, v_scales, v_ids), 0.0)
    mask = kv_valid & has_q[:, None]
    if sliding_window is not None:
        mask &= kv_pos[None, :] > (seq_lens[:, None] - 1) - sliding_window
    scores = jnp.einsum("shgd,skhd->shgk", qs, k) * scale
    probs = _masked_softmax(scores, mask[:, None, None, :], soft_cap)
    out = jnp.einsum("shgk,skhd->shgd", probs, v).reshape(num_seqs, num_q_heads, head_dim)
    dest = jnp.where(has_q, rows, num_tokens)  # sequences without a token scatter nowhere
    result = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    return result.at[dest].set(out, mode="drop")
