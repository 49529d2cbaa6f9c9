"""The Mosaic GPU grouped matmul (MoE experts) against its references.

On CPU the kernel runs under jax's GPU interpreter on small shapes with fresh random inputs and
group sizes (uneven, empty groups, one group taking every row, rows past the groups, group
boundaries inside tiles, M below one tile) and is compared row by row with a float64 numpy
one-hot oracle; the tile table's invariants (every row stored once, by a tile of its own group)
are property-tested; lowering for CUDA (`lower(lowering_platforms=("cuda",))`, no GPU needed)
checks Mosaic's layouts for each tiling class; the `-m gpu` tests run it compiled at prefill and
decode sizes. The interpreter runs programs one after another, so only the GPU run checks the
pipeline's ordering (stage release, the store overlapping the next item).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import grouped_matmul, grouped_matmul_oracle, grouped_matmul_ref
from pallas_kernels.moe.grouped_mgpu import grouped_matmul_mgpu, tile_schedule
from pallas_kernels.moe.reference import row_groups

TOL = 1e-2  # per-row relative error: the kernel rounds its fp32 accumulator to bf16 once


def random_sizes(rng: np.random.Generator, g: int, total: int, *, empty: int = 0) -> np.ndarray:
    """int32 [g]: an uneven split of `total` rows, with `empty` groups (at random) left empty."""
    sizes = np.zeros(g, np.int64)
    used = rng.choice(g, g - empty, replace=False)
    cuts = np.sort(rng.integers(0, total + 1, len(used) - 1))
    sizes[np.sort(used)] = np.diff([0, *cuts, total])
    return sizes.astype(np.int32)


def check_rows(out, lhs, rhs, sizes, what: str) -> None:
    """Every row within TOL of the oracle (relative to the row's norm); the zero rows exact."""
    ref = grouped_matmul_oracle(lhs, rhs, sizes)
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    err = np.linalg.norm(out - ref, axis=1)
    bad = np.flatnonzero(err > TOL * np.linalg.norm(ref, axis=1))
    assert not len(bad), (f"{what}: {len(bad)} rows off, e.g. {bad[:8].tolist()} (groups "
                          f"{row_groups(sizes, len(out))[bad[:8]].tolist()}), sizes "
                          f"{np.asarray(sizes).tolist()}")  # fmt: skip


def make_inputs(rng, m: int, k: int, n: int, sizes) -> tuple:
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) * k**-0.5, jnp.bfloat16)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


# (m, k, n, g, how the sizes are drawn, kernel options). DECODE tiling (64-row tiles) unless
# block_m says otherwise; K / block_k steps through fewer stages refill every slot.
PREFILL_TILES = dict(block_m=128, block_n=64, num_stages=3, grid_block_n=1, num_sms=3)
CASES = {
    "uneven_empty_group_trailing_rows": (200, 128, 128, 4, "trailing", {}),
    "one_group_takes_every_row": (136, 256, 128, 3, "one", dict(block_m=128, num_stages=2)),
    "boundaries_inside_prefill_tiles": (264, 192, 128, 3, "full", PREFILL_TILES),
    "m_below_one_tile_padded": (13, 64, 128, 3, "trailing", dict(block_n=64)),
}


