"""Speculative decoding (`engine.speculative`): the n-gram proposer and exact verification.

Verification keeps a draft only when it equals the target's own sample at its row, drawn with
that position's key (`sampler.accept_drafts`), so speculative output must equal plain output
token for token, greedy or sampled (temperature, top-k, top-p, min-p) - the strongest form of
"the same distribution". A deliberately wrong acceptance rule must break that.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.llm import LLM
from jaxinfer.engine.ngram import NgramProposer, ngram_drafts
from jaxinfer.engine.proposer import Round
from jaxinfer.engine.request import SamplingParams, Sequence

# batch_invariant: outputs equal token for token across engines that batch a row differently
# only under batch-invariant numerics (test_eagle.py's KW says why)
KW = dict(max_num_seqs=4, max_num_batched_tokens=64, num_pages=64, page_size=16,
          max_model_len=256, batch_invariant=True)  # fmt: skip


def brute_force_drafts(tokens: list[int], gamma: int, max_n: int, min_n: int) -> list[int]:
    """The definition, spelled out: the latest earlier occurrence of the longest recurring
    suffix, and the tokens after it, continued periodically past the end."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            out = list(tokens)
            for _ in range(gamma):
                out.append(out[len(out) - (len(tokens) - n - starts[-1])])
            return out[len(tokens) :]
    return []


