"""cuDNN paged attention wrapper: our layout -> cuDNN's and back, and the unsupported-feature guard.

cuDNN itself needs a GPU; on the CPU its call is replaced by a jnp emulation of what jax documents
for `paged_attention` (page_table [B, 1, blocks, 1] into [num_blocks, block, Hkv, D] pools, padding
mask from kv_seqlen), so the layout conversion is checked against the reference everywhere.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import PagedAttentionInputs, cudnn, ragged_paged_attention


def emulated_cudnn(inputs: cudnn.CudnnPagedInputs, sm_scale: float) -> jax.Array:
    q, k_pages, v_pages, table, _, kv_len = inputs
    batch, _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    assert k_pages.shape[0] == table.shape[0] * table.shape[2]  # what jax checks
    k = k_pages[table[:, 0, :, 0]].reshape(batch, -1, num_kv_heads, head_dim).astype(jnp.float32)
    v = v_pages[table[:, 0, :, 0]].reshape(batch, -1, num_kv_heads, head_dim).astype(jnp.float32)
    qg = q[:, 0].astype(jnp.float32).reshape(batch, num_kv_heads, -1, head_dim)
    s = jnp.einsum("bhgd,bkhd->bhgk", qg, k) * sm_scale
    valid = jnp.arange(k.shape[1])[None, :] < kv_len[:, None]  # [B, S]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    v = jnp.where(valid[:, :, None, None], v, 0.0)  # unowned slots hold NaN
    out = jnp.einsum("bhgk,bkhd->bhgd", jax.nn.softmax(s, axis=-1), v)
    return out.reshape(batch, 1, num_q_heads, head_dim).astype(q.dtype)


def decode_batch(rng, ctx_lens, num_pages, *, page_size=16, num_kv_heads=2, group=4, head_dim=32):
    """Decode batch in our layout (`PagedAttentionInputs`): sequence s has ctx_lens[s] tokens (incl.
    the new one; 0 means a slot with no query token). Pages are shuffled; unused pages and key
    slots hold NaN."""
    needed = [-(-n // page_size) for n in ctx_lens]
    pages_per_seq = max(needed) + 1
    assert sum(needed) < num_pages
    perm = rng.permutation(np.arange(1, num_pages))
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    table = np.zeros((len(ctx_lens), pages_per_seq), np.int32)
    used = 0
    for s, n in enumerate(ctx_lens):
        ids = perm[used : used + needed[s]]
        used += needed[s]
        table[s, : needed[s]] = ids
        for pool in (k, v):
            x = np.full((needed[s] * page_size, num_kv_heads, head_dim), np.nan, np.float32)
            x[:n] = rng.standard_normal((n, num_kv_heads, head_dim))
            pool[ids] = x.reshape(needed[s], page_size, num_kv_heads, head_dim)
    q_lens = [int(n > 0) for n in ctx_lens]
    q = rng.standard_normal((sum(q_lens) + 2, num_kv_heads * group, head_dim))
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    return PagedAttentionInputs(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16),
        jnp.asarray(table), jnp.asarray(ctx_lens, jnp.int32), jnp.asarray(qsl, jnp.int32),
        max_q_len=1,
    )  # fmt: skip


@pytest.mark.parametrize(
    "num_pages",
    [
        4 * 5,  # exactly S x pages_per_seq: pools used as they are
        4 * 7,  # longer page-table rows
        5 * 5 + 5,  # dummy sequences
        31,  # prime: pools padded (a copy)
    ],
)
def test_cudnn_layout_conversion_matches_reference(num_pages):
    rng = np.random.default_rng(num_pages)
    ctx_lens = [37, 1, 0, 64]  # slot 2 has no query token; 64 tokens fill 4 pages exactly
    x = decode_batch(rng, ctx_lens, num_pages)
    inputs = cudnn.to_cudnn_layout(x)
    rows, _, cols, _ = inputs.page_table.shape
    assert rows >= len(ctx_lens) and cols >= x.page_table.shape[1]
    assert inputs.k_pages.shape[0] == rows * cols
    if num_pages != 31:
        assert inputs.k_pages is x.k_pages  # no copy of the pools
    out = emulated_cudnn(inputs, x.q.shape[-1] ** -0.5)
    got = cudnn.from_cudnn_output(out, x.query_start_loc, x.q.shape[0], jnp.float32)
    want = ragged_paged_attention(dataclasses.replace(x, q=x.q.astype(jnp.float32)))
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(max_q_len=4), "max_q_len"),
        (dict(max_q_len=1, soft_cap=30.0), "soft cap"),
        (dict(max_q_len=1, sliding_window=128), "sliding_window"),
        (dict(max_q_len=1, kv_dtype=jnp.float8_e4m3fn), "FP8"),
        (dict(max_q_len=1, k_scales=jnp.ones((4, 2)), v_scales=jnp.ones((4, 2))), "FP8"),
    ],
)
def test_unsupported_features_raise_not_implemented_naming_them(kwargs, named):
    with pytest.raises(NotImplementedError, match=named):
        cudnn.check_supported(**kwargs)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the no-GPU message")
def test_without_gpu_the_backend_says_it_needs_one():
    x = decode_batch(np.random.default_rng(0), [5, 9], 8)
    with pytest.raises(NotImplementedError, match="GPU"):
        cudnn.cudnn_paged_attention(x)


@pytest.mark.gpu
@pytest.mark.parametrize("num_pages", [4 * 5, 31])
def test_cudnn_paged_attention_matches_reference_on_gpu(num_pages):
    rng = np.random.default_rng(1)
    x = decode_batch(rng, [37, 1, 0, 64], num_pages, head_dim=128)
    got = jax.jit(cudnn.cudnn_paged_attention)(x)
    want = ragged_paged_attention(dataclasses.replace(x, q=x.q.astype(jnp.float32)))
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)
