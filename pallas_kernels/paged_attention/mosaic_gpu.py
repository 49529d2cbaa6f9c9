"""Ragged paged attention for Hopper in Mosaic GPU (Pallas): decode, prefill chunks, FP8 K/V.

One kernel serves decode batches, chunked-prefill batches and batches that mix them (the engine's
mixed step): the contract of `PagedAttentionInputs`, whose docstring describes the layout.

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
- Batches with a few new tokens per sequence (speculative verification: gamma + 1) take the
  decode configuration too, as far as a sequence's rows fit one warpgroup (`decode_block_tokens`:
  9 tokens at GQA 4 with the new K/V rows): one block of `max_q_len` tokens per sequence,
  context splits that fill the GPU, and the new K/V written in the kernel. The new tokens may
  straddle two tiles and two splits: each split writes those in its own tiles and defers those
  tiles' loads. (One prefill block per sequence after an XLA scatter, the alternative, made a
  gamma 4 verification on the 8B shape cost 18% over a plain step at batch 1, against 1% so:
  experiments/results/h200/speculative_verify_cost_8b_blocks_ab.json.)
- Mixed batches (prefill chunks and decodes in one step, the engine's mixed step) whose longest
  chunk does not fit a decode block take two launches: sequences with one new token get decode blocks, the others prefill blocks. One launch
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

Pipelines (defaults chosen by measurement: docs/decisions.md):
- bf16 decode: one warpgroup that both issues the TMA copies and computes, 2 stages: 80 KB of
  shared memory, so two programs share an SM and one computes while the other waits (more stages
  or a warp-specialised producer were slower).
- fp8 decode: a producer warpgroup issues the copies *and* converts each landed tile to f16 (Hopper
  has no e4m3 -> bf16 conversion; q and P are f16 on this path), handing f16 tiles to the consumer.
- prefill: two consumer warpgroups (128 query rows) and a producer, 128-key tiles.
Tiles every row of a consumer sees whole skip the masking.

The fp8 path is slower than bf16: the shared-memory fp8 -> f16 round trip, not HBM, is the
limit. Current numbers: docs/kernels.md; variants measured and removed: docs/decisions.md,
"Paged attention kernel".

Reading the kernel
------------------
`ragged_paged_attention_mgpu` lays the queries out, plans the launches (`_plan`, `_query_blocks`)
and gathers or combines their outputs (`_launch`). The kernel itself (`_build_kernel`) is one
program per (query block, KV head, context split), in stages: `_unpack_refs` names the refs,
`_block` reads the block's metadata and its share of tiles, `_issue_k`/`_issue_v` copy a tile's
pages (the first `num_stages` in `_issue_first_tiles`, refills after a tile is consumed),
`_consumer` runs a warpgroup's query rows over the tiles (`_consumer_step`: scores, online softmax,
P @ V), `_producer` (warp-specialised pipelines) keeps the copies in flight and, for fp8,
`_converting_producer` hands f16 tiles over; `_store_split_outputs` / `_store_token_major` write
the outputs, `_load_new_kv` / `_write_new_kv` the step's K/V.

The Pallas Triton backend is not used (deprecated from jax 0.11). On CPU the kernel runs under jax's
GPU interpreter (`interpret=True`), which is how the tests check it against the reference.
"""

from __future__ import annotations

import dataclasses
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
from pallas_kernels.paged_attention.inputs import PagedAttentionInputs
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


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """The kernel's tuning (static, hashable; `engine.attention_options` less `fused_kv_write`).
    None: chosen per launch (defaults measured: the module docstring).

    - `num_splits`: parts each sequence's context is cut into (default: enough to fill the GPU
      for decode, 1 for prefill).
    - `num_stages`: depth of the shared-memory pipeline; `warp_specialized`: a producer
      warpgroup; `block_kv` (64 or 128): keys per tile; `num_consumers`: consumer warpgroups of
      64 query rows each.
    - `split_decode_rows`: in a batch with `max_q_len > 1`, the sequences with exactly one new
      token go through the decode configuration (a second launch; the options above then apply
      to the prefill part only). A batch whose sequences all fit a decode block
      (`decode_block_tokens`) runs in one launch of decode blocks.
    - `token_major_decode`: a decode-only batch (`max_q_len == 1`, no more tokens than
      sequences) with one context split writes its outputs in token order from the kernel
      (False: through the per-block layout and a gather, as other batches).
    """

    num_splits: int | None = None
    num_stages: int | None = None
    warp_specialized: bool | None = None
    block_kv: int | None = None
    num_consumers: int | None = None
    split_decode_rows: bool = True
    token_major_decode: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "block_kv":
                ok, want = type(value) is int and value in (64, 128), "64 or 128"
            elif f.name in ("num_splits", "num_stages", "num_consumers"):
                ok, want = type(value) is int and value >= 1, "an int >= 1"
            else:
                ok, want = type(value) is bool, "a bool"
            if not ok and not (value is None and f.default is None):
                raise ValueError(
                    f"{f.name}={value!r} is invalid: must be {want}"
                    f"{' or None (the default)' if f.default is None else ''}"
                )


DEFAULT_OPTIONS = KernelOptions()


