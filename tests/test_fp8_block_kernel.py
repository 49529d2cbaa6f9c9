"""The Mosaic GPU block-scaled FP8 GEMM against its fp32 reference and jaxinfer's `fp8_block`.

On CPU the kernel runs under jax's GPU interpreter (TMA copies, the stage ring, the promotion of
each 128-input block's product by its token and weight scales, split-K's fp32 partials) on small
shapes with fresh random weights and activations quantized by jaxinfer's own `fp8_block` format;
lowering for CUDA checks its register layouts and shared-memory plan without a GPU; the `-m gpu`
tests run it compiled at DeepSeek-V3's and Llama-3-8B's shapes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight
from jaxinfer.quant.fp8 import quantize_activations
from pallas_kernels.matmul import fp8_block_mgpu
from pallas_kernels.matmul.fp8_block_mgpu import (
    E4M3,
    choose_k_splits,
    fp8_block_matmul_mgpu,
    fp8_block_matmul_ref,
    pack_scales,
)

TOL = 1e-2  # relative Frobenius error: the kernel's output is bf16


def case(seed: int, m: int, k: int, n: int):
    """(xq, sx, wt, sw, x, arrays) from fresh random bf16 x [m, k] and weight [k, n] (stored by
    `fp8_block`: wt is its K-major values as they are)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    # per-block magnitudes that differ, so a scale applied to the wrong block shows
    mag = rng.uniform(0.01, 1.0, (k // 128, 1, n // 128, 1))
    w = rng.standard_normal((k // 128, 128, n // 128, 128)) * mag
    w = jnp.asarray(w.reshape(k, n), jnp.float32)
    arrays = WEIGHT_FORMATS["fp8_block"].quantize(w, 1)
    xq, sx = quantize_activations(x, 128)
    wt, sw = arrays["values"], pack_scales(arrays["scales"])
    return xq, sx, wt, sw, x, arrays


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_same_but_sum_order(got, want, what: str) -> None:
    """Split-K against no split: the fp32 sums differ only in order (rounding far below bf16's),
    so each bf16 output is the same or one bf16 step (2^-7 of its magnitude at most) away."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = float(np.max(np.abs(want)))
    bad = np.abs(got - want) > 2.0**-7 * np.abs(want) + 1e-4 * scale
    assert not bad.any(), f"{what}: {int(bad.sum())} outputs differ by more than the sum order can"


# M 5 (padded to 64), 3 steps through 2 stages (a slot refilled), on [64, 256] tiles (consumers
# along N) and [128, 128] tiles (along M: N 128 allows no other); 2 x 2 CTA tiles of [128, 128]
# with the stages clipped to the steps; one [128, 128] tile whose second consumer has 6 real rows.
@pytest.mark.parametrize("m,k,n,stages,layout", [(5, 384, 256, 2, "n"), (5, 384, 128, 2, "m"),
                                                 (130, 256, 256, 4, "m"), (70, 256, 128, 4, "m")])  # fmt: skip
def test_matches_reference_and_the_format_in_interpreter(fresh_seed, m, k, n, stages, layout):
    from pallas_kernels.matmul.fp8_block_mgpu import choose_tile_layout

    assert choose_tile_layout(m, n) == layout, (m, n)
    xq, sx, wt, sw, x, arrays = case(fresh_seed, m, k, n)
    got = fp8_block_matmul_mgpu(xq, sx, wt, sw, num_stages=stages, interpret=True)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    ref = fp8_block_matmul_ref(xq, sx, wt, sw)
    err = rel_err(got, ref)
    assert err < TOL, f"m={m} k={k} n={n}: rel err {err:.2e} vs reference (seed {fresh_seed})"
    fmt = WEIGHT_FORMATS["fp8_block"]  # jaxinfer's XLA product of the same quantized weight
    xla = fmt.matmul(x, QuantizedWeight(arrays, fmt, 1))
    err = rel_err(got, xla)
    assert err < TOL, f"m={m} k={k} n={n}: rel err {err:.2e} vs fp8_block (seed {fresh_seed})"


# Persistent programs taking several tiles each: 3 x 3 [128, 128] tiles over 2 programs (the
# stage ring's slots and phases run on across tiles, 3 steps through 2 stages), and [64, 256]
# tiles with 2 K splits over 3 programs (6 tiles, split ranges at their own K offsets).
@pytest.mark.parametrize("m,k,n,k_splits,layout,programs", [(260, 384, 384, 1, "m", 2),
                                                            (64, 512, 768, 2, "n", 3)])  # fmt: skip
def test_persistent_programs_in_interpreter(fresh_seed, m, k, n, k_splits, layout, programs):
    xq, sx, wt, sw, _, _ = case(fresh_seed, m, k, n)
    got = fp8_block_matmul_mgpu(xq, sx, wt, sw, num_stages=2, k_splits=k_splits,
                                tile_layout=layout, num_programs=programs, interpret=True)  # fmt: skip
    err = rel_err(got, fp8_block_matmul_ref(xq, sx, wt, sw))
    what = f"m={m} k={k} n={n} k_splits={k_splits} {layout} x{programs} (seed {fresh_seed})"
    assert err < TOL, f"{what}: rel err {err:.2e} vs reference"


def test_tile_order_visits_every_tile_once_in_bands():
    """`tile_coords` (the persistent programs' order) is a permutation of (token tile, output tile, split) for any shape, and
    consecutive tiles stay within a band of GROUP_M token tiles (the L2 reuse it is for)."""
    from pallas_kernels._mgpu import GROUP_M, tile_coords

    for mt, nt, splits in [(64, 64, 1), (11, 5, 1), (1, 24, 4), (3, 7, 2)]:
        t = jnp.arange(mt * nt * splits, dtype=jnp.int32)
        m, n, kb = (np.asarray(v) for v in tile_coords(t, mt=mt, nt=nt))
        seen = set(zip(m.tolist(), n.tolist(), kb.tolist(), strict=True))
        assert len(seen) == mt * nt * splits, (mt, nt, splits)
        assert m.max() < mt and n.max() < nt and kb.max() < splits, (mt, nt, splits)
        first = np.asarray(t[: min(len(t), GROUP_M * nt)])
        assert m[first].max() < GROUP_M, (mt, nt, splits)


def test_reference_fails_a_wrong_scale_layout(fresh_seed):
    """The check can fail: the weight scales' blocks swapped along N change the product. The
    two N-blocks' scales are set 16x apart: the case's own differ only as much as its random
    block magnitudes do (for seed 3642315452 the swap changed the product by 8.4%, under the
    10 x TOL asked here)."""
    xq, sx, wt, sw, _, _ = case(fresh_seed, 3, 256, 256)
    sw = jnp.broadcast_to(jnp.asarray([1.0, 16.0], jnp.float32)[None, :, None], sw.shape)
    ref = fp8_block_matmul_ref(xq, sx, wt, sw)
    assert rel_err(fp8_block_matmul_ref(xq, sx, wt, sw[:, ::-1]), ref) > 10 * TOL, fresh_seed


def test_arguments_are_validated_by_name():
    xq, sx, wt, sw, _, _ = case(0, 4, 256, 128)
    bad = [
        (dict(xq=xq.astype(jnp.bfloat16)), "xq must be float8_e4m3fn"),
        (dict(xq=xq[:, :200], sx=sx[:, :1]), "K must be a multiple of 128"),
        (dict(sx=sx[:, :1]), "sx must be float32 [4, 2]"),
        (dict(wt=wt[:, :128]), "wt must be float8_e4m3fn [N, K=256]"),
        (dict(wt=wt[:64], sw=sw), "N (outputs) must be a multiple of 128"),
        (dict(sw=sw[:, :, :8]), "sw must be float32 [2, 1, 64]"),
        (dict(k_splits=3), "k_splits must be a positive int dividing K/128 = 2, got 3"),
        (dict(k_splits=0), "k_splits must be a positive int dividing K/128 = 2, got 0"),
        (dict(tile_layout="k"), "tile_layout must be one of ['m', 'n']"),
        (dict(tile_layout="n"), "tile_layout 'n' needs N a multiple of 256, got N = 128"),
    ]
    for change, message in bad:
        args = dict(xq=xq, sx=sx, wt=wt, sw=sw) | change
        with pytest.raises(ValueError, match=re.escape(message)):
            fp8_block_matmul_mgpu(**args, interpret=True)


@pytest.mark.parametrize("m,k_splits,layout", [(1, 1, "n"), (128, 1, "m"), (64, 2, "n"),
                                               (128, 4, "m"), (1, 1, "m"), (200, 2, "m")])  # fmt: skip
def test_kernel_lowers_for_cuda(m, k_splits, layout):
    """Mosaic accepts the kernel's layouts (the fp8 tiles and their per-consumer views, the
    transposed weight view, the row-vector scales, the bf16 output stages; split-K's third grid
    axis, its K offsets in the prologue and its fp32 output stages) for both tile layouts and
    one and several token tiles."""
    k, n = 512, 256
    sds = jax.ShapeDtypeStruct
    args = (sds((m, k), E4M3), sds((m, k // 128), jnp.float32), sds((n, k), E4M3),
            sds((k // 128, n // 128, 64), jnp.float32))  # fmt: skip
    call = jax.jit(lambda *a: fp8_block_matmul_mgpu(*a, k_splits=k_splits, tile_layout=layout,
                                                    interpret=False))  # fmt: skip
    assert "mosaic_gpu" in call.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# Split-K: 2 splits of 2 steps (stages clipped to them), 4 splits of one step each, and 2 token
# tiles (M padded) with 2 splits of 4 steps through 2 stages (slots refilled at the split's own
# K offsets).
@pytest.mark.parametrize("m,k,n,k_splits,stages", [(64, 512, 256, 2, 4), (64, 512, 256, 4, 4),
                                                   (70, 1024, 128, 2, 2)])  # fmt: skip
def test_split_k_matches_reference_and_no_split_in_interpreter(fresh_seed, m, k, n, k_splits,
                                                               stages):  # fmt: skip
    xq, sx, wt, sw, _, _ = case(fresh_seed, m, k, n)
    got = fp8_block_matmul_mgpu(xq, sx, wt, sw, num_stages=stages, k_splits=k_splits,
                                interpret=True)  # fmt: skip
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    what = f"m={m} k={k} n={n} k_splits={k_splits} (seed {fresh_seed})"
    err = rel_err(got, fp8_block_matmul_ref(xq, sx, wt, sw))
    assert err < TOL, f"{what}: rel err {err:.2e} vs reference"
    one = fp8_block_matmul_mgpu(xq, sx, wt, sw, num_stages=stages, k_splits=1, interpret=True)
    assert_same_but_sum_order(got, one, f"{what} vs k_splits=1")


def test_the_format_splits_k_where_the_heuristic_says(fresh_seed):
    """`fp8_block` on the kernel with no split given: 3 tokens x 128 outputs over K = 4096 is
    one [128, 128] program (N 128 allows no [64, 256] tile) for 132 SMs, so `choose_k_splits`
    splits K in two; the kernel then writes fp32 partials [2, 128, 128] and the product still
    equals XLA's."""
    from jaxinfer.quant.fp8 import Fp8Block

    k, n = 4096, 128
    assert choose_k_splits(3, n, k) == 2
    rng = np.random.default_rng(fresh_seed)
    w = jnp.asarray(rng.standard_normal((k, n)) * rng.uniform(0.01, 1.0, (k, 1)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16)
    kernel, xla = Fp8Block("fp8_block", backend="pallas"), Fp8Block("fp8_block", backend="xla")
    qw = QuantizedWeight(xla.quantize(w, 1), kernel, 1)
    assert "f32[2,128,128]" in str(jax.make_jaxpr(kernel.matmul)(x, qw)), "no split-K partials"
    got = kernel.matmul(x, qw)
    err = rel_err(got, xla.matmul(x, qw.replace(format=xla)))
    assert err < TOL, f"rel err {err:.2e} vs fp8_block on XLA (seed {fresh_seed})"


# Llama-3-8B's linears at decode (m = 64): qkv, gate/up, down, o, as (n, k)
LLAMA3_8B_NK = ((6144, 4096), (28672, 4096), (4096, 14336), (4096, 4096))


def check_k_splits_rule(m: int, n: int, k: int, num_sms: int, s: int) -> None:
    """`choose_k_splits`'s documented rule, checked on its answer `s` (tiles of [64, 256] for
    up to 64 tokens, [128, 128] past that: the Llama shapes all divide by 256)."""
    tm, tn = (64, 256) if m <= 64 else (128, 128)
    rows = -(-m // tm) * tm
    tiles, blocks = rows // tm * (n // tn), k // 128
    what = f"m={m} n={n} k={k} num_sms={num_sms}: k_splits {s}"
    assert blocks % s == 0, what
    if 2 * tiles >= num_sms:  # half the SMs busy or more: no split
        assert s == 1, what
        return
    allowed = [d for d in range(1, blocks + 1) if blocks % d == 0 and (d == 1 or (
        blocks // d >= fp8_block_mgpu.MIN_STEPS_PER_SPLIT
        and d * rows * n * 4 <= fp8_block_mgpu.MAX_PARTIAL_BYTES_FRACTION * n * k))]  # fmt: skip
    assert s in allowed, f"{what} breaks a bound (allowed {allowed})"
    filling = [d for d in allowed if tiles * d >= fp8_block_mgpu.WAVE_FILL * num_sms]
    assert s == (min(filling) if filling else max(allowed)), f"{what} (allowed {allowed})"


def test_choose_k_splits_follows_its_rule():
    """Llama-3-8B's decode linears: the narrow ones (qkv, o, down: 16-24 output tiles for 132
    SMs) split (to about a wave, or as far as the partials' bytes allow), gate/up (112 tiles)
    does not; a prefill-sized M never splits."""
    for n, k in LLAMA3_8B_NK:
        for num_sms in (132, 114, 78):
            check_k_splits_rule(64, n, k, num_sms, choose_k_splits(64, n, k, num_sms))
        check_k_splits_rule(4096, n, k, 132, choose_k_splits(4096, n, k))
        assert choose_k_splits(4096, n, k) == 1, (n, k)
    chosen = {nk: choose_k_splits(64, *nk) for nk in LLAMA3_8B_NK}
    assert chosen[(28672, 4096)] == 1, chosen
    for nk in ((6144, 4096), (4096, 14336), (4096, 4096)):
        assert chosen[nk] > 1, chosen


@pytest.mark.gpu
@pytest.mark.parametrize("m", [64, 128, 4096])
@pytest.mark.parametrize("n,k", [(7168, 2048), (2048, 7168), (4096, 7168), (14336, 4096)])
def test_compiled_kernel_on_gpu(fresh_seed, m, n, k):
    """The same check, compiled, at DeepSeek-V3's shapes and Llama-3-8B's FFN (`pytest -m gpu`)."""
    xq, sx, wt, sw, _, _ = case(fresh_seed, m, k, n)
    got = fp8_block_matmul_mgpu(xq, sx, wt, sw)
    err = rel_err(got, fp8_block_matmul_ref(xq, sx, wt, sw))
    assert err < TOL, f"m={m} k={k} n={n}: rel err {err:.2e} (seed {fresh_seed})"


def test_benchmark_smoke_run_writes_rows_with_provenance(tmp_path):
    """experiments/bench_fp8_matmul.py --smoke: every impl timed, near x @ w; --k-splits gives one
    kernel row per value, each with the split it ran, and one that does not divide K/128 is an
    error row (one smoke run)."""
    import json

    import experiment_scripts

    bench = experiment_scripts.load("bench_fp8_matmul")
    out = tmp_path / "fp8_matmul.json"
    bench.main(["--smoke", "--out", str(out), "--k-splits", "auto", "2", "3"])
    result = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "timing_method"):
        assert key in result, key
    impls = [r["impl"] for r in result["rows"]]
    assert impls == ["fp8_block_pallas"] * 3 + [i for i in bench.IMPLS if i != "fp8_block_pallas"]
    kernel = [r for r in result["rows"] if r["impl"] == "fp8_block_pallas"]
    assert [(r["k_splits"], r["k_splits_auto"]) for r in kernel] == [(1, True), (2, False),
                                                                    (3, False)], kernel  # fmt: skip
    assert "k_splits must be a positive int dividing K/128 = 2" in kernel[2]["error"], kernel[2]
    for r in result["rows"][:2] + result["rows"][3:]:
        assert "error" not in r and r["time_us"] > 0 and r["tflops"] > 0, r
        assert r["rel_err"] < (0.01 if r["impl"] == "xla_bf16" else 0.1), r


@pytest.mark.parametrize(
    "shape,in_dims",
    [((256, 2, 3, 128), 1),  # w_qkv-like [E, Hkv, G + 2, D]: blocks within each head
     ((2, 128, 384), 2)],  # wo-like [H, D, E]: two input axes
)  # fmt: skip
def test_the_formats_pallas_backend_equals_its_xla_backend(fresh_seed, shape, in_dims):
    """`fp8_block` on backend "pallas" (the kernel, interpreted here) and "xla" (per-block fp8
    dots): the same stored weight, the same product, for fused and multi-input weights."""
    from jaxinfer.quant.fp8 import Fp8Block

    rng = np.random.default_rng(fresh_seed)
    w = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.01, 1.0, shape[-1]), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, *shape[:in_dims])), jnp.bfloat16)
    kernel, xla = Fp8Block("fp8_block", backend="pallas"), Fp8Block("fp8_block", backend="xla")
    arrays = xla.quantize(w, in_dims)
    got = kernel.matmul(x, QuantizedWeight(arrays, kernel, in_dims))
    want = xla.matmul(x, QuantizedWeight(arrays, xla, in_dims))
    assert got.shape == want.shape == (3, *shape[in_dims:]) and got.dtype == x.dtype
    err = rel_err(got, want)
    assert err < TOL, f"shape {shape}: rel err {err:.2e} (seed {fresh_seed})"


def test_the_pallas_backend_refuses_a_weight_it_cannot_take():
    from jaxinfer.quant.fp8 import Fp8Block

    fmt = Fp8Block("fp8_block", backend="pallas")
    qw = QuantizedWeight(fmt.quantize(jnp.ones((256, 96)), 1), fmt, 1)
    with pytest.raises(ValueError, match=r"last output axis multiples of 128.*\[96, 256\]"):
        fmt.matmul(jnp.ones((2, 256), jnp.bfloat16), qw)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,n,k,k_splits",
    [(64, 4096, 14336, 2), (64, 4096, 14336, 4), (64, 4096, 14336, 7), (64, 6144, 4096, 4),
     (64, 4096, 4096, 8), (128, 2048, 7168, 7), (64, 4096, 14336, None), (4, 4096, 4096, None)],
)  # fmt: skip
def test_split_k_compiled_on_gpu(fresh_seed, m, n, k, k_splits):
    """Split-K compiled at Llama-3-8B's decode shapes and one of DeepSeek-V3's (None: the
    kernel's own choice), against the reference and the unsplit kernel (`pytest -m gpu`)."""
    xq, sx, wt, sw, _, _ = case(fresh_seed, m, k, n)
    got = fp8_block_matmul_mgpu(xq, sx, wt, sw, k_splits=k_splits)
    what = f"m={m} k={k} n={n} k_splits={k_splits} (seed {fresh_seed})"
    err = rel_err(got, fp8_block_matmul_ref(xq, sx, wt, sw))
    assert err < TOL, f"{what}: rel err {err:.2e}"
    assert_same_but_sum_order(got, fp8_block_matmul_mgpu(xq, sx, wt, sw, k_splits=1), what)


