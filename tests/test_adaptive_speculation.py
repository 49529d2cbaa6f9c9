"""Adaptive speculation (`engine.speculative.adaptive`, `engine/adaptive.py`): per decode scan the
engine runs the speculative path or the plain one, whichever has been making more tokens per
second at that batch size.

Checked: the policy's choices on fake timings (no wall clock): it probes both paths, keeps the
faster, notices a shift, keeps batch sizes apart; in the engine, with acceptance measured for
real and step costs modelled, it speculates where drafts are kept and runs plain where they are
rejected; switching paths in every direction leaves the output plain decoding's token for token
(greedy and sampled), compiles nothing after warm-up, and leaves a draft model's or EAGLE head's
pool as speculating throughout would; a bad config names its key.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine import engine as engine_module
from jaxinfer.engine.adaptive import MARGIN, MIN_LIVE, AdaptiveSpeculation
from jaxinfer.engine.compile_counter import compile_count
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams

# batch_invariant: outputs equal token for token across engines that batch a row differently
# only under batch-invariant numerics (test_eagle.py's KW says why)
KW = dict(max_num_seqs=4, max_num_batched_tokens=64, num_pages=64, page_size=16,
          max_model_len=256, decode_steps=4, batch_invariant=True)  # fmt: skip
NGRAM = {"method": "ngram", "num_draft_tokens": 3, "adaptive": True}


def _simulate(policy, bucket, scans, spec_rate, plain_rate, rng, noise=0.1, seconds=None):
    """Run `scans` scans of `bucket` under `policy`, each path's measured rate its true rate
    (`spec_rate(i)`, `plain_rate(i)` at scan i) times noise; returns the paths taken. A scan
    lasts `seconds` = (speculative's, plain's), or any length (None: the rate is what counts)."""
    paths = []
    for i in range(scans):
        speculative = policy.speculate(bucket)
        assert policy.speculate(bucket) == speculative, "asking twice changed the answer"
        policy.dispatched(bucket, speculative)
        rate = spec_rate(i) if speculative else plain_rate(i)
        if seconds is None:
            t = float(rng.uniform(0.5, 2.0))
        else:
            t = seconds[0] if speculative else seconds[1]
        policy.record(bucket, speculative, rate * t * rng.uniform(1 - noise, 1 + noise), t)
        paths.append(speculative)
    return paths


def test_policy_probes_both_paths_then_keeps_the_faster_probing_the_other(fresh_seed):
    """The loser runs one scan in N: its lost time per probe (its scan over the winner's, times
    the rate it gives up) over the 1% budget, within [probe_every, max_probe_every]."""
    rng = np.random.default_rng(fresh_seed)
    for trial in range(30):
        slow = rng.uniform(100, 1000)
        fast = slow * rng.uniform(1.02 + MARGIN, 3)  # (speculation wins beyond the margin)
        spec_pays = bool(rng.integers(2))
        t_spec, t_plain = rng.uniform(0.5, 2.0, 2)  # each path's scan length
        policy = AdaptiveSpeculation(probe_every=int(rng.integers(4, 20)),
                                     max_probe_every=int(rng.integers(20, 150)))  # fmt: skip
        spec, plain = (fast, slow) if spec_pays else (slow, fast)
        paths = _simulate(policy, 8, 600, lambda i, r=spec: r, lambda i, r=plain: r, rng,
                          noise=0.0, seconds=(t_spec, t_plain))  # fmt: skip
        t_lose, t_win = (t_plain, t_spec) if spec_pays else (t_spec, t_plain)
        cost = t_lose / t_win * (1 - slow / fast)
        want = min(max(policy.probe_every, int(np.ceil(cost / 0.01 - 1e-9))),
                   policy.max_probe_every)  # fmt: skip
        where = (f"seed {fresh_seed} trial {trial}: spec {spec:.0f} plain {plain:.0f} tok/s, "
                 f"scans {t_spec:.2f} / {t_plain:.2f} s, want N {want}")  # fmt: skip
        assert policy.probe_interval(8) == want, (where, policy.probe_interval(8))
        assert paths[:2] == [True, False], (where, paths[:2])  # each path probed, speculation first
        losers = [j for j, p in enumerate(paths) if p != spec_pays]
        assert losers[1] - losers[0] <= want, (where, losers[:3])
        gaps = np.diff(losers[1:])
        assert len(gaps) >= 600 // want - 2 and (gaps == want).all(), (where, losers)
        # what the probes cost over whole periods (a probe and N - 1 winner scans): `cost` of
        # N - 1 + t_lose / t_win winner scans' time, so the budget unless N is held at the
        # maximum (and a little over where the loser's scan is shorter than the N it assumes)
        period = paths[losers[1] : losers[-1]]
        time = sum(t_spec if p else t_plain for p in period)
        made = sum((spec * t_spec) if p else (plain * t_plain) for p in period)
        loss = cost / (want - 1 + t_lose / t_win)
        assert abs(1 - made / time / fast - loss) < 1e-9, (where, made / time / fast, loss)
        if want < policy.max_probe_every:
            assert loss <= 0.01 * want / (want - 1), (where, loss)


def test_policy_notices_a_shift_in_acceptance_within_a_probe_period(fresh_seed):
    """Drafts that stop being accepted (a new workload) hand the bucket to the plain path at
    once, and back when they are accepted again within the loser's probe period."""
    rng = np.random.default_rng(fresh_seed)
    policy = AdaptiveSpeculation()
    plain = 500.0

    def spec(i):  # 2x plain, then 0.5x from scan 100, then 2x again from scan 300
        return plain * (0.5 if 100 <= i < 300 else 2.0)

    paths = _simulate(policy, 8, 500, spec, lambda i: plain, rng, seconds=(1.0, 1.0))
    # scans of equal length: the loser (at half the winner's rate, +-10% noise) is probed one
    # scan in ~50, so it takes over within 60 scans of a shift in its favour; the winner's own
    # EWMA crosses within a few scans of a shift against it
    for start, want, within in ((100, False, 8), (300, True, 60)):
        first = paths.index(want, start)
        assert first <= start + within, (f"seed {fresh_seed}", start, paths[start : start + 80])
        settled = paths[first + 5 : start + 200]
        assert settled.count(not want) <= len(settled) // 16 + 1, (
            f"seed {fresh_seed}: after scan {start}", paths[start : start + 200])  # fmt: skip


