"""Shared test helpers: CPU device meshes in a subprocess, fresh seeds that failures name, argparse
refusals with their message, the test-only weight format registered for a module's tests, the
count of GPU-only tests a CPU run deselected, and the CPU run's compile settings (little
optimization, one compilation cache for the run's processes)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ("pytester",)  # tests of these hooks run pytest on a tiny test file

SEED_ENV = "JAXINFER_TEST_SEED"
_SEED = pytest.StashKey[int]()
_GPU_DESELECTED = pytest.StashKey[int]()


@pytest.fixture
def run_on_cpu_devices():
    """run(code, n): run `code` in a fresh Python that sees `n` CPU devices (a mesh on one host);
    the code must exit 0 with "ok" as its last printed line."""

    def run(code: str, n: int, timeout: float = 300) -> None:
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}  # fmt: skip
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                             capture_output=True, text=True, timeout=timeout)  # fmt: skip
        assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]

    return run


@pytest.fixture(scope="module")
def channel_scaled_format():
    """spine_parts' test-only weight format "test_channel_scaled", in `WEIGHT_FORMATS` while the
    requesting module's tests run and removed after them (importing spine_parts registers
    nothing, so no other module's tests see it)."""
    import spine_parts

    with spine_parts.registered_format(spine_parts.CHANNEL_SCALED) as fmt:
        yield fmt


@pytest.fixture
def fresh_seed(request) -> int:
    """A seed drawn for this run (tests draw fresh random inputs). A failure of the test names it
    in its report and in the one-line summary; `JAXINFER_TEST_SEED=<seed>` replays it."""
    seed = int(os.environ.get(SEED_ENV) or secrets.randbelow(2**32))
    request.node.stash[_SEED] = seed
    return seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = item.stash.get(_SEED, None)
    if report.failed and seed is not None:
        replay = f"{SEED_ENV}={seed} python -m pytest '{item.nodeid}'"
        longrepr = report.longrepr
        if hasattr(longrepr, "addsection"):  # shown under the traceback, whatever --show-capture
            longrepr.addsection("fresh seed", f"seed {seed}; replay: {replay}")
        else:
            report.sections.append(("fresh seed", f"seed {seed}; replay: {replay}"))
        crash = getattr(longrepr, "reprcrash", None)
        if crash is not None:  # the "FAILED test - message" line
            crash.message = f"[seed {seed}] {crash.message}"
    return report


@pytest.fixture
def refused(capsys):
    """refused(fn, argv): what an argparse refusal of `fn(argv)` printed to stderr (it must exit
    with argparse's status 2), for the test to check that the message names the bad input."""

    def run(fn, argv) -> str:
        with pytest.raises(SystemExit) as exit_info:
            fn(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, (argv, exit_info.value.code, err)
        return err

    return run


# ---- The CPU suite compiles far more than it runs (tiny models, many step shapes; a warm
# compilation cache takes test_engine.py from 46 to 12 s): it asks XLA for little optimization
# (`jax_disable_most_optimizations`: LLVM -O0, no expensive passes; 15-25% less time per file).
# Set in the environment, so the Pythons the tests start inherit it; an explicit setting wins. A
# run that selects the GPU tests compiles as a user's program does.
OPTIMIZATIONS_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"
# The run's workers (and the Pythons they start) share one persistent compilation cache, a folder
# of the run's own that it deletes at its end: the suite builds the same tiny engines' programs in
# many files, and a program another file compiled is loaded instead (pytest 8-12% faster on two
# cores in two paired runs: experiments/results/cpu/suite_time.json). An explicit
# JAX_COMPILATION_CACHE_DIR wins.
CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
_RUN_CACHE = pytest.StashKey[str]()


def pytest_configure(config):
    markexpr = config.getoption("markexpr") or ""
    if "gpu" in markexpr and "not gpu" not in markexpr:
        return
    os.environ.setdefault(OPTIMIZATIONS_ENV, "1")
    if not hasattr(config, "workerinput") and CACHE_ENV[0] not in os.environ:
        import tempfile  # (the controller, before its workers start: they inherit the variables)

        config.stash[_RUN_CACHE] = tempfile.mkdtemp(prefix="jaxinfer-test-compiles-")
        os.environ[CACHE_ENV[0]] = config.stash[_RUN_CACHE]
        os.environ[CACHE_ENV[1]] = "0"  # (every program: jax's default keeps those over 1 s)
    if "jax" in sys.modules:  # (imported already: the flags' defaults were read then)
        jax_config = sys.modules["jax"].config
        jax_config.update(
            "jax_disable_most_optimizations", os.environ[OPTIMIZATIONS_ENV] not in ("", "0")
        )
        if CACHE_ENV[0] in os.environ:
            jax_config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV[0]])
            jax_config.update("jax_persistent_cache_min_compile_time_secs",
                              float(os.environ.get(CACHE_ENV[1], "1")))  # fmt: skip


