"""Prefix caching (`engine.prefix_caching`, `block_manager.py`): content-addressed full pages.

Outputs with the cache on must equal outputs with it off (fp32: identical, greedy and sampled per
seed); a forced hash collision must not change them (a hit is checked against the page's
tokens); pages poisoned with NaN on the free list never reach an output; and the block manager's
accounting holds under random interleavings of admit / register / finish / preempt.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams, Sequence

KW = dict(max_num_seqs=3, max_num_batched_tokens=64, page_size=16, max_model_len=256,
          decode_steps=4)  # fmt: skip


def _workload(seed: int):
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 4000, 70).tolist()  # 4 full pages of 16 and a partial one
    prompts = [system + rng.integers(3, 4000, int(n)).tolist() for n in (3, 21, 9, 40, 1, 17)]
    prompts.append(list(prompts[1]))  # a repeat: every full page of it is cached
    sampling = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=t, seed=seed + i)
                for i, t in enumerate([0, 0.8, 0, 0.9, 0, 0.7, 0.8])]  # fmt: skip
    return prompts, sampling


def _run(prompts, sampling, num_pages=96, hook=None, warmup=False, **engine):
    """(tokens, cached tokens per prompt, the engine). warmup: compile every bucket first (for a
    check of compiles after it); without, an engine compiles only the steps it runs."""
    llm = LLM("tiny", num_pages=num_pages, warmup=False, **{**KW, **engine})
    if hook is not None:
        hook(llm.engine)
    if warmup:
        llm.engine.warmup()
    outs = llm.generate(prompts, sampling)
    llm.engine.block_manager.check_invariants()
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs], llm.engine


def test_cached_prefixes_skip_prefill_and_change_no_output(fresh_seed):
    prompts, sampling = _workload(fresh_seed)
    off, cached_off, _ = _run(prompts, sampling)
    on, cached, engine = _run(prompts, sampling, prefix_caching=True, warmup=True)
    assert on == off, f"seed {fresh_seed}"
    assert cached_off == [0] * len(prompts)
    assert cached[0] == 0 and all(c % 16 == 0 and c <= 64 for c in cached), cached
    assert sum(cached) >= 64 * 3, cached  # the shared system prompt's 4 pages, at least 3 times
    assert cached[-1] >= 64, cached  # the repeated prompt found its pages
    assert engine.compiles_after_warmup == 0


def test_forced_hash_collisions_change_no_output(fresh_seed):
    """Every page hashes alike: the cache can hold one entry, and a lookup finds a page whose
    tokens are not the sequence's; the check of the page's contents refuses it."""
    prompts, sampling = _workload(fresh_seed)
    off, _, _ = _run(prompts, sampling)

    def collide(engine):
        engine.block_manager.digest = lambda data: b"same"

    on, cached, _ = _run(prompts, sampling, prefix_caching=True, hook=collide)
    assert on == off, f"seed {fresh_seed}"
    assert sum(cached) <= 16 * len(prompts), cached  # at most the one cached page, each time


def test_nan_poisoned_free_pages_never_reach_an_output(fresh_seed):
    """After a first wave, every page on the free list is filled with NaN: the second wave
    (cache hits on the first's pages, evictions in a small pool) must give finite logits, and the
    outputs of a cache-off run."""
    prompts, sampling = _workload(fresh_seed)
    llm = LLM("tiny", num_pages=16, prefix_caching=True, warmup=False,
              **{**KW, "max_model_len": 240})  # fmt: skip
    engine = llm.engine
    first = llm.generate(prompts[:3], sampling[:3])
    bm = engine.block_manager
    free = np.asarray(sorted(bm._free), np.int32)
    kv = engine.runner.kv
    engine.runner.kv = type(kv)(kv.pages.at[:, free].set(jnp.nan))
    second = llm.generate(prompts[3:], sampling[3:])
    bm.check_invariants()
    off, _, _ = _run(prompts[3:], sampling[3:], num_pages=16, max_model_len=240)
    assert [o.token_ids for o in second] == off, f"seed {fresh_seed}"
    assert all(o.finish_reason == "length" for o in first + second)
    assert sum(o.num_cached_tokens for o in second) > 0
    assert bm.num_evictions > 0  # the pool is small: cached pages were reclaimed


def test_preempted_sequences_re_hit_their_own_pages(fresh_seed):
    prompts, sampling = _workload(fresh_seed)
    sampling = [SamplingParams(max_tokens=60, ignore_eos=True, seed=s.seed) for s in sampling]
    small = dict(num_pages=14, max_model_len=208)  # 13 pages: one request of max_model_len
    off, _, engine_off = _run(prompts[:4], sampling[:4], **small)
    on, _, engine = _run(prompts[:4], sampling[:4], **small, prefix_caching=True)
    assert engine_off.scheduler.num_preemptions > 0 and engine.scheduler.num_preemptions > 0
    assert on == off, f"seed {fresh_seed}"


# ---- accounting under random interleavings -------------------------------------------------------


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, tokens, SamplingParams(max_tokens=4, ignore_eos=True))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "finish", "preempt"]),
                          st.integers(0, 7), st.integers(0, 3), st.integers(1, 40)),
                min_size=1, max_size=60))  # fmt: skip
def test_block_manager_accounting_holds_under_any_interleaving(ops):
    """Refcounts never negative, no page both free and cached-in-use, every page accounted for,
    whatever the order of admissions (with prefix matches), growth (registering full pages),
    finishes and preemptions; shared prefixes (4 families of prompts) make hits happen."""
    bm = BlockManager(12, 4, prefix_caching=True)
    families = [[f * 100 + t for t in range(48)] for f in range(4)]
    seqs: dict[int, Sequence] = {}
    for op, i, family, n in ops:
        seq = seqs.get(i)
        if op == "admit" and seq is None:
            seq = _seq(i, families[family][: 4 + n])
            cached = bm.match_prefix(seq)
            seq.num_computed_tokens = cached
            if bm.allocate(seq, seq.num_tokens):
                seq.num_computed_tokens = seq.num_tokens
                seqs[i] = seq
            elif cached:
                bm.free(seq)
        elif op == "grow" and seq is not None:
            seq.output_token_ids += [7] * min(n, 8)
            if bm.allocate(seq, seq.num_tokens):
                seq.num_computed_tokens = seq.num_tokens
                bm.register(seq, seq.num_computed_tokens)
        elif op in ("finish", "preempt") and seq is not None:
            bm.register(seq, seq.num_computed_tokens)
            bm.free(seq)
            if op == "finish":
                del seqs[i]
            else:
                seq.num_computed_tokens = 0  # (re-admitted by a later "admit" of the same i)
                del seqs[i]
        bm.check_invariants()
        assert bm.num_free_pages + bm.num_used_pages == bm.capacity
    for seq in seqs.values():
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_used_pages == 0


def test_a_hit_shares_full_pages_only_and_never_the_last_tokens_page():
    bm = BlockManager(16, 4, prefix_caching=True)
    a = _seq(0, list(range(12)))  # 3 full pages
    assert bm.match_prefix(a) == 0 and bm.allocate(a, 12)
    bm.register(a, 12)  # pages 0 and 1 (not the page of its last token)
    b = _seq(1, list(range(12)))
    assert bm.match_prefix(b) == 8 and b.page_ids == a.page_ids[:2]
    c = _seq(2, list(range(9)))  # its third page is partial
    assert bm.match_prefix(c) == 8
    d = _seq(3, [*range(4), 99, *range(5, 12)])  # differs in page 1
    assert bm.match_prefix(d) == 4
    with pytest.raises(AssertionError):  # (the checker catches a corrupted refcount)
        bm._refcount[a.page_ids[0]] += 1
        bm.check_invariants()


def test_lpm_admits_the_longest_cached_prefix_first(fresh_seed):
    """`scheduler: lpm` orders the waiting queue by cached prefix (then arrival): with one slot,
    after a first request the one sharing its prefix goes before earlier unrelated ones."""
    rng = np.random.default_rng(fresh_seed)
    shared = rng.integers(3, 4000, 64).tolist()
    first = [*shared, 5]
    others = [rng.integers(3, 4000, 40).tolist() for _ in range(3)]
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    for policy, want_second in (("fcfs", 1), ("lpm", 4)):
        llm = LLM("tiny", num_pages=64, prefix_caching=True, scheduler=policy, warmup=False,
                  **{**KW, "max_num_seqs": 1})  # fmt: skip
        engine = llm.engine
        seqs = [engine.add_request(p, sp) for p in [first, *others, [*shared, 9]]]
        while engine.has_unfinished():
            engine.step()
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].scheduled_time)
        assert order[1] == want_second, (policy, order)
    with pytest.raises(ValueError, match=r"scheduler=lpm .* needs engine\.prefix_caching"):
        LLM("tiny", scheduler="lpm", warmup=False, **KW)


@pytest.mark.optimized
def test_fp8_pages_are_shared_with_their_scales(fresh_seed, monkeypatch):
    """FP8 KV pages (per-page-and-head scales stored by page index): a hit shares a page with its
    scales, and the outputs equal the cache-off engine's on the same fp8 pages. A page's fp8
    rounding depends on how its tokens were chunked (its scale grows as it fills, see
    `paged_attention/fp8.py`), so every prompt here is prefilled whole: a budget of 512 tokens.

    Every row is greedy. The pages a hit reads were written by another prompt's prefill, whose
    fp32 K/V can differ from this prompt's own in the last ulp (other batch shapes); fp8 turns an
    ulp across a rounding midpoint into one e4m3 step (1/16 to 1/8 of the value), and a sampled
    row's draw flips on that (seed 4223994769: one of four sampled rows, while the fp32 pages of
    the test above and every greedy row gave identical tokens). A hit with a wrong scale changes
    greedy tokens as well."""
    monkeypatch.setitem(KW, "max_num_batched_tokens", 512)
    prompts, _ = _workload(fresh_seed)
    sampling = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in prompts]
    off, _, _ = _run(prompts, sampling, kv_dtype="float8_e4m3fn")
    on, cached, _ = _run(prompts, sampling, kv_dtype="float8_e4m3fn", prefix_caching=True)
    assert sum(cached) >= 64 * 3, cached
    assert on == off, f"seed {fresh_seed}"
