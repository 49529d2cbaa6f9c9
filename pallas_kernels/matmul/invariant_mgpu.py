"""A batch-invariant GEMM on Hopper, in Mosaic GPU: y [M, N] = x [M, K] @ w [K, N], bf16 or f16,
where each row's bits depend only on that row of x (and w), never on M or on the other rows.

XLA's GPU dots (cuBLAS, its Triton emitter) choose the kernel, the K tiling and split-K from the
whole operand's shape, and the autotuner per compile: the same row rounds differently in a batch
of 1 and a batch of 64. Here the reduction order is written into the kernel and depends on K and
N only:

- Each output tile is [128, tile_n] (tile_n 128, or 64 when N is not a multiple of 128:
  `tile_n_for`), the same for every M, and each of its two consumer warpgroups owns 64 rows
  (wgmma's M). A consumer walks the tile's K range in steps of 64 inputs; each step's wgmma goes
  into a fresh fp32 accumulator that is then added to the running sum, so a row's sum is the
  same sequence of fp32 adds of the same per-step products whatever tile, position or batch it
  sits in (wgmma's arithmetic for one output reads only its own row of A). M is padded to a
  multiple of 128 (zero rows).
- Split-K S (`k_splits_for`) is a function of (K, N) alone, so the split is the same for every
  batch: tile (i, j, s) sums K range s and writes fp32 partials [S, M, N], which are added in the
  fixed order 0, 1, ..., S - 1 (elementwise adds: no backend reorders them). S > 1 keeps the SMs
  busy at decode-sized M, where few output tiles would leave most idle.
- The loop is `_mgpu.ws_gemm`, the block-scaled FP8 GEMM's: a producer warpgroup issuing the TMA
  copies into a `num_stages`-deep ring, the two consumers, and persistent programs (one per SM)
  taking the tiles in an L2-friendly order. None of it changes a row's arithmetic.

On CPU the kernel runs under jax's GPU interpreter (`interpret=True`), its wgmma a plain fp32 dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat
from pallas_kernels._mgpu import (
    CONSUMERS,
    ROWS,
    WsPlan,
    store_tile,
    swizzled_smem,
    wgmma_dot,
    ws_gemm,
    ws_launch,
)

TILE_M = CONSUMERS * ROWS  # rows per output tile: one 64-row tile per consumer
BLOCK_K = 64  # inputs per pipeline step (64 x 2 bytes: one 128-byte swizzle row)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_STEPS_PER_SPLIT = 8  # a split shorter than this is mostly pipeline prologue
TARGET_PROGRAMS = 128  # S is raised until one row of output tiles reaches this many (~132 SMs)


def tile_n_for(n: int) -> int:
    """Outputs per program for N outputs: 128, or 64 when N is not a multiple of 128."""
    return 128 if n % 128 == 0 else 64


def k_splits_for(k: int, n: int) -> int:
    """Split-K S for a [K, N] weight, from its shape alone (never from M): the smallest S that
    divides K / 64, leaves every split at least MIN_STEPS_PER_SPLIT steps and gives one row of
    output tiles TARGET_PROGRAMS tiles; the largest such S that divides when none reaches it."""
    steps = k // BLOCK_K
    tiles = n // tile_n_for(n)
    best = 1
    for s in range(2, steps + 1):
        if steps % s:
            continue
        if steps // s < MIN_STEPS_PER_SPLIT:
            break
        best = s
        if tiles * s >= TARGET_PROGRAMS:
            break
    return best if tiles < TARGET_PROGRAMS else 1


def unfit_reason(x_dtype, k: int, n: int) -> str | None:
    """Why the kernel cannot take an [M, K] @ [K, N] product (None: it can)."""
    if jnp.dtype(x_dtype) not in DTYPES:
        return f"the kernel takes bfloat16 or float16, not {jnp.dtype(x_dtype).name}"
    if k % BLOCK_K:
        return f"K must be a multiple of {BLOCK_K}, got {k}"
    if n % 64:
        return f"N must be a multiple of 64, got {n}"
    return None


def invariant_matmul_mgpu(
    x: jax.Array,
    w: jax.Array,
    *,
    num_stages: int = 4,
    num_programs: int | None = None,
    interpret: bool | None = None,
    device: jax.Device | None = None,
) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype, each row's bits independent of M and of the
    other rows (module docstring). `num_programs`: the persistent programs (None: `device`'s SMs;
    never more than the tiles). `interpret` runs the GPU interpreter (default: when `device`,
    None for `jax.devices()[0]`, is not a GPU)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x must be [M, K] and w [K, N], got x {list(x.shape)} and w "
                         f"{list(w.shape)}")  # fmt: skip
    if w.dtype != x.dtype:
        raise ValueError(f"w must have x's dtype {x.dtype}, got {w.dtype}")
    m, k = x.shape
    n = w.shape[1]
    why = unfit_reason(x.dtype, k, n)
    if why is not None:
        raise ValueError(f"invariant_matmul_mgpu: {why}")
    splits = k_splits_for(k, n)
    m_pad = -(-m // TILE_M) * TILE_M
    stages = max(1, min(int(num_stages), k // BLOCK_K // splits))
    interpret = _compat.default_interpret(device) if interpret is None else bool(interpret)
    tiles = m_pad // TILE_M * (n // tile_n_for(n)) * splits
    plan = WsPlan(mt=m_pad // TILE_M, nt=n // tile_n_for(n), k_splits=splits,
                  steps=k // BLOCK_K // splits, num_stages=stages,
                  programs=min(tiles, num_programs or _compat.num_sms(device)))  # fmt: skip
    kernel = _build_kernel(plan, m_pad=m_pad, n=n, dtype=jnp.dtype(x.dtype), interpret=interpret)
    (out,) = kernel(jnp.pad(x, ((0, m_pad - m), (0, 0))), w)
    if splits == 1:
        return out[:m]
    total = out[0, :m]
    for s in range(1, splits):  # in split order: a fixed sequence of fp32 adds per element
        total = total + out[s, :m]
    return total.astype(x.dtype)


@functools.cache
def _build_kernel(plan: WsPlan, *, m_pad: int, n: int, dtype, interpret: bool):
    tile_n = tile_n_for(n)
    split = plan.k_splits > 1

    def body(x, w, out, x_s, w_s, o_s, full, free):
        def issue(t, i, slot):  # step i of tile t: its token and weight tiles
            ks = pl.ds(pl.multiple_of((t.b0 + i) * BLOCK_K, BLOCK_K), BLOCK_K)
            m0 = pl.multiple_of(t.m_blk * TILE_M, TILE_M)
            n0 = pl.multiple_of(t.n_blk * tile_n, tile_n)
            plgpu.copy_gmem_to_smem(x.at[pl.ds(m0, TILE_M), ks], x_s.at[slot], full.at[slot])
            plgpu.copy_gmem_to_smem(w.at[ks, pl.ds(n0, tile_n)], w_s.at[slot], full.at[slot])

        def step(c, slot, acc):  # consumer c: its 64 rows @ the weight tile, a fresh accumulator
            rows = x_s.at[slot].at[pl.ds(c * ROWS, ROWS)]
            return acc + wgmma_dot(rows, w_s.at[slot], interpret=interpret)

        def finish(c, t, acc):
            m0, n0 = t.m_blk * TILE_M + c * ROWS, t.n_blk * tile_n
            store_tile(acc, o_s.at[c], out, m0, n0, t.k_blk, split=split, dtype=dtype)

        ws_gemm(plan, full=full, free=free, issue=issue, step=step, finish=finish,
                acc_shape=(ROWS, tile_n), interpret=interpret)  # fmt: skip

    out_dtype = jnp.float32 if split else dtype
    scratch = [
        swizzled_smem((plan.num_stages, TILE_M, BLOCK_K), dtype),  # token tiles
        swizzled_smem((plan.num_stages, BLOCK_K, tile_n), dtype),  # weight tiles [K, N]
        swizzled_smem((CONSUMERS, ROWS, tile_n), out_dtype),  # output stages, one per consumer
        plgpu.Barrier(num_arrivals=2, num_barriers=plan.num_stages),  # full: both copies landed
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=plan.num_stages),  # free: all read it
    ]
    return ws_launch(body, plan, m_pad=m_pad, n=n, out_dtype=out_dtype, scratch=scratch,
                     interpret=interpret)  # fmt: skip