def test_speculation_within_the_margin_of_plain_does_not_win(fresh_seed):
    """Speculative scans faster than plain ones by less than MARGIN (what speculating costs
    outside them) leave the bucket to plain decoding, its mixed steps undrafted, speculation
    probed every `probe_every` scans; beyond the margin speculation wins."""
    rng = np.random.default_rng(fresh_seed)
    plain = rng.uniform(100, 1000)
    for ratio, wins in ((1 + MARGIN * rng.uniform(0.1, 0.9), False),
                        (1 + MARGIN * rng.uniform(1.1, 3.0), True)):  # fmt: skip
        policy = AdaptiveSpeculation()
        paths = _simulate(policy, 8, 200, lambda i, r=ratio: plain * r, lambda i: plain, rng,
                          noise=0.0, seconds=(1.0, 1.0))  # fmt: skip
        where = f"seed {fresh_seed}: speculation at {ratio:.3f}x plain"
        assert policy.measured_faster(8) is wins, where
        if wins:
            assert sum(paths[2:]) > 0.9 * 198, (where, paths)
        else:
            assert policy.probe_interval(8) == policy.probe_every, where
            assert sum(paths[2:]) <= 198 // policy.probe_every + 1, (where, paths)


def test_policy_with_no_tokens_yet_probes_at_the_shortest_interval():
    policy = AdaptiveSpeculation()
    for speculative in (True, False, True, False):  # rows all ended at once: 0 tokens a scan
        policy.dispatched(8, speculative)
        policy.record(8, speculative, 0.0, 1.0)
    assert policy.probe_interval(8) == policy.probe_every
    assert policy.speculate(8) is False  # the winner (ties go to plain) until the next probe


def test_mixed_steps_follow_only_a_measured_win():
    policy = AdaptiveSpeculation()
    assert not policy.measured_faster(8)  # nothing measured
    for speculative in (True, False):  # each path's warm-up scan
        policy.dispatched(8, speculative)
        policy.record(8, speculative, 9000.0 if speculative else 1.0, 1.0)
    assert not policy.measured_faster(8)  # warm-ups measure nothing
    policy.dispatched(8, True)
    policy.record(8, True, 900.0, 1.0)
    assert not policy.measured_faster(8)  # speculation alone measured
    policy.dispatched(8, False)
    policy.record(8, False, 1000.0, 1.0)
    assert not policy.measured_faster(8)  # plain faster
    policy.dispatched(8, True)
    policy.record(8, True, 5000.0, 1.0)
    assert policy.measured_faster(8) and not policy.measured_faster(16)


