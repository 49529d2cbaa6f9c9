"""The fixed-shape ragged token batch one jitted step consumes."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv.cache import SCRATCH_PAGE, PageTable


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RaggedBatch:
    """Prefill chunks and decode tokens of many sequences, flattened into T token rows.

    `tokens`, `positions`: [T] int32; `query_start_loc`: [S+1] int32 (sequence s owns rows
    `query_start_loc[s]:query_start_loc[s+1]`); `page_table`: slot s's pages and context length.
    `max_q_len` is static (part of the compiled shape bucket): the most new tokens any sequence has.
    """

    tokens: jax.Array
    positions: jax.Array
    query_start_loc: jax.Array
    page_table: PageTable
    max_q_len: int = field(metadata=dict(static=True))

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.page_table.seq_lens.shape[0]


def build_ragged_batch(
    new_tokens: list[list[int]],
    context_lens: list[int],
    page_ids: list[list[int]],
    *,
    num_tokens: int,
    num_seqs: int,
    pages_per_seq: int,
    max_q_len: int | None = None,
    put=jax.device_put,
) -> RaggedBatch:
    """Host-side packing of a ragged batch into fixed (bucketed) shapes, with padding.

    `new_tokens[s]` are sequence s's tokens for this step, `context_lens[s]` how many of its tokens
    are already in the cache, `page_ids[s]` its pages in order; `put` moves the arrays to the
    device(s). Padding sequence slots have no tokens, length 0 and only scratch pages.
    """
    n = len(new_tokens)
    if not (len(context_lens) == len(page_ids) == n):
        raise ValueError("new_tokens, context_lens and page_ids must have one entry per sequence")
    if n > num_seqs:
        raise ValueError(f"{n} sequences do not fit the batch bucket of {num_seqs}")
    q_lens = [len(t) for t in new_tokens]
    if sum(q_lens) > num_tokens:
        raise ValueError(f"{sum(q_lens)} tokens do not fit the token bucket of {num_tokens}")
    max_q_len = max_q_len or max(q_lens, default=1)
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    qsl = np.zeros(num_seqs + 1, np.int32)
    table = np.full((num_seqs, pages_per_seq), SCRATCH_PAGE, np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    start = 0
    for s in range(n):
        q, ctx = q_lens[s], context_lens[s]
        if len(page_ids[s]) > pages_per_seq:
            raise ValueError(f"sequence {s} has {len(page_ids[s])} pages > {pages_per_seq}")
        tokens[start : start + q] = new_tokens[s]
        positions[start : start + q] = np.arange(ctx, ctx + q)
        table[s, : len(page_ids[s])] = page_ids[s]
        seq_lens[s] = ctx + q
        start += q
        qsl[s + 1] = start
    qsl[n + 1 :] = start
    tokens, positions, qsl, table, seq_lens = put((tokens, positions, qsl, table, seq_lens))
    return RaggedBatch(tokens, positions, qsl, PageTable(table, seq_lens), max_q_len)


def rows_batch(tokens: jax.Array, positions: jax.Array, live: jax.Array, page_ids: jax.Array,
               q: int) -> RaggedBatch:  # fmt: skip
    """On device: a batch of q new tokens per row, tokens/positions [S, q] (each row's last
    position its new length - 1), for the rows where `live` [S] is true (a draft pass inside a
    decode scan: `engine/draft_model.py`, `engine/eagle.py`). Row r's tokens stay at r * q: a
    row that is not live before a live one (a sequence that ended inside the scan) carries q
    tokens at positions 0 .. q - 1 of the scratch page, and the rows after the last live one
    carry none. (Packing the live rows together instead gave every row after such a row its
    predecessor's tokens and positions, written into its own pages.)"""
    before_last = jnp.flip(jnp.cumsum(jnp.flip(live.astype(jnp.int32))) > 0)
    qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(before_last * q)])
    hole = before_last & ~live
    positions = jnp.where(hole[:, None], jnp.arange(q, dtype=positions.dtype), positions)
    lens = jnp.where(live, positions[:, -1] + 1, jnp.where(hole, q, 0))
    page_ids = jnp.where(hole[:, None], SCRATCH_PAGE, page_ids)
    return RaggedBatch(tokens.reshape(-1), positions.reshape(-1), qsl, PageTable(page_ids, lens), q)
