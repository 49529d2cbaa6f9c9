"""Parallel sampling (`SamplingParams.n`, `best_of`): n samples of one prompt share its pages.

Each further sample is forked after its parent's prompt is computed (`BlockManager.fork`): it
shares the full prompt pages before the last prompt token's page and recomputes the rest into
its own page. Sample i must equal a lone request seeded `sample_seed(seed, i)` token for token
(fp32 CPU), whatever the sharing, preemption or prefix cache did; `best_of` returns the n best
by cumulative logprob.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams, sample_seed

PAGE = 16
# batch_invariant: outputs equal token for token across engines that batch a row differently
# only under batch-invariant numerics (test_eagle.py's KW says why)
KW = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=PAGE, max_model_len=160,
          decode_steps=4, batch_invariant=True)  # fmt: skip


def _prompt(seed: int, length: int = 45) -> list[int]:
    return np.random.default_rng(seed).integers(3, 4000, length).tolist()  # 2 full pages + 13


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", num_pages=64, **KW)


def _lone(llm, prompt, sampling, index):
    """Sample `index` as a request of its own."""
    lone = SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                          ignore_eos=True, seed=sample_seed(sampling.seed, index), logprobs=0)  # fmt: skip
    return llm.generate([prompt], lone)[0]


def test_n_samples_share_the_prompt_and_each_equals_its_lone_request(llm, fresh_seed):
    prompt = _prompt(fresh_seed)
    sampling = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True, seed=fresh_seed,
                              n=3, logprobs=0)  # fmt: skip
    peak = []
    step = llm.engine.step

    def watched():  # the pages the samples hold, after every step
        out = step()
        holders = [s for s in llm.engine.block_manager._holders if s.prompt_token_ids == prompt]
        if holders:
            peak.append(len({p for s in holders for p in s.page_ids}))
        llm.engine.block_manager.check_invariants()
        return out

    llm.engine.step = watched
    try:
        (out,) = llm.generate([prompt], sampling)
    finally:
        del llm.engine.step
    assert out.error is None and [c.index for c in out.outputs] == [0, 1, 2]
    samples = [c.token_ids for c in out.outputs]
    for c in out.outputs:
        lone = _lone(llm, prompt, sampling, c.index)
        assert c.token_ids == lone.token_ids, f"seed {fresh_seed}, sample {c.index}"
        np.testing.assert_allclose(c.cumulative_logprob, sum(d["logprob"] for d in c.logprobs),
                                   rtol=1e-5, err_msg=f"seed {fresh_seed}")  # fmt: skip
    assert len({tuple(t) for t in samples}) > 1, (fresh_seed, samples)  # temperature 1
    assert out.token_ids == samples[0] and out.num_cached_tokens == 0
    # 45 + 10 tokens: 4 pages each alone (12); shared, the 2 full prompt pages count once (8)
    assert max(peak) <= 8, peak


def test_best_of_returns_the_n_most_likely_samples(llm, fresh_seed):
    prompt = _prompt(fresh_seed + 1, 20)
    sampling = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, seed=fresh_seed,
                              n=2, best_of=4)  # fmt: skip
    (out,) = llm.generate([prompt], sampling)
    lone = [_lone(llm, prompt, sampling, i) for i in range(4)]
    scores = [sum(d["logprob"] for d in o.logprobs) for o in lone]
    best = sorted(range(4), key=lambda i: -scores[i])[:2]
    assert [c.index for c in out.outputs] == best, (fresh_seed, scores)
    for c in out.outputs:
        assert c.token_ids == lone[c.index].token_ids, f"seed {fresh_seed}"
        assert c.logprobs == []  # not asked for
    assert out.token_ids == out.outputs[0].token_ids


def test_samples_survive_preemption_and_the_prefix_cache(fresh_seed):
    """A cache too small for every sample at once (preemptions), and prefix caching on: the
    samples still equal their lone requests."""
    prompt = _prompt(fresh_seed + 2, 40)
    sampling = SamplingParams(max_tokens=30, temperature=0.9, ignore_eos=True, seed=fresh_seed,
                              n=4)  # fmt: skip
    small = LLM("tiny", num_pages=12, prefix_caching=True, **KW)
    (out,) = small.generate([prompt], sampling)
    small.engine.block_manager.check_invariants()
    assert out.num_preemptions > 0, "the cache was meant to be too small"
    ref = LLM("tiny", num_pages=64, **KW, warmup=False)
    for c in out.outputs:
        assert c.token_ids == _lone(ref, prompt, sampling, c.index).token_ids, (
            f"seed {fresh_seed}, sample {c.index}"
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(n=0), "SamplingParams.n=0 is invalid"),
        (dict(n=2.0), "SamplingParams.n=2.0 is invalid"),
        (dict(n=3, best_of=2), r"SamplingParams.best_of=2 is invalid: must be None or an int >= n"),
    ],
)
def test_bad_n_and_best_of_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_sample_seeds_are_distinct_and_keep_sample_zero():
    assert sample_seed(7, 0) == 7
    seeds = {sample_seed(2**64 - 1, i) for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**64 for s in seeds)