def test_a_slow_first_scan_does_not_keep_the_faster_path_out(fresh_seed):
    """A bucket's first scan of each path is a warm-up, measured by neither path's rate: on an
    H100 the first decode scan of a batch ran 2-2.5x as long as the rest, and speculation,
    measured at half its rate there, lost the bucket for 29 scans (a probe interval set by that
    scan). Here either path's first scan is that slow, and the faster one still wins by the
    bucket's fifth scan and runs all but the probes after it."""
    rng = np.random.default_rng(fresh_seed)
    for trial in range(20):
        spec_pays = bool(rng.integers(2))
        fast, slow = 16000.0, 9000.0 * rng.uniform(0.9, 1.1)  # tok/s (H100 batch 8, chat)
        spec, plain = (fast, slow) if spec_pays else (slow, fast)
        policy, paths = AdaptiveSpeculation(), []
        for _ in range(120):
            speculative = policy.speculate(8)
            policy.dispatched(8, speculative)
            t = 0.011 if speculative else 0.007
            lag = rng.uniform(2.0, 2.5) if speculative not in paths else 1.0  # its first scan
            policy.record(8, speculative, (spec if speculative else plain) * t, t * lag)
            paths.append(speculative)
        where = f"seed {fresh_seed} trial {trial}: speculation pays {spec_pays}"
        assert paths[:4] == [True, False, True, False], (where, paths[:8])
        assert np.allclose([policy.rate[8, True], policy.rate[8, False]], [spec, plain]), where
        losers = [i for i, p in enumerate(paths[4:]) if p != spec_pays]
        assert len(losers) <= 116 // policy.probe_every + 1, (where, paths)


def test_policy_keeps_batch_sizes_apart(fresh_seed):
    """Speculation can pay at batch 8 and cost at batch 64: one bucket's rates never decide
    another's."""
    rng = np.random.default_rng(fresh_seed)
    policy = AdaptiveSpeculation()
    small = _simulate(policy, 8, 100, lambda i: 900.0, lambda i: 300.0, rng)
    large = _simulate(policy, 64, 100, lambda i: 800.0, lambda i: 2400.0, rng)
    assert sum(small[2:]) > 0.9 * 98 and sum(large[2:]) < 0.1 * 98, f"seed {fresh_seed}"


def test_ngram_state_after_plain_rounds_drafts_what_the_host_drafts(fresh_seed):
    """Rounds on either path, in any order: after plain rounds (`follow`: one token fed, no
    drafts) the device form still drafts what the host form drafts from the real context."""
    from jaxinfer.engine.ngram import NgramProposer, ngram_drafts
    from jaxinfer.engine.proposer import Round

    rng = np.random.default_rng(fresh_seed)
    gamma, rows = 3, 5
    proposer = NgramProposer(gamma, max_n=3, min_n=1, max_len=128)

    class Seq:
        def __init__(self, toks):
            self.all_token_ids = toks

    contexts = [rng.integers(0, 4, int(rng.integers(2, 12))).tolist() for _ in range(rows)]
    state = jax.tree.map(jnp.asarray, proposer.device_state([Seq(c) for c in contexts], rows))
    propose, follow = jax.jit(proposer.draft), jax.jit(proposer.follow)
    checked = 0
    for rnd in range(24):
        tokens = jnp.asarray([c[-1] for c in contexts])
        positions = jnp.asarray([len(c) - 1 for c in contexts])
        if rng.random() < 0.5:  # a plain round: the target samples one token
            state, _ = follow(state, Round(tokens, positions), None, None)
            for c in contexts:
                c.append(int(rng.integers(0, 4)))
            continue
        drafts, state, _, _ = propose(state, Round(tokens, positions), None, None)
        for i, c in enumerate(contexts):
            host = ngram_drafts(np.asarray(c), gamma, 3, 1)
            if host:
                assert drafts[i].tolist() == host, (f"seed {fresh_seed} round {rnd} row {i}", c)
                checked += 1
            k = int(rng.integers(0, gamma + 1))  # the target keeps k drafts and samples one more
            c += [*drafts[i].tolist()[:k], int(rng.integers(0, 4))]
    assert checked, f"seed {fresh_seed}: no round drafted"


