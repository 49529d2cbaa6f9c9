"""experiments/merge_quant_xla.py on the H200 run it produced: the per-format files written back
from the committed results file merge into the same summary, whose ratios are the rows' own."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "experiments/results/h200/quant_xla.json"


def merge_module():
    spec = importlib.util.spec_from_file_location("merge_quant_xla",
                                                  ROOT / "experiments/merge_quant_xla.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_h200_runs_merge_into_the_committed_summary(tmp_path):
    committed = json.loads(RESULT.read_text())
    for fmt, run in committed["runs"]["decode"].items():
        (tmp_path / f"quant_xla_{fmt}.json").write_text(json.dumps(run))
    for fmt, run in committed["runs"]["throughput"].items():
        (tmp_path / f"quant_xla_tput_{fmt}.json").write_text(json.dumps(run))
    (tmp_path / "quant_xla_broken.json").write_text("{")  # a run killed while writing
    lines = [json.dumps(r) for r in committed["driver_runs"]]
    (tmp_path / "driver_runs.jsonl").write_text("\n".join(lines) + "\n")

    merged = merge_module().main([str(tmp_path), "--out", str(tmp_path / "merged.json")])
    *summary, broken = merged["summary"]
    assert summary == committed["summary"]
    assert broken["format"] == "broken" and "unreadable" in broken["errors"][0]  # named, not fatal

    rows = {r["format"]: r for r in merged["summary"]}
    plain = committed["runs"]["decode"]["none"]["decode"]
    for fmt, run in committed["runs"]["decode"].items():
        for r in run["decode"]:
            want = round(next(p["step_ms"] for p in plain if p["batch"] == r["batch"])
                         / r["step_ms"], 3)  # fmt: skip
            assert rows[fmt][f"speedup_vs_plain_b{r['batch']}"] == want, (fmt, r["batch"])
            assert rows[fmt][f"x_roofline_b{r['batch']}"] == r["ratio"]
    assert rows["fp8_channel"]["output_tok_s"] is None  # its throughput run was skipped
    assert any("skipped" in e for e in rows["fp8_channel"]["errors"])
