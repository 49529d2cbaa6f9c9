"""The mixed-step attention benchmark runs on the CPU (interpret mode) and agrees with XLA."""

from __future__ import annotations

import json

import experiment_scripts


def test_smoke_checks_both_kernel_configurations(tmp_path):
    module = experiment_scripts.load("bench_mixed_attention")
    out = tmp_path / "mixed.json"
    module.main(["--smoke", "--no-timing", "--out", str(out)])
    result = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "rows", "kv_bytes"):
        assert key in result, key
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"pallas_split", "pallas_nosplit", "xla"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["rel_err"] < 1e-2, r
    assert rows["xla"]["rel_err"] == 0.0
    assert result["query_tokens"] == 5 + 2 * 20
