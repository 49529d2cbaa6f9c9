"""On-device sampling against a numpy statement of the filters, on fresh random logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.sampler import SamplingBatch, sample


def expected_distribution(logits, temperature, top_k, top_p, min_p):
    """The distribution a request should sample from: temperature, top-k, top-p, min-p."""
    order = np.argsort(-logits, kind="stable")
    z = logits[order] / temperature
    keep = np.ones_like(z, bool)
    if top_k:
        keep[top_k:] = False
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    keep &= (np.cumsum(p) - p) < top_p
    keep &= p >= min_p * p[0]
    keep[0] = True
    q = np.exp(z - z.max()) * keep
    out = np.zeros_like(logits)
    out[order] = q / q.sum()
    return out


def draw(logits, params: SamplingParams, n: int, seed: int = 0):
    """n samples of one row (positions 0..n-1 give independent keys)."""
    rows = np.repeat(logits[None], n, axis=0)
    sb = SamplingBatch.build([params] * n, [seed] * n, list(range(n)), n)
    tokens, lp, top_lp, top_ids = jax.jit(sample, static_argnums=2)(jnp.asarray(rows), sb, 3)
    return np.asarray(tokens), np.asarray(lp), np.asarray(top_lp), np.asarray(top_ids)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=6, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2),
    ],
    ids=repr,
)
def test_sample_frequencies_match_the_filtered_distribution(params, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    logits = rng.normal(0, 1.5, 10).astype(np.float32)
    n = 20_000
    tokens, *_ = draw(logits, params, n)
    freq = np.bincount(tokens, minlength=10) / n
    want = expected_distribution(
        logits, params.temperature, params.top_k, params.top_p, params.min_p
    )
    # six binomial standard deviations per token: a wrong filter moves more mass than that, and
    # a fresh seed fails by chance about once in 10^8 runs
    bound = 6 * np.sqrt(want * (1 - want) / n) + 1e-3
    assert (np.abs(freq - want) < bound).all(), (freq.round(3), want.round(3))
    assert (freq[want == 0] == 0).all(), "sampled a filtered-out token"


def test_greedy_and_top_k_1_take_the_argmax_and_logprobs_are_log_softmax():
    logits = np.random.default_rng(1).normal(size=50).astype(np.float32)
    for params in (SamplingParams(), SamplingParams(temperature=2.0, top_k=1)):
        tokens, lp, top_lp, top_ids = draw(logits, params, 8)
        assert (tokens == logits.argmax()).all()
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits)))
    np.testing.assert_allclose(lp, ref[tokens], rtol=1e-5)
    np.testing.assert_array_equal(top_ids[0], np.argsort(-ref)[:3])
    np.testing.assert_allclose(top_lp[0], np.sort(ref)[::-1][:3], rtol=1e-5)


def test_same_seed_and_position_give_the_same_token_in_any_row():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, 100)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (5, 6, 7, 8)]
    sb = SamplingBatch.build(params, [5, 6, 7, 8], [10, 11, 12, 13], 4)
    a = np.asarray(sample(jnp.asarray(logits), sb)[0])
    perm = [2, 0, 3, 1]
    sb2 = SamplingBatch.build([params[i] for i in perm], [[5, 6, 7, 8][i] for i in perm],
                              [[10, 11, 12, 13][i] for i in perm], 4)  # fmt: skip
    b = np.asarray(sample(jnp.asarray(logits[perm]), sb2)[0])
    np.testing.assert_array_equal(a[perm], b)
    tokens, *_ = draw(logits[0], SamplingParams(temperature=1.0), 64, seed=5)
    assert len(set(tokens.tolist())) > 5, "different positions must draw different keys"
