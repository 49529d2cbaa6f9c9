"""experiments/run_gpu_tests.py: the results file of a `-m gpu` run (here a run that selects no
GPU test, and a JUnit report parsed by hand), and its shards: disjoint, covering the collection,
independent of the order it came in, and each run recording its own tests (on CPU test files)."""

from __future__ import annotations

import json

import experiment_scripts
import numpy as np
import pytest


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


# -- shards ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rgt():
    return experiment_scripts.load("run_gpu_tests")


@pytest.fixture(scope="module")
def gpu_ids(rgt):
    """The node ids of this tree's `-m gpu` tests (collected, not run)."""
    ids = rgt.collect(["-p", "no:cacheprovider"])
    assert len(ids) > 20 and all("::" in i and i.startswith("tests/") for i in ids), ids[:5]
    return ids


def check_shards(rgt, ids: list[str], n: int, seed: int) -> None:
    shards = rgt.split(ids, n)
    assert len(shards) == n
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == len(ids), f"n={n}: not disjoint"
    assert set(flat) == set(ids), f"n={n}: misses {sorted(set(ids) - set(flat))[:3]}"
    shuffled = list(np.random.default_rng(seed).permutation(ids))
    assert rgt.split(shuffled, n) == shards, f"seed {seed}: n={n} depends on the order"
    share = -(-len(ids) // n)
    assert max(map(len, shards)) <= 2 * share, (n, [len(s) for s in shards])
    files = {}
    for i in ids:
        files.setdefault(i.split("::")[0], []).append(i)
    for file, tests in files.items():  # a file within a shard's share is never cut
        if len(tests) <= share:
            assert sum(bool(set(tests) & set(s)) for s in shards) == 1, (n, file)


def test_shards_of_the_gpu_suite_are_disjoint_cover_it_and_are_deterministic(rgt, gpu_ids,
                                                                             fresh_seed):  # fmt: skip
    for n in (1, 2, 3, 4, 5, 7):  # (one test: one collection of the suite, whichever the worker)
        check_shards(rgt, gpu_ids, n, fresh_seed)


def test_shards_of_any_file_sizes_are_disjoint_cover_them_and_are_deterministic(rgt, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    counts = rng.integers(1, 40, rng.integers(1, 12))
    ids = [f"tests/test_{f}.py::test_{t}[{p}]" for f, c in enumerate(counts)
           for t, p in enumerate(range(c))]  # fmt: skip
    for n in (1, 2, 4, 9, len(ids) + 3):  # more shards than tests: some are empty
        check_shards(rgt, ids, n, fresh_seed)
    assert rgt.split([], 3) == [[], [], []]


def test_a_shard_runs_only_its_tests_and_records_them(rgt, tmp_path):
    """Shard 2/2 of two CPU test files (`-m 'not gpu'` overrides the script's `-m gpu`) runs
    exactly the tests the split gives it of the collection it records, and records them."""
    args = ["--", "tests/test_block_manager_scheduler.py", "tests/test_workload_metrics.py",
            "-m", "not gpu", "-p", "no:cacheprovider"]  # fmt: skip
    out = tmp_path / "shard2.json"
    assert rgt.main(["--shard", "2/2", "--out", str(out), *args]) == 0
    result = json.loads(out.read_text())
    assert result["shard"] == "2/2" and result["pytest_rc"] == 0
    assert {"device", "jax", "commit", "date", "command"} <= set(result)
    assert "<shard_tests>" in result["pytest_command"]
    collected, shard = result["collected"], result["shard_tests"]
    assert len(collected) > 50 and all(c.split("::")[0] in args for c in collected)
    assert shard == rgt.split(collected, 2)[1] and 0 < len(shard) < len(collected)
    # what ran, JUnit's "tests.module::name" as a node id, is the shard's list
    ran = [t["test"].replace(".", "/", 1).replace("::", ".py::", 1) for t in result["tests"]]
    assert sorted(ran) == shard
    assert all(t["outcome"] == "passed" for t in result["tests"])


@pytest.mark.parametrize("value", ["0/4", "5/4", "x", "1/0", "2"])
def test_a_bad_shard_is_refused_naming_the_option(rgt, refused, value, tmp_path):
    err = refused(rgt.main, ["--shard", value, "--out", str(tmp_path / "gpu.json")])
    assert "--shard" in err and repr(value) in err, err
    assert not (tmp_path / "gpu.json").exists()
