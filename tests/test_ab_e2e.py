"""The A/B harness's smoke run: bench_e2e variants run, their rows merged with the change against
the base, provenance and commands recorded, and a resume reruns only an unfinished run."""

from __future__ import annotations

import json

import experiment_scripts
import pytest


@pytest.fixture(scope="module")
def ab():
    return experiment_scripts.load("ab_e2e")


def _run(variant_rows, **extra):
    return {"device": "gpu:H x1", "jax": "0.x", "python": "3", "commit": "abc",
            "decode": variant_rows, "throughput": [], "errors": [], **extra}  # fmt: skip


def test_smoke_ab_runs_merges_and_resumes(ab, tmp_path):
    out = tmp_path / "ab.json"
    argv = ["--out", str(out), "--variant", "base=", "--variant", "steps2=--decode-steps 2",
            "--common", "--smoke --parts decode --compile-cache '' --batches 1 --contexts 16"]  # fmt: skip
    result = ab.main(argv)
    assert json.loads(out.read_text())["decode"] == result["decode"]
    assert result["device"] and result["jax"] and result["commit"] and result["date"]
    assert "--decode-steps 2" in result["run_commands"]["steps2_r0"]
    assert "--decode-steps" not in result["run_commands"]["base_r0"]
    assert result["errors"] == []
    base = result["runs"]["base_r0"]["decode"][0]["step_ms"]
    steps2 = result["runs"]["steps2_r0"]["decode"][0]
    assert (
        steps2["decode_steps"] == 2 and result["runs"]["base_r0"]["decode"][0]["decode_steps"] == 4
    )
    (row,) = [r for r in result["decode"] if r["variant"] == "steps2"]
    assert row["change"] == pytest.approx(steps2["step_ms"] / base - 1, abs=1e-3)

    # resume: a finished run is kept, one without its marker runs again
    work = tmp_path / "ab_runs"
    kept, redo = (work / "base_r0.log").stat().st_mtime_ns, (work / "steps2_r0.log").stat()
    (work / "steps2_r0.done").unlink()
    again = ab.main(argv)
    assert (work / "base_r0.log").stat().st_mtime_ns == kept
    assert (work / "steps2_r0.log").stat().st_mtime_ns > redo.st_mtime_ns
    assert (work / "steps2_r0.done").exists()
    assert again["runs"]["base_r0"] == result["runs"]["base_r0"]
