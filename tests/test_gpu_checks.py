"""GPU-only benchmarks refuse a CPU at once (exit 2, one line naming the CPU smoke flag) instead of
running for minutes into an out-of-memory error (issue 35)."""

from __future__ import annotations

import time

import experiment_scripts
import jax
import pytest

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU refusal")

# (script, argv of its GPU run, the flag of its CPU smoke run)
GPU_RUNS = [
    ("bench_e2e", [], "--smoke"),
    ("bench_paged_attention", ["--quick"], "--smoke"),
    ("bench_paged_attention", ["--check"], "--smoke"),
    ("bench_mixed_attention", [], "--smoke"),
    ("bench_decode_attention", [], "--smoke"),
    ("anchors", [], "--quick"),
    ("bench_data_parallel", [], "--cpu-devices 2 --model tiny"),
]


@pytest.mark.parametrize(("script", "argv", "smoke"), GPU_RUNS)
def test_gpu_run_on_a_cpu_exits_2_at_once_naming_the_smoke_flag(
    script, argv, smoke, tmp_path, refused
):
    main = experiment_scripts.load(script).main
    out = tmp_path / "out.json"
    t0 = time.perf_counter()
    err = refused(main, [*argv, "--out", str(out)])
    assert time.perf_counter() - t0 < 60, "the refusal comes before any work"
    (line,) = err.strip().splitlines()
    assert f"{script}.py needs a GPU" in line and "cpu" in line and smoke in line, line
    assert not out.exists()
