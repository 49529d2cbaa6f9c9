"""`jaxinfer run`: config validation and a small end-to-end run writing its results folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxinfer.cli import main
from jaxinfer.experiment.run import load_run_config
from jaxinfer.metrics import read_tables

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


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
