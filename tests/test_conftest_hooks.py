"""tests/conftest.py's hooks, run by pytest on a tiny test folder with this conftest: a CPU run
prints how many GPU-only tests it deselected, and a failing test names its fresh seed, which
replays it, and the run's processes share one compilation cache that the run deletes. Each in
one process and under xdist (`make test` runs `-n 2`). And the `optimized` marker: its test
compiles with XLA's optimizations, the others as the suite says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

RUNS = dict(argvalues=[[], ["-n", "2"]], ids=["one_process", "xdist"])


@pytest.fixture
def folder(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini('[pytest]\nmarkers = gpu: needs a GPU\naddopts = -m "not gpu"\n')
    return pytester


@pytest.mark.parametrize("extra", **RUNS)
def test_a_cpu_run_says_how_many_gpu_tests_it_deselected(folder, extra):
    gpu, twice = "import pytest\n@pytest.mark.gpu\n", "@pytest.mark.parametrize('n', [1, 2])\n"
    folder.makepyfile(
        test_a=f"def test_cpu(): pass\n{gpu}{twice}def test_gpu(n): pass",
        test_b=f"{gpu}def test_gpu(): pass\ndef test_fast(): pass",
    )
    out = folder.runpytest_subprocess("-k", "not fast", *extra)  # one non-GPU test deselected too
    out.assert_outcomes(passed=1)
    out.stdout.fnmatch_lines(["3 GPU-only tests deselected (run them on the device: "
                              "python -m pytest -m gpu)"])  # fmt: skip
    gpu_run = folder.runpytest_subprocess("-m", "gpu", *extra)
    gpu_run.assert_outcomes(passed=3)
    gpu_run.stdout.no_fnmatch_line("*GPU-only*")


@pytest.mark.parametrize("extra", **RUNS)
def test_a_failure_names_its_fresh_seed_which_replays_it(folder, extra, monkeypatch):
    folder.makepyfile(
        test_seeded="def test_draws(fresh_seed):\n"
        "    assert fresh_seed < 0, 'a seed is never negative'\n"
        "def test_unseeded(): assert False, 'no seed here'\n"
    )
    out = folder.runpytest_subprocess(*extra)
    out.assert_outcomes(failed=2)
    text = out.stdout.str()
    # in the one-line summary, and under the traceback with the command that replays it
    (seed,) = re.findall(r"FAILED \S*test_draws - \[seed (\d+)\] AssertionError: a seed", text)
    assert f"seed {seed}; replay: JAXINFER_TEST_SEED={seed} python -m pytest" in text, text
    assert "[seed" not in re.search(r"FAILED \S*test_unseeded.*", text)[0]

    monkeypatch.setenv("JAXINFER_TEST_SEED", seed)
    again = folder.runpytest_subprocess("-k", "draws", *extra)
    again.assert_outcomes(failed=1)
    assert f"[seed {seed}] AssertionError" in again.stdout.str()


@pytest.mark.parametrize("extra", **RUNS)
def test_only_tests_runs_exactly_the_listed_node_ids(folder, extra):
    """`--only-tests FILE` (a GPU shard's list): a listed id is not a prefix (test_x does not
    take test_x_more), other tests are deselected without the CPU run's GPU line, and a listed
    test that is not collected is an error naming the option."""
    gpu = "import pytest\n@pytest.mark.gpu\n"
    folder.makepyfile(
        test_a=f"{gpu}@pytest.mark.parametrize('n', [1, 2, 10])\ndef test_x(n): pass\n"
        "@pytest.mark.gpu\ndef test_x_more(): pass",
        test_b=f"{gpu}def test_y(): pass",
    )
    listed = folder.path / "only.txt"
    listed.write_text("test_a.py::test_x[1]\ntest_b.py::test_y\n")
    out = folder.runpytest_subprocess("-m", "gpu", "--only-tests", str(listed), "-rA", *extra)
    out.assert_outcomes(passed=2)  # (xdist's summary line leaves the deselected out)
    assert out.parseoutcomes().get("deselected") == (None if extra else 3)
    for line in ("PASSED test_a.py::test_x[[]1[]]", "PASSED test_b.py::test_y"):  # any order
        out.stdout.fnmatch_lines([line])
    out.stdout.no_fnmatch_line("*GPU-only*")
    listed.write_text("test_a.py::test_x[1]\ntest_a.py::test_gone\n")
    bad = folder.runpytest_subprocess("-m", "gpu", "--only-tests", str(listed), *extra)
    assert bad.ret != 0  # (under xdist the workers' refusal is an internal error: no message)
    if not extra:
        assert "--only-tests: 1 listed tests were not collected" in bad.stderr.str()


@pytest.mark.parametrize("extra", **RUNS)
def test_the_runs_processes_share_one_compilation_cache_that_the_run_deletes(
    folder, extra, monkeypatch
):
    """Two test files (under xdist, in whichever workers run them) compile into the one folder
    the run made, named in their environment and in jax's config; the folder is gone after the
    run."""
    from conftest import CACHE_ENV

    for name in CACHE_ENV:  # (this suite's own run set them)
        monkeypatch.delenv(name, raising=False)
    seen = folder.path / "seen.txt"
    for i, name in enumerate("ab"):
        folder.makepyfile(**{f"test_{name}": (
            "import os, jax, jax.numpy as jnp\n"
            "def test_compiles():\n"
            "    cache = jax.config.jax_compilation_cache_dir\n"
            f"    assert cache and cache == os.environ['{CACHE_ENV[0]}'], cache\n"
            f"    jax.jit(lambda x: x * 3 + {i})(jnp.ones(3)).block_until_ready()\n"
            "    assert os.listdir(cache), 'the compiled program is in the cache'\n"
            f"    with open({str(seen)!r}, 'a') as f:\n"
            "        f.write(cache + '\\n')\n"
        )})  # fmt: skip
    folder.runpytest_subprocess(*extra).assert_outcomes(passed=2)
    caches = set(seen.read_text().split())
    assert len(caches) == 1, caches
    assert not Path(caches.pop()).exists(), "the run deletes its cache"


def _suite_setting() -> bool:
    import os

    from conftest import OPTIMIZATIONS_ENV

    return os.environ.get(OPTIMIZATIONS_ENV, "") not in ("", "0")


@pytest.mark.optimized
def test_a_test_marked_optimized_compiles_with_xla_optimizations():
    import jax

    assert jax.config.read("jax_disable_most_optimizations") is False


def test_an_unmarked_test_compiles_as_the_suite_says():
    """(After a marked test too: the marker's fixture puts the suite's setting back.)"""
    import jax

    assert jax.config.read("jax_disable_most_optimizations") is _suite_setting()