def ragged_paged_attention_mgpu(
    x: PagedAttentionInputs,
    options: KernelOptions | None = None,
    *,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    interpret: bool | None = None,
    device: jax.Device | None = None,
    batch_invariant: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
    """Attention as `PagedAttentionInputs` describes it, tuned by `options` (None: defaults).

    `batch_invariant`: every row, decode or prefill, goes through one launch of prefill-shaped
    blocks with one context split, so a row's reduction order (key tiles from position 0, the
    same tile width and per-tile sums) depends on its own sequence only, never on the batch
    (the decode configuration and the split count are chosen by the batch). Tiles past a row's
    last key are fully masked for it and leave its running max, sum and output unchanged (p is
    exactly 0). Not with a sliding window (a row's first tiles could then be all masked while
    its running max is still the mask value) nor with `new_kv`.

    `interpret` runs the kernel under the GPU interpreter (default: when `device` is not a GPU).
    `device` (static): the device the kernel runs on, for that default and for the SM count the
    default split count fills (None: `jax.devices()[0]`).

    `new_kv` = (k, v), each [T, Hkv, D]: this step's keys (rope applied) and values, which the
    kernel writes into the pages itself (decode-only batches, `fused_kv_write_reason`): token t of
    sequence s goes to slot (seq_lens[s] - 1) of its page, K at `page_table` and V at
    `page_table + v_page_offset`. The pages are updated in place (aliased; donate them), and the
    call returns (out, k_pages, v_pages) (the same array twice when `k_pages is v_pages`).
    Padding tokens write nothing. Without it the caller writes the K/V before the call.
    """
    x.check()
    options = DEFAULT_OPTIONS if options is None else options
    if batch_invariant and (x.sliding_window is not None or new_kv is not None):
        raise ValueError("batch_invariant: the kernel's invariant form takes no sliding window "
                         "and no new_kv")  # fmt: skip
    q, k_pages, v_pages, page_table = x.q, x.k_pages, x.v_pages, x.page_table
    seq_lens, query_start_loc, max_q_len = x.seq_lens, x.query_start_loc, x.max_q_len
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    reason = unsupported_reason(num_q_heads, num_kv_heads, head_dim, page_size, k_pages.dtype)
    if reason is not None:
        raise NotImplementedError(reason)
    if new_kv is not None:
        reason = fused_kv_write_reason(max_q_len, k_pages.dtype, options.warp_specialized,
                                       num_q_heads // num_kv_heads)  # fmt: skip
        if reason is not None:
            raise ValueError(f"new_kv (K/V written by the kernel): {reason}")
        _check_new_kv(new_kv, num_tokens, k_pages.shape)
    group = num_q_heads // num_kv_heads
    quantized = x.k_scales is not None
    scale = float(x.scale)
    interpret = _compat.default_interpret(device) if interpret is None else interpret
    sms = _compat.num_sms(device)
    compute_dtype = jnp.float16 if quantized else jnp.bfloat16  # e4m3 converts only to f16
    # Rows per token in the query layout: its `group` query heads, then (new_kv) its key and value.
    stride = group + 2 if new_kv is not None else group
    geometry = dict(group=group, head_dim=head_dim, quantized=quantized, page_size=page_size,
                    pages_per_seq=pages_per_seq)  # fmt: skip

    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    # few new tokens per sequence (verification): one decode block of max_q_len tokens each
    few = max_q_len <= decode_block_tokens(group, stride)
    if batch_invariant:
        one_split = dataclasses.replace(options, num_splits=1)
        parts = [(_plan(decode=False, **geometry, tuning=one_split), q_lens > 0)]
    elif max_q_len == 1 or few:
        parts = [(_plan(decode=True, **geometry, tuning=options, row_stride=stride,
                        block_tokens=max_q_len), q_lens > 0)]  # fmt: skip
    elif options.split_decode_rows:
        parts = [(_plan(decode=True, **geometry), q_lens == 1),
                 (_plan(decode=False, **geometry, tuning=options), q_lens > 1)]  # fmt: skip
    else:
        parts = [(_plan(decode=False, **geometry, tuning=options), q_lens > 0)]

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
                  soft_cap=x.soft_cap, sliding_window=x.sliding_window,
                  v_page_offset=x.v_page_offset, sms=sms, interpret=interpret)  # fmt: skip
    write_kv = new_kv is not None
    plan0, take0 = parts[0]
    num_seqs = q_lens.shape[0]
    if (plan0.decode and plan0.bq == 1 and len(parts) == 1 and options.token_major_decode
            and num_tokens <= num_seqs and _resolve_splits(plan0, num_seqs, num_kv_heads, sms) == 1):  # fmt: skip
        # One split: the kernel writes each token's rows in place ([T, Hq, D]) and the zeros of
        # the padding tokens, so no gather (an XLA fusion per layer) runs after it.
        meta, _ = _query_blocks(plan0, take0, q_lens, seq_lens, query_start_loc, num_tokens,
                                stride)  # fmt: skip
        b = jnp.arange(num_seqs, dtype=jnp.int32)
        zero_row = jnp.where((b >= query_start_loc[-1]) & (b < num_tokens), b, -1)
        meta = jnp.concatenate([meta, zero_row[:, None]], axis=1)
        out = _launch(plan0, meta, qt, page_table, k_pages, v_pages, x.k_scales, x.v_scales,
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
        ob = _launch(plan, meta, qt, page_table, k_pages, v_pages, x.k_scales, x.v_scales,
                     write_kv=write_kv, **launch)  # fmt: skip
        if write_kv:  # (decode-only: this is the one launch)
            ob, k_pages, v_pages = ob
        ob = ob.astype(q.dtype)
        # ob: [nb, Hkv, q_rows, D]
        # Back to token order with a gather of rows (only the rows of real tokens are read).
        blk = first_blk[tok_seq] + tok_off // plan.bq
        row = meta[blk, 5] + (tok_off % plan.bq) * plan.row_stride
        idx = (blk[:, None, None] * num_kv_heads + heads) * plan.q_rows + row[:, None, None]
        vals = ob.reshape(-1, head_dim)[idx + in_group]  # [T, Hkv, group, D]
        mine = tok_ok & take[tok_seq]
        out = jnp.where(mine[:, None, None, None], vals, out)
    out = out.reshape(num_tokens, num_q_heads, head_dim)
    return (out, k_pages, v_pages) if write_kv else out


def decode_block_tokens(group: int, row_stride: int | None = None) -> int:
    """The most query tokens a decode block holds (its rows, `row_stride` per token and up to 7
    of alignment shift, fill at most one warpgroup's 64): `row_stride` is the GQA `group`, or
    `group + 2` with the new K/V rows (`new_kv`)."""
    stride = group if row_stride is None else row_stride
    return (ROWS - (8 - math.gcd(stride, 8))) // stride


def fused_kv_write_reason(max_q_len: int, kv_dtype, warp_specialized: bool | None = None,
                          group: int = 1) -> str | None:  # fmt: skip
    """Why the kernel cannot write this step's K/V itself (`new_kv`); None when it can: in
    decode blocks, so as many tokens a sequence as a block holds (`decode_block_tokens`)."""
    if group + 2 + 7 > ROWS:
        return f"query groups up to {ROWS - 9} heads per KV head (got {group})"
    most = decode_block_tokens(group, group + 2)
    if max_q_len > most:
        return (f"decode blocks (up to {most} tokens a sequence fit a block at group {group}), "
                f"got max_q_len {max_q_len}")  # fmt: skip
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


def _plan(*, decode, group, head_dim, quantized, page_size, pages_per_seq,
          tuning: KernelOptions = DEFAULT_OPTIONS, row_stride=None,
          block_tokens=1) -> _Plan:  # fmt: skip
    num_consumers, block_kv, num_stages = tuning.num_consumers, tuning.block_kv, tuning.num_stages
    warp_specialized, num_splits = tuning.warp_specialized, tuning.num_splits
    # Decode: one consumer warpgroup, 64-key tiles. Prefill: two consumers (128 query rows)
    # share each K/V tile, 128 keys per tile (64 for fp8, whose f16 copies also need room).
    if num_consumers is None:  # (fp8 at head dim 256 needs the room for its f16 copies)
        one = decode or warp_specialized is False or (quantized and head_dim > 128)
        num_consumers = 1 if one else 2
    if block_kv is None:  # 128-key tiles of head dim 256 would not fit shared memory twice over
        block_kv = 64 if decode or quantized or head_dim > 128 else 128
    # A block's rows are loaded from an 8-aligned row (TMA into 8-row tiles), up to
    # `max_shift` rows before its first query row: room for the shift is part of the block.
    # Tokens are `row_stride` rows apart (group, or group + 2 with the new K/V rows: decode only).
    stride = group if row_stride is None else row_stride
    if stride != group and not decode:
        raise ValueError("rows for new K/V only in decode blocks")
    max_shift = 8 - math.gcd(stride, 8)
    # decode: `block_tokens` tokens per block (1, or verification's few), in one warpgroup
    bq = block_tokens if decode else max(1, (num_consumers * ROWS - max_shift) // group)
    q_rows = -(-(bq * stride + max_shift) // 8) * 8
    if decode and q_rows > ROWS:
        raise ValueError(f"a decode block of {bq} tokens x {stride} rows does not fit {ROWS} rows")
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


def _resolve_splits(plan, num_blocks, num_kv_heads, sms) -> int:
    """Context splits of a launch of `plan` over `num_blocks` query blocks on `sms` SMs."""
    num_splits = plan.num_splits
    if num_splits is None:
        num_splits = default_num_splits(num_blocks * num_kv_heads, plan.max_tiles, sms)
    return max(1, min(int(num_splits), plan.max_tiles))


def _launch(plan, meta, qt, page_table, k_pages, v_pages, k_scales, v_scales, *, num_kv_heads,
            group, kv_dtype, soft_cap, sliding_window, v_page_offset, sms, interpret,
            token_major=0, write_kv=False):  # fmt: skip
    """One kernel launch over `meta`'s blocks; returns [nb, Hkv, q_rows, D] (splits combined), or
    with `token_major` = T (decode blocks, one split) the outputs in token order, [T * Hq, D].
    With `write_kv` the kernel also writes each token's K/V rows (the query layout's rows `group`
    and `group + 1`) into the pages, in place, and this returns (out, k_pages, v_pages)."""
    num_blocks = meta.shape[0]
    head_dim = qt.shape[-1]
    quantized = k_scales is not None
    num_splits = _resolve_splits(plan, num_blocks, num_kv_heads, sms)
    shared_pages = write_kv and k_pages is v_pages
    if token_major and (num_splits != 1 or not plan.decode):
        raise ValueError("token-major outputs need decode blocks and one split")
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
        v_page_offset=v_page_offset,
        token_major=token_major,
        row_stride=plan.row_stride,
        bq=plan.bq,
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


# ---- The kernel: one program per (query block, KV head, context split), in named stages.


class _Launch(NamedTuple):
    """The static shape of one launch (`_build_kernel`'s arguments) and what follows from it."""

    num_blocks: int
    num_kv_heads: int
    num_splits: int
    q_rows: int
    group: int
    head_dim: int
    page_size: int
    num_stages: int
    kv_dtype: jnp.dtype
    quantized: bool
    soft_cap: float | None
    sliding_window: int | None
    warp_specialized: bool
    block_kv: int
    consumers: int
    v_page_offset: int
    token_major: int  # T: decode outputs written in token order, [T * Hq, D]; 0: per block
    row_stride: int
    bq: int  # query tokens per block
    write_kv: bool
    shared_pages: bool  # one pages ref serves K and V
    interpret: bool

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def copies(self) -> int:  # TMA copies (pages) per tile
        return max(1, self.block_kv // self.page_size)

    @property
    def cdt(self):  # Hopper converts e4m3 only to f16 in hardware: FP8 tiles are computed in f16
        return jnp.float16 if self.quantized else jnp.bfloat16

    @property
    def convert_in_producer(self) -> bool:
        """FP8 with a producer warpgroup: it also converts tiles to f16, off the consumer's path."""
        return self.quantized and self.warp_specialized

    @property
    def conv_stages(self) -> int:  # f16 copies of head dim 256 tiles are big
        return 2 if self.head_dim <= 128 else 1


class _Refs(NamedTuple):
    """A program's refs: global memory (inputs, outputs), then shared memory and barriers; None
    where the launch has none (scales and f16 buffers without fp8, `lse` with token-major
    outputs, `o_smem` without them, `kvn_smem` without `write_kv`, the frees and fulls without a
    producer warpgroup)."""

    meta: object  # [nb, 6 (+1: token-major's padding row)] block metadata (`_query_blocks`)
    pt: object  # page table
    ks: object  # fp8 pages' scales, [num_pages, Hkv]: K's, V's
    vs: object
    q: object  # [Hkv, rows, D] queries in the token-major layout
    k: object  # pages, [num_pages, page_size, Hkv, D] (K's and V's: one ref with shared_pages)
    v: object
    o: object
    lse: object
    q_smem: object  # [consumers, 64, D]: queries, later the staged output
    k_smem: object  # [num_stages, bk, D] K/V tiles as copied
    v_smem: object
    kc_smem: object  # f16 copies of fp8 tiles
    vc_smem: object
    lse_smem: object
    o_smem: object  # token-major: unswizzled output stage (rows at any offset)
    kvn_smem: object  # write_kv: the block's query-layout rows from its first token's K row
    q_bar: object  # queries (one per consumer), then the new K/V rows
    k_bar: object  # a tile's copies landed
    v_bar: object
    k_free: object  # a consumer is done with a slot (producer warpgroup)
    v_free: object
    kc_full: object  # an f16 tile is ready (converting producer)
    vc_full: object


class _Block(NamedTuple):
    """What one program works on: the launch, its refs, and the block's scalars."""

    cfg: _Launch
    refs: _Refs
    blk: jax.Array
    head: jax.Array
    split: jax.Array
    seq: jax.Array
    q_pos0: jax.Array  # position of the block's first query
    n_valid: jax.Array  # queries in the block (0: a block past the real ones, which does nothing)
    kv_len: jax.Array
    q_row0: jax.Array  # 8-aligned row of the token-major queries the block loads
    shift: jax.Array  # block row of its first query (row r is token (r - shift) // group)
    my_lo: jax.Array  # this split's first tile
    n_tiles: jax.Array  # and how many it reads
    last_page: jax.Array  # the sequence's last page index (page-table reads are clamped to it)
    writer: jax.Array | None  # write_kv: this program writes new K/V (some lie in its tiles)
    first_new: jax.Array | None  # write_kv: its first local tile holding a new token


def _cast(cfg, x, layout):  # register layouts mean nothing to the GPU interpreter
    return x if cfg.interpret else plgpu.layout_cast(x, layout)


def _iota(cfg, shape, dim):
    return _cast(cfg, lax.broadcasted_iota(jnp.int32, shape, dim), plgpu.Layout.WGMMA)


def _mma(cfg, a, b_ref, **kw):
    return wgmma_dot(a, b_ref, interpret=cfg.interpret, **kw)


def _unpack_refs(cfg: _Launch, refs) -> _Refs:
    """The kernel's refs in the order `_build_kernel` declares them, named."""
    n_in = (9 if cfg.quantized else 7) - (1 if cfg.token_major else 0)
    n_in -= 1 if cfg.shared_pages else 0
    ins, scratch = refs[:n_in], refs[n_in:]
    if cfg.shared_pages:  # the same pages ref for K and V
        k_at = 5 if cfg.quantized else 3
        ins = (*ins[: k_at + 1], ins[k_at], *ins[k_at + 1 :])
    if cfg.token_major:  # no log-sum-exp output
        ins = (*ins, None)
    o_smem = kvn_smem = None
    if cfg.write_kv:
        *scratch, kvn_smem = scratch
    if cfg.token_major:
        *scratch, o_smem = scratch
    if cfg.quantized:
        meta, pt, ks, vs, q, k, v, o, lse = ins
        q_smem, k_smem, v_smem, kc_smem, vc_smem, lse_smem, *bars = scratch
    else:
        meta, pt, q, k, v, o, lse = ins
        q_smem, k_smem, v_smem, lse_smem, *bars = scratch
        ks = vs = kc_smem = vc_smem = None
    q_bar, k_bar, v_bar, *ws_bars = bars
    k_free = v_free = kc_full = vc_full = None
    if cfg.convert_in_producer:
        kc_full, vc_full, k_free, v_free = ws_bars  # the frees guard the f16 buffers
    elif cfg.warp_specialized:
        k_free, v_free = ws_bars
    return _Refs(meta, pt, ks, vs, q, k, v, o, lse, q_smem, k_smem, v_smem, kc_smem, vc_smem,
                 lse_smem, o_smem, kvn_smem, q_bar, k_bar, v_bar, k_free, v_free, kc_full,
                 vc_full)  # fmt: skip


def _block(cfg: _Launch, refs: _Refs) -> _Block:
    """This program's block (its metadata row) and its split's share of the block's tiles."""
    blk = lax.axis_index("blk")
    head = lax.axis_index("head")
    split = lax.axis_index("split")
    meta = refs.meta
    seq = meta[blk, 0]
    q_pos0 = meta[blk, 1]
    n_valid = meta[blk, 2]
    kv_len = meta[blk, 3]
    q_row0 = meta[blk, 4]
    shift = meta[blk, 5]
    bk = cfg.block_kv
    t_lo, t_hi = _kv_tile_range(q_pos0, n_valid, kv_len, bk, cfg.sliding_window)
    # tiles per split: all of the launch's splits share the block's tiles
    per = lax.div(t_hi - t_lo + cfg.num_splits - 1, jnp.int32(cfg.num_splits))
    my_lo = t_lo + split * per
    n_tiles = jnp.maximum(jnp.minimum(t_hi, my_lo + per) - my_lo, 0)
    last_page = jnp.maximum(lax.div(kv_len - 1, jnp.int32(cfg.page_size)), 0)
    # With `write_kv`, the step's new tokens (positions q_pos0 .. q_pos0 + n_valid - 1) sit in
    # the block's last tiles: each split writes those in its own tiles, the only program that
    # reads them, before it loads them.
    writer = first_new = None
    if cfg.write_kv:
        first_new = jnp.maximum(lax.div(q_pos0, jnp.int32(bk)) - my_lo, 0)
        writer = (n_valid > 0) & (first_new < n_tiles)
    return _Block(cfg, refs, blk, head, split, seq, q_pos0, n_valid, kv_len, q_row0, shift, my_lo,
                  n_tiles, last_page, writer, first_new)  # fmt: skip


# ---- K/V copies: a tile is `copies` TMA copies (one per page), into slot `i % num_stages`.


def _page_of(b: _Block, tile, c, offset=0):
    """Page holding copy `c` of `tile` (clamped to the sequence's last page) plus `offset`
    (`v_page_offset` for V's page)."""
    page_size = b.cfg.page_size
    idx = lax.div(tile * b.cfg.block_kv + c * page_size, jnp.int32(page_size))
    page = b.refs.pt[b.seq, jnp.minimum(idx, b.last_page)]
    return page + offset if offset else page


def _pages_of(b: _Block, i):
    """K's page of each copy of local tile `i`, read from the page table."""
    return [_page_of(b, b.my_lo + i, c) for c in range(b.cfg.copies)]


def _issue_k(b: _Block, i, slot):
    pages = _pages_of(b, i)
    for c in range(b.cfg.copies):
        _copy(b, b.refs.k, b.refs.k_smem, b.refs.k_bar, b.my_lo + i, c, slot, pages[c])


def _issue_v(b: _Block, i, slot):
    pages = _pages_of(b, i)
    for c in range(b.cfg.copies):
        _copy(b, b.refs.v, b.refs.v_smem, b.refs.v_bar, b.my_lo + i, c, slot,
              pages[c] + b.cfg.v_page_offset)  # fmt: skip


def _copy(b: _Block, src, dst, bar, tile, c, slot, page):
    bk, page_size, copies = b.cfg.block_kv, b.cfg.page_size, b.cfg.copies
    if page_size > bk:  # a tile is a slice of one page
        off = pl.multiple_of(lax.rem(tile * bk, jnp.int32(page_size)), bk)
        src_ref = src.at[page, pl.ds(off, bk), b.head]
    else:
        src_ref = src.at[page, :, b.head]
    dst_ref = dst.at[slot] if copies == 1 else dst.at[slot, pl.ds(c * page_size, page_size)]
    plgpu.copy_gmem_to_smem(src_ref, dst_ref, bar.at[slot])


def _issue_first_tiles(b: _Block):
    """The pipeline's prologue: the first `num_stages` tiles, less (a writer) those holding new
    tokens, issued once their K/V rows have landed (`_write_new_kv`)."""
    for st in range(b.cfg.num_stages):
        issue = st < b.n_tiles
        if b.cfg.write_kv:
            issue = issue & jnp.logical_not(b.writer & (st >= b.first_new))

        @pl.when(issue)
        def _(st=st):
            _issue_k(b, st, st)
            _issue_v(b, st, st)


def _wait_for_new_kv(b: _Block, i):
    """A writer's new K/V rows land before the first tile holding them loads."""
    if b.cfg.write_kv:

        @pl.when(b.writer & (i + b.cfg.num_stages == b.first_new))
        def _():
            plgpu.wait_smem_to_gmem(0)


# ---- The consumer: a warpgroup's 64 query rows against every tile of the split.


def _col_scales(b: _Block, scale_ref, tile, shape, offset):
    """Per-column dequantization scales of a tile: one scalar per page it spans."""
    cfg = b.cfg
    page = _page_of(b, tile, 0, offset)
    out = _cast(cfg, jnp.full(shape, scale_ref[page, b.head], jnp.float32), plgpu.Layout.WGMMA)
    if cfg.copies > 1:
        cols = _iota(cfg, shape, 1)
        for c in range(1, cfg.copies):
            page = _page_of(b, tile, c, offset)
            out = jnp.where(cols >= c * cfg.page_size, scale_ref[page, b.head], out)
    return out


def _convert_v(b: _Block, v8_ref, base):
    """An fp8 V tile as f16, rows past the sequence zeroed (they may hold NaN)."""
    v = v8_ref[...].astype(b.cfg.cdt)
    row = _iota(b.cfg, (b.cfg.block_kv, b.cfg.head_dim), 0)
    return jnp.where(base + row < b.kv_len, v, jnp.zeros_like(v))


def _tile_scores(b: _Block, q_w, slot, cslot):
    """q_w @ K^T of the tile in `slot` ([64, bk] fp32), K's slot released once read."""
    cfg, r = b.cfg, b.refs
    if cfg.convert_in_producer:  # the producer hands over f16 tiles
        plgpu.barrier_wait(r.kc_full.at[cslot])
        s = _mma(cfg, q_w, r.kc_smem.at[cslot], transpose_b=True)
        plgpu.barrier_arrive(r.k_free.at[cslot])
    elif cfg.quantized:
        plgpu.barrier_wait(r.k_bar.at[slot])
        r.kc_smem[...] = r.k_smem.at[slot][...].astype(cfg.cdt)
        plgpu.commit_smem()
        s = _mma(cfg, q_w, r.kc_smem, transpose_b=True)
    else:
        plgpu.barrier_wait(r.k_bar.at[slot])
        s = _mma(cfg, q_w, r.k_smem.at[slot], transpose_b=True)
        if cfg.warp_specialized:
            plgpu.barrier_arrive(r.k_free.at[slot])
    return s


def _add_pv(b: _Block, acc, p16, slot, cslot, base, masked):
    """acc + P @ V of the tile in `slot`, V's slot released once read. Values past the sequence
    are zeroed first: slots past it may hold anything, NaN included."""
    cfg, r = b.cfg, b.refs
    if cfg.convert_in_producer:
        plgpu.barrier_wait(r.vc_full.at[cslot])
        acc = acc + _mma(cfg, p16, r.vc_smem.at[cslot])
        plgpu.barrier_arrive(r.v_free.at[cslot])
    elif cfg.quantized:
        plgpu.barrier_wait(r.v_bar.at[slot])
        r.vc_smem[...] = _convert_v(b, r.v_smem.at[slot], base)
        plgpu.commit_smem()
        acc = acc + _mma(cfg, p16, r.vc_smem)
    else:
        plgpu.barrier_wait(r.v_bar.at[slot])
        v_tile = r.v_smem.at[slot]
        if masked:

            @pl.when(base + cfg.block_kv > b.kv_len)
            def _zero_tail():
                vrow = _iota(cfg, (cfg.block_kv, cfg.head_dim), 0)
                v = v_tile[...]
                v_tile[...] = jnp.where(base + vrow < b.kv_len, v, jnp.zeros_like(v))
                plgpu.commit_smem()

        acc = acc + _mma(cfg, p16, v_tile)
        if cfg.warp_specialized:
            plgpu.barrier_arrive(r.v_free.at[slot])
    return acc


def _consumer_step(b: _Block, w: int, *, masked: bool):
    """The loop body of consumer `w` over its tiles, (acc, m, l) -> (acc, m, l): scores, online
    softmax, P @ V; without a producer warpgroup it then refills the slot it consumed.
    `masked`: apply the causal / length / window mask (False for tiles every row sees whole)."""
    cfg, r = b.cfg, b.refs
    q_w = r.q_smem.at[w]
    r0 = w * ROWS  # this consumer's first query row in the block
    bk, num_stages = cfg.block_kv, cfg.num_stages

    def kv_step(i, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(i, jnp.int32(num_stages))
        tile = b.my_lo + i
        base = tile * bk
        shape = (ROWS, bk)
        cslot = lax.rem(i, jnp.int32(cfg.conv_stages)) if cfg.convert_in_producer else None
        s = _tile_scores(b, q_w, slot, cslot)
        if cfg.quantized:
            s = s * _col_scales(b, r.ks, tile, shape, 0)
        s = _apply_soft_cap(s, cfg.soft_cap)
        mask = None  # a tile every row of this consumer sees in full
        if masked:  # rows before `shift` are not queries
            mask = _causal_mask(functools.partial(_iota, cfg), shape, row0=r0 - b.shift,
                                base=base, q_pos0=b.q_pos0, kv_len=b.kv_len, group=cfg.row_stride,
                                sliding_window=cfg.sliding_window)  # fmt: skip
        p, acc, m_new, l_i = _online_softmax(s, acc, m_i, l_i, mask)
        if cfg.quantized:
            p = p * _col_scales(b, r.vs, tile, shape, cfg.v_page_offset)
        acc = _add_pv(b, acc, p.astype(cfg.cdt), slot, cslot, base, masked)

        if not cfg.warp_specialized:

            @pl.when(i + num_stages < b.n_tiles)
            def _refill():
                _wait_for_new_kv(b, i)
                _issue_k(b, i + num_stages, slot)
                _issue_v(b, i + num_stages, slot)

        return acc, m_new, l_i

    return kv_step


def _consumer(b: _Block, w: int):
    """Consumer warpgroup `w`: load its query rows (and, a writer, the new K/V rows), start the
    pipeline (without a producer warpgroup), stream the tiles, normalise and store."""
    cfg, r = b.cfg, b.refs
    rows = min(ROWS, cfg.q_rows - w * ROWS)  # query rows this consumer loads and stores
    if cfg.consumers > 1:
        plgpu.set_max_registers(232, action="increase")
    plgpu.copy_gmem_to_smem(
        r.q.at[b.head, pl.ds(pl.multiple_of(b.q_row0 + w * ROWS, 8), rows)],
        r.q_smem.at[w].at[pl.ds(0, rows)],
        r.q_bar.at[w],
    )
    if cfg.write_kv:
        pl.when(b.writer)(functools.partial(_load_new_kv, b))
    if not cfg.warp_specialized:
        _issue_first_tiles(b)
    if cfg.write_kv:
        pl.when(b.writer)(functools.partial(_write_new_kv, b))
    plgpu.barrier_wait(r.q_bar.at[w])
    layout = plgpu.Layout.WGMMA
    acc = _cast(cfg, jnp.zeros((ROWS, cfg.head_dim), jnp.float32), layout)
    m_i = _cast(cfg, jnp.full((ROWS,), NEG, jnp.float32), layout.reduce(1))
    l_i = _cast(cfg, jnp.zeros((ROWS,), jnp.float32), layout.reduce(1))
    # Leading tiles that every row of this consumer sees whole skip the masking.
    if cfg.sliding_window is None:
        first = lax.div(jnp.maximum(w * ROWS - b.shift, 0), jnp.int32(cfg.row_stride))
        seen = jnp.minimum(b.q_pos0 + first + 1, b.kv_len)
        n_full = jnp.clip(lax.div(seen, jnp.int32(cfg.block_kv)) - b.my_lo, 0, b.n_tiles)
    else:
        n_full = jnp.int32(0)
    carry = (acc, m_i, l_i)
    carry = lax.fori_loop(0, n_full, _consumer_step(b, w, masked=False), carry)
    acc, m_i, l_i = lax.fori_loop(n_full, b.n_tiles, _consumer_step(b, w, masked=True), carry)

    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
    out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
    if cfg.token_major:  # a decode block: its `group` rows are its token's heads, in place
        token = lax.div(b.q_row0 + b.shift, jnp.int32(cfg.row_stride))
        _store_token_major(b, out.astype(cfg.cdt), b.shift, token)
    else:
        _store_split_outputs(b, w, rows, out, m_i, l_safe)


# ---- Outputs: per block and split (combined by XLA after the launch), or token-major.


def _store_split_outputs(b: _Block, w: int, rows: int, out, m_i, l_safe):
    """Consumer `w`'s normalised rows (and, with several splits, their log-sum-exp) into this
    split's [block, KV head] outputs."""
    cfg, r = b.cfg, b.refs
    q_w, lse_w = r.q_smem.at[w], r.lse_smem.at[w]
    q_w[...] = out.astype(cfg.cdt)  # q is no longer needed: its buffer stages the output
    lse_w[...] = m_i + jnp.log(l_safe) * RCP_LN2
    plgpu.commit_smem()
    dst = pl.ds(w * ROWS, rows)
    plgpu.copy_smem_to_gmem(q_w.at[pl.ds(0, rows)], r.o.at[b.split, b.blk, b.head, dst])
    if cfg.num_splits > 1:  # the log-sum-exp only serves to combine the splits
        plgpu.copy_smem_to_gmem(lse_w.at[pl.ds(0, rows)], r.lse.at[b.split, b.blk, b.head, dst])
    plgpu.wait_smem_to_gmem(0)


def _store_token_major(b: _Block, x, first, token):
    """Token-major output: rows [first, first + group) of x [64, D] (cdt) become the output rows
    of `token`'s query heads of this KV head."""
    cfg, r = b.cfg, b.refs
    r.o_smem[...] = x
    plgpu.commit_smem()
    dst = pl.ds(token * cfg.num_q_heads + b.head * cfg.group, cfg.group)
    plgpu.copy_smem_to_gmem(r.o_smem.at[pl.ds(first, cfg.group)], r.o.at[dst])
    plgpu.wait_smem_to_gmem(0)


def _zero_padding_row(b: _Block):
    """Token-major output: block b also writes the zeros of padding token b (if any)."""
    zero_row = b.refs.meta[b.blk, 6]

    @pl.when(zero_row >= 0)
    def _():
        zeros = _cast(b.cfg, jnp.zeros((ROWS, b.cfg.head_dim), b.cfg.cdt), plgpu.Layout.WGMMA)
        _store_token_major(b, zeros, 0, zero_row)


# ---- The step's new K/V (write_kv): written by the kernel before it loads the tile holding them.


def _new_kv_rows(cfg: _Launch) -> int:
    """Rows of the query layout from a block's first K row to its last token's V row: token j's
    K and V are rows j * row_stride and j * row_stride + 1 of them."""
    return (cfg.bq - 1) * cfg.row_stride + 2


def _load_new_kv(b: _Block):
    """A writer's new K and V rows (from query-layout row `group` past its first query row,
    queries between) into their own small buffer: one TMA copy."""
    r = b.refs
    src = r.q.at[b.head, pl.ds(b.q_row0 + b.shift + b.cfg.group, _new_kv_rows(b.cfg))]
    plgpu.copy_gmem_to_smem(src, r.kvn_smem, r.q_bar.at[b.cfg.consumers])


def _write_new_kv(b: _Block):
    """The new tokens in this split's tiles: K and V rows to their slots in the pages, one TMA
    store each, straight from the buffer they landed in. The tiles holding them are loaded only
    after they have landed: now for those the prologue deferred, else the refill waits
    (`_wait_for_new_kv`)."""
    cfg, r = b.cfg, b.refs
    plgpu.barrier_wait(r.q_bar.at[cfg.consumers])
    page_size = jnp.int32(cfg.page_size)
    for j in range(cfg.bq):
        pos = b.q_pos0 + j
        tile = lax.div(pos, jnp.int32(cfg.block_kv))

        @pl.when((j < b.n_valid) & (tile >= b.my_lo) & (tile < b.my_lo + b.n_tiles))
        def _(j=j, pos=pos):
            page = r.pt[b.seq, lax.div(pos, page_size)]
            slot = pl.ds(lax.rem(pos, page_size), 1)
            row = j * cfg.row_stride
            plgpu.copy_smem_to_gmem(r.kvn_smem.at[pl.ds(row, 1)], r.k.at[page, slot, b.head])
            plgpu.copy_smem_to_gmem(r.kvn_smem.at[pl.ds(row + 1, 1)],
                                    r.v.at[page + cfg.v_page_offset, slot, b.head])  # fmt: skip

    @pl.when(b.first_new < cfg.num_stages)  # the prologue deferred tiles
    def _():
        plgpu.wait_smem_to_gmem(0)
        for st in range(cfg.num_stages):

            @pl.when((st >= b.first_new) & (st < b.n_tiles))
            def _(st=st):
                _issue_k(b, st, st)
                _issue_v(b, st, st)


# ---- The producer warpgroup (warp-specialised pipelines).


def _producer(b: _Block):
    """Keeps `num_stages` tiles in flight, refilling a slot once every consumer released it."""
    cfg, r = b.cfg, b.refs
    num_stages = cfg.num_stages
    if cfg.consumers > 1:
        plgpu.set_max_registers(40, action="decrease")
    _issue_first_tiles(b)
    if cfg.convert_in_producer:
        _converting_producer(b)
        return

    @pl.loop(0, jnp.maximum(b.n_tiles - num_stages, 0))
    def _(i):
        slot = lax.rem(i, jnp.int32(num_stages))
        plgpu.barrier_wait(r.k_free.at[slot])
        _issue_k(b, i + num_stages, slot)
        plgpu.barrier_wait(r.v_free.at[slot])
        _issue_v(b, i + num_stages, slot)

    @pl.loop(jnp.maximum(b.n_tiles - num_stages, 0), b.n_tiles)
    def _drain(i):  # observe the last releases too, so every barrier phase is consumed
        slot = lax.rem(i, jnp.int32(num_stages))
        plgpu.barrier_wait(r.k_free.at[slot])
        plgpu.barrier_wait(r.v_free.at[slot])


def _converting_producer(b: _Block):
    """FP8: convert each landed tile to f16 for the consumer, then refill its fp8 slot."""
    cfg, r = b.cfg, b.refs
    num_stages, conv_stages = cfg.num_stages, cfg.conv_stages

    def step(i, carry):
        slot = lax.rem(i, jnp.int32(num_stages))
        cslot = lax.rem(i, jnp.int32(conv_stages))
        base = (b.my_lo + i) * cfg.block_kv
        plgpu.barrier_wait(r.k_bar.at[slot])

        @pl.when(i >= conv_stages)
        def _():
            plgpu.barrier_wait(r.k_free.at[cslot])

        r.kc_smem[cslot] = r.k_smem.at[slot][...].astype(cfg.cdt)
        plgpu.commit_smem()
        plgpu.barrier_arrive(r.kc_full.at[cslot])
        plgpu.barrier_wait(r.v_bar.at[slot])

        @pl.when(i >= conv_stages)
        def _():
            plgpu.barrier_wait(r.v_free.at[cslot])

        r.vc_smem[cslot] = _convert_v(b, r.v_smem.at[slot], base)
        plgpu.commit_smem()
        plgpu.barrier_arrive(r.vc_full.at[cslot])

        @pl.when(i + num_stages < b.n_tiles)
        def _():
            _issue_k(b, i + num_stages, slot)
            _issue_v(b, i + num_stages, slot)

        return carry

    lax.fori_loop(0, b.n_tiles, step, 0)

    @pl.loop(jnp.maximum(b.n_tiles - conv_stages, 0), b.n_tiles)
    def _drain(i):  # observe the last releases too, so every barrier phase is consumed
        cslot = lax.rem(i, jnp.int32(conv_stages))
        plgpu.barrier_wait(r.k_free.at[cslot])
        plgpu.barrier_wait(r.v_free.at[cslot])


# ---- The launch: refs, scratch, grid.


def _program(b: _Block):
    """One program. Blocks without queries (the static grid's bound exceeds the real blocks) do
    nothing: their outputs are never read."""
    cfg = b.cfg
    if not cfg.warp_specialized:
        pl.when(b.n_valid > 0)(functools.partial(_consumer, b, 0))
        if cfg.token_major:
            _zero_padding_row(b)
        return
    wg = lax.axis_index("wg")
    for w in range(cfg.consumers):
        pl.when((wg == w) & (b.n_valid > 0))(functools.partial(_consumer, b, w))
    if cfg.token_major:
        pl.when(wg == 0)(functools.partial(_zero_padding_row, b))
    pl.when((wg == cfg.consumers) & (b.n_valid > 0))(functools.partial(_producer, b))


def _scratch_types(cfg: _Launch) -> list:
    """Shared memory and barriers, in the order `_unpack_refs` names them."""
    bk, head_dim, cdt = cfg.block_kv, cfg.head_dim, cfg.cdt
    consumers, num_stages, conv_stages = cfg.consumers, cfg.num_stages, cfg.conv_stages
    convert = cfg.convert_in_producer
    scratch = [
        swizzled_smem((consumers, ROWS, head_dim), cdt),
        swizzled_smem((num_stages, bk, head_dim), cfg.kv_dtype),
        swizzled_smem((num_stages, bk, head_dim), cfg.kv_dtype),
        *([swizzled_smem((conv_stages, bk, head_dim), cdt)] * 2 if convert else []),
        *([swizzled_smem((bk, head_dim), cdt)] * 2 if cfg.quantized and not convert else []),
        plgpu.SMEM((consumers, ROWS), jnp.float32),
        plgpu.Barrier(num_barriers=consumers + (1 if cfg.write_kv else 0)),  # queries (, new K/V)
        plgpu.Barrier(num_arrivals=cfg.copies, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=cfg.copies, num_barriers=num_stages),
    ]
    frees = dict(num_arrivals=consumers)
    if convert:
        scratch += [plgpu.Barrier(num_barriers=conv_stages)] * 2
        scratch += [plgpu.Barrier(num_barriers=conv_stages, **frees)] * 2
    elif cfg.warp_specialized:
        scratch += [plgpu.Barrier(num_barriers=num_stages, **frees)] * 2
    if cfg.token_major:
        scratch.append(plgpu.SMEM((ROWS, head_dim), cdt))  # o_smem: unswizzled, any row range
    if cfg.write_kv:
        scratch.append(plgpu.SMEM((_new_kv_rows(cfg), head_dim), cdt))  # kvn_smem
    return scratch


def _out_types(cfg: _Launch) -> tuple:
    if cfg.token_major:
        return (jax.ShapeDtypeStruct((cfg.token_major * cfg.num_q_heads, cfg.head_dim), cfg.cdt),)
    blocks = (cfg.num_splits, cfg.num_blocks, cfg.num_kv_heads, cfg.q_rows)
    return (jax.ShapeDtypeStruct((*blocks, cfg.head_dim), cfg.cdt),
            jax.ShapeDtypeStruct(blocks, jnp.float32))  # fmt: skip


@functools.cache
def _build_kernel(**launch):
    """The kernel of one launch (`_Launch`'s fields as keywords), cached per shape."""
    cfg = _Launch(**launch)
    if cfg.write_kv and (cfg.warp_specialized or cfg.quantized or cfg.consumers != 1):
        raise ValueError("the kernel writes new K/V only in the single-warpgroup bf16 decode")

    def body(*refs):
        _program(_block(cfg, _unpack_refs(cfg, refs)))

    kwargs = dict(
        out_type=_out_types(cfg),
        scratch_types=_scratch_types(cfg),
        grid=(cfg.num_blocks, cfg.num_kv_heads, cfg.num_splits),
        grid_names=("blk", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    if cfg.warp_specialized:
        kwargs.update(num_threads=cfg.consumers + 1, thread_name="wg")
    elif cfg.consumers != 1:
        raise ValueError("several consumer warpgroups need the warp-specialised pipeline")
    if cfg.interpret:
        kwargs["interpret"] = _compat.gpu_interpret_params()
    if cfg.write_kv:  # the pages are refs (in place): plgpu.kernel's vmap wrapper would drop them
        return _compat.mgpu_ref_kernel(body, **kwargs)
    return plgpu.kernel(body, **kwargs)
