"""Pure-JAX ragged paged attention: the oracle every paged-attention kernel is tested against.

Keys at positions >= seq_len are zeroed before use (the isolation `PagedAttentionInputs` asks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.inputs import PagedAttentionInputs


def ragged_paged_attention(x: PagedAttentionInputs) -> jax.Array:
    """Attention as `PagedAttentionInputs` describes it. With `max_q_len` 1 (decode-only) each
    sequence's keys are gathered once; otherwise each query row gathers its own sequence's keys.
    """
    x.check()
    q, k_pages, v_pages, page_table = x.q, x.k_pages, x.v_pages, x.page_table
    seq_lens, query_start_loc = x.seq_lens, x.query_start_loc
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    _, pages_per_seq = page_table.shape
    group = num_q_heads // num_kv_heads
    max_kv = pages_per_seq * page_size

    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    kv_pos = jnp.arange(max_kv)
    if x.max_q_len == 1:
        return _seq_major_decode(x, q_lens).astype(q.dtype)

    # Token-major: every query row gathers its own sequence's keys. Work is T x L, whatever the
    # mix of prefill chunks and decodes (padding queries per sequence to max_q_len would cost
    # S x max_q_len x L, which explodes for mixed batches).
    t = jnp.arange(num_tokens)
    seq, valid = token_sequences(query_start_loc, num_tokens)
    q_pos = seq_lens[seq] - q_lens[seq] + (t - query_start_loc[seq])  # [T]
    kv_valid = (kv_pos[None, :] < seq_lens[seq][:, None]) & valid[:, None]  # [T, L]
    k = jnp.where(kv_valid[:, :, None, None], _gather(k_pages, x.k_scales, page_table[seq]), 0.0)
    v_ids = page_table[seq] + x.v_page_offset
    v = jnp.where(kv_valid[:, :, None, None], _gather(v_pages, x.v_scales, v_ids), 0.0)
    mask = kv_valid & (kv_pos[None, :] <= q_pos[:, None])
    if x.sliding_window is not None:
        mask &= kv_pos[None, :] > q_pos[:, None] - x.sliding_window
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("thgd,tkhd->thgk", qg, k) * x.scale
    probs = _masked_softmax(scores, mask[:, None, None, :], x.soft_cap)
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


def _seq_major_decode(x: PagedAttentionInputs, q_lens):
    """Decode-only batches (at most one new token per sequence): gather each sequence's keys once."""
    q, k_pages, page_table, seq_lens = x.q, x.k_pages, x.page_table, x.seq_lens
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    group = num_q_heads // num_kv_heads
    max_kv = pages_per_seq * page_size
    kv_pos = jnp.arange(max_kv)
    rows = x.query_start_loc[:-1]
    has_q = q_lens > 0
    qs = q[jnp.clip(rows, 0, num_tokens - 1)].astype(jnp.float32)  # [S, Hq, D]
    qs = qs.reshape(num_seqs, num_kv_heads, group, head_dim)
    kv_valid = kv_pos[None, :] < seq_lens[:, None]  # [S, L]
    k = jnp.where(kv_valid[:, :, None, None], _gather(k_pages, x.k_scales, page_table), 0.0)
    v_ids = page_table + x.v_page_offset
    v = jnp.where(kv_valid[:, :, None, None], _gather(x.v_pages, x.v_scales, v_ids), 0.0)
    mask = kv_valid & has_q[:, None]
    if x.sliding_window is not None:
        mask &= kv_pos[None, :] > (seq_lens[:, None] - 1) - x.sliding_window
    scores = jnp.einsum("shgd,skhd->shgk", qs, k) * x.scale
    probs = _masked_softmax(scores, mask[:, None, None, :], x.soft_cap)
    out = jnp.einsum("shgk,skhd->shgd", probs, v).reshape(num_seqs, num_q_heads, head_dim)
    dest = jnp.where(has_q, rows, num_tokens)  # sequences without a token scatter nowhere
    result = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    return result.at[dest].set(out, mode="drop")