def test_ngram_drafts_follow_the_definition(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    for trial in range(200):
        tokens = rng.integers(0, 5, int(rng.integers(1, 30))).tolist()  # small vocab: repeats
        gamma, max_n = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        min_n = int(rng.integers(1, max_n + 1))
        want = brute_force_drafts(tokens, gamma, max_n, min_n)
        got = ngram_drafts(np.asarray(tokens), gamma, max_n, min_n)
        assert got == want, (f"seed {fresh_seed} trial {trial}", tokens, gamma, max_n, min_n)


def test_device_drafts_equal_host_drafts_as_rounds_accept_some(fresh_seed):
    """The device form tracks each row's context from the previous round's drafts and the new
    last token (as a decode scan feeds it) and drafts what the host form drafts."""
    rng = np.random.default_rng(fresh_seed)
    gamma, rows = 3, 5
    proposer = NgramProposer(gamma, max_n=3, min_n=1, max_len=128)

    class Seq:
        def __init__(self, toks):
            self.all_token_ids = toks

    contexts = [rng.integers(0, 4, int(rng.integers(2, 12))).tolist() for _ in range(rows)]
    state = proposer.device_state([Seq(c) for c in contexts], rows)
    state = jax.tree.map(jnp.asarray, state)
    step = jax.jit(proposer.draft)
    for rnd in range(12):
        tokens = jnp.asarray([c[-1] for c in contexts])
        positions = jnp.asarray([len(c) - 1 for c in contexts])
        drafts, state, _, _ = step(state, Round(tokens, positions), None, None)
        for i, c in enumerate(contexts):
            host = ngram_drafts(np.asarray(c), gamma, 3, 1)
            if host:
                assert drafts[i].tolist() == host, (f"seed {fresh_seed} round {rnd} row {i}", c)
            # the target keeps k of the drafts and samples one more token
            k = int(rng.integers(0, gamma + 1))
            c += [*drafts[i].tolist()[:k], int(rng.integers(0, 4))]


def _generate(prompts, sampling, warmup=True, **engine):
    """(token ids per prompt, the engine). warmup=False compiles only the executables the run
    uses (a reference run, or an engine whose compiles after warm-up are not checked)."""
    llm = LLM("tiny", **KW, **engine, warmup=warmup)
    return [o.token_ids for o in llm.generate(prompts, sampling)], llm.engine


def _prompts(rng):
    """Repetitive prompts (n-gram drafts get accepted) and a random one."""
    motif = rng.integers(3, 400, 7).tolist()
    return [motif * 4, rng.integers(3, 400, 19).tolist(), [*motif, 9, 9] * 3]


@pytest.mark.parametrize("decode_steps", [1, 4], ids=["mixed steps", "decode scans"])
def test_speculative_output_equals_plain_output_token_for_token(fresh_seed, decode_steps,
                                                                 monkeypatch):  # fmt: skip
    rng = np.random.default_rng(fresh_seed)
    prompts = _prompts(rng)
    sampling = [
        SamplingParams(max_tokens=20, ignore_eos=True),  # greedy
        SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, top_k=40, seed=fresh_seed),
        SamplingParams(
            max_tokens=20,
            ignore_eos=True,
            temperature=0.8,
            top_p=0.9,
            min_p=0.05,
            seed=fresh_seed + 1,
        ),
    ]
    plain, _ = _generate(prompts, sampling, False, decode_steps=decode_steps)
    if decode_steps > 1:  # a draft model drafts in the decode scans
        spec, engine = _generate(prompts, sampling, decode_steps=decode_steps,
                                 speculative={"method": "draft", "draft_model": "tiny-draft",
                                              "num_draft_tokens": 3, "draft_sampling": "greedy"})  # fmt: skip
        assert spec == plain, f"seed {fresh_seed}, draft model"
        assert engine.compiles_after_warmup == 0
        assert sum(r.accepted_draft_tokens for r in engine.step_records) > 0
    host_drafts = []  # (prompt, output so far, draft) of every draft proposed on the host
    propose = NgramProposer.propose

    def recorded(self, seq):
        draft = propose(self, seq)
        host_drafts.append((list(seq.prompt_token_ids), list(seq.output_token_ids), draft))
        return draft

    monkeypatch.setattr(NgramProposer, "propose", recorded)
    spec, engine = _generate(prompts, sampling, decode_steps=decode_steps,
                             speculative={"method": "ngram", "num_draft_tokens": 3})  # fmt: skip
    monkeypatch.undo()
    assert spec == plain, f"seed {fresh_seed}, n-gram"
    assert engine.compiles_after_warmup == 0
    records = engine.step_records
    drafted = sum(r.draft_tokens for r in records)
    accepted = sum(r.accepted_draft_tokens for r in records)
    assert drafted > 0, f"seed {fresh_seed}"  # the motif is drafted
    # Kept, if any draft could be: a draft whose first token is the token that came at its
    # position. Mixed steps: the drafts the host proposed (a step dispatched while the previous
    # one's token is still on the device drafts nothing, so not every position is verified).
    # Decode scans draft on the device every round: a position whose n-gram draft (from the same
    # context) starts with the token that came there is a verification's start, or inside a run
    # already kept.
    outs = {tuple(p): out for p, out in zip(prompts, spec, strict=True)}
    if decode_steps == 1:
        keepable = any(draft[:1] == outs[tuple(p)][len(o) : len(o) + 1]
                       for p, o, draft in host_drafts)  # fmt: skip
    else:
        keepable = any(
            engine.proposer.propose(Sequence(0, p, sp, output_token_ids=out[:i]))[:1] == [out[i]]
            for p, sp, out in zip(prompts, sampling, spec, strict=True)
            for i in range(1, len(out) - 1)  # (token 0 is the prefill's: never a draft)
        )  # fmt: skip
    assert accepted > 0 or not keepable, (f"seed {fresh_seed}", drafted, accepted)
    verifications = sum(sum(r.accepted_hist or []) for r in records)
    # each verification made 1 + its kept drafts of the tokens after a sequence's first (the
    # prefill's); decodes without drafts (no n-gram recurred) are not verifications
    assert verifications + accepted <= sum(len(t) for t in spec) - len(spec)


def test_speculative_config_names_the_bad_key():
    from jaxinfer.engine.config import EngineConfig

    with pytest.raises(
        ValueError, match=re.escape("engine.speculative.method='medusa' is invalid")
    ):
        EngineConfig(speculative={"method": "medusa"})
    with pytest.raises(ValueError, match=re.escape("engine.speculative.num_draft_tokens=0")):
        EngineConfig(speculative={"method": "ngram", "num_draft_tokens": 0})
    with pytest.raises(
        ValueError, match=re.escape("engine.speculative.ngram_min=3 exceeds ngram_max=2")
    ):
        EngineConfig(speculative={"method": "ngram", "ngram_min": 3, "ngram_max": 2})
    with pytest.raises(ValueError, match=re.escape("engine.speculative.gamma is unknown")):
        EngineConfig(speculative={"gamma": 3})
    # too many drafts: past the cap (100,000 ate memory in warm-up), or past max_model_len
    with pytest.raises(ValueError, match=re.escape("num_draft_tokens=100000 is invalid: must be "
                                                   "less than or equal to 64")):  # fmt: skip
        EngineConfig(speculative={"method": "ngram", "num_draft_tokens": 100_000})
    with pytest.raises(ValueError, match=re.escape("engine.speculative.num_draft_tokens=40 "
                                                   "leaves no room in engine.max_model_len=32: "
                                                   "must be <= max_model_len - 2 = 30")):  # fmt: skip
        EngineConfig(max_model_len=32, speculative={"method": "ngram", "num_draft_tokens": 40})
    EngineConfig(max_model_len=32, speculative={"method": "ngram", "num_draft_tokens": 30})


