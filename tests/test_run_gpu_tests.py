"""experiments/run_gpu_tests.py: the results file of a `-m gpu` run (here a run that selects no
GPU test, and a JUnit report parsed by hand)."""

from __future__ import annotations

import json

import experiment_scripts


def test_junit_outcomes_are_read(tmp_path):
    rgt = experiment_scripts.load("run_gpu_tests")
    xml = """<testsuites><testsuite>
      <testcase classname="tests.a" name="t1" time="1.5"/>
      <testcase classname="tests.a" name="t2" time="2"><failure message="x"/></testcase>
      <testcase classname="tests.b" name="t3" time="0"><skipped/></testcase>
    </testsuite></testsuites>"""
    path = tmp_path / "j.xml"
    path.write_text(xml)
    rows = rgt.parse_junit(path)
    assert rows == [
        {"test": "tests.a::t1", "outcome": "passed", "seconds": 1.5},
        {"test": "tests.a::t2", "outcome": "failed", "seconds": 2.0},
        {"test": "tests.b::t3", "outcome": "skipped", "seconds": 0.0},
    ]


def test_a_run_writes_provenance_and_pytests_exit_code(tmp_path):
    rgt = experiment_scripts.load("run_gpu_tests")
    out = tmp_path / "gpu.json"
    rc = rgt.main(["--out", str(out), "--", "tests/test_sampler.py", "-p", "no:cacheprovider"])
    result = json.loads(out.read_text())
    assert rc == result["pytest_rc"] == 5  # pytest's "no tests collected": no GPU test there
    assert {"device", "jax", "commit", "date", "command"} <= set(result)
    assert result["tests"] == [] and "deselected" in result["summary"]
