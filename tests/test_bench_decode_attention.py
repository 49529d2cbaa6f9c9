"""The decode-attention benchmark starts on the CPU (the kernel interpreted) and writes a checked,
timed row with provenance on its tiniest shape (one sequence, one page, the kernel's default
options: each more shape or config is another interpreted compile and timing loop; the kernel's
options and shapes are tests/test_paged_attention_kernel.py's)."""

from __future__ import annotations

import json

import experiment_scripts
import pytest


@pytest.fixture(scope="module")
def bench():
    return experiment_scripts.load("bench_decode_attention")


def test_smoke_run_writes_a_checked_timed_row_with_provenance(bench, tmp_path):
    out = tmp_path / "decode_attention.json"
    argv = ["--smoke", "--batches", "1", "--contexts", "16", "--configs", "auto"]
    bench.main([*argv, "--out", str(out)])
    result = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "timing_method", "rows", "finished"):
        assert key in result, key
    (row,) = result["rows"]
    assert (row["config"], row["batch"], row["context"], row["page_size"]) == ("auto", 1, 16, 16)
    assert "error" not in row, row
    assert row["rel_err"] < 1e-2, row  # bf16 kernel vs the fp32 reference
    assert row["time_us"] > 0 and row["kv_TBps"] > 0
