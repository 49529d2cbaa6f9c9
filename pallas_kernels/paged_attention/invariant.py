"""Batch-invariant ragged paged attention (pure JAX): each query row's output is a fixed function
of its query and its own sequence's keys up to its position, whatever else the batch holds.

The reference (`reference.py`) reduces every row over the page table's whole width
(pages_per_seq * page_size keys) with einsums whose kernels XLA picks by the batch's shape, and
takes one of two paths by `max_q_len`. Here instead, for every row alike:

- the keys are visited in blocks of `KEY_BLOCK` positions (block j holds positions
  [j * KEY_BLOCK, (j + 1) * KEY_BLOCK)), gathered by position through the page table, so the
  blocks do not depend on the page size or the page table's width;
- within a block every sum (q . k over the head dim, the softmax denominator, p . v over the
  keys) is `fixed_order_sum`, a tree of elementwise adds; masked keys are zeroed and their
  probabilities are exactly 0, which the tree adds exactly;
- blocks are combined in order 0, 1, ... by the online softmax (running max, denominator and
  output rescaled by exp(old max - new max)); a block that holds none of the row's keys (past its
  position, before its sliding window, or a padding row) leaves the running state untouched (a
  select, not an update by exp(0) = 1 and + 0), so how many blocks the loop runs past a row's
  last key changes nothing.

Inputs: `PagedAttentionInputs`; `max_q_len` is unused (decode and prefill rows take the same
path). FP8 pages are dequantized by their scales as the reference does. Padding rows are zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.invariant import fixed_order_sum
from pallas_kernels.paged_attention.inputs import PagedAttentionInputs
from pallas_kernels.paged_attention.reference import token_sequences

KEY_BLOCK = 128  # key positions per block of the online softmax


def ragged_paged_attention_invariant(
    x: PagedAttentionInputs, key_block: int = KEY_BLOCK
) -> jax.Array:
    """Attention as `PagedAttentionInputs` describes it, each row computed alone (module
    docstring); softmax and sums in fp32. `key_block`: key positions per block."""
    x.check()
    q, page_table, query_start_loc = x.q, x.page_table, x.query_start_loc
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = x.k_pages.shape
    pages_per_seq = page_table.shape[1]
    group = num_q_heads // num_kv_heads

    seq, valid = token_sequences(query_start_loc, num_tokens)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    t = jnp.arange(num_tokens)
    q_pos = x.seq_lens[seq] - q_lens[seq] + (t - query_start_loc[seq])
    q_pos = jnp.where(valid, q_pos, -1)  # padding rows: no keys
    rows_table = page_table[seq]  # [T, pages_per_seq]
    qg = q.astype(jnp.float32).reshape(num_tokens, 1, num_kv_heads, group, head_dim)

    def gather(pages, scales, pos, offset):  # keys at positions pos [B] of each row's sequence
        col = jnp.minimum(pos // page_size, pages_per_seq - 1)
        ids = rows_table[:, col] + offset  # [T, B]
        keys = pages[ids, (pos % page_size)[None, :]].astype(jnp.float32)  # [T, B, Hkv, D]
        return keys if scales is None else keys * scales[ids][..., None]

    def block(j, state):
        m, denom, acc = state  # [T, Hkv, G], [T, Hkv, G], [T, Hkv, G, D]
        pos = j * key_block + jnp.arange(key_block)
        ok = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < pages_per_seq * page_size)
        if x.sliding_window is not None:
            ok &= pos[None, :] > q_pos[:, None] - x.sliding_window
        ok4 = ok[:, :, None, None]
        k = jnp.where(ok4, gather(x.k_pages, x.k_scales, pos, 0), 0.0)
        v = jnp.where(ok4, gather(x.v_pages, x.v_scales, pos, x.v_page_offset), 0.0)
        s = fixed_order_sum(qg * k[:, :, :, None, :], axis=-1) * x.scale  # [T, B, Hkv, G]
        if x.soft_cap is not None:
            s = x.soft_cap * jnp.tanh(s / x.soft_cap)
        s = jnp.where(ok[:, :, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)  # 0 while m is -inf (no key yet)
        p = jnp.exp(s - m_new[:, None])  # masked keys: exp(-inf) = 0
        denom_new = denom * alpha + fixed_order_sum(p, axis=1)
        pv = fixed_order_sum(p[..., None] * v[:, :, :, None, :], axis=1)  # [T, Hkv, G, D]
        acc_new = acc * alpha[..., None] + pv
        any_key = jnp.any(ok, axis=1)[:, None, None]
        return (jnp.where(any_key, m_new, m), jnp.where(any_key, denom_new, denom),
                jnp.where(any_key[..., None], acc_new, acc))  # fmt: skip

    shape = (num_tokens, num_kv_heads, group)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32))  # fmt: skip
    # Blocks up to the batch's last key (a row's later blocks are selects that keep its state).
    num_blocks = (jnp.max(q_pos, initial=-1) + key_block) // key_block
    _, denom, acc = lax.fori_loop(0, num_blocks, block, init)
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    out = out.reshape(num_tokens, num_q_heads, head_dim)
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)
