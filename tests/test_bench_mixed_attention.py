"""The mixed-step attention benchmark runs on the CPU (interpret mode) and agrees with XLA."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "bench_mixed_attention.py"


def test_smoke_checks_both_kernel_configurations(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_mixed_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
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