def pytest_unconfigure(config):
    folder = config.stash.get(_RUN_CACHE, None)
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        for name in CACHE_ENV:
            os.environ.pop(name, None)


@pytest.fixture(autouse=True)
def _optimized_compiles(request):
    """`@pytest.mark.optimized`: the few tests whose time is running, not compiling (FP8 page
    writes, long greedy runs), compile with XLA's usual optimizations (2-3x faster to run)."""
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    import jax

    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


# ---- A worker runs a hundred test files' compiles in one process. XLA:CPU maps ~3 memory regions
# per loaded program and jax's caches keep every program a module-level jitted function compiled:
# a worker of the suite reached 53,572 mappings of Linux's 65,530 (vm.max_map_count), and past
# the limit XLA's compile crashed the worker (a segfault, an abort; experiments/results/cpu/
# suite_time.json). So after a test file, a process past 2/3 of the limit drops jax's caches (at
# half it cleared 3-4 times a worker, ~3 CPU-minutes of compiles; a worker's count rose at most
# 15,418 in two minutes).
def _mappings() -> tuple[int, int] | None:
    """(this process' memory mappings, the kernel's limit), or None where /proc cannot tell."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module", autouse=True)
def _bounded_mappings():
    yield  # (torn down after the file's own module fixtures: its engines are garbage by now)
    counts = _mappings()
    if counts is not None and counts[0] > counts[1] * 2 // 3 and "jax" in sys.modules:
        import gc

        sys.modules["jax"].clear_caches()
        gc.collect()


# ---- `--only-tests FILE`: run exactly the tests whose node ids FILE lists, one a line (a shard of
# the GPU suite, experiments/run_gpu_tests.py --shard). Node ids on the command line would not do:
# pytest would also run the files the other arguments name; `--deselect` matches id prefixes.
# (Under xdist, a worker's refusal of a listed test it did not collect is an internal error.)


def pytest_addoption(parser):
    parser.addoption("--only-tests", metavar="FILE", default=None,
                     help="run only the tests whose node ids FILE lists, one a line (after -m "
                          "and -k); a listed test that is not collected is an error")  # fmt: skip


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    path = config.getoption("only_tests")
    if path is None:
        return
    wanted = [line for line in Path(path).read_text().splitlines() if line.strip()]
    collected = {item.nodeid for item in items}
    missing = [nodeid for nodeid in wanted if nodeid not in collected]
    if missing:
        raise pytest.UsageError(f"--only-tests: {len(missing)} listed tests were not collected "
                                f"(by these arguments): {missing[:5]}")  # fmt: skip
    keep = set(wanted)
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in keep])
    items[:] = [item for item in items if item.nodeid in keep]


# ---- "N GPU-only tests deselected": a CPU run (`-m 'not gpu'`, the default) says what it skipped.
# Under xdist each worker collects (and deselects) the whole selection; the controller prints.


def pytest_deselected(items):
    config = items[0].config if items else None
    if config is None or config.getoption("only_tests") is not None:  # a shard's own choice
        return
    gpu = sum(item.get_closest_marker("gpu") is not None for item in items)
    config.stash[_GPU_DESELECTED] = config.stash.get(_GPU_DESELECTED, 0) + gpu
    if hasattr(config, "workeroutput"):  # an xdist worker: report to the controller
        config.workeroutput["gpu_deselected"] = config.stash[_GPU_DESELECTED]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    n = getattr(node, "workeroutput", {}).get("gpu_deselected", 0)
    config = node.config
    config.stash[_GPU_DESELECTED] = max(config.stash.get(_GPU_DESELECTED, 0), n)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = config.stash.get(_GPU_DESELECTED, 0)
    if n:
        terminalreporter.write_line(
            f"{n} GPU-only test{'s' * (n != 1)} deselected (run them on the device: "
            "python -m pytest -m gpu)"
        )
