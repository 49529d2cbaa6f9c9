"""The pure-JAX ragged paged attention against a per-sequence numpy loop on contiguous K/V."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kv.cache import SCRATCH_PAGE, KVCache, PageTable, token_slots, write_kv
from pallas_kernels.paged_attention import PagedAttentionInputs, ragged_paged_attention


def make_case(rng, *, q_lens, ctx_lens, page_size, num_kv_heads, group, head_dim, pad_tokens=3):
    """Random ragged batch: sequence s has ctx_lens[s] cached tokens and q_lens[s] new ones.

    Pages are handed out in a shuffled order; every page no sequence owns (scratch included) and
    every padding query row is filled with NaN.
    """
    num_seqs = len(q_lens)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    pages_needed = [math.ceil(n / page_size) for n in seq_lens]
    pages_per_seq = max(pages_needed) + 1  # a spare column that must stay unread
    num_pages = sum(pages_needed) + 4
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.full((num_seqs + 1, pages_per_seq), SCRATCH_PAGE, np.int32)  # +1 padding slot
    k_pages = np.full((num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    k_seqs, v_seqs, used = [], [], 0
    for s, n in enumerate(seq_lens):
        table[s, : pages_needed[s]] = perm[used : used + pages_needed[s]]
        used += pages_needed[s]
        k = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        for pos in range(n):
            page = table[s, pos // page_size]
            k_pages[page, pos % page_size], v_pages[page, pos % page_size] = k[pos], v[pos]
        k_seqs.append(k)
        v_seqs.append(v)
    num_tokens = sum(q_lens) + pad_tokens
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    q[sum(q_lens) :] = np.nan
    qsl = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)]]).astype(np.int32)
    lens = np.array([*seq_lens, 0], np.int32)
    return q, k_pages, v_pages, table, lens, qsl, k_seqs, v_seqs


def naive_attention(q, qsl, k_seqs, v_seqs, sliding_window=None):
    """Loop over sequences and tokens, contiguous K/V, float64."""
    out = np.zeros(q.shape, np.float64)
    for s, (k, v) in enumerate(zip(k_seqs, v_seqs, strict=True)):
        n = k.shape[0]
        group = q.shape[1] // k.shape[1]
        for i, row in enumerate(range(qsl[s], qsl[s + 1])):
            pos = n - (qsl[s + 1] - qsl[s]) + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                kh, vh = k[lo : pos + 1, h // group], v[lo : pos + 1, h // group]
                scores = kh.astype(np.float64) @ q[row, h] / math.sqrt(q.shape[2])
                p = np.exp(scores - scores.max())
                out[row, h] = (p / p.sum()) @ vh
    return out


def run_reference(q, k_pages, v_pages, table, lens, qsl, **kw):
    max_q = int(np.max(np.diff(qsl)))
    arrays = map(jnp.asarray, (q, k_pages, v_pages, table, lens, qsl))
    return np.asarray(
        ragged_paged_attention(PagedAttentionInputs(*arrays, max_q_len=max(max_q, 1), **kw))
    )


@pytest.mark.parametrize("page_size", [8, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_ragged_mixed_batch_matches_naive_and_never_reads_unowned_pages(page_size, group):
    rng = np.random.default_rng(page_size * 10 + group)
    # Mixed batch: a fresh prefill, a chunk after context, decodes (q_len 1) with a length of
    # exactly one page, one token, and a partial last page.
    q_lens = [13, 7, 1, 1, 1]
    ctx_lens = [0, 2 * page_size + 3, page_size - 1, 0, 3 * page_size + 5]
    case = make_case(
        rng, q_lens=q_lens, ctx_lens=ctx_lens, page_size=page_size, num_kv_heads=2,
        group=group, head_dim=16,
    )  # fmt: skip
    q, k_pages, v_pages, table, lens, qsl, k_seqs, v_seqs = case
    out = run_reference(q, k_pages, v_pages, table, lens, qsl)
    expected = naive_attention(q, qsl, k_seqs, v_seqs)
    n = sum(q_lens)
    assert np.isfinite(out).all(), "NaN from an unowned page or padding row leaked into the output"
    np.testing.assert_allclose(out[:n], expected[:n], atol=2e-5, rtol=2e-5)
    assert (out[n:] == 0).all(), "padding rows must be zero"


@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_lengths_match_naive(seed):
    rng = np.random.default_rng(100 + seed)
    num_seqs = int(rng.integers(1, 6))
    page_size = int(rng.choice([8, 16]))
    q_lens = [int(x) for x in rng.integers(1, 20, num_seqs)]
    ctx_lens = [int(x) for x in rng.integers(0, 50, num_seqs)]
    case = make_case(
        rng, q_lens=q_lens, ctx_lens=ctx_lens, page_size=page_size, num_kv_heads=2,
        group=int(rng.choice([1, 2, 4])), head_dim=8,
    )  # fmt: skip
    q, k_pages, v_pages, table, lens, qsl, k_seqs, v_seqs = case
    window = int(rng.integers(1, 30)) if seed % 2 else None
    out = run_reference(q, k_pages, v_pages, table, lens, qsl, sliding_window=window)
    expected = naive_attention(q, qsl, k_seqs, v_seqs, sliding_window=window)
    n = sum(q_lens)
    np.testing.assert_allclose(out[:n], expected[:n], atol=2e-5, rtol=2e-5)


def test_other_sequences_pages_do_not_change_output():
    """Rewriting every page a sequence does not own leaves that sequence's output unchanged."""
    rng = np.random.default_rng(7)
    case = make_case(
        rng, q_lens=[5, 1], ctx_lens=[9, 20], page_size=8, num_kv_heads=2, group=2, head_dim=8
    )
    q, k_pages, v_pages, table, lens, qsl, _, _ = case
    before = run_reference(q, k_pages, v_pages, table, lens, qsl)
    own = set(table[0, : math.ceil(lens[0] / 8)].tolist())
    k2, v2 = k_pages.copy(), v_pages.copy()
    for page in range(k_pages.shape[0]):
        if page not in own:
            k2[page] = rng.standard_normal(k2[page].shape)
            v2[page] = rng.standard_normal(v2[page].shape)
    after = run_reference(q, k2, v2, table, lens, qsl)
    np.testing.assert_array_equal(before[:5], after[:5])
    assert not np.allclose(before[5], after[5]), "sequence 1 should see its rewritten pages"