def test_summary_reports_acceptance():
    from jaxinfer.metrics.summary import summarize

    steps = [{"time": 0.0, "num_seqs": 1, "num_batched_tokens": 4, "kv_pages_used": 1,
              "kv_pages_total": 8, "draft_tokens": 9, "accepted_draft_tokens": 4,
              "accepted_hist": [1, 0, 2, 0]}]  # fmt: skip
    s = summarize([], steps)
    assert s["draft_acceptance_rate"] == pytest.approx(4 / 9)
    assert s["tokens_per_verification"] == pytest.approx(1 + 4 / 3)
    assert s["acceptance_by_position"] == pytest.approx([2 / 3, 2 / 3, 0.0])


def test_rejection_sampled_drafts_in_the_engine(fresh_seed):
    """Sampled drafts (the default): greedy requests still decode exactly as plain decoding,
    sampled ones keep drafts, no compile after warm-up. (That sampled outputs follow the
    target's distribution is checked at the rule's level below: 20,000 rows per position.)"""
    rng = np.random.default_rng(fresh_seed)
    prompts = [rng.integers(3, 4000, int(n)).tolist() for n in (7, 19)]
    sampling = [SamplingParams(max_tokens=20, ignore_eos=True),
                SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.95,
                               seed=fresh_seed)]  # fmt: skip
    plain, _ = _generate(prompts, sampling, False, decode_steps=4)
    spec, engine = _generate(prompts, sampling, decode_steps=4,
                             speculative={"method": "draft", "draft_model": "tiny-draft",
                                          "num_draft_tokens": 3})  # fmt: skip
    assert spec[0] == plain[0], f"seed {fresh_seed}: greedy"
    assert len(spec[1]) == 20 and all(0 <= t < 4096 for t in spec[1])
    assert engine.compiles_after_warmup == 0
    assert sum(r.accepted_draft_tokens for r in engine.step_records) > 0


def test_the_target_as_its_own_draft_keeps_every_greedy_draft(fresh_seed):
    """With the draft = the target, greedy drafts are the target's own tokens: every
    verification keeps all γ unless the token limit cuts it. This checks the draft's cache:
    its catch-up over (token at p - 1, token at p) each round, after kept and cut rounds."""
    rng = np.random.default_rng(fresh_seed)
    prompts = [rng.integers(3, 4000, int(n)).tolist() for n in (5, 30)]
    gamma, max_tokens = 3, 33  # 32 tokens after the prefill's first: 8 rounds of 4
    _, engine = _generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), False,
                          decode_steps=4, speculative={"method": "draft", "draft_model": "tiny",
                                                       "num_draft_tokens": gamma})  # fmt: skip
    hist = [0] * (gamma + 1)
    for r in engine.step_records:
        for j, c in enumerate(r.accepted_hist or []):
            hist[j] += c
    assert hist == [0, 0, 0, 8 * len(prompts)], (f"seed {fresh_seed}", hist)


def test_draft_model_must_share_the_vocabulary():
    with pytest.raises(ValueError, match=r"draft_model='preset:tiny-qwen3' has a vocabulary"):
        LLM("tiny", **KW, warmup=False,
            speculative={"method": "draft", "draft_model": "preset:tiny-qwen3"})  # fmt: skip
    from jaxinfer.engine.config import EngineConfig

    with pytest.raises(ValueError, match="draft_model names the draft model of method 'draft'"):
        EngineConfig(speculative={"method": "ngram", "draft_model": "tiny-draft"})


