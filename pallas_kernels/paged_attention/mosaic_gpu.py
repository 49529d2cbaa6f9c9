"""Ragged paged attention for Hopper in Mosaic GPU (Pallas): decode, prefill chunks, FP8 K/V.

One kernel serves decode batches, chunked-prefill batches and batches that mix them (the engine's
mixed step): the same layout as `reference.ragged_paged_attention`, whose docstring describes it.

How the work is cut
-------------------
- The query tokens of each sequence are cut into *query blocks* of `bq` tokens (`bq = 1` for
  decode; `128 // group` for prefill). For one KV head, a block's queries of all the `group` query
  heads sharing that KV head form the A operand of `wgmma` (rows are (token, head-in-group) pairs,
  64 per consumer warpgroup). A decode block so fills `group` of 64 rows: the tensor cores do 16x
  the useful FLOPs for GQA 32/8, which costs nothing because decode is bound by reading K/V (the
  FLOPs per K/V byte stay far under the H200's ~200 FLOP/B balance point).
- Queries are laid out token-major per KV head ([Hkv, T * group, D], pre-scaled), so a block is a
  contiguous run of rows that one TMA copy loads from the block's first row; rows past the block's
  tokens are loaded too (later tokens or zero padding) and their outputs are never read. Outputs
  are written per block and gathered back to token order (only real tokens' rows are read). Blocks
  past the real ones (the grid is a static bound) skip all work.
- Decode-only batches with one context split (the engine's decode scans from ~17 sequences up)
  skip that gather: each block writes its token's `group` rows straight into the [T, Hq, D]
  output through an unswizzled staging buffer (any row offset), and block b writes the zeros of
  padding token b. The gather was its own XLA kernel after every layer's attention.
- Decode-only batches may hand the kernel the step's new K/V (`new_kv`), which it writes itself
  instead of an XLA scatter before it: each token then has `group + 2` query-layout rows (its
  query heads, its key, its value). The block whose context split ends at the token (the one
  that reads the tile holding it) copies the two rows into a small buffer with TMA and stores
  them into the page slot; it issues that tile's load only once the stores completed. The pages
  are a global-memory ref, aliased in and out (updated in place when donated).
- Mixed batches (prefill chunks and decodes in one step, the engine's mixed step) take two
  launches: sequences with one new token get decode blocks, the others prefill blocks. One launch
  of prefill-shaped blocks for all of them would give every decode token a 128-row block, two
  consumer warpgroups and 128-key tiles (`split_decode_rows=False` keeps that for comparison).
- Grid: (query block, KV head, context split). Each program streams its share of the sequence's
  K/V in tiles of `block_kv = max(64, page_size)` tokens, each tile one TMA copy per page
  (`block_kv // page_size` copies for small pages) straight from the page pool, through
  `num_stages` shared-memory buffers: the copies for tile i+num_stages-1 are in flight while tile
  i is computed. Page ids come from the page table in global memory, read as scalars.
- Softmax is online (flash-attention style) in fp32, in the log2 domain. With several context
  splits (long contexts, few sequences: the grid would not fill 132 SMs otherwise) each split
  writes its normalised output and log-sum-exp, and a small XLA epilogue combines them.
- Isolation: only pages below the sequence's length are read; page-table entries past it are
  clamped to its last page (never dereferenced as garbage). Keys past the length are masked
  (select, not multiply) and values past it are zeroed in shared memory before `P @ V`, so NaN in
  unused page slots cannot reach an output, not even as NaN * 0.
- FP8 (e4m3) pages with one fp32 scale per (page, KV head): tiles are copied as fp8 (half the
  bytes), converted to bf16 in shared memory, and the scales are applied to the columns of the
  scores (K) and of the probabilities (V), so dequantization is one multiply per score.

Pipelines (defaults chosen on the H200 probe runs, `experiments/scratch/probe_pa.py`):
- bf16 decode: one warpgroup that both issues the TMA copies and computes, 2 stages: 80 KB of
  shared memory, so two programs share an SM and one computes while the other waits (3.48 TB/s at
  B64 L2048 against 2.69 with 3 stages, one program per SM; a warp-specialised producer gave 3.30).
- fp8 decode: a producer warpgroup issues the copies *and* converts each landed tile to f16 (Hopper
  has no e4m3 -> bf16 conversion; q and P are f16 on this path), handing f16 tiles to the consumer.
- prefill: two consumer warpgroups (128 query rows) and a producer, 128-key tiles.
Tiles every row of a consumer sees whole skip the masking.

Measured (`experiments/results/h200/paged_attention.json`, H200, bf16, GQA 32/8, d128, page 16;
TB/s of K/V read, ours / cuDNN paged in the same run): B64 L2048 3.46 / 3.26; B1 L32768 2.24 /
1.79; B8 L8192 2.39 / 2.36; B256 L2048 4.05 / 4.07; fp8 B64 L2048 1.10 TB/s (0.245 ms, slower than
bf16's 0.155 ms: the shared-memory fp8 -> f16 round trip, not HBM, is the limit); causal prefill
4 x 4096: 405 TFLOP/s (cuDNN dense 470, jax's `attention_mgpu` 472 on contiguous f16 K/V). A mixed
step (`mixed_attention.json`: 500 decode rows, 12 prompt chunks): 0.238 ms with the decode launch,
0.409 ms without it.

The Pallas Triton backend is not used (deprecated from jax 0.11). On CPU the kernel runs under jax's
GPU interpreter (`interpret=True`), which is how the tests check it against the reference.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat
from pallas_kernels._mgpu import ROWS, swizzled_smem, wgmma_dot
from pallas_kernels.paged_attention.reference import token_sequences

LOG2E = math.log2(math.e)
RCP_LN2 = 1.0 / math.log(2.0)
NEG = -1e30  # masked score in the log2 domain: finite, so fully masked tiles never give NaN
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)


def default_num_splits(num_programs: int, max_tiles: int, sms: int) -> int:
    """Context splits so that (programs x splits) covers the SMs about twice, never past the tiles."""
    if num_programs >= sms:
        return 1
    return max(1, min(max_tiles, -(-2 * sms // num_programs)))


def dynamic_num_splits(num_active, num_kv_heads: int, cap: int, sms: int):
    """Splits each block uses when `dynamic_splits` is on: as many as fit one wave of two programs
    per SM over the blocks that have queries (`num_active`, a traced count), rounded down (a
    launch of 1.2 waves runs its last 0.2 as a second wave), between 1 and the launch's `cap`."""
    per_wave = 2 * sms // num_kv_heads
    return jnp.clip(per_wave // jnp.maximum(num_active, 1), 1, cap).astype(jnp.int32)


def _apply_soft_cap(s, soft_cap):
    """cap * tanh(s / cap), tanh through exp (scores fp32); s itself without a cap."""
    if soft_cap is None:
        return s
    e = jnp.exp(s * (2.0 / soft_cap))
    return soft_cap - (2.0 * soft_cap) / (e + 1.0)


def _causal_mask(iota, shape, *, row0, base, q_pos0, kv_len, group, sliding_window):
    """Which scores of a [rows, bk] tile count: rows are (query token, head-in-group) pairs
    counted from the block's first query (`row0` is the tile's first row on that count: negative
    for rows before it), columns are keys from position `base`. Causal (a key at most the row's
    token position), below the sequence length, and within the sliding window if any."""
    row = iota(shape, 0) + row0
    col = iota(shape, 1)
    rel = base + col - q_pos0  # key position relative to the block's first query
    # `row` counts from the first query: its token is row // group; causal means
    # rel <= row // group, i.e. row >= rel * group.
    mask = (row >= rel * group) & (base + col < kv_len)
    if sliding_window is not None:  # key > q_pos - window <=> row // group < rel + window
        mask = mask & (row < (rel + sliding_window) * group)
    return mask


def _kv_tile_range(q_pos0, n_valid, kv_len, block_kv, sliding_window):
    """Tiles [t_lo, t_hi) of `block_kv` keys that a block of `n_valid` queries from position
    `q_pos0` reads: up to its last query's causal bound, from its first query's window start."""
    kv_end = jnp.minimum(kv_len, q_pos0 + n_valid)
    if sliding_window is None:
        kv_start = jnp.int32(0)
    else:
        kv_start = jnp.maximum(q_pos0 - sliding_window + 1, 0)
    t_lo = lax.div(kv_start, jnp.int32(block_kv))
    return t_lo, lax.div(kv_end + block_kv - 1, jnp.int32(block_kv))


def _online_softmax(s, acc, m_i, l_i, mask=None):
    """One tile's flash-attention update in the log2 domain: scores s [rows, bk] fp32 (masked to
    NEG where `mask` is False) -> (probabilities p, acc rescaled, new row max, new row sum)."""
    s2 = s * LOG2E if mask is None else jnp.where(mask, s * LOG2E, NEG)
    m_new = jnp.maximum(m_i, s2.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s2 - lax.broadcast_in_dim(m_new, s2.shape, [0]))
    l_new = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p, acc, m_new, l_new


def ragged_paged_attention_mgpu(
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
    num_splits: int | None = None,
    num_stages: int | None = None,
    warp_specialized: bool | None = None,
    block_kv: int | None = None,
    num_consumers: int | None = None,
    fp8_load: str = "default",
    split_decode_rows: bool = True,
    token_major_decode: bool = True,
    prefetch_page_ids: bool = False,
    persistent: int = 0,
    early_exit: bool = False,
    dynamic_splits: bool = False,
    early_k_refill: bool = False,
    v_page_offset: int = 0,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    interpret: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
    """Same contract as `reference.ragged_paged_attention` (`v_page_offset` included); returns
    [T, Hq, D] in q.dtype.

    `num_splits` (static) cuts each sequence's context into that many parts (default: enough to
    fill the GPU for decode, 1 for prefill); `num_stages` is the depth of the shared-memory
    pipeline; `warp_specialized` adds a producer warpgroup; `block_kv` (64 or 128) keys per tile;
    `num_consumers` consumer warpgroups of 64 query rows each. Defaults: see the module docstring.
    In a batch with `max_q_len > 1`, `split_decode_rows` sends the sequences with exactly one new
    token through the decode configuration (a second launch; the tuning options above then apply
    to the prefill part only). `token_major_decode` lets a decode-only batch (`max_q_len == 1`,
    no more tokens than sequences) with one context split write its outputs in token order from
    the kernel (False: through the per-block layout and a gather, as other batches).
    `prefetch_page_ids` reads a refill's page ids from the page table a tile before the refill is
    issued, instead of right before its copies (off: no faster on the H200,
    `e2e_llama3_8b_prefetch_page_ids.json`). `persistent` = n > 0 serves a decode-only batch that has one
    context split (and no `new_kv`, bf16 pages) with n programs per SM that each stream several
    (block, KV head) items, their K/V pipeline running on across items (`persistent.py`); 0: one
    program per item. `early_exit`: a program's last output stores are waited for only until
    they have read shared memory (the kernel's end still orders them before any later reader),
    so the SM takes its next program sooner. `dynamic_splits` (decode blocks with the default
    split count): the launch keeps that count as its grid, but each block uses only as many
    splits as fit one wave for the blocks that have queries at run time (`dynamic_num_splits`);
    the rest find no tiles and add nothing. A decode bucket of 8 rows then runs 4 splits with 8
    sequences and 5 with one, where the static count gives 5 to both: on the H200 (8B, batch 8 x
    2048) 4 splits were 2.5% faster per step and 1 sequence was 1.0-1.2% slower with 4
    (`e2e_llama3_8b_num_splits.json`). Off by default: on the GPU it was 1.3% faster at batch 8 x
    2048 and within 0.5% elsewhere (`e2e_llama3_8b_dynamic_splits.json`). `early_k_refill`
    (bf16 pages, one warpgroup without a producer: the decode default): a K slot is refilled as
    soon as the scores of its tile are computed, before the softmax and the P @ V product, instead
    of together with the V slot after them, so the next K copy starts about half a tile's work
    earlier. Off by default: correct on the GPU but no faster, +0.1 to +0.6% per 8B decode step
    at 9 of 10 rows (`ab_early_k_refill.json`). `interpret` runs the kernel under the GPU interpreter
    (default: when there is no GPU).

    `new_kv` = (k, v), each [T, Hkv, D]: this step's keys (rope applied) and values, which the
    kernel writes into the pages itself (decode-only batches, `fused_kv_write_reason`): token t of
    sequence s goes to slot (seq_lens[s] - 1) of its page, K at `page_table` and V at
    `page_table + v_page_offset`. The pages are updated in place (aliased; donate them), and the
    call returns (out, k_pages, v_pages) (the same array twice when `k_pages is v_pages`).
    Padding tokens write nothing. Without it the caller writes the K/V before the call.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    _check_inputs(q, k_pages, v_pages, page_table, seq_lens, query_start_loc, k_scales, v_scales)
    v_page_offset = _static_offset(v_page_offset)
    if new_kv is not None:
        reason = fused_kv_write_reason(max_q_len, k_pages.dtype, warp_specialized,
                                       num_q_heads // num_kv_heads)  # fmt: skip
        if reason is not None:
            raise ValueError(f"new_kv (K/V written by the kernel): {reason}")
        _check_new_kv(new_kv, num_tokens, k_pages.shape)
    if fp8_load not in ("default", "wgmma8"):
        raise ValueError(f"fp8_load must be 'default' or 'wgmma8', got {fp8_load!r}")
    group = num_q_heads // num_kv_heads
    quantized = k_scales is not None
    scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
    interpret = _compat.default_interpret() if interpret is None else interpret
    compute_dtype = jnp.float16 if quantized else jnp.bfloat16  # e4m3 converts only to f16
    # Rows per token in the query layout: its `group` query heads, then (new_kv) its key and value.
    stride = group + 2 if new_kv is not None else group
    geometry = dict(group=group, head_dim=head_dim, quantized=quantized, page_size=page_size,
                    pages_per_seq=pages_per_seq)  # fmt: skip
    tuning = dict(num_splits=num_splits, num_stages=num_stages, warp_specialized=warp_specialized,
                  block_kv=block_kv, num_consumers=num_consumers)  # fmt: skip

    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if max_q_len == 1:
        parts = [(_plan(decode=True, **geometry, **tuning, row_stride=stride), q_lens > 0)]
    elif split_decode_rows:
        parts = [(_plan(decode=True, **geometry), q_lens == 1),
                 (_plan(decode=False, **geometry, **tuning), q_lens > 1)]  # fmt: skip
    else:
        parts = [(_plan(decode=False, **geometry, **tuning), q_lens > 0)]

    # ---- queries, token-major per KV head: row (t * group + g) of head h is query head
    # h * group + g of token t, pre-scaled. A query block is then a contiguous run of rows, which
    # the kernel loads with one TMA copy from the block's first row (rows past the block belong
    # to later tokens or to the zero padding; their outputs are never read). With `new_kv` each
    # token has `group + 2` rows: its query heads, then its key and value for this KV head, which
    # so arrive with the queries (one XLA fusion builds them all; no separate K/V scatter).
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tok_seq, tok_ok = token_sequences(query_start_loc, num_tokens)
    tok_off = t - query_start_loc[tok_seq]
    qt = jnp.where(tok_ok[:, None, None], q.astype(jnp.float32) * scale, 0.0).astype(compute_dtype)
    qt = qt.reshape(num_tokens, num_kv_heads, group, head_dim)
    if new_kv is not None:
        kv_rows = [jnp.where(tok_ok[:, None, None], x, 0).astype(compute_dtype)[:, :, None]
                   for x in new_kv]  # fmt: skip
        qt = jnp.concatenate([qt, *kv_rows], axis=2)
    qt = qt.transpose(1, 0, 2, 3)
    # padding: room for the last block's rows, and a multiple of 8 rows (TMA's 8-row tiles)
    pad = max(plan.q_rows for plan, _ in parts) + (-num_tokens * stride) % 8
    qt = jnp.pad(
        qt.reshape(num_kv_heads, num_tokens * stride, head_dim), ((0, 0), (0, pad), (0, 0))
    )

    launch = dict(num_kv_heads=num_kv_heads, group=group, kv_dtype=jnp.dtype(k_pages.dtype),
                  soft_cap=soft_cap, sliding_window=sliding_window, fp8_load=fp8_load,
                  v_page_offset=v_page_offset, prefetch_page_ids=bool(prefetch_page_ids),
                  early_exit=bool(early_exit), early_k_refill=bool(early_k_refill),
                  interpret=interpret)  # fmt: skip
    dynamic = bool(dynamic_splits) and num_splits is None  # (an explicit count stays fixed)
    write_kv = new_kv is not None
    plan0, take0 = parts[0]
    num_seqs = q_lens.shape[0]
    if (plan0.decode and len(parts) == 1 and token_major_decode and num_tokens <= num_seqs
            and _resolve_splits(plan0, num_seqs, num_kv_heads) == 1):  # fmt: skip
        # One split: the kernel writes each token's rows in place ([T, Hq, D]) and the zeros of
        # the padding tokens, so no gather (an XLA fusion per layer) runs after it.
        meta, _ = _query_blocks(plan0, take0, q_lens, seq_lens, query_start_loc, num_tokens,
                                stride)  # fmt: skip
        b = jnp.arange(num_seqs, dtype=jnp.int32)
        zero_row = jnp.where((b >= query_start_loc[-1]) & (b < num_tokens), b, -1)
        meta = jnp.concatenate([meta, zero_row[:, None]], axis=1)
        if persistent_reason(plan0, persistent, k_pages.dtype, write_kv) is None:
            out = _launch_persistent(plan0, meta, qt, page_table, k_pages, v_pages,
                                     num_programs=int(persistent) * _compat.num_sms(),
                                     num_tokens=num_tokens, **launch)  # fmt: skip
            return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
        out = _launch(plan0, meta, qt, page_table, k_pages, v_pages, k_scales, v_scales,
                      token_major=num_tokens, write_kv=write_kv, **launch)  # fmt: skip
        if write_kv:
            out, k_pages, v_pages = out
        out = out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
        return (out, k_pages, v_pages) if write_kv else out

    out = jnp.zeros((num_tokens, num_kv_heads, group, head_dim), q.dtype)
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    in_group = jnp.arange(group, dtype=jnp.int32)[None, None, :]
    for plan, take in parts:
        meta, first_blk = _query_blocks(plan, take, q_lens, seq_lens, query_start_loc, num_tokens,
                                        stride if plan.decode else group)  # fmt: skip
        ob = _launch(plan, meta, qt, page_table, k_pages, v_pages, k_scales, v_scales,
                     write_kv=write_kv, dynamic_splits=dynamic and plan.decode, **launch)  # fmt: skip
        if write_kv:  # (decode-only: this is the one launch)
            ob, k_pages, v_pages = ob
        ob = ob.astype(q.dtype)
        # ob: [nb, Hkv, q_rows, D]
        # Back to token order with a gather of rows (only the rows of real tokens are read).
        blk = first_blk[tok_seq] + tok_off // plan.bq
        row = meta[blk, 5] + (tok_off % plan.bq) * group
        idx = (blk[:, None, None] * num_kv_heads + heads) * plan.q_rows + row[:, None, None]
        vals = ob.reshape(-1, head_dim)[idx + in_group]  # [T, Hkv, group, D]
        mine = tok_ok & take[tok_seq]
        out = jnp.where(mine[:, None, None, None], vals, out)
    out = out.reshape(num_tokens, num_q_heads, head_dim)
    return (out, k_pages, v_pages) if write_kv else out


def persistent_reason(plan, persistent, kv_dtype, write_kv) -> str | None:
    """Why a token-major decode launch does not run persistent (None when it does)."""
    if not persistent:
        return "persistent=0"
    if write_kv:
        return "the kernel writes the new K/V (new_kv): one program per item"
    if jnp.dtype(kv_dtype) != jnp.dtype(jnp.bfloat16):
        return "bf16 pages only"
    if plan.warp_specialized or plan.consumers != 1:
        return "the single-warpgroup decode pipeline only"
    return None


def _launch_persistent(plan, meta, qt, page_table, k_pages, v_pages, *, num_programs, num_tokens,
                       num_kv_heads, group, soft_cap, sliding_window, v_page_offset, interpret,
                       **_):  # fmt: skip
    """The token-major decode launch of `persistent.py`: [T * Hq, D] outputs."""
    from pallas_kernels.paged_attention.persistent import (
        build_persistent_decode_kernel,
        work_list,
    )

    num_blocks = meta.shape[0]
    kernel = build_persistent_decode_kernel(
        num_programs=max(1, min(int(num_programs), num_blocks * num_kv_heads)),
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        num_tokens=num_tokens,
        q_rows=plan.q_rows,
        group=group,
        head_dim=qt.shape[-1],
        page_size=k_pages.shape[1],
        num_stages=plan.num_stages,
        block_kv=plan.block_kv,
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        v_page_offset=v_page_offset,
        interpret=interpret,
    )
    (out,) = kernel(meta, work_list(meta), page_table.astype(jnp.int32), qt, k_pages, v_pages)
    return out


def fused_kv_write_reason(max_q_len: int, kv_dtype, warp_specialized: bool | None = None,
                          group: int = 1) -> str | None:  # fmt: skip
    """Why the kernel cannot write this step's K/V itself (`new_kv`); None when it can."""
    if group + 2 + 7 > ROWS:
        return f"query groups up to {ROWS - 9} heads per KV head (got {group})"
    if max_q_len != 1:
        return f"decode-only batches (max_q_len 1), got max_q_len {max_q_len}"
    if jnp.dtype(kv_dtype) in FP8_DTYPES:
        return "fp8 pages are quantized on write by XLA (per-page scales)"
    if warp_specialized:
        return "the single-warpgroup decode pipeline (warp_specialized=False)"
    return None


def _check_new_kv(new_kv, num_tokens, pages_shape):
    _, _, num_kv_heads, head_dim = pages_shape
    want = (num_tokens, num_kv_heads, head_dim)
    if len(new_kv) != 2 or any(tuple(x.shape) != want for x in new_kv):
        raise ValueError(f"new_kv must be (k, v), each [T, Hkv, D] = {want}; got "
                         f"{[tuple(x.shape) for x in new_kv]}")  # fmt: skip


class _Plan(NamedTuple):
    """Static shape of one launch: query-block size, warpgroups, tiles, pipeline."""

    decode: bool
    bq: int  # query tokens per block
    q_rows: int  # rows of a block loaded and stored: bq * group + the alignment shift, to 8s
    consumers: int
    block_kv: int
    num_stages: int
    warp_specialized: bool
    num_splits: int | None  # None: chosen from the grid size
    max_tiles: int
    row_stride: int  # rows per token in the query layout: group (+ 2 with the new K/V rows)


def _plan(*, decode, group, head_dim, quantized, page_size, pages_per_seq, num_splits=None,
          num_stages=None, warp_specialized=None, block_kv=None, num_consumers=None,
          row_stride=None) -> _Plan:  # fmt: skip
    # Decode: one consumer warpgroup, 64-key tiles. Prefill: two consumers (128 query rows)
    # share each K/V tile, 128 keys per tile (64 for fp8, whose f16 copies also need room).
    if num_consumers is None:  # (fp8 at head dim 256 needs the room for its f16 copies)
        one = decode or warp_specialized is False or (quantized and head_dim > 128)
        num_consumers = 1 if one else 2
    if block_kv is None:  # 128-key tiles of head dim 256 would not fit shared memory twice over
        block_kv = 64 if decode or quantized or head_dim > 128 else 128
    if block_kv not in (64, 128):
        raise ValueError(f"block_kv must be 64 or 128, got {block_kv}")
    # A block's rows are loaded from an 8-aligned row (TMA into 8-row tiles), up to
    # `max_shift` rows before its first query row: room for the shift is part of the block.
    # Tokens are `row_stride` rows apart (group, or group + 2 with the new K/V rows: decode only).
    stride = group if row_stride is None else row_stride
    if stride != group and not decode:
        raise ValueError("rows for new K/V only in decode blocks")
    max_shift = 8 - math.gcd(stride, 8)
    bq = 1 if decode else max(1, (num_consumers * ROWS - max_shift) // group)
    q_rows = -(-(bq * stride + max_shift) // 8) * 8
    num_consumers = -(-q_rows // ROWS)
    if warp_specialized is None:  # measured on the H200: see the module docstring
        warp_specialized = quantized or num_consumers > 1
    if num_stages is None:
        num_stages = 4 if warp_specialized and block_kv == 64 and head_dim <= 128 else 2
    if not decode and num_splits is None:
        num_splits = 1
    max_tiles = -(-pages_per_seq * page_size // block_kv)
    return _Plan(decode, bq, q_rows, num_consumers, block_kv, num_stages, warp_specialized,
                 num_splits, max_tiles, stride)  # fmt: skip


def _query_blocks(plan, take, q_lens, seq_lens, query_start_loc, num_tokens, group):
    """Per-block metadata [nb, 6] (sequence, first query position, valid queries, kv length,
    8-aligned first q row, shift of the first query row past it) for the sequences in `take`, and
    each sequence's first block [S]."""
    num_seqs = q_lens.shape[0]
    bq = plan.bq
    if plan.decode:  # block i is sequence i's one query
        num_blocks = num_seqs
        blk_seq = jnp.arange(num_seqs, dtype=jnp.int32)
        blk_off = jnp.zeros((num_seqs,), jnp.int32)
        blk_ok = take
        first_blk = blk_seq
    else:
        num_blocks = -(-num_tokens // bq) + num_seqs  # static bound on sum(ceil(q_len / bq))
        per_seq = jnp.where(take, (q_lens + bq - 1) // bq, 0)
        ends = jnp.cumsum(per_seq)
        first_blk = (ends - per_seq).astype(jnp.int32)
        b = jnp.arange(num_blocks, dtype=jnp.int32)
        blk_seq = jnp.searchsorted(ends, b, side="right", method="compare_all").astype(jnp.int32)
        blk_ok = blk_seq < num_seqs
        blk_seq = jnp.minimum(blk_seq, num_seqs - 1)
        blk_off = (b - first_blk[blk_seq]) * bq
    n_valid = jnp.where(blk_ok, jnp.clip(q_lens[blk_seq] - blk_off, 0, bq), 0)
    kv_len = jnp.where(n_valid > 0, seq_lens[blk_seq], 0)
    q_pos0 = kv_len - q_lens[blk_seq] + blk_off
    q_row0 = jnp.where(n_valid > 0, (query_start_loc[blk_seq] + blk_off) * group, 0)
    shift = q_row0 % 8  # the block's first query row sits `shift` rows into its 8-aligned load
    meta = jnp.stack([blk_seq, q_pos0, n_valid, kv_len, q_row0 - shift, shift], axis=1)
    return meta.astype(jnp.int32), first_blk


def _resolve_splits(plan, num_blocks, num_kv_heads) -> int:
    """Context splits of a launch of `plan` over `num_blocks` query blocks."""
    num_splits = plan.num_splits
    if num_splits is None:
        num_splits = default_num_splits(num_blocks * num_kv_heads, plan.max_tiles,
                                        _compat.num_sms())  # fmt: skip
    return max(1, min(int(num_splits), plan.max_tiles))


def _launch(plan, meta, qt, page_table, k_pages, v_pages, k_scales, v_scales, *, num_kv_heads,
            group, kv_dtype, soft_cap, sliding_window, fp8_load, v_page_offset, interpret,
            token_major=0, write_kv=False, prefetch_page_ids=False, early_exit=False,
            dynamic_splits=False, early_k_refill=False):  # fmt: skip
    """One kernel launch over `meta`'s blocks; returns [nb, Hkv, q_rows, D] (splits combined), or
    with `token_major` = T (decode blocks, one split) the outputs in token order, [T * Hq, D].
    With `write_kv` the kernel also writes each token's K/V rows (the query layout's rows `group`
    and `group + 1`) into the pages, in place, and this returns (out, k_pages, v_pages)."""
    num_blocks = meta.shape[0]
    head_dim = qt.shape[-1]
    quantized = k_scales is not None
    num_splits = _resolve_splits(plan, num_blocks, num_kv_heads)
    shared_pages = write_kv and k_pages is v_pages
    if token_major and (num_splits != 1 or not plan.decode):
        raise ValueError("token-major outputs need decode blocks and one split")
    splits_col = None
    if dynamic_splits and num_splits > 1:  # each block's split count, a column of its metadata
        active = jnp.sum(meta[:, 2] > 0)
        used = dynamic_num_splits(active, num_kv_heads, num_splits, _compat.num_sms())
        splits_col = meta.shape[1]
        meta = jnp.concatenate([meta, jnp.broadcast_to(used, (num_blocks, 1))], axis=1)
    kernel = _build_kernel(
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        num_splits=num_splits,
        q_rows=plan.q_rows,
        group=group,
        head_dim=head_dim,
        page_size=k_pages.shape[1],
        num_stages=plan.num_stages,
        kv_dtype=kv_dtype,
        quantized=quantized,
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        warp_specialized=plan.warp_specialized,
        block_kv=plan.block_kv,
        consumers=plan.consumers,
        fp8_load=fp8_load,
        v_page_offset=v_page_offset,
        prefetch_page_ids=prefetch_page_ids,
        early_exit=early_exit,
        early_k_refill=early_k_refill,
        token_major=token_major,
        splits_col=splits_col,
        row_stride=plan.row_stride,
        write_kv=write_kv,
        shared_pages=shared_pages,
        interpret=interpret,
    )
    args = [meta, page_table.astype(jnp.int32)]
    if quantized:
        args += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
    if write_kv:  # the pages are in/out buffers of the kernel: refs, updated in place
        pages = [k_pages] if shared_pages else [k_pages, v_pages]
        outs, pages = _compat.call_with_page_refs(kernel, [*args, qt], pages)
        k_pages, v_pages = (pages[0], pages[0]) if shared_pages else pages
    else:
        outs = kernel(*args, qt, k_pages, v_pages)
    if token_major:
        (out,) = outs
        return (out, k_pages, v_pages) if write_kv else out
    out, lse = outs  # [splits, nb, Hkv, rows, D], [.., rows]
    if num_splits == 1:
        out = out[0]
    else:  # combine the splits' partial softmaxes (log2 domain)
        lmax = jnp.max(lse, axis=0)
        w = jnp.exp2(lse - lmax[None])
        out = jnp.sum(w[..., None] * out.astype(jnp.float32), axis=0)
        out = out / jnp.sum(w, axis=0)[..., None]
    return (out, k_pages, v_pages) if write_kv else out


def unsupported_reason(num_q_heads, num_kv_heads, head_dim, page_size, kv_dtype) -> str | None:
    """Why the kernel cannot serve this attention shape (None when it can)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} not in {SUPPORTED_HEAD_DIMS}"
    if page_size not in SUPPORTED_PAGE_SIZES:
        return f"page_size {page_size} not in {SUPPORTED_PAGE_SIZES}"
    if num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > ROWS:
        return f"{num_q_heads} query heads over {num_kv_heads} kv heads"
    if jnp.dtype(kv_dtype) not in (*FP8_DTYPES, jnp.dtype(jnp.bfloat16)):
        return f"kv dtype {jnp.dtype(kv_dtype)}: the kernel reads bf16 or fp8 pages"
    return None


def _static_offset(v_page_offset) -> int:
    try:
        off = int(v_page_offset)
    except TypeError as e:  # a tracer
        raise TypeError(f"v_page_offset must be a static int, got {v_page_offset!r}") from e
    if off < 0:
        raise ValueError(f"v_page_offset must be >= 0, got {off}")
    return off


def _check_inputs(q, k_pages, v_pages, page_table, seq_lens, query_start_loc, k_scales, v_scales):
    _, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, d_k = k_pages.shape
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages {v_pages.shape} {v_pages.dtype} must match k_pages "
                         f"{k_pages.shape} {k_pages.dtype}")  # fmt: skip
    if d_k != head_dim:
        raise ValueError(f"head dim of q ({head_dim}) and k_pages ({d_k}) differ")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) not a multiple of kv heads ({num_kv_heads})")
    if page_table.ndim != 2 or seq_lens.shape != (page_table.shape[0],):
        raise ValueError(f"page_table {page_table.shape} / seq_lens {seq_lens.shape} mismatch")
    if query_start_loc.shape != (page_table.shape[0] + 1,):
        raise ValueError(f"query_start_loc {query_start_loc.shape} must be [num_seqs + 1]")
    quantized = jnp.dtype(k_pages.dtype) in FP8_DTYPES
    if quantized != (k_scales is not None) or (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales are required exactly when the pages are fp8 "
                         f"(pages are {k_pages.dtype})")  # fmt: skip
    want = (num_pages, num_kv_heads)
    if quantized and (k_scales.shape != want or v_scales.shape != want):
        raise ValueError(f"k_scales {k_scales.shape} / v_scales {v_scales.shape} must be "
                         f"[num_pages, Hkv] = {want}")  # fmt: skip
    reason = unsupported_reason(num_q_heads, num_kv_heads, head_dim, page_size, k_pages.dtype)
    if reason is not None:
        raise NotImplementedError(reason)


@functools.cache
def _build_kernel(
    *,
    num_blocks,
    num_kv_heads,
    num_splits,
    q_rows,
    group,
    head_dim,
    page_size,
    num_stages,
    kv_dtype,
    quantized,
    soft_cap,
    sliding_window,
    warp_specialized,
    block_kv,
    consumers,
    fp8_load,
    v_page_offset,
    prefetch_page_ids,
    early_exit,
    early_k_refill,
    token_major,
    splits_col,
    row_stride,
    write_kv,
    shared_pages,
    interpret,
):
    if write_kv and (warp_specialized or quantized or consumers != 1):
        raise ValueError("the kernel writes new K/V only in the single-warpgroup bf16 decode")
    bk = block_kv
    num_q_heads = num_kv_heads * group
    # K's refill right after its scores (bf16, no producer warpgroup: else the option is moot)
    early_k = bool(early_k_refill) and not warp_specialized and not quantized
    # FP8 with a producer warpgroup: it also converts tiles to f16, off the consumer's path.
    convert_in_producer = quantized and warp_specialized
    conv_stages = 2 if head_dim <= 128 else 1  # f16 copies of head dim 256 tiles are big
    copies = max(1, bk // page_size)  # TMA copies (pages) per tile
    # Hopper converts e4m3 only to f16 in hardware: FP8 tiles are computed in f16.
    cdt = jnp.float16 if quantized else jnp.bfloat16
    wgmma_layout = plgpu.Layout.WGMMA

    def cast(x, layout):  # register layouts mean nothing to the GPU interpreter
        return x if interpret else plgpu.layout_cast(x, layout)

    mma = functools.partial(wgmma_dot, interpret=interpret)

    def iota(shape, dim):
        return cast(lax.broadcasted_iota(jnp.int32, shape, dim), wgmma_layout)

    def load_fp8(ref):
        """An fp8 tile into registers. `fp8_load="wgmma8"` loads in the 8-bit wgmma layout (4-byte
        shared-memory accesses) and shuffles once to the wgmma layout; the default lets Mosaic load
        straight into the wgmma layout (2-byte accesses). Not yet compared on the GPU."""
        if interpret or fp8_load == "default":
            return ref[...]
        x = plgpu.load(ref, (), layout=plgpu.Layout.WGMMA_8BIT)
        return plgpu.layout_cast(x, wgmma_layout)

    def convert_v(v8_ref, base, kv_len):
        """An fp8 V tile as f16, rows past the sequence zeroed (they may hold NaN)."""
        v = load_fp8(v8_ref).astype(cdt)
        row = iota((bk, head_dim), 0)
        return jnp.where(base + row < kv_len, v, jnp.zeros_like(v))

    def body(*refs):
        # inputs and outputs; one pages ref serves K and V when they share it (`shared_pages`)
        n_in = (9 if quantized else 7) - (1 if token_major else 0) - (1 if shared_pages else 0)
        ins, scratch = refs[:n_in], refs[n_in:]
        if shared_pages:  # the same pages ref for K and V
            k_at = 5 if quantized else 3
            ins = (*ins[: k_at + 1], ins[k_at], *ins[k_at + 1 :])
        if token_major:  # no log-sum-exp output
            ins = (*ins, None)
        o_smem = kvn_smem = None
        if write_kv:  # unswizzled: the token's new K and V rows (loaded at any row offset)
            *scratch, kvn_smem = scratch
        if token_major:  # an unswizzled buffer stages rows written at any offset
            *scratch, o_smem = scratch
        if quantized:
            meta_ref, pt_ref, ks_ref, vs_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = ins
            q_smem, k_smem, v_smem, kc_smem, vc_smem, lse_smem, *bars = scratch
        else:
            meta_ref, pt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = ins
            q_smem, k_smem, v_smem, lse_smem, *bars = scratch
            ks_ref = vs_ref = kc_smem = vc_smem = None
        q_bar, k_bar, v_bar, *ws_bars = bars
        k_free = v_free = kc_full = vc_full = None
        if convert_in_producer:
            kc_full, vc_full, k_free, v_free = ws_bars  # the frees guard the f16 buffers
        elif warp_specialized:
            k_free, v_free = ws_bars

        blk = lax.axis_index("blk")
        head = lax.axis_index("head")
        split = lax.axis_index("split")
        seq = meta_ref[blk, 0]
        q_pos0 = meta_ref[blk, 1]
        n_valid = meta_ref[blk, 2]
        kv_len = meta_ref[blk, 3]
        q_row0 = meta_ref[blk, 4]  # 8-aligned row of the token-major queries the block loads
        shift = meta_ref[blk, 5]  # block row of its first query (row r is token (r-shift)//group)

        t_lo, t_hi = _kv_tile_range(q_pos0, n_valid, kv_len, bk, sliding_window)
        if splits_col is None:  # tiles per split: all of the launch's splits share the tiles
            per = lax.div(t_hi - t_lo + num_splits - 1, jnp.int32(num_splits))
        else:  # (dynamic) the block's metadata says how many share them; later ones find none
            used = meta_ref[blk, splits_col]
            per = lax.div(t_hi - t_lo + used - 1, used)
        my_lo = t_lo + split * per
        n_tiles = jnp.maximum(jnp.minimum(t_hi, my_lo + per) - my_lo, 0)
        last_page = jnp.maximum(lax.div(kv_len - 1, jnp.int32(page_size)), 0)
        # With `write_kv`, the split whose tiles end at the block's query (decode: the new token)
        # writes that token's K/V: the only block that reads the tile holding it.
        writer = (n_valid > 0) & (n_tiles > 0) & (my_lo + n_tiles == t_hi) if write_kv else None

        def page_of(tile, c, offset=0):
            """Page holding copy `c` of `tile` (clamped to the sequence's last page) plus `offset`
            (`v_page_offset` for V's page)."""
            idx = lax.div(tile * bk + c * page_size, jnp.int32(page_size))
            page = pt_ref[seq, jnp.minimum(idx, last_page)]
            return page + offset if offset else page

        def pages_of(i):
            """K's page of each copy of local tile `i`, read from the page table now (with
            `prefetch_page_ids` a refill reads them a tile ahead, off its critical path)."""
            return [page_of(my_lo + i, c) for c in range(copies)]

        def issue_k(i, slot, pages=None):
            pages = pages_of(i) if pages is None else pages
            for c in range(copies):
                _copy(k_ref, k_smem, k_bar, my_lo + i, c, slot, pages[c])

        def issue_v(i, slot, pages=None):
            pages = pages_of(i) if pages is None else pages
            for c in range(copies):
                _copy(v_ref, v_smem, v_bar, my_lo + i, c, slot, pages[c] + v_page_offset)

        def _copy(src, dst, bar, tile, c, slot, page):
            if page_size > bk:  # a tile is a slice of one page
                off = pl.multiple_of(lax.rem(tile * bk, jnp.int32(page_size)), bk)
                src_ref = src.at[page, pl.ds(off, bk), head]
            else:
                src_ref = src.at[page, :, head]
            dst_ref = dst.at[slot] if copies == 1 else dst.at[slot, pl.ds(c * page_size, page_size)]
            plgpu.copy_gmem_to_smem(src_ref, dst_ref, bar.at[slot])

        def producer_prologue(defer_last=False):
            """The first `num_stages` tiles; `defer_last`: not the block's last tile (a writer
            block issues it once its new K/V rows have landed)."""
            for st in range(num_stages):
                issue = st < n_tiles
                if defer_last is not False:
                    issue = issue & jnp.logical_not(defer_last & (st == n_tiles - 1))

                @pl.when(issue)
                def _(st=st):
                    issue_k(st, st)
                    issue_v(st, st)

        def col_scales(scale_ref, tile, shape, offset):
            """Per-column dequantization scales of a tile: one scalar per page it spans."""
            out = cast(
                jnp.full(shape, scale_ref[page_of(tile, 0, offset), head], jnp.float32),
                wgmma_layout,
            )
            if copies > 1:
                cols = iota(shape, 1)
                for c in range(1, copies):
                    page = page_of(tile, c, offset)
                    out = jnp.where(cols >= c * page_size, scale_ref[page, head], out)
            return out

        def wait_for_new_kv(i):
            """A writer's new K/V rows land before its last tile (which holds them) loads."""
            if write_kv:

                @pl.when(writer & (i + num_stages == n_tiles - 1))
                def _():
                    plgpu.wait_smem_to_gmem(0)

        def make_step(w, masked):
            q_w = q_smem.at[w]
            r0 = w * ROWS  # this consumer's first query row in the block

            def kv_step(i, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(i, jnp.int32(num_stages))
                # the refill's page ids, read before this tile's work (clamped: always in range)
                prefetch = prefetch_page_ids and not warp_specialized  # (else the producer's)
                refill_pages = pages_of(i + num_stages) if prefetch else None
                tile = my_lo + i
                base = tile * bk
                shape = (ROWS, bk)
                vshape = (bk, head_dim)

                if convert_in_producer:  # the producer hands over f16 tiles
                    cslot = lax.rem(i, jnp.int32(conv_stages))
                    plgpu.barrier_wait(kc_full.at[cslot])
                    s = mma(q_w, kc_smem.at[cslot], transpose_b=True)
                    plgpu.barrier_arrive(k_free.at[cslot])
                elif quantized:
                    plgpu.barrier_wait(k_bar.at[slot])
                    kc_smem[...] = load_fp8(k_smem.at[slot]).astype(cdt)
                    plgpu.commit_smem()
                    s = mma(q_w, kc_smem, transpose_b=True)
                else:
                    plgpu.barrier_wait(k_bar.at[slot])
                    s = mma(q_w, k_smem.at[slot], transpose_b=True)  # [64, bk] scores, fp32
                    if warp_specialized:
                        plgpu.barrier_arrive(k_free.at[slot])
                    if early_k:  # the scores are in registers: the K slot is free

                        @pl.when(i + num_stages < n_tiles)
                        def _refill_k():
                            wait_for_new_kv(i)
                            issue_k(i + num_stages, slot, refill_pages)

                if quantized:
                    s = s * col_scales(ks_ref, tile, shape, 0)
                s = _apply_soft_cap(s, soft_cap)
                mask = None  # a tile every row of this consumer sees in full
                if masked:  # rows before `shift` are not queries
                    mask = _causal_mask(iota, shape, row0=r0 - shift, base=base, q_pos0=q_pos0,
                                        kv_len=kv_len, group=group,
                                        sliding_window=sliding_window)  # fmt: skip
                p, acc, m_new, l_i = _online_softmax(s, acc, m_i, l_i, mask)
                if quantized:
                    p = p * col_scales(vs_ref, tile, shape, v_page_offset)
                p16 = p.astype(cdt)

                if convert_in_producer:
                    plgpu.barrier_wait(vc_full.at[cslot])
                    acc = acc + mma(p16, vc_smem.at[cslot])
                    plgpu.barrier_arrive(v_free.at[cslot])
                elif quantized:
                    plgpu.barrier_wait(v_bar.at[slot])
                    vc_smem[...] = convert_v(v_smem.at[slot], base, kv_len)
                    plgpu.commit_smem()
                    acc = acc + mma(p16, vc_smem)
                else:
                    plgpu.barrier_wait(v_bar.at[slot])
                    v_tile = v_smem.at[slot]
                    if masked:

                        @pl.when(base + bk > kv_len)
                        def _zero_tail():  # slots past the sequence may hold anything, NaN included
                            vrow = iota(vshape, 0)
                            v = v_tile[...]
                            v_tile[...] = jnp.where(base + vrow < kv_len, v, jnp.zeros_like(v))
                            plgpu.commit_smem()

                    acc = acc + mma(p16, v_tile)
                    if warp_specialized:
                        plgpu.barrier_arrive(v_free.at[slot])

                if not warp_specialized:

                    @pl.when(i + num_stages < n_tiles)
                    def _refill():
                        wait_for_new_kv(i)
                        if not early_k:
                            issue_k(i + num_stages, slot, refill_pages)
                        issue_v(i + num_stages, slot, refill_pages)

                return acc, m_new, l_i

            return kv_step

        def converting_producer():
            """FP8: convert each landed tile to f16 for the consumer, then refill its fp8 slot."""

            def step(i, carry):
                slot = lax.rem(i, jnp.int32(num_stages))
                cslot = lax.rem(i, jnp.int32(conv_stages))
                base = (my_lo + i) * bk
                plgpu.barrier_wait(k_bar.at[slot])

                @pl.when(i >= conv_stages)
                def _():
                    plgpu.barrier_wait(k_free.at[cslot])

                kc_smem[cslot] = load_fp8(k_smem.at[slot]).astype(cdt)
                plgpu.commit_smem()
                plgpu.barrier_arrive(kc_full.at[cslot])
                plgpu.barrier_wait(v_bar.at[slot])

                @pl.when(i >= conv_stages)
                def _():
                    plgpu.barrier_wait(v_free.at[cslot])

                vc_smem[cslot] = convert_v(v_smem.at[slot], base, kv_len)
                plgpu.commit_smem()
                plgpu.barrier_arrive(vc_full.at[cslot])

                @pl.when(i + num_stages < n_tiles)
                def _():
                    issue_k(i + num_stages, slot)
                    issue_v(i + num_stages, slot)

                return carry

            lax.fori_loop(0, n_tiles, step, 0)

            @pl.loop(jnp.maximum(n_tiles - conv_stages, 0), n_tiles)
            def _drain(i):  # observe the last releases too, so every barrier phase is consumed
                cslot = lax.rem(i, jnp.int32(conv_stages))
                plgpu.barrier_wait(k_free.at[cslot])
                plgpu.barrier_wait(v_free.at[cslot])

        def consumer(w):
            rows = min(ROWS, q_rows - w * ROWS)  # query rows this consumer loads and stores
            q_w, lse_w = q_smem.at[w], lse_smem.at[w]
            if consumers > 1:
                plgpu.set_max_registers(232, action="increase")
            plgpu.copy_gmem_to_smem(
                q_ref.at[head, pl.ds(pl.multiple_of(q_row0 + w * ROWS, 8), rows)],
                q_w.at[pl.ds(0, rows)],
                q_bar.at[w],
            )
            if write_kv:
                pl.when(writer)(load_new_kv)
            if not warp_specialized:
                producer_prologue(defer_last=False if writer is None else writer)
            if write_kv:
                pl.when(writer)(write_new_kv)
            plgpu.barrier_wait(q_bar.at[w])
            acc = cast(jnp.zeros((ROWS, head_dim), jnp.float32), wgmma_layout)
            m_i = cast(jnp.full((ROWS,), NEG, jnp.float32), wgmma_layout.reduce(1))
            l_i = cast(jnp.zeros((ROWS,), jnp.float32), wgmma_layout.reduce(1))
            # Leading tiles that every row of this consumer sees whole skip the masking.
            if sliding_window is None:
                first = lax.div(jnp.maximum(w * ROWS - shift, 0), jnp.int32(group))
                seen = jnp.minimum(q_pos0 + first + 1, kv_len)
                n_full = jnp.clip(lax.div(seen, jnp.int32(bk)) - my_lo, 0, n_tiles)
            else:
                n_full = jnp.int32(0)
            carry = (acc, m_i, l_i)
            carry = lax.fori_loop(0, n_full, make_step(w, masked=False), carry)
            acc, m_i, l_i = lax.fori_loop(n_full, n_tiles, make_step(w, masked=True), carry)

            l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
            out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            if token_major:  # a decode block: its `group` rows are its token's heads, in place
                token = lax.div(q_row0 + shift, jnp.int32(row_stride))
                store_rows(out.astype(cdt), shift, token)
                return
            q_w[...] = out.astype(cdt)  # q is no longer needed: its buffer stages the output
            lse_w[...] = m_i + jnp.log(l_safe) * RCP_LN2
            plgpu.commit_smem()
            dst = pl.ds(w * ROWS, rows)
            plgpu.copy_smem_to_gmem(q_w.at[pl.ds(0, rows)], o_ref.at[split, blk, head, dst])
            if num_splits > 1:  # the log-sum-exp only serves to combine the splits
                plgpu.copy_smem_to_gmem(lse_w.at[pl.ds(0, rows)], lse_ref.at[split, blk, head, dst])
            plgpu.wait_smem_to_gmem(0, wait_read_only=early_exit)

        def load_new_kv():
            """A writer's token's K and V rows (query-layout rows group and group + 1 past its
            first query row) into their own small buffer: one 2-row TMA copy."""
            src = q_ref.at[head, pl.ds(q_row0 + shift + group, 2)]
            plgpu.copy_gmem_to_smem(src, kvn_smem, q_bar.at[consumers])

        def write_new_kv():
            """The token's K and V rows go to its slot in the pages, one TMA store each, straight
            from the buffer they landed in. The last tile (which holds that slot) is loaded only
            after they have landed: now if the prologue deferred it, else the refill waits."""
            plgpu.barrier_wait(q_bar.at[consumers])
            pos = q_pos0
            page = pt_ref[seq, lax.div(pos, jnp.int32(page_size))]
            slot = pl.ds(lax.rem(pos, jnp.int32(page_size)), 1)
            plgpu.copy_smem_to_gmem(kvn_smem.at[pl.ds(0, 1)], k_ref.at[page, slot, head])
            plgpu.copy_smem_to_gmem(kvn_smem.at[pl.ds(1, 1)],
                                    v_ref.at[page + v_page_offset, slot, head])  # fmt: skip

            @pl.when(n_tiles <= num_stages)  # the prologue deferred the last tile
            def _():
                plgpu.wait_smem_to_gmem(0)
                last = n_tiles - 1
                issue_k(last, lax.rem(last, jnp.int32(num_stages)))
                issue_v(last, lax.rem(last, jnp.int32(num_stages)))

        def store_rows(x, first, token):
            """Token-major output: rows [first, first + group) of x [64, D] (cdt) become the
            output rows of `token`'s query heads of this KV head."""
            o_smem[...] = x
            plgpu.commit_smem()
            dst = pl.ds(token * num_q_heads + head * group, group)
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(first, group)], o_ref.at[dst])
            plgpu.wait_smem_to_gmem(0, wait_read_only=early_exit)

        def zero_padding_row():
            """Token-major output: block b also writes the zeros of padding token b (if any)."""
            zero_row = meta_ref[blk, 6]

            @pl.when(zero_row >= 0)
            def _():
                store_rows(cast(jnp.zeros((ROWS, head_dim), cdt), wgmma_layout), 0, zero_row)

        # Blocks without queries (the static grid's bound exceeds the real blocks) do nothing:
        # their outputs are never read.
        if not warp_specialized:
            pl.when(n_valid > 0)(functools.partial(consumer, 0))
            if token_major:
                zero_padding_row()
            return

        wg = lax.axis_index("wg")
        for w in range(consumers):
            pl.when((wg == w) & (n_valid > 0))(functools.partial(consumer, w))
        if token_major:
            pl.when(wg == 0)(zero_padding_row)

        @pl.when((wg == consumers) & (n_valid > 0))
        def _producer():  # keeps num_stages tiles in flight, refilling a slot once it is consumed
            if consumers > 1:
                plgpu.set_max_registers(40, action="decrease")
            producer_prologue()
            if convert_in_producer:
                converting_producer()
                return

            @pl.loop(0, jnp.maximum(n_tiles - num_stages, 0))
            def _(i):
                slot = lax.rem(i, jnp.int32(num_stages))
                pages = pages_of(i + num_stages) if prefetch_page_ids else None
                plgpu.barrier_wait(k_free.at[slot])
                issue_k(i + num_stages, slot, pages)
                plgpu.barrier_wait(v_free.at[slot])
                issue_v(i + num_stages, slot, pages)

            @pl.loop(jnp.maximum(n_tiles - num_stages, 0), n_tiles)
            def _drain(i):  # observe the last releases too, so every barrier phase is consumed
                slot = lax.rem(i, jnp.int32(num_stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

    scratch = [
        swizzled_smem((consumers, ROWS, head_dim), cdt),
        swizzled_smem((num_stages, bk, head_dim), kv_dtype),
        swizzled_smem((num_stages, bk, head_dim), kv_dtype),
        *([swizzled_smem((conv_stages, bk, head_dim), cdt)] * 2 if convert_in_producer else []),
        *(
            [swizzled_smem((bk, head_dim), cdt)] * 2
            if quantized and not convert_in_producer
            else []
        ),
        plgpu.SMEM((consumers, ROWS), jnp.float32),
        plgpu.Barrier(num_barriers=consumers + (1 if write_kv else 0)),  # queries (, new K/V)
        plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
    ]
    frees = dict(num_arrivals=consumers)
    if convert_in_producer:
        scratch += [plgpu.Barrier(num_barriers=conv_stages)] * 2
        scratch += [plgpu.Barrier(num_barriers=conv_stages, **frees)] * 2
    elif warp_specialized:
        scratch += [plgpu.Barrier(num_barriers=num_stages, **frees)] * 2
    if token_major:
        scratch.append(plgpu.SMEM((ROWS, head_dim), cdt))  # o_smem: unswizzled, any row range
    if write_kv:
        scratch.append(plgpu.SMEM((2, head_dim), cdt))  # kvn_smem: the token's new K and V rows
    if token_major:
        out_type = (jax.ShapeDtypeStruct((token_major * num_q_heads, head_dim), cdt),)
    else:
        out_type = (
            jax.ShapeDtypeStruct((num_splits, num_blocks, num_kv_heads, q_rows, head_dim), cdt),
            jax.ShapeDtypeStruct((num_splits, num_blocks, num_kv_heads, q_rows), jnp.float32),
        )
    kwargs = dict(
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_blocks, num_kv_heads, num_splits),
        grid_names=("blk", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    if warp_specialized:
        kwargs.update(num_threads=consumers + 1, thread_name="wg")
    elif consumers != 1:
        raise ValueError("several consumer warpgroups need the warp-specialised pipeline")
    if interpret:
        kwargs["interpret"] = _compat.gpu_interpret_params()
    if write_kv:  # the pages are passed as refs (in place): plgpu.kernel's vmap wrapper drops them
        return _compat.mgpu_ref_kernel(body, **kwargs)
    return plgpu.kernel(body, **kwargs)
