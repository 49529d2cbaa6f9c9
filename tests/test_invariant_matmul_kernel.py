"""The batch-invariant GEMM (`pallas_kernels.matmul.invariant_mgpu`): a row's bits alone equal its
bits inside any batch, at any position; the product matches an fp32 reference to bf16 rounding;
its split-K is a function of the weight's shape only; `layers.linear` runs it under GPU
batch-invariant numerics. CPU: the GPU interpreter and lowering for CUDA; `-m gpu`: compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.layers import linear
from jaxinfer.models.numerics import Numerics
from pallas_kernels.matmul.invariant_mgpu import (
    BLOCK_K,
    MIN_STEPS_PER_SPLIT,
    TARGET_PROGRAMS,
    invariant_matmul_mgpu,
    k_splits_for,
    tile_n_for,
)

BF16 = jnp.bfloat16


def _operands(rng, m, k, n):
    x = jnp.asarray(rng.standard_normal((m, k)), BF16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), BF16)
    return x, w


def _check_rows(fn, rng, k, n, ms, what):
    """Rows of a batch of max(ms) computed in smaller batches (shuffled, at random positions)
    give the same bits; the whole batch matches the fp32 product to bf16 rounding."""
    x, w = _operands(rng, max(ms), k, n)
    full = np.asarray(fn(x, w).astype(jnp.float32))
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)))
    np.testing.assert_allclose(full, ref, rtol=2e-2, atol=2e-2, err_msg=what)
    for m in ms[:-1]:
        rows = rng.permutation(max(ms))[:m]
        got = np.asarray(fn(x[rows], w).astype(jnp.float32))
        bad = np.flatnonzero(~np.all(got == full[rows], axis=1))
        assert bad.size == 0, f"{what}: rows {rows[bad][:4]} differ in a batch of {m}"


@pytest.mark.parametrize("k,n", [(512, 192), (1024, 128)], ids=["tile64", "split2"])
def test_rows_are_invariant_in_the_interpreter(fresh_seed, k, n):
    rng = np.random.default_rng(fresh_seed)
    assert (tile_n_for(n), k_splits_for(k, n)) == ((64, 1) if n == 192 else (128, 2))

    def fn(x, w):  # 2 persistent programs: one takes two of tile64's 3 output tiles
        return invariant_matmul_mgpu(x, w, num_programs=2, interpret=True)

    _check_rows(fn, rng, k, n, (1, 5, 70), f"k={k} n={n} seed {fresh_seed}")


def test_split_k_follows_the_weights_shape_only():
    # the 8B's projections: (K, N) -> S
    assert k_splits_for(4096, 6144) == 4  # qkv: 48 tiles
    assert k_splits_for(4096, 4096) == 4  # o: 32 tiles
    assert k_splits_for(14336, 4096) == 4  # down
    assert k_splits_for(4096, 28672) == 1  # gate/up: 224 tiles fill the SMs
    assert k_splits_for(640, 128) == 1  # 10 steps: no split leaves MIN_STEPS_PER_SPLIT
    for k in range(BLOCK_K, 20000, 3 * BLOCK_K):
        for n in (64, 128, 576, 4096):
            s = k_splits_for(k, n)
            steps = k // BLOCK_K
            assert steps % s == 0, (k, n, s)
            assert s == 1 or steps // s >= MIN_STEPS_PER_SPLIT, (k, n, s)
            assert s == 1 or n // tile_n_for(n) < TARGET_PROGRAMS, (k, n, s)


def test_arguments_are_checked_by_name():
    x = jnp.zeros((4, 128), BF16)
    with pytest.raises(ValueError, match="K must be a multiple of 64"):
        invariant_matmul_mgpu(jnp.zeros((4, 96), BF16), jnp.zeros((96, 128), BF16))
    with pytest.raises(ValueError, match="N must be a multiple of 64"):
        invariant_matmul_mgpu(x, jnp.zeros((128, 100), BF16))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        invariant_matmul_mgpu(x.astype(jnp.float32), jnp.zeros((128, 128), jnp.float32))
    with pytest.raises(ValueError, match="w must have x's dtype"):
        invariant_matmul_mgpu(x, jnp.zeros((128, 128), jnp.float16))
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        invariant_matmul_mgpu(x, jnp.zeros((64, 128), BF16))


def _lowered(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, BF16) for s in shapes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("k,n", [(512, 192), (1024, 256)], ids=["tile64", "split2"])
def test_kernel_lowers_for_cuda(k, n):
    text = _lowered(lambda x, w: invariant_matmul_mgpu(x, w, interpret=False), (70, k), (k, n))
    assert "mosaic_gpu" in text


def test_linear_runs_the_kernel_under_gpu_invariant_numerics():
    """Every fitting plain weight goes to the kernel (in_dims 2 and several output axes as one
    [K, N]); an unfit one (N = 40) and the default numerics do not."""
    gpu = Numerics(batch_invariant=True, gpu=True)

    def text(shape_x, shape_w, in_dims, numerics):
        return _lowered(lambda x, w: linear(x, w, in_dims, numerics), shape_x, shape_w)

    assert "mosaic_gpu" in text((3, 4, 64), (4, 64, 256), 2, gpu)  # an O projection
    assert "mosaic_gpu" in text((3, 256), (256, 2, 128), 1, gpu)  # fused gate/up
    assert "mosaic_gpu" not in text((3, 256), (256, 40), 1, gpu)
    assert "mosaic_gpu" not in text((3, 256), (256, 128), 1, Numerics(batch_invariant=True))


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096), (4096, 28672), (576, 576)],
                         ids=["qkv8b", "down8b", "gateup8b", "smollm2"])  # fmt: skip
def test_rows_are_invariant_compiled_on_gpu(fresh_seed, k, n):
    rng = np.random.default_rng(fresh_seed)
    fn = jax.jit(invariant_matmul_mgpu)
    _check_rows(fn, rng, k, n, (1, 3, 8, 64, 65, 256), f"k={k} n={n} seed {fresh_seed}")
