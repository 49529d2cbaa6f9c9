"""The inputs of ragged paged attention: one pytree that every backend takes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.fp8 import FP8_DTYPE

_STATIC = dict(static=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedAttentionInputs:
    """Causal GQA attention of each sequence's new tokens over its paged context: the layout and
    contract every backend (`reference`, `invariant`, `mosaic_gpu`, `cudnn`) shares.

    Arrays (the pytree's leaves):

    - `q`: [T, Hq, D] query tokens of all sequences, flattened; sequence `s` owns rows
      `query_start_loc[s]:query_start_loc[s+1]`. Rows past `query_start_loc[-1]` are padding.
    - `k_pages`, `v_pages`: [num_pages, page_size, Hkv, D] page pools (one layer's); Hq is a
      multiple of Hkv.
    - `page_table`: [S, pages_per_seq] int32 page ids; entry `j` of row `s` holds keys
      `j*page_size .. (j+1)*page_size - 1` of sequence `s`.
    - `seq_lens`: [S] int32 context length *including* this step's new tokens, which are the last
      `q_len` positions of the sequence. A prefill chunk and a decode token are the same thing
      with different `q_len`, so one call handles a batch mixing both.
    - `query_start_loc`: [S + 1] int32 row offsets of the sequences' tokens in `q`.
    - `k_scales`, `v_scales` (FP8 pages only, else None): [num_pages, Hkv] float32; a page's value
      is `float32(page) * scale[page, head]` (see `fp8.py`). Only gathered pages are dequantized.

    Static fields (the treedef's: hashable, a jit argument's compile key):

    - `max_q_len`: bounds the new tokens of any one sequence (1: a decode-only batch).
    - `sm_scale`: the scores' scale (None: D ** -0.5); `soft_cap`: `cap * tanh(s / cap)` on the
      scores (None: none); `sliding_window`: a query at position p sees keys > p - window (None:
      all up to p).
    - `v_page_offset`: V's page for a table entry `p` is `p + v_page_offset` (K's is `p`), so K
      and V may share one pool: the model's cache keeps a page's K and V side by side and passes
      the same pool twice with offset 1 (`jaxinfer.kv.cache`). Scales follow the same ids.

    Result: [T, Hq, D] in q.dtype; padding rows are zero; softmax and accumulation in fp32.
    Isolation: keys at positions >= seq_len are never used, so pages a sequence does not own (or
    poisoned padding) cannot reach its output, not even as NaN * 0.
    """

    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    _: dataclasses.KW_ONLY
    max_q_len: int = dataclasses.field(metadata=_STATIC)
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None
    sm_scale: float | None = dataclasses.field(default=None, metadata=_STATIC)
    soft_cap: float | None = dataclasses.field(default=None, metadata=_STATIC)
    sliding_window: int | None = dataclasses.field(default=None, metadata=_STATIC)
    v_page_offset: int = dataclasses.field(default=0, metadata=_STATIC)

    @property
    def scale(self) -> float:
        """The scores' scale: `sm_scale`, or D ** -0.5."""
        return self.q.shape[-1] ** -0.5 if self.sm_scale is None else self.sm_scale

    def check(self) -> None:
        """Raise ValueError naming the first input that breaks the layout above."""
        _, num_q_heads, head_dim = self.q.shape
        num_pages, _, num_kv_heads, d_k = self.k_pages.shape
        k, v = self.k_pages, self.v_pages
        if v.shape != k.shape or v.dtype != k.dtype:
            raise ValueError(f"v_pages {v.shape} {v.dtype} must match k_pages {k.shape} {k.dtype}")
        if d_k != head_dim:
            raise ValueError(f"head dim of q ({head_dim}) and k_pages ({d_k}) differ")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"q heads ({num_q_heads}) not a multiple of kv heads ({num_kv_heads})")
        table, lens, qsl = self.page_table, self.seq_lens, self.query_start_loc
        if table.ndim != 2 or lens.shape != (table.shape[0],):
            raise ValueError(f"page_table {table.shape} / seq_lens {lens.shape} mismatch")
        if qsl.shape != (table.shape[0] + 1,):
            raise ValueError(f"query_start_loc {qsl.shape} must be [num_seqs + 1]")
        ks, vs = self.k_scales, self.v_scales
        quantized = jnp.dtype(k.dtype) == FP8_DTYPE
        if quantized != (ks is not None) or (ks is None) != (vs is None):
            raise ValueError("k_scales and v_scales are required exactly when the pages are fp8 "
                             f"(pages are {k.dtype})")  # fmt: skip
        want = (num_pages, num_kv_heads)
        if quantized and (ks.shape != want or vs.shape != want):
            raise ValueError(f"k_scales {ks.shape} / v_scales {vs.shape} must be [num_pages, Hkv] "
                             f"= {want}")  # fmt: skip
        if not isinstance(self.v_page_offset, int) or self.v_page_offset < 0:
            raise ValueError(f"v_page_offset must be a static int >= 0, got {self.v_page_offset!r}")
