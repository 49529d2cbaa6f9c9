"""The decode-attention benchmark runs on the CPU (the kernel interpreted, tiny shapes), agrees
with the reference and writes one row per (page size, batch, context, config)."""

from __future__ import annotations

import json

import experiment_scripts
import pytest


@pytest.fixture(scope="module")
def bench():
    return experiment_scripts.load("bench_decode_attention")


def test_smoke_run_writes_a_checked_timed_row_per_config(bench, tmp_path):
    out = tmp_path / "decode_attention.json"
    bench.main(["--smoke", "--configs", "auto", "num_splits=2,num_stages=3", "--out", str(out)])
    result = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "timing_method", "rows", "finished"):
        assert key in result, key
    rows = result["rows"]
    assert [r["config"] for r in rows] == ["auto", "num_splits=2,num_stages=3"]
    for r in rows:
        assert "error" not in r, r
        assert r["rel_err"] < 1e-2, r  # bf16 kernel vs the fp32 reference
        assert r["time_us"] > 0 and r["kv_TBps"] > 0


def test_configs_name_only_surviving_kernel_options(bench):
    assert bench.parse_config("auto") == {}
    assert bench.parse_config("num_stages=3,warp_specialized=1") == {
        "num_stages": 3,
        "warp_specialized": True,
    }
    for removed in ("persistent=2", "early_exit=1", "fused_kv_write=1", "num_splits"):
        with pytest.raises(ValueError, match="name one of"):
            bench.parse_config(removed)
    with pytest.raises(SystemExit):  # rejected before anything runs
        bench.parse_args(["--out", "x.json", "--configs", "dynamic_splits=1"])
