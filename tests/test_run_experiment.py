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


def test_small_run_writes_results_with_zero_compiles_after_warmup(tmp_path):
    out = tmp_path / "run"
    overrides = [
        f"out_dir={out}", "workload.num_requests=12", "workload.arrival.rate=50",
        "engine.max_num_batched_tokens=64", "engine.max_num_seqs=8", "engine.max_model_len=320",
        "workload.output_len.hi=24",
    ]  # fmt: skip
    assert main(["run", str(QUICKSTART), *overrides, "--no-progress"]) == 0
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


def _start_run(out: Path, overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "jaxinfer.cli", "run", str(QUICKSTART), f"out_dir={out}",
           *overrides, "--no-progress"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip


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
