"""cuDNN's paged attention through jax's private API: an ablation baseline, decode only.

jax exposes cuDNN's paged flash attention as `jax._src.cudnn.fused_attention_stablehlo.
paged_attention` (private; same signature in jax 0.10.2 and 0.11). Its layout:

- `query`: [B, T, Hq, D] ("BTNH"); here T = 1 (one decode token per sequence).
- `key`, `value`: [num_blocks, block_size, Hkv, D] -- the same memory layout as our page pools,
  so the pools are used as they are. jax requires num_blocks == B * blocks_per_seq exactly.
- `page_table_k`, `page_table_v`: [B, 1, blocks_per_seq, 1] int32.
- `q_seqlen`, `kv_seqlen`: [B] int32; the padding mask keeps keys [0, kv_seqlen).

`to_cudnn_layout` converts our ragged layout (`PagedAttentionInputs`); what it costs per call:

- q: gather each sequence's one query row into [S', 1, Hq, D] (S' * Hq * D elements; negligible).
- page table: reshape (free) plus, when the pool size is not S * pages_per_seq, padding with extra
  columns and/or dummy sequences until S' * pages_per_seq' == num_pages (tiny int arrays; dummy
  sequences read one key of page 0 and are dropped).
- pools: zero-copy whenever num_pages has a divisor d >= pages_per_seq with num_pages / d >= S.
  Otherwise (e.g. a prime pool size smaller than S * pages_per_seq) both pools are padded with
  zero pages: a full copy of K and V on every call, which would dominate a decode step. Size the
  pool as a multiple of pages_per_seq to avoid it.
- output: scatter S rows back to [T, Hq, D] (negligible).

Benchmarks must time `cudnn_paged_decode` on inputs already converted by `to_cudnn_layout`.

Not supported (each raises NotImplementedError naming it): no NVIDIA GPU, the private API absent,
`max_q_len != 1`, `soft_cap`, `sliding_window` (jax's window is measured from the query's index in
its own T-long query block, not from the end of the context, so it does not express a decode
window), FP8 pages or scales (jax raises "Paged attention doesn't support fp8 for now").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.inputs import PagedAttentionInputs

_API = "jax._src.cudnn.fused_attention_stablehlo.paged_attention"


class CudnnPagedInputs(NamedTuple):
    """Operands of `cudnn_paged_decode`, already in cuDNN's layout."""

    q: jax.Array  # [B, 1, Hq, D], pages' dtype
    k_pages: jax.Array  # [B * blocks_per_seq, block_size, Hkv, D]
    v_pages: jax.Array
    page_table: jax.Array  # [B, 1, blocks_per_seq, 1] int32
    q_seqlen: jax.Array  # [B] int32
    kv_seqlen: jax.Array  # [B] int32


def _cudnn_api():
    """jax's cuDNN paged attention and its mask enum, or NotImplementedError saying what is missing."""
    if jax.default_backend() != "gpu":
        raise NotImplementedError(
            f"cuDNN paged attention needs an NVIDIA GPU; jax's default backend is "
            f"{jax.default_backend()!r}"
        )
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError as e:
        raise NotImplementedError(f"{_API} is absent in jax {jax.__version__}: {e}") from e
    if not hasattr(fa, "paged_attention") or not hasattr(fa, "MaskType"):
        raise NotImplementedError(f"{_API} is absent in jax {jax.__version__}")
    try:
        fa.check_cudnn_version()
    except RuntimeError as e:  # raised when jaxlib finds no cuDNN
        raise NotImplementedError(f"cuDNN paged attention: {e}") from e
    return fa.paged_attention, fa.MaskType