def test_self_speculation_equals_plain_decoding(fresh_seed):
    """The target's first layers with its head as the draft (early exit)."""
    rng = np.random.default_rng(fresh_seed)
    prompts = [rng.integers(3, 4000, 9).tolist()]
    sampling = SamplingParams(max_tokens=17, ignore_eos=True, temperature=0.7, seed=fresh_seed)
    plain, _ = _generate(prompts, sampling, False, decode_steps=4)
    spec, engine = _generate(prompts, sampling, False, decode_steps=4,
                             speculative={"method": "self", "draft_layers": 2,
                                          "num_draft_tokens": 2, "draft_sampling": "greedy"})  # fmt: skip
    assert spec == plain, f"seed {fresh_seed}"
    draft = engine.runner.draft_params
    assert draft["embed"] is not None and len(draft["layers"]) == 2
    assert sum(r.draft_tokens for r in engine.step_records) > 0
    with pytest.raises(ValueError, match="draft_layers=4 must be fewer than the model's 4"):
        LLM("tiny", **KW, warmup=False, speculative={"method": "self", "draft_layers": 4})


def test_a_wrong_acceptance_rule_changes_the_output(fresh_seed, monkeypatch):
    """Keeping every draft (no check against the target) must not pass for exact. (The file's
    last engine test: its jax.clear_caches drops the steps the tests before it compiled.)"""
    import jaxinfer.engine.model_runner as model_runner

    rng = np.random.default_rng(fresh_seed)
    prompts = _prompts(rng)
    sampling = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=fresh_seed)
    plain, _ = _generate(prompts, sampling, False, decode_steps=4)
    monkeypatch.setattr(model_runner, "accept_drafts", lambda tok, drafts, n: 1 + n)
    jax.clear_caches()  # (the steps were traced with the real rule)
    try:
        wrong, _ = _generate(prompts, sampling, False, decode_steps=4,
                             speculative={"method": "ngram", "num_draft_tokens": 3})  # fmt: skip
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert wrong != plain, f"seed {fresh_seed}"


# ---- rejection sampling (sampled drafts) ---------------------------------------------------------

CHI2_CRITICAL_DF4 = 33.4  # P(chi2 with 4 dof > 33.4) ~ 1e-6: a correct rule fails ~1e-6 per check


def _simulate(rule, p, q, n, seed, gamma=3):
    """Run speculative sampling to the end of `p` (positions [L, V], context-free target) for n
    independent rows (seeds seed..seed+n-1) with drafts drawn from q [L, V]; tokens [n, L]."""
    from jaxinfer.engine.sampler import DRAFT_STREAM, SamplingBatch, draw_from

    length = p.shape[0]
    sb = SamplingBatch(jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.zeros(n),
                       jnp.arange(seed, seed + n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32))  # fmt: skip
    pad = lambda a: jnp.concatenate([a, jnp.tile(a[-1:], (gamma + 1, 1))])  # noqa: E731
    p_all, q_all = pad(jnp.asarray(p)), pad(jnp.asarray(q))
    out = np.full((n, length + gamma + 1), -1)
    pos = np.zeros(n, np.int64)

    @jax.jit
    def round_(pos):
        cols = jnp.asarray(pos)[:, None] + jnp.arange(gamma + 1)
        pr, qr = p_all[cols], q_all[cols[:, :gamma]]
        drafts = jnp.stack([draw_from(qr[:, j], sb, jnp.asarray(pos) + j, DRAFT_STREAM)
                            for j in range(gamma)], axis=1)  # fmt: skip
        bonus = draw_from(pr[:, gamma], sb, jnp.asarray(pos) + gamma, 0)
        return rule(pr, qr, drafts, bonus, sb, jnp.asarray(pos, jnp.int32))

    while (pos < length).any():
        tokens, kept = map(np.asarray, round_(pos))
        for i in np.flatnonzero(pos < length):
            k = kept[i] + 1
            out[i, pos[i] : pos[i] + k] = tokens[i, :k]
            pos[i] += k
    return out[:, :length]


def _chi2(tokens, p):
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(p))
    expected = n * p
    return float(np.sum((counts - expected) ** 2 / np.where(expected > 0, expected, 1)))