# ---- the engine ----------------------------------------------------------------------------------


class Forced:
    """A policy of seeded coin flips (`p_speculate` per scan): the engine then switches paths
    in every direction, at scan boundaries it does not choose. With 0 < p < 1 the first three
    scans go speculative, plain, speculative, so both switches happen however the coins fall
    (six fair flips in a row came up the same for seed 215079440)."""

    def __init__(self, rng, p_speculate: float = 0.5) -> None:
        self.rng, self.p = rng, p_speculate
        self.next = True
        self.script = [False, True] if 0 < p_speculate < 1 else []

    def speculate(self, bucket: int) -> bool:
        return self.next

    def dispatched(self, bucket: int, speculative: bool) -> None:
        self.next = self.script.pop(0) if self.script else bool(self.rng.random() < self.p)

    def record(self, *args) -> None:
        pass

    def measured_faster(self, bucket: int) -> bool:  # (mixed steps: a coin of their own)
        return bool(self.rng.random() < self.p)


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    """Plain and adaptive n-gram engines (their warm-ups are this file's main cost; the plain
    one, the reference, is not warmed up: it compiles only what it runs)."""
    return {
        "plain": LLM("tiny", **KW, warmup=False),
        "adaptive": LLM("tiny", **KW, speculative=NGRAM),
    }


def _generate(llm: LLM, prompts, sampling, policy=None):
    """(token ids per prompt, paths of the decode scans, XLA compiles while generating: the
    counter is process-wide, so `compiles_after_warmup` would count later engines' warm-ups)."""
    engine = llm.engine
    if policy is not None:
        engine.adaptive = policy
    engine.step_records.clear()
    before = compile_count()
    tokens = [o.token_ids for o in llm.generate(prompts, sampling)]
    paths = [r.speculative for r in engine.step_records if r.decode_steps > 1]
    return tokens, paths, compile_count() - before


def _requests(rng, n=3, max_tokens=40):
    prompts = [rng.integers(3, 4000, int(rng.integers(5, 40))).tolist() for _ in range(n)]
    motif = rng.integers(3, 400, 7).tolist()
    prompts[0] = motif * 4  # (a copy prompt: its drafts get kept)
    sampling = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)]  # greedy
    sampling += [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.9,
                                top_k=40, top_p=0.95, seed=int(rng.integers(2**31)))
                 for _ in range(n - 1)]  # fmt: skip
    return prompts, sampling


def test_adaptive_output_equals_plain_output_token_for_token(fresh_seed, engines):
    """Whichever path each scan takes (the engine's own choice from wall-clock timings, then
    seeded coin flips), greedy and seeded sampled outputs are plain decoding's, and no
    executable is compiled after warm-up."""
    rng = np.random.default_rng(fresh_seed)
    prompts, sampling = _requests(rng)
    plain, _, _ = _generate(engines["plain"], prompts, sampling)
    for name, policy in (("measured", AdaptiveSpeculation()), ("coin flips", Forced(rng))):
        out, paths, compiles = _generate(engines["adaptive"], prompts, sampling, policy)
        assert out == plain, f"seed {fresh_seed}: {name} paths {paths}"
        assert compiles == 0, f"seed {fresh_seed}: {compiles} compiles after warm-up, {name}"
        assert True in paths and False in paths, (f"seed {fresh_seed}: {name}", paths)


def test_a_thinning_batch_does_not_read_as_a_slower_path(fresh_seed, engines):
    """Sequences that end inside a scan (token limits drawn at random) make fewer tokens on
    either path: the engine reports a scan's tokens per live row-round scaled to the bucket, so
    every plain scan reports exactly rows x rounds, and a speculative one at least that."""
    rng = np.random.default_rng(fresh_seed)
    reports = []

    class Recording(Forced):
        def record(self, bucket, speculative, tokens, seconds):
            reports.append((bucket, speculative, tokens))

    prompts = [rng.integers(3, 4000, 9).tolist() for _ in range(4)]
    sampling = [SamplingParams(max_tokens=int(rng.integers(2, 40)), ignore_eos=True)
                for _ in prompts]  # fmt: skip
    _generate(engines["adaptive"], prompts, sampling, Recording(rng))
    full = KW["max_num_seqs"] * KW["decode_steps"]  # (one bucket: max_num_seqs rows)
    where = f"seed {fresh_seed}: (bucket, speculative, tokens) {reports}"
    assert reports and all(t == full for _, s, t in reports if not s), where
    assert all(t >= full for _, s, t in reports if s), where