def check_supported(
    *,
    max_q_len: int,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    kv_dtype=None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> None:
    """Raise NotImplementedError naming the first unsupported feature (checks the GPU/API too)."""
    if max_q_len != 1:
        raise NotImplementedError(
            f"cuDNN paged attention here is decode-only; max_q_len={max_q_len}"
        )
    if soft_cap is not None:
        raise NotImplementedError("cuDNN paged attention has no logit soft cap")
    if sliding_window is not None:
        raise NotImplementedError(
            "cuDNN paged attention: sliding_window not supported (jax's window is aligned to the "
            "query block, not to the end of a decode sequence's context)"
        )
    fp8 = kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1
    if fp8 or k_scales is not None or v_scales is not None:
        raise NotImplementedError("cuDNN paged attention through jax has no FP8 K/V path")
    _cudnn_api()


def _factor_pool(num_pages: int, num_seqs: int, pages_per_seq: int) -> tuple[int, int] | None:
    """(S', pages_per_seq') with S' >= num_seqs, pages_per_seq' >= pages_per_seq and
    S' * pages_per_seq' == num_pages, preferring the shortest page-table rows; None if none."""
    for cols in range(pages_per_seq, num_pages // max(num_seqs, 1) + 1):
        if num_pages % cols == 0:
            return num_pages // cols, cols
    return None


def to_cudnn_layout(x: PagedAttentionInputs) -> CudnnPagedInputs:
    """Our decode-only ragged layout -> cuDNN's (see the module docstring for what it costs).

    Sequences with no query token and dummy sequences get kv_seqlen >= 1 (one real key, never a
    fully masked row) and their output rows are dropped by `from_cudnn_output`.
    """
    q, k_pages, v_pages, page_table = x.q, x.k_pages, x.v_pages, x.page_table
    num_pages = k_pages.shape[0]
    num_seqs, pages_per_seq = page_table.shape
    factors = _factor_pool(num_pages, num_seqs, pages_per_seq)
    if factors is None:  # pad the pools: a full copy of K and V (see docstring)
        cols = pages_per_seq
        rows = max(num_seqs, -(-num_pages // cols))
        pad = ((0, rows * cols - num_pages), (0, 0), (0, 0), (0, 0))
        k_pages, v_pages = jnp.pad(k_pages, pad), jnp.pad(v_pages, pad)
    else:
        rows, cols = factors
    table = jnp.zeros((rows, cols), jnp.int32).at[:num_seqs, :pages_per_seq].set(page_table)
    kv_len = jnp.ones((rows,), jnp.int32).at[:num_seqs].set(jnp.maximum(x.seq_lens, 1))
    num_tokens = q.shape[0]
    q_rows = jnp.clip(x.query_start_loc[:-1], 0, num_tokens - 1)
    q_seq = (
        jnp.zeros((rows, *q.shape[1:]), k_pages.dtype)
        .at[:num_seqs]
        .set(q[q_rows].astype(k_pages.dtype))
    )
    return CudnnPagedInputs(
        q=q_seq[:, None],
        k_pages=k_pages,
        v_pages=v_pages,
        page_table=table[:, None, :, None],
        q_seqlen=jnp.ones((rows,), jnp.int32),
        kv_seqlen=kv_len,
    )


def from_cudnn_output(
    out: jax.Array, query_start_loc: jax.Array, num_tokens: int, dtype
) -> jax.Array:
    """[S', 1, Hq, D] -> [T, Hq, D]; rows of sequences without a query token stay zero."""
    num_seqs = query_start_loc.shape[0] - 1
    rows = query_start_loc[:-1]
    has_q = query_start_loc[1:] > rows
    dest = jnp.where(has_q, rows, num_tokens)
    result = jnp.zeros((num_tokens, *out.shape[2:]), dtype)
    return result.at[dest].set(out[:num_seqs, 0].astype(dtype), mode="drop")


def cudnn_paged_decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    q_seqlen: jax.Array,
    kv_seqlen: jax.Array,
    *,
    sm_scale: float | None = None,
    v_page_offset: int = 0,
) -> jax.Array:
    """cuDNN's paged attention call alone, on operands in its layout (`CudnnPagedInputs`).

    V's page table is K's plus `v_page_offset` (K and V in one pool: `PagedAttentionInputs`).
    Returns [B, 1, Hq, D] in q.dtype. This is what a benchmark should time.
    """
    paged_attention, mask_type = _cudnn_api()
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return paged_attention(
        q,
        k_pages,
        v_pages,
        q_seqlen,
        kv_seqlen,
        page_table,
        page_table + v_page_offset if v_page_offset else page_table,
        scale=scale,
        mask_type=mask_type.PADDING,
        qkv_layout="BTNH",
    )


def cudnn_paged_attention(x: PagedAttentionInputs) -> jax.Array:
    """Attention as `PagedAttentionInputs` describes it, via cuDNN.

    Decode-only (`max_q_len == 1`), bf16/f16 pages; q is cast to the pages' dtype and the result
    back to q.dtype. Raises NotImplementedError for anything else (see the module docstring).
    """
    x.check()
    check_supported(max_q_len=x.max_q_len, soft_cap=x.soft_cap, sliding_window=x.sliding_window,
                    kv_dtype=x.k_pages.dtype, k_scales=x.k_scales, v_scales=x.v_scales)  # fmt: skip
    out = cudnn_paged_decode(*to_cudnn_layout(x), sm_scale=x.sm_scale,
                             v_page_offset=x.v_page_offset)  # fmt: skip
    return from_cudnn_output(out, x.query_start_loc, x.q.shape[0], x.q.dtype)
