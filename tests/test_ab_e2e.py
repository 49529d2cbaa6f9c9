"""The A/B harness runs bench_e2e variants interleaved, merges their rows with the change against
the base, records provenance and commands, and resumes without rerunning finished runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import experiment_scripts
import pytest


@pytest.fixture(scope="module")
def ab():
    return experiment_scripts.load("ab_e2e")


def _run(variant_rows, **extra):
    return {"device": "gpu:H x1", "jax": "0.x", "python": "3", "commit": "abc",
            "decode": variant_rows, "throughput": [], "errors": [], **extra}  # fmt: skip


def test_merge_means_rounds_and_changes_against_the_base(ab, tmp_path):
    args = ab.parse_args(["--out", str(tmp_path / "ab.json"), "--rounds", "2",
                          "--variant", "a=", "--variant", "b=--decode-steps 4"])  # fmt: skip
    plan = ab.run_plan(args)
    assert [p[0] for p in plan] == ["a_r0", "b_r0", "a_r1", "b_r1"]  # interleaved
    row = lambda ms, ratio: {"batch": 8, "context": 512, "step_ms": ms, "ratio": ratio}  # noqa: E731
    runs = {
        "a_r0": _run([row(4.0, 1.20)], warmup_s=50.0),
        "b_r0": _run([row(3.9, 1.17), {"batch": 64, "context": 512, "error": "OOM"}]),
        "a_r1": _run(
            [row(4.2, 1.26)],
            throughput=[{"impl": "jaxinfer", "workload": "w", "output_tok_s": 100.0}],
        ),
        "b_r1": _run(
            [row(3.8, 1.14)],
            commit="def",
            throughput=[{"impl": "jaxinfer", "workload": "w", "output_tok_s": 120.0}],
        ),
    }
    merged = ab.merge(args, runs, plan)
    assert merged["base"] == "a"
    (ra, rb) = merged["decode"]
    assert ra["variant"] == "a" and ra["step_ms"] == pytest.approx(4.1) and "change" not in ra
    assert ra["step_ms_rounds"] == [4.0, 4.2] and ra["ratio"] == pytest.approx(1.23)
    assert rb["step_ms"] == pytest.approx(3.85)
    assert rb["change"] == pytest.approx(3.85 / 4.1 - 1, abs=1e-4)
    (ta, tb) = merged["throughput"]
    assert ta["output_tok_s"] == 100.0 and "change" not in ta
    assert tb["change"] == pytest.approx(0.2)
    assert merged["errors"] == [{"run": "b_r0", "batch": 64, "context": 512, "error": "OOM"}]
    assert merged["warmup_s"]["a_r0"] == 50.0
    prov = ab.provenance(runs, plan)
    assert prov["commit"] == "abc" and prov["mismatch"] == {"commit": ["abc", "def"]}


def test_bad_variants_are_refused_by_name(ab, tmp_path, refused):
    out = ["--out", str(tmp_path / "x.json")]
    two = ["--variant", "a=", "--variant", "b="]
    for bad, message in [
        (["--variant", "a="], "give at least two --variant (the first is the base)"),
        (["--variant", "a=", "--variant", "a=--smoke"], "--variant 'a' given twice"),
        (["--variant", "a", "--variant", "b="], "--variant 'a': expected NAME=ARGS"),
        (["--variant", "a b=", "--variant", "c="], "--variant 'a b=': expected NAME=ARGS"),
        (["--variant", "a=", "--variant", "b=--out y"], "--variant b: --out is set per run"),
        (["--variant", "a=", "--variant", "b=--out=y"], "--variant b: --out is set per run"),
        (["--variant", "a=", "--variant", "b='open"], "--variant b: No closing quotation"),
        ([*two, "--common", "--out z"], "--common: --out is set per run"),
        ([*two, "--common", "'open"], "--common: No closing quotation"),
        ([*two, "--rounds", "0"], "--rounds must be at least 1"),
    ]:
        assert message in refused(ab.parse_args, out + bad), bad


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


def test_a_variant_runs_another_checkouts_code(ab, tmp_path, refused):
    """`--tree NAME=PATH@COMMIT`: that variant's runs use PATH's bench_e2e.py, PATH first on the
    import path and COMMIT as the recorded commit; a tree without the script is refused."""
    root = Path(ab.__file__).resolve().parents[1]
    out = ["--out", str(tmp_path / "ab.json"), "--variant", "before=", "--variant", "after="]
    args = ab.parse_args([*out, "--tree", f"before={root}@abc123"])
    assert ab.run_command(args, "before", tmp_path / "x.json")[1] == str(
        root / "experiments" / "bench_e2e.py"
    )
    env = ab.run_env(args, "before")
    assert (
        env["PYTHONPATH"].split(os.pathsep)[0] == str(root) and env["JAXINFER_COMMIT"] == "abc123"
    )
    assert ab.run_env(args, "after") is None
    for bad in (f"nope={root}", f"before={tmp_path}", f"before{root}"):
        err = refused(ab.parse_args, [*out, "--tree", bad])
        assert f"--tree {bad!r}: expected NAME=PATH[@COMMIT]" in err, bad