@pytest.mark.parametrize("limits", ["same", "random"])
def test_a_scan_mostly_past_its_sequences_end_is_not_reported(fresh_seed, engines, limits):
    """Plain decoding only, so a scan's live row-rounds are its tokens: exactly the scans live in
    at least MIN_LIVE of their row-rounds are reported. Four requests of 10 tokens end one
    round into their third scan (live 1/4): were it reported, its time (host work on 4 tokens)
    over 16 scaled tokens would read ~4x a full scan's rate."""
    rng = np.random.default_rng(fresh_seed)
    reports = []

    class PlainRecording(Forced):
        def speculate(self, bucket: int) -> bool:
            return False

        def measured_faster(self, bucket: int) -> bool:  # (no drafts in mixed steps either)
            return False

        def record(self, bucket, speculative, tokens, seconds):
            reports.append(tokens)

    prompts = [rng.integers(3, 4000, 9).tolist() for _ in range(4)]
    sampling = [SamplingParams(max_tokens=10 if limits == "same" else int(rng.integers(2, 40)),
                               ignore_eos=True) for _ in prompts]  # fmt: skip
    _generate(engines["adaptive"], prompts, sampling, PlainRecording(rng))
    scans = [r for r in engines["adaptive"].engine.step_records if r.decode_steps > 1]
    live = [r.num_batched_tokens / (r.num_seqs * r.decode_steps) for r in scans]
    where = f"seed {fresh_seed}: live shares {live}, reports {reports}"
    assert len(reports) == sum(x >= MIN_LIVE for x in live), where
    if limits == "same":
        assert min(live) == 0.25 and len(reports) == len(scans) - 1, where


def test_mixed_steps_draft_only_where_decode_scans_measured_speculation_faster(
    fresh_seed, engines, monkeypatch
):
    """More requests than sequence slots: later ones are admitted (mixed steps) while others
    decode. A policy that never measures drafts nothing in those mixed steps, whatever its
    decode scans run; one that has measured speculation faster drafts in them."""
    rng = np.random.default_rng(fresh_seed)
    llm = engines["adaptive"]
    drafted = []
    propose = llm.engine.proposer.propose
    monkeypatch.setattr(llm.engine.proposer, "propose",
                        lambda seq: drafted.append(seq.seq_id) or propose(seq))  # fmt: skip
    prompts, sampling = _requests(rng, n=7, max_tokens=24)

    class Unmeasured(AdaptiveSpeculation):
        def record(self, *args) -> None:
            pass

    class Won(Forced):
        def measured_faster(self, bucket: int) -> bool:
            return True

    counts = {}
    for name, policy in (("unmeasured", Unmeasured()), ("won", Won(rng))):
        drafted.clear()
        paths = _generate(llm, prompts, sampling, policy)[1]
        counts[name] = len(drafted), paths
    where = f"seed {fresh_seed}: (host drafts, scan paths) {counts}"
    assert counts["unmeasured"][0] == 0 and True in counts["unmeasured"][1], where
    assert counts["won"][0] > 0, where


def test_a_scan_is_timed_with_the_host_work_on_its_own_tokens(fresh_seed, engines, monkeypatch):
    """A clock that moves only while the host appends a scan's tokens (1 ms a token; the
    device is free): each scan, chained or not, is reported with exactly its own tokens' host
    time. Timed from read to read, a chained scan would carry its predecessor's, which favours
    a speculative probe after plain scans (fewer tokens before it) and charges the plain scan
    after it for the probe's extra tokens."""
    rng = np.random.default_rng(fresh_seed)
    engine = engines["adaptive"].engine
    now, appended, reports = [engine.clock()], [], []  # (past the engine's earlier scans)

    class Recording(Forced):
        def record(self, bucket, speculative, tokens, seconds):
            reports.append(seconds)

    append_all = engine._append_all

    def slow_append(results):
        n = sum(len(new) for _, new in results)
        now[0] += 1e-3 * n
        if n:
            appended.append(1e-3 * n)
        return append_all(results)

    monkeypatch.setattr(engine, "clock", lambda: now[0])
    monkeypatch.setattr(engine, "_append_all", slow_append)
    monkeypatch.setattr(engine_module, "MIN_LIVE", 0.0)  # (every scan reported, thinned or not)
    prompts, sampling = _requests(rng, n=4, max_tokens=40)
    chained = engine.chained_scans
    _generate(engines["adaptive"], prompts, sampling, Recording(rng))
    where = f"seed {fresh_seed}: host seconds {appended}, reported {reports}"
    assert engine.chained_scans > chained and len(reports) >= 4, where
    assert reports == pytest.approx(appended, abs=1e-9), where


