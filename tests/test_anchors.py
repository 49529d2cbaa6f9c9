"""The anchors script's CPU smoke run writes every row with a positive value and its method, its
timed GEMMs compute the product they are named for, and its roofline counts Llama-3-8B's
published parameters."""

from __future__ import annotations

import json
import random

import experiment_scripts
import jax
import jax.numpy as jnp
import numpy as np
import pytest

NAMES = {
    "copy",
    "elementwise_bf16",
    "matmul_bf16",
    "matmul_fp8",
    "gemv_bf16",
    "decode_roofline_llama3_8b",
}


@pytest.fixture(scope="module")
def anchors():
    return experiment_scripts.load("anchors")


def test_quick_run_writes_every_row_with_a_positive_value_and_its_method(anchors, tmp_path):
    out = tmp_path / "anchors.json"
    anchors.main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "timing", "rows", "errors"):
        assert key in result, key
    assert "--quick" in result["command"] and result["quick"] is True
    assert result["errors"] == []
    rows = result["rows"]
    assert {r["name"] for r in rows} == NAMES
    assert {r["impl"] for r in rows if r["name"] == "matmul_fp8"} >= {"xla", "xla_dequant"}
    for r in rows:
        assert r["value"] > 0 and r["unit"] and r["method"], r
        if r["impl"] != "derived":
            assert r["timing"] in result["timing"] and r["iterations"] >= 1, r
    # torch (the test extra) runs its rows on the CPU in a smoke run; otherwise they are skipped
    torch_rows = {r["name"] for r in rows if r["impl"] == "torch"}
    skipped = {s["name"] for s in result["skipped"] if s["impl"] == "torch"}
    assert torch_rows | skipped == {"copy", "matmul_bf16", "matmul_fp8"}
    (roof,) = [r for r in rows if r["name"] == "decode_roofline_llama3_8b"]
    fastest = max(r["value"] for r in rows if r["name"] == "copy")
    assert roof["value"] == pytest.approx(roof["weight_bytes"] / (fastest * 1e12) * 1e3)


def test_timed_gemms_compute_the_scaled_product(anchors, fresh_seed):
    key = jax.random.key(fresh_seed)
    m, k, n = 16, 64, 24
    a, b = anchors.gemm_operands(key, m, k, n, fp8=False)
    ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32).T
    np.testing.assert_allclose(np.asarray(anchors.bf16_gemm(a, b), np.float32), ref, rtol=2e-2,
                               atol=2e-2 * np.abs(ref).max())  # fmt: skip
    a8, b8, sa, sb = anchors.gemm_operands(key, m, k, n, fp8=True)
    assert a8.dtype == b8.dtype == jnp.float8_e4m3fn
    ref = (np.asarray(a8, np.float32) * float(sa)) @ (np.asarray(b8, np.float32) * float(sb)).T
    for gemm in (anchors.fp8_dequant_gemm, anchors.fp8_dot_gemm):
        out = gemm(a8, b8, sa, sb)
        assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
        np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-2,
                                   atol=2e-2 * np.abs(ref).max())  # fmt: skip


def test_loop_time_is_per_iteration_and_reaches_the_minimum_loop(anchors, fresh_seed):
    per_iter = random.Random(fresh_seed).uniform(1e-4, 1e-2)
    calls = []

    def run(n):  # a fake clock: exactly per_iter a loop iteration
        calls.append(n)
        return n * per_iter

    seconds, n = anchors.loop_time(run, min_loop_s=0.05, repeats=3)
    assert seconds == pytest.approx(per_iter)
    assert n * per_iter >= 0.05 and (n == 1 or n // 2 * per_iter < 0.05)
    assert calls[-3:] == [n] * 3


def test_roofline_weights_are_llama3_8b_published_parameters_less_the_embedding(anchors):
    # Llama-3-8B: 8,030,261,248 parameters; a decode step gathers 1 of the 128,256 embedding rows
    assert anchors.decode_weight_bytes() == 2 * (8_030_261_248 - (128_256 - 1) * 4096)