def _distributions(rng, length=5, v=5):
    """Per position a target p and a draft q that differ, some tokens impossible under each."""
    p = rng.dirichlet(np.ones(v), length)
    q = rng.dirichlet(np.ones(v), length)
    p[:, 0], q[:, 1] = 0.0, 0.0  # a token the target never emits; one the draft never drafts
    return p / p.sum(1, keepdims=True), q / q.sum(1, keepdims=True)


def test_rejection_sampling_emits_the_target_distribution(fresh_seed):
    """Each output position's token, over 20,000 independent rows, follows p (chi-square), and
    draft tokens were kept (not a plain sampler in disguise)."""
    from jaxinfer.engine.sampler import rejection_verify

    rng = np.random.default_rng(fresh_seed)
    p, q = _distributions(rng)
    tokens = _simulate(rejection_verify, p, q, 20_000, fresh_seed % 2**20)
    for j in range(p.shape[0]):
        stat = _chi2(tokens[:, j], p[j])
        assert stat < CHI2_CRITICAL_DF4, (f"seed {fresh_seed}: position {j} chi2 {stat:.1f}", p[j])
    assert not (tokens == 0).any(), "a token of target probability 0 was emitted"


def test_a_correction_drawn_from_p_instead_of_the_residual_fails_the_check(fresh_seed):
    from jaxinfer.engine.sampler import RESIDUAL_STREAM, draw_from, rejection_verify

    def wrong_rule(p, q, drafts, bonus, sb, positions):
        tokens, kept = rejection_verify(p, q, drafts, bonus, sb, positions)
        rows, g = jnp.arange(drafts.shape[0]), drafts.shape[1]
        from_p = draw_from(p[rows, jnp.minimum(kept, g - 1)], sb, positions + kept,
                           RESIDUAL_STREAM)  # fmt: skip
        return tokens.at[rows, kept].set(jnp.where(kept == g, tokens[rows, kept], from_p)), kept

    rng = np.random.default_rng(fresh_seed)
    p, q = _distributions(rng)
    tokens = _simulate(wrong_rule, p, q, 20_000, fresh_seed % 2**20)
    worst = max(_chi2(tokens[:, j], p[j]) for j in range(p.shape[0]))
    assert worst > CHI2_CRITICAL_DF4, f"seed {fresh_seed}: the wrong rule passed (chi2 {worst})"


def test_a_draft_the_target_gives_probability_zero_is_never_kept(monkeypatch):
    """Even when the acceptance uniform is exactly 0 (SGLang shipped this bug)."""
    from jaxinfer.engine import sampler

    monkeypatch.setattr(jax.random, "uniform", lambda key, *a, **k: jnp.zeros((), jnp.float32))
    p = jnp.asarray([[[0.0, 0.5, 0.5], [0.0, 0.5, 0.5]]])  # [S=1, G+1=2, V=3]
    q = jnp.asarray([[[1.0, 0.0, 0.0]]])  # the draft always drafts token 0
    sb = sampler.SamplingBatch(jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1), jnp.zeros(1),
                               jnp.zeros(1, jnp.uint32), jnp.zeros(1, jnp.int32))  # fmt: skip
    tokens, kept = sampler.rejection_verify(p, q, jnp.zeros((1, 1), jnp.int32),
                                            jnp.ones(1, jnp.int32), sb, jnp.zeros(1, jnp.int32))  # fmt: skip
    assert int(kept[0]) == 0 and int(tokens[0, 0]) in (1, 2)


@pytest.mark.parametrize("given, expected", [
    (None, "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE"),
    ("--xla_force_host_platform_device_count=2",
     "--xla_force_host_platform_device_count=2 --xla_gpu_command_buffer_scheduling_mode=SERIALIZE"),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT",
     "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"),
])  # fmt: skip
def test_import_chains_command_buffers_unless_set(given, expected):
    """`import jaxinfer` puts the chained command-buffer mode into XLA_FLAGS before JAX's
    backend starts (jaxinfer/__init__.py), keeping the user's flags and a mode they chose."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if given is not None:
        env["XLA_FLAGS"] = given
    code = "import os, jaxinfer, jax; jax.devices(); print(os.environ['XLA_FLAGS'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == expected, (given, out.stdout)
