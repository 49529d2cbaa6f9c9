"""The paged-attention benchmark's smoke mode runs on the CPU and writes the documented schema."""

from __future__ import annotations

import json

import experiment_scripts
import pytest

ROW_KEYS = {"impl", "batch", "context", "q_heads", "kv_heads", "head_dim", "page_size", "kv_dtype"}
TIMED_KEYS = {"time_ms", "kv_TBps", "rel_err"}


@pytest.fixture(scope="module")
def bench():
    return experiment_scripts.load("bench_paged_attention")


def test_smoke_run_writes_schema_and_matches_reference(bench, tmp_path):
    out = tmp_path / "paged_attention.json"
    bench.main(["--smoke", "--impls", "xla", "cudnn_paged", "--out", str(out)])
    result = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "timing_method", "rows"):
        assert key in result, key
    assert "--smoke" in result["command"]
    rows = result["rows"]
    xla = [r for r in rows if r["impl"] == "xla"]
    assert {r["kind"] for r in xla} == {"decode", "prefill"}
    assert {r["kv_dtype"] for r in xla} == {"bfloat16", "float8_e4m3fn"}
    for r in xla:
        assert r.keys() >= ROW_KEYS | TIMED_KEYS, r
        assert "error" not in r, r
        assert r["time_ms"] > 0 and r["kv_TBps"] > 0
        assert r["rel_err"] < 2e-2, r  # bf16 output vs the fp32 reference
        if r["kind"] == "prefill":
            assert r["tflops"] >= 0
    # A GPU-only implementation on the CPU is an error row, not a crashed run.
    (cudnn,) = [r for r in rows if r["impl"] == "cudnn_paged"]
    assert cudnn.keys() >= ROW_KEYS and "GPU" in cudnn["error"]


def test_prefill_flops_count_causal_pairs(bench):
    case = bench.Case("prefill", 2, 3, 4, 2, 8, 16, "bfloat16")
    # 3 queries see 1 + 2 + 3 = 6 keys; 2 matmuls x 2 flops x D per pair, per head and sequence.
    assert case.causal_flops == 2 * 4 * 6 * 2 * 2 * 8


def test_decode_bytes_count_k_and_v_and_fp8_scales(bench):
    bf16 = bench.Case("decode", 2, 64, 4, 2, 8, 16, "bfloat16")
    fp8 = bench.Case("decode", 2, 64, 4, 2, 8, 16, "float8_e4m3fn")
    assert bf16.kv_bytes == 2 * 64 * 2 * 8 * 2 * 2
    assert fp8.kv_bytes == 2 * 64 * 2 * 8 * 2 + 2 * 4 * 2 * 4 * 2  # + (pages x heads) f32 scales