def draw_sizes(rng, kind: str, m: int, g: int) -> np.ndarray:
    if kind == "trailing":  # an empty group and rows past the groups
        return random_sizes(rng, g, m - int(rng.integers(1, max(2, m // 5))), empty=1)
    if kind == "one":
        sizes = np.zeros(g, np.int32)
        sizes[rng.integers(g)] = m
        return sizes
    return random_sizes(rng, g, m)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_oracle_row_by_row(fresh_seed, case):
    m, k, n, g, kind, kw = CASES[case]
    rng = np.random.default_rng(fresh_seed)
    lhs, rhs, sizes = make_inputs(rng, m, k, n, draw_sizes(rng, kind, m, g))
    out = grouped_matmul_mgpu(lhs, rhs, sizes, interpret=True, **kw)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    check_rows(out, lhs, rhs, sizes, f"{case} (seed {fresh_seed})")


def test_comparison_catches_rows_in_the_wrong_group(fresh_seed):
    """The check above fails when the oracle is given group sizes one row off at a boundary."""
    rng = np.random.default_rng(fresh_seed)
    sizes = np.array([30, 40], np.int32)
    lhs, rhs, gs = make_inputs(rng, 72, 64, 64, sizes)
    out = grouped_matmul_mgpu(lhs, rhs, gs, interpret=True)
    check_rows(out, lhs, rhs, sizes, f"seed {fresh_seed}")
    for wrong in ([31, 39], [30, 41]):  # a row moved across the boundary; a trailing row used
        with pytest.raises(AssertionError, match="rows off"):
            check_rows(out, lhs, rhs, np.array(wrong), f"seed {fresh_seed}")


_schedule = jax.jit(tile_schedule, static_argnums=(1, 2, 3))


def check_tile_table(sizes, m: int, m_pad: int, block_m: int) -> None:
    group, row0, lo, hi = np.asarray(_schedule(jnp.asarray(sizes, jnp.int32), m, m_pad, block_m))
    live = hi > lo
    assert (row0 % 8 == 0).all() and (row0 >= 0).all() and (row0 + block_m <= m_pad).all()
    assert (row0[live] <= lo[live]).all() and (hi[live] <= row0[live] + block_m).all()
    covered = np.zeros(m_pad, int)
    owner = np.full(m_pad, -2)
    for t in np.flatnonzero(live):
        covered[lo[t] : hi[t]] += 1
        owner[lo[t] : hi[t]] = group[t]
    assert (covered == 1).all(), f"rows stored {covered.tolist()}"
    want = np.concatenate([row_groups(sizes, m), np.full(m_pad - m, -1)])
    np.testing.assert_array_equal(owner, np.where(want < 0, len(sizes), want))


def test_tile_table_stores_every_row_once_from_its_own_group(fresh_seed):
    """Tiles' [lo, hi) partition the rows; each lies in its window (8-aligned, inside M), and its
    rows belong to its group (G: the rows past the groups, cut at M as ragged_dot does). Random
    size vectors (empty, tiny and large groups, sums over and under M) and the worst case for the
    tile bound (every group one row, each starting off an 8-row boundary)."""
    rng = np.random.default_rng(fresh_seed)
    m, m_pad = 301, 304
    draws = [np.ones(40, np.int32), np.full(40, 9, np.int32)]
    for _ in range(150):
        kind = rng.integers(3, size=6)
        draws.append(np.choose(kind, [np.zeros(6, int), rng.integers(1, 10, 6),
                                      rng.integers(0, 131, 6)]))  # fmt: skip
    for sizes in draws:
        for block_m in (64, 128):
            try:
                check_tile_table(sizes, m, m_pad, block_m)
            except AssertionError as e:
                raise AssertionError(f"sizes {sizes.tolist()} block_m {block_m} (seed "
                                     f"{fresh_seed}): {e}") from e  # fmt: skip


def test_xla_reference_matches_oracle_and_cuts_groups_at_m(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    for sizes in (random_sizes(rng, 5, 40, empty=2), np.array([20, 30, 10], np.int32)):
        lhs, rhs, gs = make_inputs(rng, 48, 32, 16, sizes)  # the second: sum 60 > M = 48
        ref = np.asarray(grouped_matmul_ref(lhs, rhs, gs))
        np.testing.assert_allclose(ref, grouped_matmul_oracle(lhs, rhs, sizes), rtol=1e-4,
                                   atol=1e-4, err_msg=f"seed {fresh_seed}")  # fmt: skip


def test_dispatcher_picks_xla_on_cpu(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    lhs, rhs, gs = make_inputs(rng, 24, 32, 16, random_sizes(rng, 3, 20, empty=1))
    out = grouped_matmul(lhs, rhs, gs)
    want = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want.astype(jnp.bfloat16)),
                                  err_msg=f"seed {fresh_seed}")  # fmt: skip


def test_arguments_are_validated_by_name():
    bf = jnp.bfloat16
    lhs, rhs, gs = jnp.zeros((16, 128), bf), jnp.zeros((4, 128, 128), bf), jnp.zeros(4, jnp.int32)
    big_k = dict(lhs=jnp.zeros((16, 512), bf), rhs=jnp.zeros((4, 512, 128), bf))
    bad = [
        (dict(lhs=lhs.astype(jnp.float32)), "lhs must be bf16 or f16 [M, K], got float32"),
        (dict(lhs=lhs[None]), "lhs must be bf16 or f16 [M, K]"),
        (dict(rhs=rhs.astype(jnp.float16)), "rhs must be bfloat16 (lhs's dtype) [G, K, N]"),
        (dict(rhs=rhs[:, :64]), "rhs: K must match lhs's K = 128"),
        (dict(group_sizes=gs[:3]), "group_sizes must be int32 [G] with G = 4"),
        (dict(group_sizes=gs.astype(jnp.float32)), "group_sizes must be int32 [G]"),
        (dict(lhs=lhs[:, :96], rhs=rhs[:, :96]), "lhs, rhs: K must be a multiple of block_k=64"),
        (dict(rhs=rhs[..., :96]), "rhs: N must be a multiple of block_n=64, got 96"),
        (dict(block_m=96), "block_m must be a multiple of 64 in 64..256"),
        (dict(block_n=512), "block_n must be a multiple of 64 in 64..256"),
        (dict(num_stages=1), "num_stages must be >= 2"),
        (dict(**big_k, block_m=256, block_k=256), "bytes of shared memory at K=512"),
        (dict(num_sms=0), "num_sms must be >= 1"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(block_size=64), "unknown kernel options ['block_size']"),
    ]
    for change, message in bad:
        args = dict(lhs=lhs, rhs=rhs, group_sizes=gs, backend="pallas", interpret=True) | change
        with pytest.raises(ValueError, match=re.escape(message)):
            grouped_matmul(**args)
    with pytest.raises(ValueError, match="pallas backend only"):
        grouped_matmul(lhs, rhs, gs, backend="xla", block_m=64)
    with pytest.raises(ValueError, match="lhs must be bf16"):  # the xla backend checks too
        grouped_matmul(lhs.astype(jnp.float32), rhs, gs, backend="xla")


def lower_for_cuda(m: int, k: int, n: int, g: int, **kw) -> str:
    try:
        from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401
    except ImportError as e:  # pragma: no cover - a jax without Mosaic GPU lowering
        pytest.skip(f"Mosaic GPU lowering unavailable: {e}")
    sds = jax.ShapeDtypeStruct

    def call(lhs, rhs, gs):
        return grouped_matmul_mgpu(lhs, rhs, gs, interpret=False, num_sms=132, **kw)

    args = (sds((m, k), jnp.bfloat16), sds((g, k, n), jnp.bfloat16), sds((g,), jnp.int32))
    return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "shape,kw",
    [
        ((512, 256, 256, 16), {}),  # DECODE: 64-row tiles
        ((1024, 512, 256, 4), {}),  # PREFILL: 128-row tiles
        ((1024, 256, 512, 4), dict(block_m=192, num_stages=3)),  # a 128 + 64 row store ladder
        ((1024, 256, 512, 4), dict(block_m=64, block_n=256)),
        ((13, 128, 192, 4), dict(block_n=64)),  # M padded to one tile
    ],
)
def test_kernel_lowers_for_cuda(shape, kw):
    """Mosaic's layout inference accepts the 8-aligned lhs windows, the wgmma pipeline and the
    row-masked store ladder for every tiling class."""
    assert "mosaic_gpu" in lower_for_cuda(*shape, **kw)


def test_benchmark_smoke_run_writes_rows_with_provenance(tmp_path):
    """experiments/bench_grouped_matmul.py --smoke (decode case): each impl timed, close to the
    reference, the expert bytes counting only experts that have rows."""
    import json

    import experiment_scripts

    bench = experiment_scripts.load("bench_grouped_matmul")
    out = tmp_path / "grouped_matmul.json"
    bench.main(["--smoke", "--cases", "decode", "--out", str(out)])
    result = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "timing_method", "notes"):
        assert key in result, key
    assert {r["impl"] for r in result["rows"]} == {"grouped_pallas", "xla_ragged_dot"}
    for r in result["rows"]:
        assert "error" not in r and r["time_us"] > 0 and r["expert_TBps"] > 0, r
        assert r["rel_err"] < TOL, r
        touched = sum(s > 0 for s in r["group_sizes"])
        assert r["expert_bytes"] == touched * r["k"] * r["n"] * 2 and touched < r["g"], r


# ---- Compiled on the GPU (`pytest -m gpu`): the sizes the benchmark times.


def check_rows_on_device(out, ref, what: str) -> None:
    err = jnp.linalg.norm(out.astype(jnp.float32) - ref, axis=1)
    bad = np.flatnonzero(np.asarray(err > TOL * jnp.linalg.norm(ref, axis=1)))
    assert not len(bad), f"{what}: {len(bad)} rows off, e.g. {bad[:8].tolist()}"


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, dict(block_m=64, block_n=256), dict(block_m=192, num_stages=3)])
def test_compiled_prefill_matches_ragged_dot_on_gpu(fresh_seed, kw):
    """G=8, M=8192, K=4096, N=14336: an uneven split with an empty group and trailing rows."""
    rng = np.random.default_rng(fresh_seed)
    m, k, n, g = 8192, 4096, 14336, 8
    lhs, rhs, gs = make_inputs(rng, m, k, n, random_sizes(rng, g, m - 100, empty=1))
    out = grouped_matmul(lhs, rhs, gs, backend="pallas", **kw)
    check_rows_on_device(out, grouped_matmul_ref(lhs, rhs, gs), f"prefill {kw} seed {fresh_seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [64, 512])
def test_compiled_decode_matches_ragged_dot_on_gpu(fresh_seed, tokens):
    """G=128, K=2048, N=768, `tokens` routed top-8 of 128 at random (M = 8 * tokens rows)."""
    rng = np.random.default_rng(fresh_seed)
    picks = np.argsort(rng.random((tokens, 128)), axis=1)[:, :8]
    sizes = np.bincount(picks.ravel(), minlength=128).astype(np.int32)
    lhs, rhs, gs = make_inputs(rng, 8 * tokens, 2048, 768, sizes)
    out = grouped_matmul(lhs, rhs, gs, backend="pallas")
    check_rows_on_device(
        out, grouped_matmul_ref(lhs, rhs, gs), f"decode {tokens}, seed {fresh_seed}"
    )
