"""experiments/speculative/run.py's batching: B requests in flight (a finished one's slot takes
the next prompt at once), a KV cache sized so that no point preempts, and each method in a
process of its own."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import time
from types import SimpleNamespace

import experiment_scripts
import numpy as np
import pytest

from jaxinfer.experiment.isolated import in_own_process


class FakeSeq:
    def __init__(self, prompt: list[int]) -> None:
        self.left = prompt[0]  # the engine steps this request takes
        self.output_token_ids: list[int] = []
        self.error = None

    @property
    def is_finished(self) -> bool:
        return self.left == 0


class FakeEngine:
    """Each step gives every unfinished request one token; records the most in flight."""

    def __init__(self) -> None:
        self.seqs, self.steps, self.most, self.step_records = [], 0, 0, []
        self.compiles_after_warmup, self.adaptive = 0, None
        self.chained_scans = 7  # (an earlier point's): a row counts its own only

    def add_request(self, prompt, sampling):
        self.seqs.append(FakeSeq(prompt))
        return self.seqs[-1]

    def has_unfinished(self) -> bool:
        return any(not s.is_finished for s in self.seqs)

    def step(self) -> None:
        live = [s for s in self.seqs if not s.is_finished]
        self.most = max(self.most, len(live))
        self.steps += 1
        self.chained_scans += 1
        for s in live:
            s.output_token_ids.append(len(s.output_token_ids))
            s.left -= 1

    def release(self, seqs) -> None:
        pass


def test_a_finished_requests_slot_takes_the_next_prompt_at_once():
    run = experiment_scripts.load("speculative/run")
    eng = FakeEngine()
    lengths = [3, 1, 1, 3]
    row, tokens = run.run_point(SimpleNamespace(engine=eng), {"speculative": {}}, 0.0, "none", 2,
                                [[n] for n in lengths], None)  # fmt: skip
    # in flight: r0 and r1; r1 ends after step 1, r2 takes its slot, ends after step 2; r3 then
    # runs steps 3-5. Waves of two would take 3 + 3 = 6 steps.
    assert eng.steps == 5 and eng.most == 2, (eng.steps, eng.most)
    assert tokens == [list(range(n)) for n in lengths]
    assert row["output_tokens"] == sum(lengths) and row["requests"] == 4
    assert row["preemptions"] == 0 and row["chained_scans"] == 5, row


def test_the_kv_cache_holds_every_point_and_one_request_of_max_model_len():
    run = experiment_scripts.load("speculative/run")
    args = SimpleNamespace(batches=[1, 8, 64], max_tokens=256, decode_steps=8,
                           num_draft_tokens=4, max_model_len=1024)  # fmt: skip
    # 64 sequences of 248 + 256 tokens and two scans of 8 rounds x 5 rows ahead: 37 pages each
    assert run.pages_for(args, 248) == 64 * 37 + 1
    args.batches = [1]  # one sequence needs 37 pages; the engine wants one of 1,024 tokens: 64
    assert run.pages_for(args, 248) == 64 + 1


def test_attention_and_engine_options_reach_every_methods_engine(monkeypatch, capsys, tmp_path):
    """--attention-options and --engine KEY=VALUE (typed as YAML) reach the engine; one without
    = fails at once, naming it."""
    run = experiment_scripts.load("speculative/run")
    built = []

    class StopAtBuild(Exception):
        pass

    def fake_llm(*model, warmup=True, **engine):  # the prompter (no warm-up), then an engine
        if not warmup:
            return None
        built.append(engine)
        raise StopAtBuild

    monkeypatch.setattr(run, "LLM", fake_llm)
    monkeypatch.setattr(run, "prompts_of", lambda wl, llm, n, chars: [[1, 2, 3]] * n)
    monkeypatch.setattr(run, "in_own_process", lambda fn, *args: fn(*args))  # (sees the fakes)
    out = str(tmp_path / "s.json")
    engine = [
        "--engine",
        "compile_workers=1",
        "compiler_options.decode.xla_gpu_autotune_level=0",
        "decode_steps=4",
    ]  # (the script's own --decode-steps 8 gives way)
    argv = ["--out", out, "--methods", "none", *engine, "--attention-options", "num_splits=2"]
    with pytest.raises(StopAtBuild):
        run.main(argv)
    assert built[0]["attention_options"] == {"num_splits": 2}, built
    assert built[0]["compile_workers"] == 1 and built[0]["decode_steps"] == 4, built
    assert built[0]["compiler_options"] == {"decode": {"xla_gpu_autotune_level": 0}}, built
    for bad in ([*argv[:-1], "num_splits"], [*argv[:3], "none", "--engine", "compile_workers"]):
        with pytest.raises(SystemExit):
            run.main(bad)
    err = capsys.readouterr().err
    assert "--attention-options: 'num_splits' is not KEY=VALUE" in err
    assert "--engine: 'compile_workers' is not KEY=VALUE" in err


def test_a_bad_method_fails_at_the_flag_before_any_method_runs(monkeypatch, capsys, tmp_path):
    run = experiment_scripts.load("speculative/run")
    monkeypatch.setattr(run, "in_own_process", lambda *a: pytest.fail("a method ran"))
    for bad, says in (("eagle:h:x", "invalid literal"), ("beam", "is not none, ngram")):
        with pytest.raises(SystemExit):
            run.main(["--out", str(tmp_path / "s.json"), "--methods", "none", bad])
        assert f"--methods: {bad!r}: " in (err := capsys.readouterr().err) and says in err, err
    assert not (tmp_path / "s.json").exists()


def test_profile_scans_below_one_fail_at_the_flag(capsys, tmp_path):
    run = experiment_scripts.load("speculative/run")
    with pytest.raises(SystemExit):
        run.main(["--out", str(tmp_path / "s.json"), "--methods", "none", "--profile-scans", "0"])
    assert "--profile-scans must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


def test_adaptive_state_reports_each_buckets_rates():
    from jaxinfer.engine.adaptive import AdaptiveSpeculation

    run = experiment_scripts.load("speculative/run")
    policy = AdaptiveSpeculation()
    for bucket, speculative, tokens, seconds in ((8, True, 1.0, 9.0), (8, False, 1.0, 9.0),
                                                 (64, False, 1.0, 9.0),  # the warm-ups
                                                 (8, True, 100.0, 0.5), (8, False, 80.0, 0.25),
                                                 (64, False, 512.0, 0.125)):  # fmt: skip
        policy.dispatched(bucket, speculative)
        policy.record(bucket, speculative, tokens, seconds)
    assert run.adaptive_state(policy) == {
        "8": {"speculative": {"tok_s": 200.0, "scan_s": 0.5},
              "plain": {"tok_s": 320.0, "scan_s": 0.25}},
        "64": {"plain": {"tok_s": 4096.0, "scan_s": 0.125}},
    }  # fmt: skip


def test_adaptive_trace_shows_each_scan_and_the_rates_it_left():
    """The trace follows the policy scan by scan: each path's warm-up (logged, in no EWMA),
    a fast speculative probe, then plain scans that overtake it; each entry carries the EWMAs
    right after that record."""
    from jaxinfer.engine.adaptive import AdaptiveSpeculation

    run = experiment_scripts.load("speculative/run")
    policy = AdaptiveSpeculation(alpha=0.5)
    policy.log = []
    for speculative, tokens, seconds in ((True, 5.0, 1.0), (False, 5.0, 1.0), (True, 300.0, 0.5),
                                         (False, 100.0, 0.5), (False, 900.0, 0.5)):  # fmt: skip
        policy.dispatched(8, speculative)
        policy.record(8, speculative, tokens, seconds)
    assert run.adaptive_trace(policy.log) == {
        "scan": [1, 2, 3, 4, 5], "bucket": [8] * 5, "speculative": [1, 0, 1, 0, 0],
        "tok_s": [5.0, 5.0, 600.0, 200.0, 1800.0], "ms": [1000.0, 1000.0, 500.0, 500.0, 500.0],
        "spec_ewma": [None, None, 600.0, 600.0, 600.0],
        "plain_ewma": [None, None, None, 200.0, 1000.0],
    }  # fmt: skip
    assert not policy.speculate(8)  # plain's EWMA (1000) passed speculation's (600)


def test_steps_by_kind_splits_wall_time_between_decode_scans_and_other_steps():
    from jaxinfer.metrics.steps import StepRecord

    run = experiment_scripts.load("speculative/run")
    records = [StepRecord(0.0, 6, 300, 1, 9, host_ms=2.0, device_ms=1.0),  # a prefill step
               StepRecord(0.0, 8, 64, 1, 9, host_ms=0.5, device_ms=7.5, decode_steps=8),
               StepRecord(0.0, 6, 48, 1, 9, host_ms=1.0, device_ms=5.0, decode_steps=8),
               StepRecord(0.0, 8, 40, 1, 9, host_ms=1.5, device_ms=1.5)]  # fmt: skip
    assert run.steps_by_kind(records) == {
        "scan": {"n": 2, "s": 0.014, "host_s": 0.0015, "mean_seqs": 7.0},
        "other": {"n": 2, "s": 0.006, "host_s": 0.0035, "mean_seqs": 7.0}}  # fmt: skip


def test_a_profiled_point_accounts_its_decode_rounds(tmp_path):
    """--profile: a trace of exactly the asked decode scans of a real engine (n-gram, tiny),
    prefill left out, its device time per round split by kind of work; then the engine drains."""
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams

    run = experiment_scripts.load("speculative/run")
    llm = LLM("tiny", max_num_seqs=2, num_pages=32, page_size=16, max_model_len=128,
              decode_steps=4, speculative={"method": "ngram", "num_draft_tokens": 2},
              warmup=False)  # fmt: skip
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, [12] * 5]
    out = run.profile_point(llm, prompts, SamplingParams(max_tokens=40, ignore_eos=True), 2,
                            tmp_path / "p", scans=2)  # fmt: skip
    assert "error" not in out and (out["scans"], out["rounds"]) == (2, 8), out
    assert out["steps_traced"] == 2, out  # (scans only: the prefill ran before the trace)
    kinds = out["kinds_ms_per_round"]
    assert kinds.get("matmul", 0) > 0 and out["top_ops"], out
    assert sum(kinds.values()) == pytest.approx(out["device_ms_per_round"], rel=0.01, abs=1e-3)
    assert 0 <= out["idle_ms_per_round"] <= out["span_ms_per_round"], out
    assert 0 <= out["overlapped_starts"] <= 1, out
    gaps_ms = sum(g["time_ms"] for g in out["top_gaps"])
    assert gaps_ms <= out["idle_ms_per_round"] * out["rounds"] + 1e-3, out
    assert not llm.engine.has_unfinished()


def test_each_method_runs_in_a_process_of_its_own_whose_failure_is_raised_here():
    """`in_own_process` (run.py's per-method process): the generator's items come from a fresh
    process, another each call; its exception comes back with its traceback; a process that
    dies is named by its exit code after the items it sent."""
    first = list(in_own_process(itertools.starmap, os.getpid, [(), ()]))
    second = list(in_own_process(itertools.starmap, os.getpid, [()]))
    assert len(first) == 2 and first[0] == first[1], first  # one process for all of its items
    assert os.getpid() not in first + second and first[0] != second[0], (first, second)
    with pytest.raises(RuntimeError, match="invalid literal for int"):
        list(in_own_process(itertools.starmap, int, [("7",), ("x",)]))
    items = in_own_process(itertools.starmap, time.sleep, [(0,), (3600,)])
    assert next(items) is None
    items.close()  # ends the process (else this waits for its hour)
    assert multiprocessing.active_children() == []
    died = []
    with pytest.raises(RuntimeError, match="exited with code 3"):
        for item in in_own_process(itertools.starmap, os._exit, [(3,)]):
            died.append(item)
    assert died == []


def test_main_puts_each_methods_rows_beside_nones_with_the_first_process_provenance(
    monkeypatch, tmp_path
):
    """main: one process per method, "none" first, each given the run's command line; every
    row's speedup and sameness are against none's row of its point; provenance from none's."""
    run = experiment_scripts.load("speculative/run")
    calls = []

    def fake_in_own_process(fn, args, method, command):
        assert fn is run.method_points
        calls.append((method, command))
        yield {"device": f"device of {method}", "commit": "c"}
        for batch in args.batches:
            tokens = [[1, 2, 3]] if method == "none" else [[1, 2, 4]]
            row = {"method": method, "workload": "grounded", "batch": batch,
                   "output_tok_s": 100.0 * batch * (1 if method == "none" else 3),
                   "tokens_per_verification": None}  # fmt: skip
            yield row, tokens

    monkeypatch.setattr(run, "in_own_process", fake_in_own_process)
    out = tmp_path / "s.json"
    run.main(["--out", str(out), "--methods", "ngram", "none", "--batches", "1", "4",
              "--workloads", "grounded"])  # fmt: skip
    command = run.typed_command()
    assert calls == [("none", command), ("ngram", command)], calls
    result = json.loads(out.read_text())
    assert result["device"] == "device of none" and list(result)[:2] == ["device", "commit"]
    rows = [
        (r["method"], r["batch"], r["speedup"], r["same_output_as_none"]) for r in result["rows"]
    ]
    assert rows == [("none", 1, 1.0, True), ("none", 4, 1.0, True), ("ngram", 1, 3.0, False),
                    ("ngram", 4, 3.0, False)], rows  # fmt: skip


def _record(decode_steps: int, hist: list[int] | None = None) -> SimpleNamespace:
    kept = sum(j * n for j, n in enumerate(hist or []))
    return SimpleNamespace(decode_steps=decode_steps, accepted_hist=hist,
                           accepted_draft_tokens=kept)  # fmt: skip


def test_end_of_turn_splits_tau_where_each_reply_ends(fresh_seed):
    """Each verifying step is placed at the output tokens before it (a plain step adds its
    decode_steps, a verifying one its verifications plus kept drafts), and tau splits at the
    reply's first end-of-sequence token."""
    eot = experiment_scripts.load("speculative/end_of_turn")
    rng = np.random.default_rng(fresh_seed)
    records, want, made = [_record(1)], [], 1  # the prefill's token
    for _ in range(int(rng.integers(3, 12))):
        if rng.integers(3):  # a verifying scan: 8 rounds, each keeping 0..4 drafts
            hist = np.bincount(rng.integers(0, 5, 8), minlength=5).tolist()
            records.append(_record(8, hist))
            want.append((made, 8, records[-1].accepted_draft_tokens))
            made += 8 + records[-1].accepted_draft_tokens
        else:  # a plain scan
            records.append(_record(8))
            made += 8
    steps = eot.verifications(records)
    assert steps == want, f"seed {fresh_seed}"
    end = int(rng.integers(1, made))
    ended = {"end_of_turn": end, "steps": steps}
    never = {"end_of_turn": None, "steps": [(0, 2, 6)]}
    summary = eot.split([ended, never], 64)
    before = [s for s in want if s[0] < end]
    after = [s for s in want if s[0] >= end]

    def tau(ss):
        v = sum(s[1] for s in ss)
        return round((v + sum(s[2] for s in ss)) / v, 3) if v else None

    where = f"seed {fresh_seed}: steps {want}, end {end}"
    assert summary["before_end"]["tau"] == tau(before), where
    assert summary["after_end"]["tau"] == tau(after), where
    assert summary["never_ended"] == {"tau": 4.0, "verifications": 2}, where
    assert summary["all"]["verifications"] == sum(s[1] for s in want) + 2, where
    assert summary["ended"] == 1
    assert sum(b["verifications"] for b in summary["by_position"].values()) == \
        summary["all"]["verifications"], where  # fmt: skip


def test_end_of_turn_run_agrees_with_the_engines_account(tmp_path):
    """On the tiny model with n-gram drafts: tau over every request is the engine's own tokens
    per verification, and each reply's end is its first EOS."""
    eot = experiment_scripts.load("speculative/end_of_turn")
    out = tmp_path / "eot.json"
    eot.main(["--model", "tiny", "--method", "ngram", "--workload", "grounded", "--requests", "2",
              "--max-tokens", "40", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["summary"]["all"]["verifications"] > 0, result["summary"]
    assert result["summary"]["all"]["tau"] == round(result["engine_tokens_per_verification"], 3)
    assert all(r["tokens"] == 40 for r in result["requests"]), result["requests"]
    with pytest.raises(SystemExit):
        eot.main(["--method", "none", "--out", str(out)])