def test_write_then_read_round_trips_through_shuffled_page_table():
    """token_slots + write_kv put each token's K/V where the page table says; padding -> scratch."""
    rng = np.random.default_rng(3)
    page_size, num_pages, hkv, d = 4, 12, 2, 8
    table = np.array([[5, 2, 9, 0], [7, 11, 0, 0]], np.int32)
    qsl = np.array([0, 6, 9], np.int32)  # seq 0: positions 3..8, seq 1: positions 2..4
    positions = np.array([3, 4, 5, 6, 7, 8, 2, 3, 4, 0, 0], np.int32)  # two padding tokens
    lens = np.array([9, 5], np.int32)
    k_new = rng.standard_normal((len(positions), hkv, d)).astype(np.float32)
    kv = KVCache(jnp.zeros((2, num_pages, 2, page_size, hkv, d)))
    page, offset = token_slots(
        PageTable(jnp.asarray(table), jnp.asarray(lens)), jnp.asarray(qsl), jnp.asarray(positions), page_size
    )  # fmt: skip
    kv = write_kv(kv, 1, jnp.asarray(k_new), jnp.asarray(-k_new), page, offset)
    k_pages, v_pages = np.asarray(kv.k_pages), np.asarray(kv.v_pages)
    assert (k_pages[0] == 0).all() and (v_pages[0] == 0).all(), "layer 0 must be untouched"
    for t, pos in enumerate(positions[:9]):
        seq = 0 if t < 6 else 1
        slot = (1, table[seq, pos // page_size], pos % page_size)
        np.testing.assert_array_equal(k_pages[slot], k_new[t])
        np.testing.assert_array_equal(v_pages[slot], -k_new[t])
    # the pool view attention reads: K of (layer 1, page p) at 2 * (num_pages + p), V right after
    pool, _ = kv.pool()
    ids = np.asarray(kv.pool_page_ids(jnp.asarray(table), 1))
    np.testing.assert_array_equal(np.asarray(pool)[ids], k_pages[1][table])
    np.testing.assert_array_equal(np.asarray(pool)[ids + 1], v_pages[1][table])
    np.testing.assert_array_equal(np.asarray(page)[9:], [SCRATCH_PAGE, SCRATCH_PAGE])
    written = {int(p) for p in np.asarray(page)[:9]}
    assert written == {5, 2, 9, 7, 11}, written
    assert jax.tree.structure(kv) == jax.tree.structure(KVCache(0))


@pytest.mark.parametrize("page_size", [8, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_only_batch_matches_naive_and_ignores_poisoned_pages(page_size, group):
    """max_q_len=1 takes the per-sequence path; ragged lengths incl. 1 and exact page multiples."""
    rng = np.random.default_rng(1000 + page_size + group)
    ctx_lens = [0, page_size - 1, 2 * page_size - 1, 37, 5 * page_size + 2]
    case = make_case(
        rng, q_lens=[1] * len(ctx_lens), ctx_lens=ctx_lens, page_size=page_size,
        num_kv_heads=2, group=group, head_dim=16, pad_tokens=2,
    )  # fmt: skip
    q, k_pages, v_pages, table, lens, qsl, k_seqs, v_seqs = case
    out = run_reference(q, k_pages, v_pages, table, lens, qsl)
    expected = naive_attention(q, qsl, k_seqs, v_seqs)
    n = len(ctx_lens)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:n], expected[:n], atol=2e-5, rtol=2e-5)
    assert (out[n:] == 0).all()
    window = 9
    out = run_reference(q, k_pages, v_pages, table, lens, qsl, sliding_window=window)
    expected = naive_attention(q, qsl, k_seqs, v_seqs, sliding_window=window)
    np.testing.assert_allclose(out[:n], expected[:n], atol=2e-5, rtol=2e-5)
