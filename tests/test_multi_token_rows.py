"""Several scored rows per sequence: draft tokens verified in the ragged step and the decode scan.

A test-only proposer (`spine_parts.KnownTokens`) drafts known continuations with some tokens
deliberately wrong, so verifications keep a data-dependent number of tokens. Checked here: the
step's logits at every draft row against a full forward; the token budget and pages counting the
drafts; placeholders of a step that kept several tokens (async scheduling); and the engine's
output with drafts equal to its output without (greedy, and sampled with seeds: the kept tokens
are the target's own samples, keyed by position).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spine_parts

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.model_runner import mixed_step, sample_step
from jaxinfer.engine.request import SamplingParams, Sequence
from jaxinfer.engine.sampler import SamplingBatch, accept_drafts
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.models.dense import forward
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=8,
             max_model_len=128)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny")
    return cfg, init_params(cfg, jax.random.key(21))


_forward = jax.jit(forward, static_argnames="cfg")
REF_LEN = 16  # every reference forward is padded to this length: one compile for all prefixes


def full_logits(model, tokens):
    """Logits of a full (causal) forward at each of `tokens`: later positions (the padding)
    never change earlier logits."""
    cfg, params = model
    assert len(tokens) <= REF_LEN, len(tokens)
    padded = jnp.asarray([[*tokens, *[0] * (REF_LEN - len(tokens))]])
    return np.asarray(_forward(params, cfg=cfg, tokens=padded)[0, : len(tokens)])


def test_accept_drafts_keeps_the_agreeing_prefix_and_one_more():
    tokens = jnp.asarray([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = jnp.asarray([[5, 6, 7], [5, 9, 7], [5, 6, 7], [9, 2, 3]])
    counts = accept_drafts(tokens, drafts, jnp.asarray([3, 3, 1, 3]))
    # all pass (+ bonus); a miss at 1 (later matches do not count); 1 draft; a miss at once
    assert counts.tolist() == [4, 2, 2, 1]


def test_step_scores_draft_rows_like_a_full_forward(model):
    """A prefill, then one step with a 3-draft verification, a 1-draft one and a prompt chunk:
    each returned row's logits are the full forward's at that token; then a step fed the
    placeholder of the 3-draft sequence, whose verification kept 3 tokens (2 drafts right, the
    third wrong), scores the sequence at its real position, 2 past the host's count."""
    cfg, params = model
    seed = 21
    rng = np.random.default_rng(seed)
    config = EngineConfig(model="preset:tiny", **SMALL)
    runner = Engine(config, cfg, params, proposer=spine_parts.KnownTokens([], 3, 512)).runner
    assert runner.num_rows == 4
    pa, pb, pc = (rng.integers(0, cfg.vocab_size, n).tolist() for n in (10, 7, 5))
    pages = [[1, 2, 3], [4, 5], [6]]
    static = runner._mixed_static()

    def step(tokens, contexts, num_drafts, prev=None):
        batch = runner.build_mixed(tokens, contexts, [pages[i] for i in range(len(tokens))])
        nd = np.zeros(config.max_num_seqs, np.int32)
        nd[: len(num_drafts)] = num_drafts
        prev = runner.no_prev()[:2] if prev is None else prev
        (logits, drafts, shift, _), runner.kv, _ = mixed_step(
            params, runner.kv, batch, runner.put(nd), *prev, **static
        )
        return np.asarray(logits), np.asarray(drafts), (logits, drafts, runner.put(nd), shift)

    step([pa, pb], [0, 0], [0, 0])

    def greedy_after(tokens):
        return int(np.argmax(full_logits(model, tokens)[-1]))

    ta, tb = greedy_after(pa), greedy_after(pb)
    d1 = greedy_after([*pa, ta])
    d2 = greedy_after([*pa, ta, d1])
    d3 = (greedy_after([*pa, ta, d1, d2]) + 1) % cfg.vocab_size  # wrong
    e1 = int(rng.integers(cfg.vocab_size))
    fed = [[ta, d1, d2, d3], [tb, e1], pc]
    logits, drafts, outs = step(fed, [len(pa), len(pb), 0], [3, 1, 0])
    for s, (prefix, num_drafts) in enumerate([(pa, 3), (pb, 1), ([], 0)]):
        want = full_logits(model, prefix + fed[s])
        n = 1 + num_drafts  # rows past them repeat the last
        for j in range(4):
            row = len(want) - n + min(j, n - 1)
            np.testing.assert_allclose(logits[s, j], want[row], rtol=2e-4, atol=2e-4,
                                       err_msg=f"seed {seed}: sequence {s} row {j}")  # fmt: skip
    assert drafts[0].tolist() == [d1, d2, d3] and drafts[1, 0] == e1

    sb = SamplingBatch.build([SamplingParams()] * 3, [0, 0, 0], [len(pa) + 1, len(pb) + 1, 5],
                             config.max_num_seqs, put=runner.put)  # fmt: skip
    tokens, counts, *_ = sample_step(*outs, sb, num_logprobs=0)
    assert int(counts[0]) == 3, f"seed {seed}: kept {int(counts[0])} of sequence 0's tokens"
    kept = [int(t) for t in tokens[0, :3]]
    assert kept[:2] == [d1, d2]
    # the next step feeds sequence 0's placeholder at the host's position len(pa) + 1
    logits, _, _ = step([[-1]], [len(pa) + 1], [0], prev=(tokens, counts))
    want = full_logits(model, [*pa, ta, *kept])
    np.testing.assert_allclose(logits[0, 0], want[-1], rtol=2e-4, atol=2e-4,
                               err_msg=f"seed {seed}: the placeholder's shifted position")  # fmt: skip


