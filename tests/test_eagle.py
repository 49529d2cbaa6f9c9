"""The EAGLE draft head (`engine.speculative.method: eagle`, `engine/eagle.py`, `train/eagle.py`).

Verification is exact whatever the head drafts, so speculative output must equal plain output
token for token (fp32; greedy drafts, greedy and sampled requests); the head's sampled drafts
must follow the distribution q it hands to the verifier; and training must be what makes its
drafts worth verifying: a trained head is accepted more often than a random one.
"""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams

# Token-for-token equality needs a verification of 1 + gamma rows to round like a plain step of
# fewer rows: it holds by construction only with batch-invariant numerics (a row's logits the same
# bits whatever is verified beside it), so the engines run with engine.batch_invariant on every
# backend. XLA's default numerics round by the batch's shape, on a GPU (an H200 run diverged on
# sampled rows: h200/gpu_tests_eagle_fp32.json) and on the CPU (a one-row product differs from a
# many-row one; the suite's unoptimised compiles diverged on a sampled row, seed 3885777001).
KW = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=16,
          max_model_len=256, decode_steps=4, batch_invariant=True)  # fmt: skip
GAMMA = 3
# the modules the head is not trained on (the train config leaves them out): its test text
UNSEEN = ("textwrap", "shlex", "fnmatch", "heapq")


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    """One engine each (their warm-ups are the file's main cost): plain (the reference: not
    warmed up, it compiles only what it runs), and with greedy drafts the shipped trained head
    (`configs/train/eagle-tiny.yaml`) and a random one."""
    spec = dict(method="eagle", num_draft_tokens=GAMMA, draft_sampling="greedy")
    return {
        "plain": LLM("tiny", **KW, warmup=False),
        "trained": LLM("tiny", **KW, speculative={**spec, "eagle_head": "eagle-tiny"}),
        "random": LLM("tiny", **KW, speculative={**spec, "eagle_head": "random"}),
    }


def _code_prompts(llm: LLM, rng, n: int, chars: int = 300) -> list[list[int]]:
    """n pieces of Python source the head never trained on, at random offsets."""
    out = []
    for _ in range(n):
        src = inspect.getsource(__import__(UNSEEN[int(rng.integers(len(UNSEEN)))]))
        start = int(rng.integers(0, len(src) - chars))
        out.append(llm.tokenizer.encode(src[start : start + chars]).ids)
    return out


def _generate(llm: LLM, prompts, sampling):
    """(token ids per prompt, XLA compiles while generating: the counter is process-wide, so
    `compiles_after_warmup` would count the next engine's warm-up)."""
    from jaxinfer.engine.compile_counter import compile_count

    llm.engine.step_records.clear()
    before = compile_count()
    tokens = [o.token_ids for o in llm.generate(prompts, sampling)]
    return tokens, compile_count() - before


def _acceptance(llm: LLM) -> tuple[int, int]:
    records = llm.engine.step_records
    return (sum(r.accepted_draft_tokens for r in records), sum(r.draft_tokens for r in records))


def test_eagle_output_equals_plain_output_token_for_token(fresh_seed, engines):
    rng = np.random.default_rng(fresh_seed)
    prompts = [*_code_prompts(engines["plain"], rng, 2), rng.integers(3, 4000, 13).tolist()]
    sampling = [
        SamplingParams(max_tokens=24, ignore_eos=True),  # greedy
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_k=40, seed=fresh_seed),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, min_p=0.05,
                       seed=fresh_seed + 1),
    ]  # fmt: skip
    plain, _ = _generate(engines["plain"], prompts, sampling)
    for name in ("trained", "random"):
        overlapped = engines[name].engine.overlapped_steps
        spec, compiles = _generate(engines[name], prompts, sampling)
        assert spec == plain, f"seed {fresh_seed}: the {name} head's output differs"
        # the head drafts in the scans alone: its mixed steps (prefill chunks) still overlap,
        # and return one row of logits per sequence
        assert engines[name].engine.runner.mixed_rows == 1
        assert engines[name].engine.overlapped_steps > overlapped, (
            f"seed {fresh_seed}: {name}: no mixed step overlapped the host's work"
        )
        assert compiles == 0, f"seed {fresh_seed}: {compiles} compiles after warm-up, {name}"
        assert _acceptance(engines[name])[1] > 0, f"seed {fresh_seed}: {name} drafted nothing"
    assert _acceptance(engines["trained"])[0] > 0, f"seed {fresh_seed}: nothing kept"