@pytest.mark.gpu
def test_the_format_runs_the_kernel_on_the_gpu(fresh_seed):
    """On one GPU, `fp8_block`'s product ("auto") is the Mosaic kernel from KERNEL_MIN_ROWS
    tokens and XLA's below, and both equal XLA's product."""
    from jaxinfer.quant.fp8 import KERNEL_MIN_ROWS, Fp8Block

    fmt = WEIGHT_FORMATS["fp8_block"]
    rng = np.random.default_rng(fresh_seed)
    w = jnp.asarray(rng.standard_normal((4096, 8, 6, 128)) * 0.02, jnp.float32)
    qw = QuantizedWeight(fmt.quantize(w, 1), fmt, 1)
    xla = Fp8Block("fp8_block", backend="xla")
    call = jax.jit(lambda x, qw: fmt.matmul(x, qw))
    for rows in (KERNEL_MIN_ROWS - 1, KERNEL_MIN_ROWS):
        x = jnp.asarray(rng.standard_normal((rows, 4096)), jnp.bfloat16)
        on_kernel = "mosaic_gpu" in call.lower(x, qw).as_text()
        assert on_kernel == (rows >= KERNEL_MIN_ROWS), f"{rows} rows: kernel {on_kernel}"
        err = rel_err(call(x, qw), xla.matmul(x, QuantizedWeight(qw.arrays, xla, 1)))
        assert err < TOL, f"{rows} rows: rel err {err:.2e} (seed {fresh_seed})"
