"""The skinny (decode) matmul kernel under jax's GPU interpreter, against jnp.dot in fp32.

Fresh random inputs per case (the seed is in the failure message); shapes exercise one and several
K splits (including a split left with no K steps), short pipelines and M of 1 to 64.
"""

from __future__ import annotations

import secrets

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import skinny_matmul


def check(m, k, n, dtype=jnp.bfloat16, **kw):
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    out = skinny_matmul(x, w, interpret=True, **kw)
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert out.shape == (m, n) and out.dtype == x.dtype
    got = np.asarray(out, np.float32)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-2, f"rel err {err:.2e} (seed {seed})"


@pytest.mark.parametrize(
    "m,k,n,kw",
    [
        (1, 256, 128, dict(k_splits=1, num_stages=2)),
        (5, 384, 256, dict(k_splits=2, num_stages=4)),
        (64, 192, 128, dict(k_splits=1, num_stages=1)),
        (3, 640, 128, dict(k_splits=6, num_stages=2)),  # splits of 2,2,2,2,2,0 K steps
    ],
)
def test_matches_dot(m, k, n, kw):
    check(m, k, n, **kw)


def test_float16_and_wide_tiles():
    check(7, 256, 256, dtype=jnp.float16, block_n=256, block_k=128, k_splits=2)


def test_bad_inputs_name_the_problem():
    x = jnp.zeros((65, 128), jnp.bfloat16)
    w = jnp.zeros((128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="at most 64"):
        skinny_matmul(x, w, interpret=True)
    with pytest.raises(ValueError, match="multiples"):
        skinny_matmul(x[:4, :100], w[:100], interpret=True)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        skinny_matmul(x[:4].astype(jnp.float32), w.astype(jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="want x"):
        skinny_matmul(x[:4], w[:64], interpret=True)


def test_benchmark_smoke_writes_rows_that_match(tmp_path):
    import json

    import experiment_scripts

    module = experiment_scripts.load("bench_skinny_matmul")
    out = tmp_path / "skinny.json"
    module.main(["--smoke", "--out", str(out), "--min-loop-ms", "0.1", "--repeats", "1"])
    result = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "timing_method", "rows"):
        assert key in result, key
    rows = result["rows"]
    assert {r["impl"] for r in rows} == {"xla", "pallas 128,64,2,auto", "pallas 128,64,2,2"}
    for r in rows:
        assert "error" not in r, r
        assert r["rel_err"] < 1e-2 and r["time_us"] > 0, r


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
def test_compiled_kernel_on_gpu(m):
    """Compiled for the GPU (run on the device machine: `pytest -m gpu`), 8B-like shapes."""
    for k, n, kw in [(4096, 6144, {}), (14336, 4096, dict(block_n=256)),
                     (4096, 4096, dict(block_k=128, num_stages=3, k_splits=1))]:  # fmt: skip
        rng = np.random.default_rng(secrets.randbelow(2**31))
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
        out = np.asarray(skinny_matmul(x, w, interpret=False, **kw), np.float32)
        ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert err < 1e-2, (k, n, kw, err)