def test_a_sequence_ending_inside_a_scan_leaves_the_rows_after_it_drafting_as_alone(
    fresh_seed, engines, monkeypatch
):
    """Request A (row 0) ends in its first scan, B (row 1) decodes on through the rounds in
    which A's row is dead: B's head K/V (every position its rounds rewrote) equals B's run
    alone. The head's passes used to pack the live rows together, so B took A's tokens and
    positions and wrote them into its own pages (τ at batch 8 fell 2.38 -> 2.16 on chat)."""
    rng = np.random.default_rng(fresh_seed)
    llm = engines["trained"]
    engine = llm.engine
    pages = {}  # a finished sequence's pages, taken as the block manager frees them
    free = engine.block_manager.free
    monkeypatch.setattr(engine.block_manager, "free",
                        lambda seq: (pages.__setitem__(seq.seq_id, list(seq.page_ids)),
                                     free(seq)))  # fmt: skip
    a, b = _code_prompts(llm, rng, 2, chars=200)
    a, b = a[:12], b[:40]  # (A's positions below B's: B's own rewrites never cover them)
    greedy = dict(ignore_eos=True, temperature=0.0)
    n = len(b) + 48 - 2 * GAMMA - 4  # positions every last round has rewritten

    def run(prompts, sampling):
        engine.runner.draft_kv = jax.tree.map(jnp.zeros_like, engine.runner.draft_kv)
        pages.clear()
        out, _ = _generate(llm, prompts, sampling)
        kv = engine.runner.draft_kv.kv
        ids = np.asarray(pages[max(pages)])  # B: the last request
        pos = np.arange(n)
        return out[-1], np.asarray(
            kv.pages[:, ids[pos // KW["page_size"]], :, pos % KW["page_size"]]
        )

    alone = run([b], SamplingParams(max_tokens=48, **greedy))
    both = run(
        [a, b], [SamplingParams(max_tokens=3, **greedy), SamplingParams(max_tokens=48, **greedy)]
    )
    assert both[0] == alone[0], f"seed {fresh_seed}"
    assert np.abs(alone[1]).sum(axis=(0, 1, 3, 4)).min() > 0, "a position the head never wrote"
    np.testing.assert_allclose(
        both[1], alone[1], rtol=1e-4, atol=1e-4, err_msg=f"seed {fresh_seed}"
    )


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "eagle", "eagle_head": "eagle-tiny"},
        {"method": "draft", "draft_model": "tiny-draft"},
    ],
    ids=["eagle", "draft model"],
)
def test_all_greedy_rounds_verify_without_the_rejection_rule(fresh_seed, engines, spec,
                                                            monkeypatch):  # fmt: skip
    """With rejection-sampled drafts (the default), a scan whose rows are all greedy drafts
    argmaxes and verifies them by matching (no q, no `rejection_verify`); one with a sampled row
    takes the rule. Greedy rounds give plain decoding's tokens (sampled ones its distribution:
    test_sampled_drafts_follow_the_q_handed_to_the_verifier). (Shapes of their own: the steps
    are traced here, where the spy sees them.)"""
    from jaxinfer.engine import model_runner

    traced = []
    rule = model_runner.rejection_verify
    monkeypatch.setattr(model_runner, "rejection_verify",
                        lambda *a: traced.append(1) or rule(*a))  # fmt: skip
    kw = KW | dict(max_num_seqs=3, decode_steps=3)
    llm = LLM("tiny", **kw, speculative={**spec, "num_draft_tokens": 2}, warmup=False)
    rng = np.random.default_rng(fresh_seed)
    prompts = _code_prompts(engines["plain"], rng, 2, chars=120)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=fresh_seed)
    want = [o.token_ids for o in engines["plain"].generate(prompts, greedy)]
    got = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert got == want and not traced, f"seed {fresh_seed}: greedy, rule traced {len(traced)}x"
    llm.generate(prompts, sampled)
    assert traced, f"seed {fresh_seed}: sampled rows verified without the rejection rule"


@pytest.mark.optimized
def test_training_raises_the_heads_agreement_with_the_target(fresh_seed, tmp_path):
    """`train_eagle` on tiny, briefly, on the target's own replies (`data: generated`) to
    prompts on text files, two draft steps unrolled: the held-out share of positions where the
    head's argmax is the target's rises from a random head's (~0) by at least 0.05, for the
    first draft and for the second, fed the head's own features (about 0.3-0.5 seen)."""
    from jaxinfer.engine.eagle import load_head
    from jaxinfer.train.eagle import generated_streams, load_eagle_config, train_eagle

    tc = load_eagle_config(None, ["name=eagle-test", "target=tiny", f"out_dir={tmp_path}",
                                  f"exclude_modules=[{','.join(UNSEEN)}]", "max_files=20",
                                  "data=generated", "prompts=24", "heldout_prompts=6",
                                  "reply_tokens=48", "unroll=2",
                                  "seq_len=64", "batch_size=8", "steps=40", "lr=3e-3",
                                  "warmup_steps=4", "eval_every=40", "eval_windows=8",
                                  f"seed={fresh_seed % 2**16}"])  # fmt: skip
    summary = train_eagle(tc, log=lambda *_: None)
    before, after = summary["heldout_agreement_before"], summary["heldout_agreement"]
    assert after >= before + 0.05, f"seed {fresh_seed}: agreement {before} -> {after}"
    second = summary["heldout_agreement_by_step"][1]
    assert second >= 0.05, f"seed {fresh_seed}: second draft's agreement {second}"
    cfg = LLM("tiny", warmup=False, num_pages=4, max_model_len=48).engine.runner.cfg
    train = generated_streams(tc, cfg.eos_token_ids[0], log=lambda *_: None)[0]  # its saved one
    ends = np.flatnonzero(np.diff(np.append(train[:, 1], 0)) == -1)  # each reply's last token
    assert len(ends) == 24 and train[0, 1] == 0, "24 prompts, each followed by its reply"
    assert set(train[ends, 0]) == {cfg.eos_token_ids[0]}, "a reply ends with EOS"
    head, info = load_head(tc.head, cfg)
    assert info["train"]["steps"] == 40 and head["fc"].shape == (512, 256)


