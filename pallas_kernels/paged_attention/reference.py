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
) -> jax.Array:
    """Causal GQA attention of each sequence's new tokens over its paged context.

    `max_q_len` (static) bounds the new tokens of any one sequence: 1 for a decode-only batch.
    Returns [T, Hq, D] in q.dtype; padding rows are zero. Softmax and accumulation in fp32.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) not a multiple of kv heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    max_kv = pages_per_seq * page_size
    scale = head_dim**-0.5 if sm_scale is None else sm_scale

    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    q_offsets = jnp.arange(max_q_len)
    q_rows = query_start_loc[:-1, None] + q_offsets[None, :]  # [S, Qm]
    q_valid = q_offsets[None, :] < q_lens[:, None]
    qs = q[jnp.clip(q_rows, 0, num_tokens - 1)].astype(jnp.float32)  # [S, Qm, Hq, D]
    qs = qs.reshape(num_seqs, max_q_len, num_kv_heads, group, head_dim)

    kv_pos = jnp.arange(max_kv)
    kv_valid = kv_pos[None, :] < seq_lens[:, None]  # [S, L]
    k = k_pages[page_table].reshape(num_seqs, max_kv, num_kv_heads, head_dim)
    v = v_pages[page_table].reshape(num_seqs, max_kv, num_kv_heads, head_dim)
    k = jnp.where(kv_valid[:, :, None, None], k.astype(jnp.float32), 0.0)
    v = jnp.where(kv_valid[:, :, None, None], v.astype(jnp.float32), 0.0)

    q_pos = (seq_lens - q_lens)[:, None] + q_offsets[None, :]  # [S, Qm]
    mask = kv_valid[:, None, :] & (kv_pos[None, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask &= q_valid[:, :, None]  # [S, Qm, L]

    scores = jnp.einsum("sqhgd,skhd->shgqk", qs, k) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("shgqk,skhd->sqhgd", probs, v).reshape(
        num_seqs, max_q_len, num_q_heads, head_dim
    )

    dest = jnp.where(q_valid, q_rows, num_tokens)  # invalid rows scatter out of bounds: dropped
    result = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    result = result.at[dest].set(out, mode="drop")
    return result.astype(q.dtype)