VERIFY_COST = 1.2  # a verification of 1 + gamma rows, in plain decode steps (memory-bound)


def _modelled(engine) -> AdaptiveSpeculation:
    """The engine's policy with fake timings: tokens as the engine measured them, seconds from
    the cost model (a plain round costs 1, a speculative round VERIFY_COST), not the clock."""
    policy = AdaptiveSpeculation()
    record, rounds = policy.record, engine.config.decode_steps

    def modelled(bucket, speculative, tokens, seconds):
        record(bucket, speculative, tokens, rounds * (VERIFY_COST if speculative else 1.0))

    policy.record = modelled
    return policy


def _loop_start(tokens: list[int]) -> int | None:
    """Where `tokens` becomes periodic to its end (period <= 32, at least 3 periods and 20
    tokens of it), or None."""
    for period in range(1, 33):
        i = len(tokens) - period
        while i > 0 and tokens[i - 1] == tokens[i - 1 + period]:
            i -= 1
        if len(tokens) - i >= max(3 * period, 20):
            return i
    return None


def _scans(records) -> list[tuple[bool, float | None, int]]:
    """Each decode scan of one sequence's run as (speculative, tokens per verification or None,
    output tokens before it)."""
    out, made = [], 0
    for r in records:
        verifications = sum(r.accepted_hist or [])
        tau = (r.accepted_draft_tokens + verifications) / verifications if verifications else None
        if r.decode_steps > 1:
            out.append((r.speculative, tau, made))
        made += r.accepted_draft_tokens + verifications if verifications else r.decode_steps
    return out