@pytest.mark.parametrize("feature_layers", [(), (0, 2)], ids=["final", "fused"])
def test_unrolled_training_steps_see_what_drafting_sees(fresh_seed, feature_layers):
    """Training's draft step s at position i (`head_forward_unrolled`) is what drafting computes
    there: a causal forward of the head in which positions up to the chain's start c = i - s + 1
    read the target's features (a fused head: projected by its "fuse") and each later one the
    head's own previous output, built one draft at a time from scratch. The loss's agreement of
    step s is the share of positions i >= s - 1 of every window where g_s's argmax is the
    target's."""
    from jaxinfer.engine.eagle import (
        SHARED_KEYS,
        head_forward,
        init_head,
        shifted_features,
        true_features,
    )
    from jaxinfer.engine.loading import load_model
    from jaxinfer.models.attention import causal_attention
    from jaxinfer.models.dense import compute_logits
    from jaxinfer.train.eagle import head_forward_unrolled, head_loss

    cfg, params, _ = load_model("tiny", "float32", 0)
    shared = {k: params[k] for k in SHARED_KEYS if k in params}
    head = init_head(cfg, jax.random.key(fresh_seed % 2**31), feature_layers=feature_layers)
    rng = np.random.default_rng(fresh_seed)
    n, steps = 8, 3
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, n)), jnp.int32)
    width = cfg.hidden_size * max(len(feature_layers), 1)
    hidden = jnp.asarray(rng.standard_normal((2, n, width)), jnp.float32)
    gs = head_forward_unrolled(head, shared, cfg, hidden, tokens, steps)

    @jax.jit
    def padded_last(feats, length):
        pos = jnp.broadcast_to(jnp.arange(n), tokens.shape)
        attend = lambda q, k, v, carry, layer, kind: (causal_attention(q, k, v), carry)  # noqa: E731
        out = head_forward(head, shared, cfg, feats, tokens, pos, attend, None)[0]
        return lax.dynamic_index_in_dim(out, length - 1, axis=1, keepdims=False)

    def dense_last(feats, length):
        """The head's causal forward over the first `length` positions, at the last of them:
        `feats` zero-padded to n and all n tokens go in, which causal attention keeps out of the
        positions before (one shape, one compile)."""
        return padded_last(jnp.pad(feats, ((0, 0), (0, n - length), (0, 0))), length)

    for c in range(n - steps + 1):
        feats = true_features(head, cfg, shifted_features(hidden))[:, : c + 1]
        for s in range(1, steps + 1):
            want = dense_last(feats, c + s)
            np.testing.assert_allclose(np.asarray(gs[s - 1][:, c + s - 1]), np.asarray(want),
                                       rtol=1e-5, atol=1e-5,
                                       err_msg=f"chain at {c}, step {s}; seed {fresh_seed}")  # fmt: skip
            feats = jnp.concatenate([feats, want[:, None]], axis=1)

    # window 0's target agrees with draft step 1 everywhere, window 1's is noise
    noise = jnp.asarray(rng.standard_normal((1, n, cfg.vocab_size)), jnp.float32)
    target_logits = jnp.concatenate([compute_logits(shared, cfg, gs[0])[:1], noise])
    _, agree = head_loss(head, shared, cfg, hidden, target_logits, tokens, None, distill="soft",
                         feature_weight=1.0, feature_noise=0.0, unroll=steps)  # fmt: skip
    for s, g in enumerate(gs):
        hit = np.argmax(np.asarray(compute_logits(shared, cfg, g)), -1) == np.argmax(
            np.asarray(target_logits), -1
        )
        assert float(agree[s]) == pytest.approx(hit[:, s:].mean(), abs=1e-6), (s, fresh_seed)
    # loss weights: only the weighted positions count (none of window 1's, some of window 0's)
    w = rng.integers(0, 2, (2, n)) * np.array([[1], [0]])
    w[0, -1] = 1
    _, agree = head_loss(head, shared, cfg, hidden, target_logits, tokens, None, distill="soft",
                         feature_weight=1.0, feature_noise=0.0, unroll=steps,
                         weights=jnp.asarray(w, jnp.float32))  # fmt: skip
    for s, g in enumerate(gs):
        hit = np.argmax(np.asarray(compute_logits(shared, cfg, g)), -1) == np.argmax(
            np.asarray(target_logits), -1
        )
        want = (hit[:, s:] * w[:, s:]).sum() / w[:, s:].sum()
        assert float(agree[s]) == pytest.approx(want, abs=1e-6), (s, fresh_seed)
    # a batch of windows with no weighted position (all inside prompts): its loss is the feature
    # term's alone and its gradient finite (it was 0 / 0 and turned the head NaN for good)
    zero = jnp.zeros((2, n), jnp.float32)
    loss_of = lambda h, wts: head_loss(h, shared, cfg, hidden, target_logits, tokens, None,  # noqa: E731
                                       distill="soft", feature_weight=1.0, feature_noise=0.0,
                                       unroll=steps, weights=wts)[0]  # fmt: skip
    loss, grads = jax.value_and_grad(loss_of)(head, zero)
    feature_only = head_loss(head, shared, cfg, hidden, target_logits, tokens, None,
                             distill="soft", feature_weight=1.0, feature_noise=0.0, unroll=1,
                             weights=zero)[0]  # fmt: skip
    assert float(loss) == pytest.approx(float(feature_only), rel=1e-6), fresh_seed
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads)), fresh_seed


def test_generated_windows_weigh_the_positions_before_reply_tokens():
    """A generated stream's windows (token, is-reply) weigh position i by token i + 1's flag;
    a text stream's weigh every position."""
    from jaxinfer.train.eagle import window_weights

    flags = np.array([[0, 0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 1, 1, 1]])
    windows = np.stack([np.arange(14).reshape(2, 7), flags], axis=-1)
    tokens, weights = window_weights(windows)
    assert tokens.tolist() == np.arange(14).reshape(2, 7).tolist()
    assert weights.tolist() == [[0, 1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 1, 0]]
    tokens, weights = window_weights(np.arange(14).reshape(2, 7))
    assert weights.tolist() == np.ones((2, 7)).tolist()


