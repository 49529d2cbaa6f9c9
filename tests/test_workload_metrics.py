"""Workload generation (lengths, arrivals, synthetic/trace requests) and benchmark metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxinfer.engine.request import SamplingParams, SeqStatus, Sequence
from jaxinfer.metrics import (
    SLO,
    StepRecord,
    read_tables,
    request_rows,
    stats,
    summarize,
    write_tables,
)
from jaxinfer.workload import (
    ArrivalSpec,
    LengthSpec,
    WorkloadSpec,
    all_at_once,
    build_workload,
    fixed,
    gamma,
    load_jsonl_trace,
    lognormal,
    multi_turn_requests,
    poisson,
    shared_prefix_requests,
    synthetic_requests,
    uniform,
)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- lengths


def test_fixed_and_uniform_lengths():
    x = fixed(7).sample(_rng(), 50)
    assert x.shape == (50,) and x.dtype == np.int64 and (x == 7).all()
    u = uniform(3, 9).sample(_rng(), 20_000)
    assert u.min() == 3 and u.max() == 9  # both ends included
    assert abs(u.mean() - 6.0) < 0.05
    assert set(np.unique(u)) == set(range(3, 10))


def test_lognormal_mean_sigma_and_clip():
    d = lognormal(200.0, 0.5, lo=1, hi=100_000)
    x = d.sample(_rng(1), 50_000)
    assert abs(x.mean() / 200.0 - 1) < 0.02
    # sigma is the std of log(length)
    assert abs(np.log(x).std() - 0.5) < 0.02
    c = lognormal(200.0, 1.0, lo=50, hi=300).sample(_rng(2), 10_000)
    assert c.min() == 50 and c.max() == 300


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: fixed(0), "fixed.value"),
        (lambda: uniform(5, 4), "uniform.hi"),
        (lambda: lognormal(-1.0, 1.0), "lognormal.mean"),
        (lambda: lognormal(10.0, -1.0), "lognormal.sigma"),
    ],
)
def test_length_validation(make, field):
    with pytest.raises(ValueError, match=field):
        make()


# ---------------------------------------------------------------- arrivals


def _cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


def test_poisson_rate_sorted_and_starts_at_zero():
    t = poisson(10.0).sample(_rng(3), 20_000)
    assert t[0] == 0.0 and (np.diff(t) >= 0).all()
    assert abs((len(t) - 1) / t[-1] / 10.0 - 1) < 0.03  # rate roughly right
    assert abs(_cv(t) - 1.0) < 0.05


def test_gamma_burstiness_cv():
    g1 = gamma(5.0, 1.0).sample(_rng(4), 20_000)
    assert abs(_cv(g1) - 1.0) < 0.05  # burstiness 1 == Poisson
    g = gamma(5.0, 0.25).sample(_rng(5), 40_000)
    assert (np.diff(g) >= 0).all() and g[0] == 0.0
    assert abs(_cv(g) - 2.0) < 0.15  # CV = 1/sqrt(burstiness)
    assert abs((len(g) - 1) / g[-1] / 5.0 - 1) < 0.06
    assert (all_at_once().sample(_rng(), 4) == 0).all()
    assert (poisson(float("inf")).sample(_rng(), 3) == 0).all()
    with pytest.raises(ValueError, match="burstiness"):
        gamma(1.0, 0.0)
    with pytest.raises(ValueError, match="rate"):
        poisson(0.0)


# ---------------------------------------------------------------- generators


def test_synthetic_requests_seeded_and_avoid_ids():
    kw = dict(vocab_size=8, seed=11, avoid_ids=[0, 1, 7])
    a = synthetic_requests(30, uniform(2, 20), fixed(5), arrivals=poisson(2.0), **kw)
    b = synthetic_requests(30, uniform(2, 20), fixed(5), arrivals=poisson(2.0), **kw)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    ids = {t for r in a for t in r.prompt_token_ids}
    assert ids == {2, 3, 4, 5, 6}
    assert all(2 <= len(r.prompt_token_ids) <= 20 and r.output_len == 5 for r in a)
    assert all(r.prompt is None for r in a)
    times = [r.arrival_time for r in a]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] > 0
    # Another arrival process leaves the prompts and lengths as they were.
    c = synthetic_requests(30, uniform(2, 20), fixed(5), arrivals=gamma(9.0, 0.5), **kw)
    assert [r.prompt_token_ids for r in c] == [r.prompt_token_ids for r in a]
    d = synthetic_requests(30, uniform(2, 20), fixed(5), vocab_size=8, seed=12)
    assert [r.prompt_token_ids for r in d] != [r.prompt_token_ids for r in a]


def test_shared_prefix_requests():
    reqs = shared_prefix_requests(6, 16, fixed(4), fixed(3), vocab_size=1000, seed=2)
    prefix = reqs[0].prompt_token_ids[:16]
    assert all(len(r.prompt_token_ids) == 20 for r in reqs)
    assert all(r.prompt_token_ids[:16] == prefix for r in reqs)
    assert len({tuple(r.prompt_token_ids[16:]) for r in reqs}) == 6


def test_multi_turn_requests_grow_their_conversations(fresh_seed):
    """Turn t's prompt is turn t - 1's prompt + a reply of its output_len + a new user message,
    turn_gap_s later; every conversation starts with the shared system prompt."""
    reqs = multi_turn_requests(11, 3, uniform(2, 9), uniform(1, 5), turn_gap_s=1.5,
                               system_prompt_len=7, vocab_size=1000, seed=fresh_seed,
                               arrivals=poisson(0.2))  # fmt: skip
    assert len(reqs) == 11 and [r.arrival_time for r in reqs] == sorted(
        r.arrival_time for r in reqs
    )
    system = reqs[0].prompt_token_ids[:7]
    turns = []
    for r in reqs:
        assert r.prompt_token_ids[:7] == system, fresh_seed
        earlier = [q for q in reqs if len(q.prompt_token_ids) < len(r.prompt_token_ids)
                   and r.prompt_token_ids[: len(q.prompt_token_ids)] == q.prompt_token_ids]  # fmt: skip
        turns.append(len(earlier))  # a conversation's earlier turns are its prompt's prefixes
        if earlier:
            last = max(earlier, key=lambda q: len(q.prompt_token_ids))
            grown = len(r.prompt_token_ids) - len(last.prompt_token_ids) - last.output_len
            assert 2 <= grown <= 9, (fresh_seed, grown)
            assert r.arrival_time == pytest.approx(last.arrival_time + 1.5), fresh_seed
    assert sorted(turns) == [0] * 4 + [1] * 4 + [2] * 3, (fresh_seed, turns)
    again = multi_turn_requests(11, 3, uniform(2, 9), uniform(1, 5), turn_gap_s=1.5,
                                system_prompt_len=7, vocab_size=1000, seed=fresh_seed,
                                arrivals=poisson(0.2))  # fmt: skip
    assert again == reqs


def test_build_workload_and_spec_validation():
    spec = WorkloadSpec(
        num_requests=12,
        prompt_len=LengthSpec(dist="lognormal", mean=40.0, sigma=0.3, lo=8, hi=80),
        output_len=LengthSpec(dist="uniform", lo=2, hi=6),
        arrival=ArrivalSpec(process="gamma", rate=4.0, burstiness=0.5),
        seed=3,
        avoid_token_ids=(0,),
    )
    reqs = build_workload(spec, vocab_size=50)
    assert len(reqs) == 12 and build_workload(spec, vocab_size=50) == reqs
    assert all(8 <= r.prompt_len <= 80 and 2 <= r.output_len <= 6 for r in reqs)
    assert all(0 not in r.prompt_token_ids for r in reqs)
    sp = build_workload(
        WorkloadSpec(kind="shared_prefix", num_requests=3, system_prompt_len=5), vocab_size=50
    )
    assert all(r.prompt_token_ids[:5] == sp[0].prompt_token_ids[:5] for r in sp)
    assert all(len(r.prompt_token_ids) == 5 + 128 for r in sp)
    mt = build_workload(WorkloadSpec(kind="multi_turn", num_requests=4, num_turns=2,
                                     prompt_len=LengthSpec(value=3), output_len=LengthSpec(value=2),
                                     system_prompt_len=4), vocab_size=50)  # fmt: skip
    assert sorted(len(r.prompt_token_ids) for r in mt) == [7, 7, 12, 12]
    for bad, field in [
        (WorkloadSpec(kind="nope"), "kind"),
        (WorkloadSpec(num_requests=0), "num_requests"),
        (WorkloadSpec(prompt_len=LengthSpec(dist="zipf")), "prompt_len.dist"),
        (WorkloadSpec(output_len=LengthSpec(dist="uniform", lo=4, hi=2)), "output_len"),
        (WorkloadSpec(arrival=ArrivalSpec(process="bursty")), "arrival.process"),
        (WorkloadSpec(arrival=ArrivalSpec(process="poisson", rate=-1.0)), "arrival.rate"),
        (WorkloadSpec(arrival=ArrivalSpec(process="trace")), "arrival.process"),
        (WorkloadSpec(kind="shared_prefix"), "system_prompt_len"),
        (WorkloadSpec(kind="trace"), "trace_path"),
        (WorkloadSpec(kind="multi_turn", num_turns=0), "num_turns"),
        (WorkloadSpec(kind="multi_turn", turn_gap_s=-1.0), "turn_gap_s"),
        (WorkloadSpec(kind="multi_turn", system_prompt_len=-2), "system_prompt_len"),
    ]:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            build_workload(bad, vocab_size=50)


# ---------------------------------------------------------------- traces


def _encode(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


def _write_jsonl(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_trace_plain_rows(tmp_path):
    p = _write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"prompt_token_ids": [1, 2, 3], "output_len": 4, "arrival": 0.5},
            "",
            {"prompt": "hey", "output_len": 2, "arrival": 0.25},
            {"prompt": "x", "output_len": 1, "arrival": 2.0},
        ],
    )
    reqs = load_jsonl_trace(p)
    assert [r.arrival_time for r in reqs] == [0.25, 0.5, 2.0]  # sorted by arrival
    assert reqs[0].prompt == "hey" and reqs[0].prompt_token_ids is None
    assert reqs[1].prompt_token_ids == [1, 2, 3] and reqs[1].output_len == 4
    assert load_jsonl_trace(p, encode=_encode)[0].prompt_token_ids == _encode("hey")
    capped = load_jsonl_trace(p, max_requests=2, arrivals=poisson(100.0))
    assert len(capped) == 2 and capped[0].arrival_time == 0.0
    assert capped[1].arrival_time not in (0.25, 0.5)
    spec = WorkloadSpec(kind="trace", trace_path=p, num_requests=None)
    assert [r.arrival_time for r in build_workload(spec, 100)] == [0.0, 0.0, 0.0]
    spec = WorkloadSpec(kind="trace", trace_path=p, arrival=ArrivalSpec(process="trace"))
    assert [r.arrival_time for r in build_workload(spec, 100)] == [0.25, 0.5, 2.0]


def test_trace_sharegpt_rows(tmp_path):
    conv = [
        {"from": "gpt", "value": "ignored opener"},
        {"from": "human", "value": "hello"},
        {"from": "gpt", "value": "four"},
        {"from": "human", "value": "later"},
        {"from": "gpt", "value": "a much longer reply"},
    ]
    p = _write_jsonl(tmp_path / "s.jsonl", [{"conversations": conv}])
    (r,) = load_jsonl_trace(p, encode=_encode)
    assert r.prompt == "hello" and r.prompt_token_ids == _encode("hello")
    assert r.output_len == 4 and r.arrival_time == 0.0
    with pytest.raises(ValueError, match=r"line 1: .*encode"):
        load_jsonl_trace(p)


@pytest.mark.parametrize(
    "bad, field",
    [
        ("{not json", "<json>"),
        ({"prompt": "a"}, "output_len"),
        ({"prompt": "a", "output_len": 0}, "output_len"),
        ({"prompt_token_ids": [1, "2"], "output_len": 3}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 999], "output_len": 3}, "prompt_token_ids"),
        ({"prompt": "a", "prompt_token_ids": [1], "output_len": 3}, "prompt"),
        ({"prompt": "a", "output_len": 3, "arrival": -1}, "arrival"),
        ({"prompt": "a", "output_len": 3}, "arrival"),  # missing while row 1 has one
        ({"conversations": [{"from": "human", "value": "only"}]}, "conversations"),
        ([1, 2], "<row>"),
    ],
)
def test_trace_errors_name_line_and_field(tmp_path, bad, field):
    good = {"prompt": "ok", "output_len": 2, "arrival": 0.0}
    p = _write_jsonl(tmp_path / "bad.jsonl", [good, "", bad])
    with pytest.raises(ValueError, match=rf"line 3: field '{field}'"):
        load_jsonl_trace(p, encode=_encode, vocab_size=100)


def test_trace_skip_invalid(tmp_path):
    p = _write_jsonl(
        tmp_path / "t.jsonl",
        [{"prompt": "a", "output_len": 2}, {"prompt": "b"}, {"prompt": "c", "output_len": 1}],
    )
    assert [r.prompt for r in load_jsonl_trace(p, skip_invalid=True)] == ["a", "c"]


# ---------------------------------------------------------------- metrics


def _seq(seq_id, arrival, scheduled, token_times, finish, *, prompt_len=4, failed=False, npre=0):
    s = Sequence(seq_id, list(range(prompt_len)), SamplingParams(max_tokens=8), arrival)
    s.output_token_ids = list(range(len(token_times)))
    s.scheduled_time = scheduled
    s.first_token_time = token_times[0] if token_times else None
    s.token_times = list(token_times)
    s.finish_time = finish
    s.num_preemptions = npre
    s.status = SeqStatus.FAILED if failed else SeqStatus.FINISHED
    s.finish_reason = "error" if failed else "length"
    return s


def test_request_rows_exact_values():
    a = _seq(0, 1.0, 1.25, [1.5, 1.75, 2.25, 2.5], 2.5, npre=1)
    b = _seq(1, 2.0, 2.5, [3.0], 3.0)
    c = _seq(2, 2.0, None, [], 2.75, failed=True)
    ra, rb, rc = request_rows([a, b, c])
    assert ra["ttft"] == 0.5 and ra["e2e"] == 1.5 and ra["queue_time"] == 0.25
    assert ra["tpot"] == pytest.approx(1.0 / 3)
    assert ra["itls"] == [0.25, 0.5, 0.25]
    assert ra["output_len"] == 4 and ra["prompt_len"] == 4 and ra["num_preemptions"] == 1
    assert not ra["failed"] and ra["finish_reason"] == "length"
    assert rb["tpot"] is None and rb["itls"] == [] and rb["ttft"] == 1.0
    assert rc["failed"] and rc["ttft"] is None and rc["queue_time"] is None
    running = _seq(3, 0.0, 0.0, [0.5], None)
    running.status = SeqStatus.RUNNING
    with pytest.raises(ValueError, match="not finished"):
        request_rows([running])


def test_stats_percentiles_against_numpy():
    vals = np.arange(1, 101, dtype=float)
    s = stats(vals, "x")
    assert s == {"x_mean": 50.5, "x_median": 50.5, "x_p90": pytest.approx(90.1)} | {
        "x_p99": pytest.approx(99.01)
    }
    rnd = _rng(7).exponential(size=333)
    s = stats(rnd, "y")
    for name, q in (("median", 50), ("p90", 90), ("p99", 99)):
        assert s[f"y_{name}"] == pytest.approx(np.percentile(rnd, q))
    assert stats([], "z") == dict.fromkeys(["z_mean", "z_median", "z_p90", "z_p99"])


def test_summarize_throughput_latency_and_goodput():
    seqs = [
        _seq(0, 0.0, 0.0, [0.5, 1.0, 1.5], 1.5, prompt_len=10),  # ttft .5  tpot .5
        _seq(1, 0.5, 0.5, [1.0, 1.25], 1.25, prompt_len=6),  # ttft .5  tpot .25
        _seq(2, 1.0, 1.5, [3.0, 3.25, 3.5], 3.5, prompt_len=4),  # ttft 2   tpot .25
        _seq(3, 1.0, 1.0, [2.0], 2.0, prompt_len=2),  # ttft 1, no tpot
        _seq(4, 2.0, 2.0, [], 4.0, prompt_len=8, failed=True),
    ]
    rows = request_rows(seqs)
    s = summarize(rows, slo=SLO(ttft=1.0, tpot=0.3))
    assert s["duration_s"] == 4.0 and s["duration_definition"] == "first arrival to last finish"
    assert s["num_completed"] == 4 and s["num_failed"] == 1
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 9 / 4.0
    assert s["total_token_throughput"] == (9 + 22) / 4.0
    assert s["ttft_mean"] == pytest.approx(1.0)
    assert s["ttft_p90"] == pytest.approx(np.percentile([0.5, 0.5, 2.0, 1.0], 90))
    assert s["tpot_median"] == 0.25 and s["tpot_mean"] == pytest.approx(1 / 3)
    assert s["itl_mean"] == pytest.approx(np.mean([0.5, 0.5, 0.25, 0.25, 0.25]))
    assert s["queue_time_p99"] == pytest.approx(np.percentile([0, 0, 0.5, 0], 99))
    # seq 1 (ttft .5, tpot .25) and seq 3 (ttft 1, no tpot) meet the SLO.
    assert s["good_requests"] == 2 and s["goodput"] == 0.5 and s["slo_attainment"] == 0.4
    assert summarize(rows, slo=SLO(ttft=0.5))["good_requests"] == 2
    assert summarize(rows, slo=SLO(tpot=0.5))["good_requests"] == 4
    assert summarize(rows)["goodput"] is None
    json.dumps(s, allow_nan=False)


def test_summarize_steps():
    steps = [
        StepRecord(0.1, 2, 100, 10, 100, wasted_slots=28, kv_slots_allocated=128, host_ms=1.0),
        StepRecord(
            0.2,
            4,
            4,
            30,
            100,
            wasted_slots=4,
            kv_slots_allocated=8,
            is_decode_only=True,
            preemptions=2,
        ),
        dict(time=0.3, num_seqs=3, num_batched_tokens=3, kv_pages_used=20, kv_pages_total=100),
    ]
    s = summarize([], steps, max_num_seqs=6)
    assert s["num_steps"] == 3 and s["total_preemptions"] == 2
    assert s["kv_use_mean"] == pytest.approx(0.2) and s["kv_use_max"] == 0.3
    assert s["mean_num_seqs"] == 3.0 and s["mean_batch_occupancy"] == 0.5
    assert s["wasted_slot_fraction_mean"] == pytest.approx((28 / 128 + 0.5) / 2)
    assert s["decode_only_step_fraction"] == pytest.approx(1 / 3)
    assert s["duration_s"] is None and s["request_throughput"] is None
    json.dumps(s, allow_nan=False)
    with pytest.raises(ValueError, match="unknown"):
        summarize([], [dict(time=0.0, bogus=1)])


def test_parquet_round_trip(tmp_path):
    rows = request_rows(
        [_seq(0, 0.0, 0.0, [0.5, 1.0, 1.5], 1.5), _seq(1, 0.0, None, [], 1.0, failed=True)]
    )
    steps = [StepRecord(0.1, 2, 8, 3, 10, 1, False, 0, 0.5, 2.0)]
    rp, sp = write_tables(tmp_path / "run", rows, steps)
    assert rp.name == "requests.parquet" and sp.name == "steps.parquet"
    req_df, step_df = read_tables(tmp_path / "run")
    assert list(req_df["seq_id"]) == [0, 1]
    assert list(req_df["itls"][0]) == [0.5, 0.5] and len(req_df["itls"][1]) == 0
    assert req_df["ttft"][0] == 0.5 and np.isnan(req_df["ttft"][1])
    assert list(req_df["failed"]) == [False, True]
    (got,), want = step_df.to_dict("records"), steps[0].to_row()
    assert got.keys() == want.keys()
    for key, value in want.items():  # (pandas reads a null float as NaN)
        if value is None:
            assert got[key] is None or np.isnan(got[key]), (key, got[key])
        else:
            assert got[key] == value, (key, got[key], value)
    write_tables(tmp_path / "empty", [], [])
    e_req, e_step = read_tables(tmp_path / "empty")
    assert len(e_req) == 0 and "ttft" in e_req.columns and "kv_pages_used" in e_step.columns
