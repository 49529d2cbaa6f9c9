"""experiments/speculative/verify_cost.py: its CPU smoke run (tiny) times each gamma's
verification step through bench_e2e and writes the cost over the plain step with provenance."""

from __future__ import annotations

import json
from types import SimpleNamespace

import experiment_scripts


def test_smoke_run_writes_each_gammas_cost_over_the_plain_step(tmp_path):
    script = experiment_scripts.load("speculative/verify_cost")
    out, png = tmp_path / "vc.json", tmp_path / "vc.png"
    script.main(["--smoke", "--out", str(out), "--plot", str(png)])
    r = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "engine"):
        assert key in r, key
    assert r["errors"] == []
    rows = {(x["gamma"], x["batch"]): x for x in r["rows"]}
    assert set(rows) == {(0, 1), (0, 4), (2, 1), (2, 4)}
    for (gamma, batch), x in rows.items():
        assert x["rows_per_sequence"] == 1 + gamma and x["step_ms"] > 0, x
        want = x["step_ms"] / rows[0, batch]["step_ms"]
        assert abs(x["cost_x"] - want) <= 1e-3 * want, x
    assert png.stat().st_size > 0


def test_attention_options_reach_each_gammas_bench():
    script = experiment_scripts.load("speculative/verify_cost")
    args = SimpleNamespace(batches=[1, 8], smoke=False, preset="llama3-8b", dtype="bfloat16",
                           context=512, attention_options=["num_splits=2"])  # fmt: skip
    cmd = script.bench_command(args, 4, "out.json")
    at = cmd.index("--attention-options")
    assert cmd[at + 1 :] == ["num_splits=2"] and cmd[cmd.index("--num-draft-tokens") + 1] == "4"
    args.attention_options = []
    assert "--attention-options" not in script.bench_command(args, 4, "out.json")
