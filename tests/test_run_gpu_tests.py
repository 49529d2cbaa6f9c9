"""experiments/run_gpu_tests.py: one smoke run (a shard of two CPU test files) writes its results
file with provenance and records exactly its shard's tests, read from pytest's JUnit report; and
its shards are disjoint, cover the collection, and do not depend on the order it came in."""

from __future__ import annotations

import json
import signal
import sys

import experiment_scripts
import numpy as np
import pytest


@pytest.fixture(scope="module")
def rgt():
    return experiment_scripts.load("run_gpu_tests")


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
    assert "--only-tests=<shard_tests>" in result["pytest_command"]
    collected, shard = result["collected"], result["shard_tests"]
    assert len(collected) > 50 and all(c.split("::")[0] in args for c in collected)
    assert shard == rgt.split(collected, 2)[1] and 0 < len(shard) < len(collected)
    # what ran, JUnit's "tests.module::name" as a node id, is the shard's list
    ran = [t["test"].replace(".", "/", 1).replace("::", ".py::", 1) for t in result["tests"]]
    assert sorted(ran) == shard
    assert all(t["outcome"] == "passed" for t in result["tests"])


def test_a_shard_runs_when_no_test_path_is_given(rgt, tmp_path, monkeypatch):
    """The device's command names no test file (`--shard 5/5 -- -p no:cacheprovider`): the run
    must still see conftest.py's `--only-tests` (given as a separate word, pytest took the list's
    temporary path for the tests' root and refused the option) and run the shard's tests only.
    The collection is stubbed: one small file's node ids stand for the whole suite's."""
    ids = [f"tests/test_workload_metrics.py::{name}" for name in
           ("test_fixed_and_uniform_lengths", "test_poisson_rate_sorted_and_starts_at_zero")]  # fmt: skip
    monkeypatch.setattr(rgt, "collect", lambda args: ids)
    out = tmp_path / "shard1.json"
    rc = rgt.main(["--shard", "1/2", "--out", str(out), "--", "-m", "not gpu",
                   "-p", "no:cacheprovider"])  # fmt: skip
    result = json.loads(out.read_text())
    assert rc == 0, result["failures"]
    ran = [t["test"].replace(".", "/", 1).replace("::", ".py::", 1) for t in result["tests"]]
    assert ran == result["shard_tests"] == rgt.split(ids, 2)[0]


def test_a_run_past_its_timeout_is_interrupted_and_reported(rgt):
    """A child that never ends on its own (a sleeping test, here a sleeping Python) is
    interrupted at the timeout: timed out, a failing exit code, whatever it printed kept."""
    cmd = [sys.executable, "-c", "print('started', flush=True); import time; time.sleep(600)"]
    returncode, out, timed_out = rgt.run_streaming(cmd, timeout_s=1.0)
    assert timed_out and returncode != 0, (returncode, out)
    # stopped by the interrupt, not killed after the minute's grace (as when the child inherits
    # SIGINT ignored: under pytest-xdist, or a background job)
    assert returncode != -signal.SIGKILL, (returncode, out)
    returncode, out, timed_out = rgt.run_streaming([sys.executable, "-c", "print('done')"], 600)
    assert (returncode, out, timed_out) == (0, "done\n", False)