def test_a_trained_head_is_accepted_more_than_a_random_one(fresh_seed, engines):
    """Same prompts (code the head never trained on), greedy: the shipped head (400 steps)
    keeps >= 15% of its drafts (about 29% seen) and 3x the random head's share (~0)."""
    rng = np.random.default_rng(fresh_seed)
    prompts = _code_prompts(engines["plain"], rng, 4)
    sampling = SamplingParams(max_tokens=48, ignore_eos=True)
    rates = {}
    for name in ("trained", "random"):
        _generate(engines[name], prompts, sampling)
        kept, drafted = _acceptance(engines[name])
        rates[name] = kept / drafted
    assert rates["trained"] >= 0.15 and rates["trained"] >= 3 * rates["random"], (
        f"seed {fresh_seed}: acceptance {rates}"
    )


@pytest.mark.optimized
@pytest.mark.parametrize("vocab", [False, True], ids=["whole_vocab", "draft_vocab"])
def test_sampled_drafts_follow_the_q_handed_to_the_verifier(fresh_seed, engines, vocab):
    """Rejection sampling is exact if each draft is drawn from the q the verifier divides by
    (the rule itself: test_speculative.py). 2,000 rows share one context, each with its own
    pages and seed; the first draft's empirical distribution must be q of its row (top-k 5:
    chi-square with 4 dof), and the second's, among the rows whose first draft is the most
    common one, their q of the second position. With a draft vocabulary (a random half of the
    tokens), q is zero outside it and every draft is one of its tokens."""
    from test_speculative import CHI2_CRITICAL_DF4, _chi2

    from jaxinfer.engine.draft_model import DraftState
    from jaxinfer.engine.eagle import EagleProposer
    from jaxinfer.engine.proposer import Round
    from jaxinfer.engine.sampler import SamplingBatch
    from jaxinfer.kv.cache import PageTable
    from jaxinfer.models.batch import RaggedBatch
    from jaxinfer.models.dense import forward_hidden

    runner = engines["trained"].engine.runner
    cfg, params = runner.cfg, runner.params
    rng = np.random.default_rng(fresh_seed)
    head = dict(runner.proposer.head)
    if vocab:
        head["draft_vocab"] = rng.choice(cfg.vocab_size, cfg.vocab_size // 2, replace=False)
    proposer = EagleProposer(cfg, head, GAMMA, rejection=True)
    n, length = 2_000, 9  # rows; context tokens (the last at p = length - 1 not yet fed)
    ctx = jnp.asarray(_code_prompts(engines["plain"], rng, 1)[0][:length], jnp.int32)
    draft_params, cache = proposer.init_pool(params, n + 1, 16, "auto", runner.shardings)
    page_ids = jnp.arange(1, n + 1, dtype=jnp.int32)[:, None]  # row i: page i + 1
    hidden = forward_hidden(params, cfg, ctx[None])[0]
    p = length - 1
    fill = RaggedBatch(jnp.tile(ctx[:p], n), jnp.tile(jnp.arange(p), n),
                       jnp.arange(n + 1, dtype=jnp.int32) * p,
                       PageTable(page_ids, jnp.full(n, p, jnp.int32)), p)  # fmt: skip
    cache = jax.jit(proposer.fill, static_argnums=4)(
        draft_params, cache, fill, jnp.tile(hidden[:p], (n, 1)), runner.attention)  # fmt: skip
    # the state a decode scan starts from (device_state's, for a context of `length` tokens)
    p0 = max(p - GAMMA - 1, -1)
    fed = np.zeros(GAMMA + 1, np.int32)
    fed[: p - p0] = np.asarray(ctx[p0:p])
    state = DraftState(jnp.tile(jnp.asarray(fed), (n, 1)), jnp.full(n, p0, jnp.int32))
    sb = SamplingBatch(jnp.full(n, 0.9), jnp.full(n, 5, jnp.int32), jnp.ones(n), jnp.zeros(n),
                       jnp.arange(n, dtype=jnp.uint32) + np.uint32(fresh_seed % 2**20),
                       jnp.full(n, p + 1, jnp.int32))  # fmt: skip
    rnd = Round(jnp.full(n, ctx[p]), jnp.full(n, p, jnp.int32), jnp.ones(n, bool), page_ids, sb,
                runner.attention)  # fmt: skip
    drafts, _, _, q = jax.jit(proposer.draft)(state, rnd, draft_params, cache)
    drafts, q = np.asarray(drafts), np.asarray(q)
    np.testing.assert_allclose(q.sum(-1), 1, atol=1e-5, err_msg=f"seed {fresh_seed}")
    if vocab:
        outside = np.setdiff1d(np.arange(cfg.vocab_size), head["draft_vocab"])
        assert np.isin(drafts, head["draft_vocab"]).all(), f"seed {fresh_seed}: a draft outside"
        assert not q[..., outside].any(), f"seed {fresh_seed}: q > 0 outside the vocabulary"
    assert np.allclose(q[:, 0], q[0, 0], atol=1e-5), f"seed {fresh_seed}: rows' q differ"
    stat = _chi2(drafts[:, 0], q[0, 0])
    assert stat < CHI2_CRITICAL_DF4, f"seed {fresh_seed}: first draft chi2 {stat:.1f}"
    first = np.bincount(drafts[:, 0]).argmax()
    rows = np.flatnonzero(drafts[:, 0] == first)
    stat = _chi2(drafts[rows, 1], q[rows[0], 1])
    assert stat < CHI2_CRITICAL_DF4, f"seed {fresh_seed}: second draft chi2 {stat:.1f}"


def test_eagle_config_errors_name_the_key(tmp_path):
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.engine.eagle import init_head, load_head, save_head
    from jaxinfer.models.presets import preset
    from jaxinfer.train.eagle import load_eagle_config

    with pytest.raises(ValueError, match=re.escape("engine.speculative.eagle_head (a head file")):
        EngineConfig(speculative={"method": "eagle"})
    with pytest.raises(ValueError, match=re.escape("eagle_head='x.safetensors'")):
        EngineConfig(speculative={"method": "ngram", "eagle_head": "x.safetensors"})
    with pytest.raises(ValueError, match=re.escape("engine.speculative.eagle_head='missing")):
        LLM("tiny", **KW, warmup=False,
            speculative={"method": "eagle", "eagle_head": "missing.safetensors"})  # fmt: skip
    other = preset("tiny-qwen3")  # a head trained for another target's shape
    path = save_head(tmp_path / "h.safetensors", init_head(other, jax.random.key(0)), other)
    with pytest.raises(ValueError, match=r"engine\.speculative\.eagle_head=.*hidden_size="):
        load_head(path, LLM("tiny", warmup=False, num_pages=4, max_model_len=48).engine.runner.cfg)
    with pytest.raises(ValueError, match="distill='kl' is invalid: must be one of soft, argmax"):
        load_eagle_config(None, ["name=x", "target=tiny", "distill=kl"])
    with pytest.raises(ValueError, match="feature_wieght"):
        load_eagle_config(None, ["name=x", "target=tiny", "feature_wieght=1"])
    with pytest.raises(ValueError, match="target"):
        load_eagle_config(None, ["name=x"])
    # fused features: no feature loss, distinct layers, layers the target has, a file that agrees
    with pytest.raises(ValueError, match=r"feature_layers=\[0, 2\] needs feature_weight=0"):
        load_eagle_config(None, ["name=x", "target=tiny", "feature_layers=[0,2]"])
    with pytest.raises(ValueError, match=r"feature_layers=\[1, 1\]: distinct"):
        load_eagle_config(None, ["name=x", "target=tiny", "feature_layers=[1,1]",
                                 "feature_weight=0"])  # fmt: skip
    tiny = LLM("tiny", warmup=False, num_pages=4, max_model_len=48).engine.runner.cfg
    for layers, meta, match in (((0, 1), [0], "do not fit its fuse"),
                                ((0, 1), [0, 9], "do not fit its fuse"),
                                ((), [0, 1], "names feature_layers")):  # fmt: skip
        head = init_head(tiny, jax.random.key(0), feature_layers=layers)
        path = save_head(tmp_path / "f.safetensors", head, tiny, {"feature_layers": meta})
        with pytest.raises(ValueError, match=match):
            load_head(path, tiny)


def test_engines_of_one_head_configuration_share_compiled_steps(engines):
    """The proposer, a static argument of the jitted steps, is equal across heads of one
    configuration (its weights are arguments), so the random head's engine reuses the trained
    one's compiles; another draft length is another configuration."""
    from jaxinfer.engine.eagle import EagleProposer

    trained, rand = (engines[name].engine.runner.proposer for name in ("trained", "random"))
    assert trained is not rand and trained == rand and hash(trained) == hash(rand)
    longer = EagleProposer(trained.target, trained.head, GAMMA + 1, rejection=trained.rejection)
    assert longer != trained


def test_generated_data_that_cannot_fit_fails_naming_the_keys(tmp_path):
    """`data: generated` with replies past the generating engine's max_model_len: one error
    naming snippet_chars and reply_tokens, not a stream missing the failed replies."""
    from jaxinfer.train.eagle import load_eagle_config, train_eagle

    tc = load_eagle_config(None, ["name=e", "target=tiny", f"out_dir={tmp_path}", "max_files=4",
                                  "data=generated", "prompts=4", "heldout_prompts=2",
                                  "reply_tokens=2000", "steps=2", "warmup_steps=1"])  # fmt: skip
    with pytest.raises(ValueError, match=r"4 of the train prompts failed \(snippet_chars=400, "
                                         r"reply_tokens=2000\).*exceeds max_model_len"):  # fmt: skip
        train_eagle(tc, log=lambda *_: None)
    assert not (tmp_path / "generated").exists()


def test_repeat_cut_and_lookup_share_on_hand_made_replies():
    """`cut_at_repeat` stops before the first n-gram seen earlier in the reply; `lookup_share`
    counts the tokens whose n predecessors occurred earlier followed by that same token."""
    from jaxinfer.train.eagle import cut_at_repeat, lookup_share

    loop = np.array([5, 1, 2, 3, 1, 2, 3, 1, 2, 9])
    kept, cut = cut_at_repeat(loop, 3)
    assert kept.tolist() == [5, 1, 2, 3] and cut  # (1, 2, 3) again at index 4
    assert cut_at_repeat(loop, 5)[0].tolist() == [5, 1, 2, 3]  # (1, 2, 3, 1, 2) at 1 and 4
    kept, cut = cut_at_repeat(loop, 6)  # (1, 2, 3, 1, 2, 3) at 1, then (1, 2, 3, 1, 2, 9) at 4
    assert kept.tolist() == loop.tolist() and not cut
    assert cut_at_repeat(np.arange(8), 2)[1] is False
    # predecessors (1,2,3)->1 at 4 new; (2,3,1)->2 new; (3,1,2)->3 new; (1,2,3)->1 at 7 seen
    assert lookup_share(loop, 3) == (2, 10)  # index 7 (1 after 1,2,3) and 8 (2 after 2,3,1)
    assert lookup_share(np.arange(8), 3) == (0, 8)


def test_generated_replies_sampled_seeded_and_cut_where_they_repeat(tmp_path):
    """`data: generated` with `cut_repeats`: no kept reply repeats an n-gram of itself, only
    uncut replies end with EOS, and the stats count what was kept; `reply_temperature` samples
    the replies with per-prompt seeds: the same config gives the same stream, and it is not the
    greedy one. (tiny, fixed prompts and seeds: deterministic.)"""
    from jaxinfer.train.eagle import generated_streams, load_eagle_config

    cfg = LLM("tiny", warmup=False, num_pages=4, max_model_len=48).engine.runner.cfg
    eos = cfg.eos_token_ids[0]

    def streams(out, *extra):
        tc = load_eagle_config(None, ["name=e", "target=tiny", f"out_dir={tmp_path / out}",
                                      "max_files=8", "data=generated", "prompts=6",
                                      "heldout_prompts=2", "reply_tokens=40", *extra])  # fmt: skip
        return generated_streams(tc, eos, log=lambda *_: None)

    def replies(stream):
        flag = np.append(np.insert(stream[:, 1], 0, 0), 0)
        starts, ends = np.flatnonzero(np.diff(flag) == 1), np.flatnonzero(np.diff(flag) == -1)
        return [stream[a:b, 0] for a, b in zip(starts, ends, strict=True)]

    greedy, _, _ = streams("greedy")
    train, _, stats = streams("cut", "cut_repeats=3")
    got = replies(train)
    assert len(got) == 6 and len(replies(greedy)) == 6
    cut = [r for r in got if r[-1] != eos]
    assert len(cut) == stats["train"]["cut"] > 0, "greedy replies of tiny loop: some are cut"
    for r in got:
        body = r if r[-1] != eos else r[:-1]
        grams = [tuple(body[i : i + 3]) for i in range(len(body) - 2)]
        assert len(grams) == len(set(grams)), f"a kept reply repeats a 3-gram: {body}"
    assert stats["train"]["reply_tokens"] == sum(len(r) - (r[-1] == eos) for r in got)
    sampled = streams("t1", "reply_temperature=0.8", "seed=3")[0]
    again = streams("t2", "reply_temperature=0.8", "seed=3")[0]
    np.testing.assert_array_equal(sampled, again)
    assert not np.array_equal(sampled, greedy)


def test_generated_replies_past_the_end_of_turn(tmp_path, monkeypatch):
    """`reply_past_end`: the target decodes each reply to `reply_tokens` whatever it samples
    (ignore_eos), the reply gets no EOS appended, and chunks made without it are not reused."""
    from jaxinfer.train.eagle import generated_streams, load_eagle_config

    cfg = LLM("tiny", warmup=False, num_pages=4, max_model_len=48).engine.runner.cfg
    eos = cfg.eos_token_ids[0]
    asked = []
    generate = LLM.generate

    def spy(self, prompts, sampling, *a, **k):
        asked.extend(sampling)
        return generate(self, prompts, sampling, *a, **k)

    monkeypatch.setattr(LLM, "generate", spy)

    def streams(*extra):
        tc = load_eagle_config(None, ["name=e", "target=tiny", f"out_dir={tmp_path}",
                                      "max_files=8", "data=generated", "prompts=4",
                                      "heldout_prompts=2", "reply_tokens=24", *extra])  # fmt: skip
        return generated_streams(tc, eos, log=lambda *_: None)

    streams()
    assert asked and not any(s.ignore_eos for s in asked)
    asked.clear()
    train, _, stats = streams("reply_past_end=true")
    assert len(asked) == 6 and all(s.ignore_eos for s in asked), "the chunks were reused"
    assert stats["train"]["reply_tokens"] == 4 * 24, stats  # every reply to reply_tokens
    assert int(train[:, 1].sum()) == 4 * 24, "a reply got an EOS appended"


def test_generated_replies_kept_by_chunk_and_reused(tmp_path):
    """`data: generated` makes `reply_chunk` prompts at a time and keeps each chunk: a run with
    more prompts reuses the finished chunks unchanged (the file is not made again) and makes
    only the rest, and its stream starts with the smaller run's; a chunk made with other
    settings is made again. (tiny, fixed prompts and seeds: deterministic.)"""
    from jaxinfer.train.eagle import generated_streams, load_eagle_config

    cfg = LLM("tiny", warmup=False, num_pages=4, max_model_len=48).engine.runner.cfg
    eos = cfg.eos_token_ids[0]

    def streams(prompts, *extra):
        tc = load_eagle_config(None, ["name=e", "target=tiny", f"out_dir={tmp_path}",
                                      "max_files=8", "data=generated", f"prompts={prompts}",
                                      "heldout_prompts=2", "reply_tokens=24", "reply_chunk=3",
                                      "reply_batch=4", *extra])  # fmt: skip
        return generated_streams(tc, eos, log=lambda *_: None)

    first, heldout, stats = streams(3)
    # a chunk is written whole and renamed into place: a new file (inode) each time it is made
    made = {p.name: p.stat().st_ino for p in (tmp_path / "generated").iterdir()}
    assert sorted(made) == ["heldout-0-2.npz", "train-0-3.npz"]
    more, heldout_again, more_stats = streams(5)
    kept = {p.name: p.stat().st_ino for p in (tmp_path / "generated").iterdir()}
    assert sorted(kept) == ["heldout-0-2.npz", "train-0-3.npz", "train-3-5.npz"]
    assert all(kept[name] == t for name, t in made.items()), "a finished chunk was made again"
    np.testing.assert_array_equal(more[: len(first)], first)
    np.testing.assert_array_equal(heldout_again, heldout)
    assert len(more) > len(first) and more_stats["train"]["replies"] == 5
    assert more_stats["train"]["reply_tokens"] > stats["train"]["reply_tokens"]
    hot = streams(3, "reply_temperature=0.9")[0]  # other settings: not the kept chunk
    assert (tmp_path / "generated" / "train-0-3.npz").stat().st_ino != made["train-0-3.npz"]
    assert not np.array_equal(hot, first)


def test_tapped_features_are_each_layers_normalised_residual_stream(fresh_seed):
    """`forward_hidden(taps=...)`: the residual stream after each tapped layer, RMS-normalised
    without a weight, concatenated in the order asked: what the model cut after that layer
    returns through a final norm of ones."""
    from jaxinfer.engine.loading import load_model
    from jaxinfer.models.dense import forward_hidden

    cfg, params, _ = load_model("tiny", "float32", 0)
    rng = np.random.default_rng(fresh_seed)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
    taps = (cfg.num_layers - 1, 0, 2)
    hidden, feats = forward_hidden(params, cfg, tokens, taps)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(forward_hidden(params, cfg, tokens)),
                               rtol=1e-6, atol=1e-6, err_msg=f"seed {fresh_seed}")  # fmt: skip
    e = cfg.hidden_size
    assert feats.shape == (2, 11, len(taps) * e)
    for j, layer in enumerate(taps):
        cut = cfg.replace(num_layers=layer + 1)
        cut_params = {**params, "layers": params["layers"][: layer + 1],
                      "final_norm": jnp.ones_like(params["final_norm"])}  # fmt: skip
        want = forward_hidden(cut_params, cut, tokens)
        np.testing.assert_allclose(np.asarray(feats[..., j * e : (j + 1) * e]), np.asarray(want),
                                   rtol=1e-5, atol=1e-5,
                                   err_msg=f"layer {layer}; seed {fresh_seed}")  # fmt: skip


