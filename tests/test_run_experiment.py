"""`jaxinfer run`: config validation, a small end-to-end run writing its results folder, the\nresults streamed out of the engine as it goes, and what an interrupted run keeps."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from rich.console import Console

from jaxinfer.cli import main
from jaxinfer.engine.engine import Engine
from jaxinfer.experiment import run as runs
from jaxinfer.experiment.run import load_run_config, run_experiment
from jaxinfer.metrics import REQUEST_COLUMNS, SLO, read_tables, request_rows, step_row, summarize

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
QUIET = Console(quiet=True)


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("engine.no_such_key=1", "no_such_key"),
        ("engine.scheduler=lifo", "scheduler"),
        ("engine.page_size=0", "page_size"),
        ("workload.arrival.process=sometimes", "process"),
        ("engine.max_num_seqs=many", "max_num_seqs"),
    ],
)
def test_invalid_config_names_the_key(override, names):
    with pytest.raises(ValueError, match=names):
        load_run_config(QUICKSTART, [override])


@pytest.mark.parametrize(
    ("override", "key", "allowed"),
    [
        ("sampling.max_tokens=0", "sampling.max_tokens=0", "int >= 1"),
        ("sampling.temperature=-1", "sampling.temperature=-1.0", ">= 0"),
        ("sampling.top_p=1.5", "sampling.top_p=1.5", "(0, 1]"),
        ("sampling.min_p=1", "sampling.min_p=1.0", "[0, 1)"),
        ("sampling.top_k=-2", "sampling.top_k=-2", "-1 or 0 for off"),
        ("workload.num_requests=0", "workload.num_requests=0", "int >= 1"),
        ("workload.prompt_len.lo=0", "workload.prompt_len.lo=0", "int >= 1"),
        ("workload.output_len.hi=8", "workload.output_len.hi=8", ">= lo=16"),
        ("workload.arrival.rate=-1", "workload.arrival.rate=-1.0", "> 0"),
        ("workload.prompt_len.lo=600", "workload.prompt_len.hi=192", ">= lo=600"),
    ],
)
def test_sampling_and_workload_values_are_refused_at_load_naming_the_key(override, key, allowed):
    """Each would otherwise fail every request at run time (after the warm-up), or, for
    max_tokens=0, silently become 1."""
    with pytest.raises(ValueError) as info:
        load_run_config(QUICKSTART, [override])
    assert str(info.value).startswith(key) and allowed in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["workload.prompt_len.lo=500", "workload.prompt_len.hi=600"],
         ["500 prompt tokens (workload.prompt_len)", "16 output tokens (workload.output_len)",
          "= 516 > engine.max_model_len=512"]),
        (["workload.kind=shared_prefix", "workload.system_prompt_len=490"],
         ["506 prompt tokens (workload.prompt_len + workload.system_prompt_len)"]),
        (["sampling.max_tokens=64", "workload.prompt_len.lo=512", "workload.prompt_len.hi=600"],
         ["+ 1 output tokens (sampling.max_tokens, cut to engine.max_model_len) = 513"]),
    ],
)  # fmt: skip
def test_a_workload_no_request_of_which_fits_the_engine_is_refused_at_load(overrides, fragments):
    with pytest.raises(ValueError, match=r"^every request would be refused: ") as info:
        load_run_config(QUICKSTART, overrides)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("engine.max_model_len=3000", ["engine.max_model_len=3000",
                                       "max_position_embeddings=2048", "engine.model=tiny"]),
        ("sampling.top_k=5000", ["sampling.top_k=5000", "vocabulary size 4096"]),
    ],
)  # fmt: skip
def test_what_the_model_cannot_serve_is_refused_before_a_weight_or_a_file(
    tmp_path, capsys, monkeypatch, override, fragments
):
    """max_model_len over the model's positions ended in a device OOM at warm-up; top_k over
    its vocabulary failed every request. Refused from the model's config.json alone."""
    monkeypatch.setattr(runs, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    out = tmp_path / "run"
    assert main(["run", str(QUICKSTART), override, f"out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxinfer run: error: ") and err.count("\n") == 1, err
    assert all(f in err for f in fragments), err
    assert not out.exists()


def test_small_run_writes_results_with_zero_compiles_after_warmup(tmp_path, capsys):
    out = tmp_path / "run"
    overrides = [
        f"out_dir={out}", "workload.num_requests=12", "workload.arrival.rate=50",
        "engine.max_num_batched_tokens=64", "engine.max_num_seqs=8", "engine.max_model_len=320",
        "workload.output_len.hi=24",
    ]  # fmt: skip
    assert main(["run", str(QUICKSTART), *overrides, "--no-progress"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-2:] == [f"results: {out}", f"report:  jaxinfer report {out}"]
    assert not any("requests failed" in line for line in printed)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_completed"] == 12 and metrics["num_failed"] == 0
    assert metrics["compiles_after_warmup"] == 0
    assert metrics["output_throughput"] > 0 and metrics["ttft_median"] > 0
    env = json.loads((out / "env.json").read_text())
    assert {"device", "jax", "commit", "date", "command"} <= env.keys()
    requests, steps = read_tables(out)
    assert len(requests) == 12 and len(steps) == metrics["num_steps"]
    assert (requests["output_len"] >= 16).all() and (requests["ttft"] > 0).all()
    assert "max_num_batched_tokens: 64" in (out / "config.yaml").read_text()


# Few jit buckets (as in test_sweep.py): the warm-up compiles in seconds.
TINY = [
    "workload.output_len.hi=20", "workload.prompt_len.hi=40", "engine.max_num_batched_tokens=16",
    "engine.max_num_seqs=2", "engine.max_model_len=128", "engine.num_pages=64",
    "engine.decode_steps=1",
]  # fmt: skip
REPO = QUICKSTART.parent.parent


class EngineSpy:
    """Wraps Engine: keeps every sequence added and every step record made (the engine lets them
    go during the run), and what the engine still holds each time a step starts."""

    def __init__(self, monkeypatch):
        self.engines, self.seqs, self.steps = [], [], []
        self.finished_held, self.records_held = [], []
        add, step = Engine.add_request, Engine.step

        def add_request(engine, *args, **kwargs):
            seq = add(engine, *args, **kwargs)
            self.seqs.append(seq)
            return seq

        def spy_step(engine):
            if engine not in self.engines:
                self.engines.append(engine)
            self.finished_held.append(sum(q.is_finished for q in engine.sequences))
            self.records_held.append(len(engine.step_records))
            n = len(engine.step_records)
            outputs = step(engine)
            self.steps += engine.step_records[n:]
            return outputs

        monkeypatch.setattr(Engine, "add_request", add_request)
        monkeypatch.setattr(Engine, "step", spy_step)


def test_finished_requests_and_step_records_leave_the_engine_as_the_run_goes(tmp_path, monkeypatch):
    spy = EngineSpy(monkeypatch)
    overrides = [f"out_dir={tmp_path}", "workload.num_requests=10", "workload.arrival.rate=100"]
    metrics = run_experiment(
        load_run_config(QUICKSTART, [*TINY, *overrides]), show_progress=False, console=QUIET
    )
    assert metrics["num_completed"] == 10 and len(spy.seqs) == 10
    (engine,) = spy.engines
    assert len(spy.finished_held) > 10  # many steps, the arrivals spread over them
    # When a step starts, no finished sequence and no step record is left in the engine.
    assert max(spy.finished_held) == 0 and max(spy.records_held) == 0
    assert engine.sequences == [] and engine.step_records == []


def test_streamed_tables_and_metrics_equal_those_of_the_whole_run(tmp_path, monkeypatch):
    """The tables and metrics.json, written as the run goes, equal what the run's every sequence
    and step record give at once (the way they were computed before streaming), to the bit:
    with requests rejected on arrival (prompt + output over max_model_len: about half of them)
    finishing before those that arrived earlier."""
    spy = EngineSpy(monkeypatch)
    seed = int(np.random.default_rng().integers(1000))
    overrides = [
        f"out_dir={tmp_path}", "workload.num_requests=12", "workload.arrival.rate=100",
        "workload.prompt_len.lo=100", "workload.prompt_len.hi=120", f"workload.seed={seed}",
    ]  # fmt: skip
    rc = load_run_config(QUICKSTART, [*TINY, *overrides])
    run_experiment(rc, show_progress=False, console=QUIET)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    rows = request_rows(spy.seqs)  # in arrival (seq_id) order
    expected = summarize(rows, spy.steps, SLO(rc.slo.ttft, rc.slo.tpot), max_num_seqs=2)
    expected.update(
        warmup_s=metrics["warmup_s"], compiles_after_warmup=0, num_requests=12,
        failed_errors=sorted({q.error for q in spy.seqs if q.error}),
    )  # fmt: skip
    env = json.loads((tmp_path / "env.json").read_text())
    assert metrics == json.loads(json.dumps({**env, **expected})), f"seed {seed}"
    assert 0 < metrics["num_failed"] < 12, f"seed {seed}: some rejected, some served"
    requests = pq.read_table(tmp_path / "requests.parquet").to_pylist()
    assert requests == [{c: r[c] for c in REQUEST_COLUMNS} for r in rows], f"seed {seed}"
    steps = pq.read_table(tmp_path / "steps.parquet").to_pylist()
    assert steps == [step_row(s) for s in spy.steps], f"seed {seed}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.yaml", "env.json", "metrics.json", "requests.parquet", "steps.parquet",
    ]  # fmt: skip


def test_run_of_a_sweep_config_says_to_sweep_it_in_one_line(tmp_path, capsys):
    cfg = OmegaConf.load(QUICKSTART)
    cfg.sweep = {"grid": {"engine.scheduler": ["fcfs", "static"]}}
    path = tmp_path / "sweep.yaml"
    OmegaConf.save(cfg, path)
    assert main(["run", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"jaxinfer sweep {path}" in err and "sweep:" in err


def _trace(path: Path, prompt_lens: list[int]) -> Path:
    rows = [{"prompt_token_ids": list(range(1, n + 1)), "output_len": 4} for n in prompt_lens]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("prompt_lens", "code"), [([200, 300, 200], 1), ([200, 10, 300], 0)], ids=["all", "some"]
)
def test_failed_requests_are_summarised_and_a_run_with_none_served_exits_1(
    tmp_path, capsys, prompt_lens, code
):
    """Prompts over max_model_len=128 (a trace's lengths are known only as it is read): the
    count and the kinds of error printed, exit status 1 when no request succeeded."""
    trace = _trace(tmp_path / "trace.jsonl", prompt_lens)
    out = tmp_path / "run"
    overrides = [*TINY, f"out_dir={out}", "workload.kind=trace", f"workload.trace_path={trace}",
                 "workload.num_requests=null", "workload.arrival.process=all_at_once"]  # fmt: skip
    assert main(["run", str(QUICKSTART), *overrides, "--no-progress"]) == code
    captured = capsys.readouterr()
    failed = sum(n > 128 for n in prompt_lens)
    summary = captured.out[captured.out.index(f"{failed} of 3 requests failed:") :].splitlines()
    assert re.fullmatch(
        rf"  {failed} x request \d: prompt \(\d+ tokens\) \+ max_tokens \(4\) = \d+ exceeds "
        r"max_model_len=128",
        summary[1],
    ), summary  # one kind of error, with its count
    assert summary[2:] == [f"results: {out}", f"report:  jaxinfer report {out}"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_failed"] == failed and len(metrics["failed_errors"]) == failed
    if code:
        assert captured.err == (
            f"jaxinfer run: error: none of the 3 requests succeeded (the reasons above; every "
            f"one in {out / 'metrics.json'})\n"
        )


def test_summary_shows_units_goodput_with_an_slo_and_explains_a_zero_itl():
    m = {"num_completed": 9, "ttft_median": 0.01234, "tpot_p99": 0.2, "itl_median": 0.0,
         "duration_s": 2.5, "output_throughput": 100.0, "host_ms_mean": 1.5,
         "slo_ttft": 1.0, "slo_tpot": 0.1, "goodput": 3.2, "slo_attainment": 0.8}  # fmt: skip
    console = Console(record=True, width=200, file=open(os.devnull, "w"))  # noqa: SIM115

    def rows(metrics):
        console.print(runs.summary_table("x", metrics))
        text = console.export_text()
        return dict(re.findall(r"│ (.+?) +│ +(\S+) │", text))

    assert rows(m) == {
        "completed requests": "9", "duration (s)": "2.5", "output throughput (tok/s)": "100",
        "TTFT median (ms)": "12.34", "TPOT p99 (ms)": "200", "ITL median (ms)": "0",
        "goodput (req/s within TTFT 1000 ms, TPOT 100 ms)": "3.2",
        "SLO attainment (% of requests)": "80", "host time per step, mean (ms)": "1.5",
    }  # fmt: skip
    no_slo = {**m, "slo_ttft": None, "slo_tpot": None}
    assert not any("goodput" in k or "SLO" in k for k in rows(no_slo))
    (note,) = runs.summary_notes(m)
    assert "ITL median 0 ms" in note and "decode scan" in note
    assert runs.summary_notes({**m, "itl_median": 0.004}) == []


def _start_run(out: Path, overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "jaxinfer.cli", "run", str(QUICKSTART), f"out_dir={out}",
           *overrides, "--no-progress"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the drop)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_whose_exception_a_finalizer_drops_still_stops_the_run(tmp_path, monkeypatch, sig):
    """A handler runs between any two bytecodes: inside a finalizer (jax's gc callback is one)
    its `Signalled` is printed and dropped (a CI run once finished with rc 0 after SIGINT). The
    signal still stops the run (the serving loop's `raise_caught_signal`), which keeps its
    finished part; outside `stop_on_signals` nothing is left."""

    class Finalized:
        def __del__(self):
            signal.raise_signal(sig)  # the handler raises here, inside the finalizer

    step, calls = Engine.step, []

    def step_dropping_a_signal(engine):
        calls.append(1)
        if len(calls) == 3:
            obj = Finalized()
            del obj  # "Exception ignored in ... __del__": the Signalled is dropped
        return step(engine)

    monkeypatch.setattr(Engine, "step", step_dropping_a_signal)
    overrides = [f"out_dir={tmp_path}", "workload.num_requests=10", "workload.arrival.rate=100"]
    with runs.stop_on_signals():
        with pytest.raises(runs.RunInterrupted, match=f"interrupted by {sig.name} after") as e:
            run_experiment(load_run_config(QUICKSTART, [*TINY, *overrides]),
                           show_progress=False, console=QUIET)  # fmt: skip
        assert e.value.signum == sig and len(calls) == 3, len(calls)
        runs.raise_caught_signal()  # the run took it
    assert json.loads((tmp_path / "metrics.json").read_text())["interrupted"] == sig.name


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_signal_mid_run_keeps_the_finished_part_and_says_what_it_kept(tmp_path, sig, code):
    out = tmp_path / "run"
    # ~10 s of arrivals: the signal comes once the first table parts are written, ~1 s in.
    proc = _start_run(out, [*TINY, "workload.num_requests=400", "workload.arrival.rate=40"])
    try:
        parts = out / "requests.parquet.parts"
        while proc.poll() is None and not (parts.is_dir() and any(parts.glob("*.parquet"))):
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before its first table parts appeared"
        assert (out / "config.yaml").is_file() and (out / "env.json").is_file()  # from the start
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    name = signal.Signals(sig).name
    last = err.strip().splitlines()[-1]
    found = re.fullmatch(
        rf"jaxinfer run: interrupted by {name} after (\d+) of 400 requests: kept in {out} "
        r"config.yaml, env.json, requests.parquet \((\d+) finished requests\), "
        r"steps.parquet \((\d+) steps\) and metrics.json of the finished part",
        last,
    )  # fmt: skip
    assert found, last
    n, n_again, num_steps = map(int, found.groups())
    requests, steps = read_tables(out)
    assert n == n_again == len(requests) < 400 and num_steps == len(steps) > 0
    assert requests["seq_id"].is_unique and requests["seq_id"].is_monotonic_increasing
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["interrupted"] == name and metrics["num_requests"] == 400
    assert metrics["num_completed"] + metrics["num_failed"] == n
    assert metrics["num_steps"] == num_steps
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml", "env.json", "metrics.json", "requests.parquet", "steps.parquet",
    ]  # fmt: skip


def test_sigint_during_warm_up_ends_the_run_at_once(tmp_path):
    out = tmp_path / "run"
    proc = _start_run(out, [])  # quickstart's buckets: a warm-up of ~15 s on 2 cores
    try:
        for line in proc.stdout:
            if "warm-up" in line:
                break
        time.sleep(3.0)  # compiles queued by now (waiting for them at exit takes ~8 s)
        assert proc.poll() is None, "the warm-up ended before the signal"
        proc.send_signal(signal.SIGINT)
        t0 = time.perf_counter()
        _, err = proc.communicate(timeout=60)
        waited = time.perf_counter() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert waited < 4.0, f"{waited:.1f} s from SIGINT to exit"
    assert err.strip().splitlines()[-1] == (
        f"jaxinfer run: interrupted by SIGINT during the warm-up: kept config.yaml and env.json "
        f"in {out}; no request ran, so no tables and no metrics.json"
    )
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "env.json"]


def test_sampling_penalties_reach_the_requests_and_need_the_engine_option(tmp_path):
    """The sampling section takes penalties; without engine.penalties the config is refused at
    load (each request would fail alone at run time)."""
    from jaxinfer.experiment.run import load_run_config

    with pytest.raises(ValueError, match=r"engine\.penalties=true"):
        load_run_config(None, ["sampling.repetition_penalty=0.5"])
    rc = load_run_config(None, ["sampling.repetition_penalty=0.5", "engine.penalties=true"])
    assert rc.sampling.repetition_penalty == 0.5