def test_scheduler_counts_drafts_in_the_budget_and_reserves_their_pages():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=9, page_size=4, num_pages=32,
                          max_model_len=64)  # fmt: skip
    bm = BlockManager(32, 4)
    sch = Scheduler(config, bm)
    seqs = [Sequence(i, [1] * 3, SamplingParams(max_tokens=20)) for i in range(3)]
    for seq in seqs:
        sch.add(seq)
    out = sch.schedule(0.0)
    assert [s.num_new_tokens for s in out.scheduled] == [3, 3, 3]
    for seq in seqs:  # each prefilled and sampled one token
        seq.num_computed_tokens = 3
        seq.output_token_ids.append(7)
        seq.draft_token_ids = [8, 9, 10]
    out = sch.schedule(1.0)
    # 4 + 4 tokens, then 1 left: the third decodes without drafts
    assert [(s.num_new_tokens, s.num_draft_tokens) for s in out.scheduled] == [(4, 3), (4, 3),
                                                                            (1, 0)]  # fmt: skip
    assert out.scheduled[0].new_token_ids == [7, 8, 9, 10]
    assert [len(s.page_ids) for s in seqs] == [2, 2, 1]  # 3 + 4 tokens; 3 + 1 tokens
    assert not out.is_decode_only


def run(engine, prompts, sampling):
    seqs = [engine.add_request(p, s) for p, s in zip(prompts, sampling, strict=True)]
    engine.run()
    return seqs


@pytest.mark.parametrize(
    "variant",
    [
        dict(decode_steps=1),
        dict(decode_steps=1, async_schedule=False),
        dict(decode_steps=4),
        dict(decode_steps=4, on_device=False),
    ],
    ids=["mixed-async", "mixed-sync", "scans", "scans-without-device-drafts"],
)
def test_drafts_leave_the_output_unchanged_and_take_fewer_steps(model, variant):
    cfg, params = model
    seed = 22
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(2, 40, 6)]
    kw = {k: v for k, v in variant.items() if k != "on_device"}
    config = EngineConfig(model="preset:tiny", **SMALL, **kw)
    greedy = [SamplingParams(max_tokens=int(n), ignore_eos=True) for n in rng.integers(5, 30, 6)]
    sampled = [SamplingParams(max_tokens=20, temperature=0.9, top_k=40, seed=100 + i)
               for i in range(6)]  # fmt: skip
    plain = Engine(config, cfg, params)
    plain.warmup()
    for sampling in (greedy, sampled):
        want = [s.output_token_ids for s in run(plain, prompts, sampling)]
        steps = len(plain.step_records)
        plain.step_records.clear()
        proposer = spine_parts.KnownTokens(list(zip(prompts, want, strict=True)), 3,
                                           cfg.vocab_size, on_device=variant.get("on_device", True))  # fmt: skip
        spec = Engine(config, cfg, params, proposer=proposer)
        spec.warmup()
        got = run(spec, prompts, sampling)
        assert [s.output_token_ids for s in got] == want, f"seed {seed}"
        assert spec.compiles_after_warmup == 0
        assert proposer.proposed > 0 or variant.get("decode_steps") == 4
        if variant.get("on_device", True):  # (else only the few mixed decodes carry drafts)
            assert len(spec.step_records) < steps, (len(spec.step_records), steps)
        if variant.get("decode_steps") == 4 and variant.get("on_device", True):
            scans = [r for r in spec.step_records if r.decode_steps > 1]
            assert any(r.num_batched_tokens > r.decode_steps * r.num_seqs for r in scans)
        assert spec.block_manager.num_free_pages == spec.block_manager.capacity