@pytest.fixture(scope="module")
def fused_head(tmp_path_factory) -> str:
    """A random fused head (EAGLE-3's features: tiny's layers 0 and 2), saved as training saves
    one."""
    from jaxinfer.engine.eagle import init_head, save_head
    from jaxinfer.engine.loading import load_model

    cfg, _, _ = load_model("tiny", "float32", 0)
    head = init_head(cfg, jax.random.key(7), feature_layers=(0, 2))
    path = tmp_path_factory.mktemp("fused") / "head.safetensors"
    return str(save_head(path, head, cfg, {"feature_layers": [0, 2]}))


def test_a_fused_heads_pool_holds_the_tapped_features_and_its_output_equals_plain(
        fresh_seed, engines, fused_head):  # fmt: skip
    """A head on tapped layers (`feature_layers`) in the engine: outputs equal plain decoding's
    (greedy and sampled), and in the middle of a request its feature pool holds, at every
    position the host has read, the tapped features the model computes for those tokens."""
    from jaxinfer.models.dense import forward_hidden

    llm = LLM("tiny", **KW, speculative=dict(method="eagle", num_draft_tokens=GAMMA,
                                              draft_sampling="greedy", eagle_head=fused_head))  # fmt: skip
    runner = llm.engine.runner
    assert runner.proposer.feature_layers == (0, 2)
    rng = np.random.default_rng(fresh_seed)
    prompts = [*_code_prompts(engines["plain"], rng, 2), rng.integers(3, 4000, 13).tolist()]
    sampling = [SamplingParams(max_tokens=20, ignore_eos=True),
                SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, top_k=40,
                               seed=fresh_seed)]  # fmt: skip
    for sp in sampling:
        plain, _ = _generate(engines["plain"], prompts, sp)
        spec, _ = _generate(llm, prompts, sp)
        assert spec == plain, f"seed {fresh_seed}: a fused head's output differs ({sp})"

    eng = llm.engine
    seq = eng.add_request(prompts[0], SamplingParams(max_tokens=40, ignore_eos=True))
    while len(seq.output_token_ids) < 12 and not seq.is_finished:
        eng.step()
    assert seq.error is None and not seq.is_finished, f"seed {fresh_seed}: {seq.error}"
    tokens, pages = list(seq.all_token_ids), list(seq.page_ids)
    _, want = forward_hidden(runner.params, runner.cfg, jnp.asarray([tokens]), (0, 2))
    pool = np.asarray(runner.draft_kv.features)
    n = len(tokens) - 1  # the last read token's features may not be written yet
    ps = pool.shape[1]
    got = np.stack([pool[pages[i // ps], i % ps] for i in range(n)])
    np.testing.assert_allclose(got, np.asarray(want[0, :n]), rtol=1e-4, atol=1e-4,
                               err_msg=f"seed {fresh_seed}")  # fmt: skip
    while eng.has_unfinished():
        eng.step()


def test_a_fused_head_trains_and_loads_with_its_layers(fresh_seed, tmp_path):
    """`feature_layers` in a train config: the saved head has its fuse and names its layers,
    and an engine loading it taps those layers; a layer the target lacks fails naming the key.
    With `draft_vocab` the head carries the training text's most frequent tokens and the
    engine drafts from them."""
    from jaxinfer.engine.eagle import load_head
    from jaxinfer.train.eagle import load_eagle_config, text_stream, train_eagle

    base = ["name=f", "target=tiny", f"out_dir={tmp_path}", "max_files=4", "seq_len=32",
            "batch_size=2", "steps=3", "warmup_steps=1", "eval_every=3", "eval_windows=2",
            "unroll=2", "feature_weight=0", f"seed={fresh_seed % 2**16}"]  # fmt: skip
    with pytest.raises(ValueError, match=r"feature_layers=\[0, 4\]: target='tiny' has 4 layers"):
        train_eagle(load_eagle_config(None, [*base, "feature_layers=[0,4]"]), log=lambda *_: None)
    tc = load_eagle_config(None, [*base, "feature_layers=[3,1]", "draft_vocab=100"])
    summary = train_eagle(tc, log=lambda *_: None)
    assert np.isfinite(summary["heldout_loss"]), f"seed {fresh_seed}: {summary['heldout_loss']}"
    assert 0 < summary["draft_vocab_coverage"] < 1, f"seed {fresh_seed}: {summary}"
    llm = LLM("tiny", warmup=False, num_pages=8, max_model_len=64,
              speculative={"method": "eagle", "num_draft_tokens": 2, "eagle_head": tc.head})  # fmt: skip
    cfg = llm.engine.runner.cfg
    head, info = load_head(tc.head, cfg)
    assert info["feature_layers"] == [3, 1] and head["fuse"].shape == (512, 256)
    assert llm.engine.runner.proposer.feature_layers == (3, 1)
    vocab = head["draft_vocab"]
    np.testing.assert_array_equal(llm.engine.runner.proposer.draft_vocab, vocab)
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else cfg.bos_token_id
    counts = np.bincount(text_stream(llm.tokenizer, tc, eos, "train"), minlength=cfg.vocab_size)
    assert len(vocab) == 100 and (np.diff(vocab) > 0).all()
    assert counts[vocab].min() >= np.delete(counts, vocab).max(), "not the most frequent tokens"


def test_a_draft_vocabulary_head_drafts_and_outputs_as_plain(fresh_seed, engines, tmp_path):
    """A head saved with a draft vocabulary (the shipped tiny head; the vocabulary half of the
    tokens plain decoding outputs, and a random half of the rest) loads with it, drafts (greedy
    drafts: the argmax over the vocabulary) and has drafts kept, and its outputs equal plain
    decoding's, greedy and sampled: tokens outside the vocabulary come from verification alone.
    (Sampled drafts: test_sampled_drafts_follow_the_q_handed_to_the_verifier.)"""
    from jaxinfer.engine.eagle import load_head, save_head

    rng = np.random.default_rng(fresh_seed)
    cfg = engines["plain"].engine.runner.cfg
    prompts = _code_prompts(engines["plain"], rng, 3)
    sampling = [SamplingParams(max_tokens=20, ignore_eos=True),
                SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, top_k=40,
                               seed=fresh_seed)]  # fmt: skip
    plain = [_generate(engines["plain"], prompts, sp)[0] for sp in sampling]
    seen = np.unique(np.concatenate([np.asarray(t) for out in plain for t in out]))
    rest = np.setdiff1d(np.arange(cfg.vocab_size), seen)
    vocab = np.concatenate([rng.choice(seen, len(seen) // 2, replace=False),
                            rng.choice(rest, len(rest) // 2, replace=False)])  # fmt: skip
    head, info = load_head("eagle-tiny", cfg)
    path = save_head(tmp_path / "head.safetensors", head, cfg, info, draft_vocab=vocab)
    loaded, _ = load_head(path, cfg)
    np.testing.assert_array_equal(loaded["draft_vocab"], np.sort(vocab))
    llm = LLM("tiny", **KW, speculative=dict(method="eagle", num_draft_tokens=GAMMA,
                                              draft_sampling="greedy", eagle_head=str(path)))  # fmt: skip
    assert len(llm.engine.runner.proposer.draft_vocab) == len(vocab)
    for sp, want in zip(sampling, plain, strict=True):
        got, _ = _generate(llm, prompts, sp)
        assert got == want, f"seed {fresh_seed}: the draft-vocabulary head's output differs ({sp})"
    kept, drafted = _acceptance(llm)
    assert drafted > 0 and kept > 0, f"seed {fresh_seed}: {kept} of {drafted} drafts kept"


def test_a_draft_vocabulary_that_is_not_token_ids_fails_naming_it(tmp_path):
    from jaxinfer.engine.eagle import check_draft_vocab, top_tokens

    assert top_tokens(np.array([5, 3, 5, 1, 3, 5]), 2, 8).tolist() == [3, 5]
    assert top_tokens(np.array([2, 2]), 3, 4).tolist() == [0, 1, 2]  # ties to the lower id
    for bad in ([], [1, 1], [-1, 2], [0, 8], [[1, 2]], [0.5]):
        with pytest.raises(ValueError, match=r"draft_vocab must be distinct token ids in 0 \.\. 7"):
            check_draft_vocab(np.asarray(bad), 8)


@pytest.mark.parametrize("head", ["tied", "untied", "untied_int8"])
def test_the_draft_lm_head_gives_the_targets_logits_at_its_tokens(fresh_seed, head):
    """`draft_lm_head` (the target's LM head at the vocabulary's ids) against the target's own
    logits at those ids, for a tied embedding, an untied LM head and an int8 one."""
    from jaxinfer.engine.eagle import draft_lm_head
    from jaxinfer.engine.loading import model_config
    from jaxinfer.models.dense import compute_logits
    from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight

    rng = np.random.default_rng(fresh_seed)
    cfg = model_config("tiny", "float32").replace(tie_word_embeddings=head == "tied")
    e, v = cfg.hidden_size, cfg.vocab_size
    params = {"embed": jnp.asarray(rng.standard_normal((v, e)), jnp.float32)}
    if head != "tied":
        w = jnp.asarray(rng.standard_normal((e, v)), jnp.float32)
        params["lm_head"] = (QuantizedWeight(WEIGHT_FORMATS["int8"].quantize(w, 1),
                                             WEIGHT_FORMATS["int8"])
                             if head == "untied_int8" else w)  # fmt: skip
    ids = jnp.asarray(np.sort(rng.choice(v, v // 3, replace=False)), jnp.int32)
    g = jnp.asarray(rng.standard_normal((5, e)), jnp.float32)
    got = np.asarray(g @ draft_lm_head(params, cfg, ids))
    want = np.asarray(compute_logits(params, cfg, g))[:, np.asarray(ids)]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.abs(want).max(),
                               err_msg=f"{head}; seed {fresh_seed}")  # fmt: skip