def test_the_engine_speculates_where_drafts_are_kept_and_not_where_they_are_rejected(
    fresh_seed, engines
):
    """Greedy decoding of the tiny model after a copy prompt falls into a loop that n-gram drafts
    predict (tau ~4, above VERIFY_COST: speculation pays); sampling at temperature 1.5 draws
    tokens no n-gram predicts (tau 1: it cannot pay). Once a speculative scan inside the loop
    has found it, the engine speculates in every scan after the one already dispatched and the
    bucket's first probes (each path twice: a warm-up, then a measured scan; a scan chained while
    the last of them is in flight probes its path again); on the second path it runs plain in all
    but its probes. (Before the
    loop, the continuation may follow the prompt's motif for a while: a probe there can win and
    the scans after it lose again, so only a probe inside the loop decides.)"""
    rng = np.random.default_rng(fresh_seed)
    llm = engines["adaptive"]
    pays = SamplingParams(max_tokens=200, ignore_eos=True)
    # Where the greedy continuation of a copy prompt starts to loop depends on the motif (token
    # 17 or 174, or not within 200): take the first motif whose loop starts early, so a probe
    # finds it with scans to spare (a losing probe puts the next ~20 scans, ~80 tokens, later).
    for _ in range(20):
        prompt = [rng.integers(3, 400, 7).tolist() * 4]
        start = _loop_start(engines["plain"].generate(prompt, pays)[0].token_ids)
        if start is not None and start <= 40:
            break
    else:
        raise AssertionError(f"seed {fresh_seed}: no motif of 20 made the tiny model loop early")
    rejected = SamplingParams(max_tokens=200, ignore_eos=True, temperature=1.5,
                              seed=int(rng.integers(2**31)))  # fmt: skip
    scans = {}
    for name, sampling in (("pays", pays), ("rejected", rejected)):
        _generate(llm, prompt, sampling, _modelled(llm.engine))
        scans[name] = _scans(llm.engine.step_records)
    where = f"seed {fresh_seed}: loop from token {start}, scans (path, tau, tokens before) {scans}"
    # (the first two scans are warm-ups, measured by neither path)
    found = [i for i, (spec, tau, made) in enumerate(scans["pays"])
             if i >= 2 and spec and made >= start and (tau or 0) >= 2]  # fmt: skip
    assert found, where
    after = [spec for spec, _, _ in scans["pays"][max(found[0] + 2, 5) :]]
    assert after and all(after), where
    rejected = [spec for spec, _, _ in scans["rejected"][5:]]
    assert sum(rejected) <= len(rejected) / 16 + 2, where


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "draft", "draft_model": "tiny-draft"},
        {"method": "eagle", "eagle_head": "eagle-tiny"},
    ],
    ids=["draft model", "eagle"],
)
def test_switching_paths_leaves_the_draft_pool_as_speculating_throughout(fresh_seed, spec,
                                                                          monkeypatch):  # fmt: skip
    """A plain scan feeds the draft model (or EAGLE head) what a speculative round's first
    pass would, so after any mix of paths its K/V at every position up to the last rounds'
    equals what it is after speculating in every scan: later drafts are as good."""
    rng = np.random.default_rng(fresh_seed)
    llm = LLM("tiny", **KW, speculative={**spec, "num_draft_tokens": 3, "adaptive": True,
                                         "draft_sampling": "greedy"})  # fmt: skip
    engine, gamma = llm.engine, 3
    pages = {}  # a finished sequence's pages, taken as the block manager frees them
    free = engine.block_manager.free
    monkeypatch.setattr(engine.block_manager, "free",
                        lambda seq: (pages.__setitem__(seq.seq_id, list(seq.page_ids)),
                                     free(seq)))  # fmt: skip
    prompt = [rng.integers(3, 4000, int(rng.integers(10, 30))).tolist()]
    sampling = SamplingParams(max_tokens=48, ignore_eos=True)
    n = len(prompt[0]) + 48 - 2 * gamma - 4  # positions every last round has rewritten

    def pool(kv) -> np.ndarray:  # K/V of the positions < n of the last finished sequence
        kv = getattr(kv, "kv", kv)  # (EAGLE: its head's K/V)
        ids = np.asarray(pages[max(pages)])
        pos = np.arange(n)
        return np.asarray(kv.pages[:, ids[pos // KW["page_size"]], :, pos % KW["page_size"]])

    runs = {}
    for name, policy in (("speculating", Forced(rng, 1.0)), ("switching", Forced(rng))):
        engine.runner.draft_kv = jax.tree.map(jnp.zeros_like, engine.runner.draft_kv)
        out, paths, compiles = _generate(llm, prompt, sampling, policy)
        runs[name] = out, pool(engine.runner.draft_kv), paths
        assert compiles == 0, f"seed {fresh_seed}: {compiles} compiles after warm-up, {name}"
    assert False in runs["switching"][2], (f"seed {fresh_seed}", runs["switching"][2])
    assert runs["switching"][0] == runs["speculating"][0], f"seed {fresh_seed}"
    a, b = runs["speculating"][1], runs["switching"][1]
    assert np.abs(a).sum(axis=(0, 1, 3, 4)).min() > 0, "a position the draft never wrote"
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4,
                               err_msg=f"seed {fresh_seed}, paths {runs['switching'][2]}")  # fmt: skip


def test_adaptive_config_names_the_key():
    from jaxinfer.engine.config import EngineConfig

    with pytest.raises(ValueError, match=re.escape("engine.speculative.adaptive='yes'")):
        EngineConfig(speculative={"method": "ngram", "adaptive": "yes"})
    with pytest.raises(
        ValueError, match=r"engine\.speculative\.adaptive .* method other than none"
    ):
        EngineConfig(speculative={"adaptive": True})
    with pytest.raises(
        ValueError, match=r"engine\.speculative\.adaptive .* engine\.decode_steps >= 2"
    ):
        EngineConfig(decode_steps=1, speculative=NGRAM)


def test_summary_reports_the_speculative_fraction():
    from jaxinfer.metrics.summary import summarize

    step = {"time": 0.0, "num_seqs": 1, "num_batched_tokens": 4, "kv_pages_used": 1,
            "kv_pages_total": 8, "is_decode_only": True}  # fmt: skip
    steps = [{**step, "speculative": True, "draft_tokens": 3, "accepted_hist": [0, 1]},
             {**step, "speculative": False}, {**step, "speculative": False},
             {**step, "is_decode_only": False}]  # fmt: skip
    assert summarize([], steps)["speculative_step_fraction"] == pytest.approx(1 / 3)
