"""A batch-invariant GEMM on Hopper, in Mosaic GPU: y [M, N] = x [M, K] @ w [K, N], bf16 or f16,
where each row's bits depend only on that row of x (and w), never on M or on the other rows.

XLA's GPU dots (cuBLAS, its Triton emitter) choose the kernel, the K tiling and split-K from the
whole operand's shape, and the autotuner per compile: the same row rounds differently in a batch
of 1 and a batch of 64. Here the reduction order is written into the kernel and depends on K and
N only:

- A program owns a [64, tile_n] output tile (wgmma's M is 64; tile_n 128, or 64 when N is not a
  multiple of 128: `tile_n_for`) and walks its K range in steps of 64 inputs. Each step's wgmma
  goes into a fresh fp32 accumulator that is then added to the running sum, so a row's sum is
  the same sequence of fp32 adds of the same per-step products whatever tile, position or batch
  it sits in (wgmma's arithmetic for one output reads only its own row of A).
- M is padded to a multiple of 64 (zero rows); the grid is (M / 64, N / tile_n, S).
- Split-K S (`k_splits_for`) is a function of (K, N) alone, so the split is the same for every
  batch: program (i, j, s) sums K range s and writes fp32 partials [S, M, N], which are added in
  the fixed order 0, 1, ..., S - 1 (elementwise adds: no backend reorders them). S > 1 keeps the
  SMs busy at decode-sized M, where (M / 64)(N / tile_n) programs would leave most idle.

The operands arrive by TMA, `num_stages` deep, one barrier per stage (the pipeline of
`fp8_block_mgpu.py`). Compared with cuBLAS this gives up larger tiles, a producer warpgroup and
a persistent grid; the cost on the 8B model: `experiments/batch_invariance/`,
docs/batch_invariance.md. One wgmma accumulator over the K loop with one wgmma in flight, and
2 or 3 stages, measured the same (`batch_invariance_gemm.json`): the single 64-row warpgroup
per program is the limit.

On CPU the kernel runs under jax's GPU interpreter (`interpret=True`), its wgmma a plain fp32 dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat
from pallas_kernels._mgpu import ROWS, split_k_kernel, store_tile, swizzled_smem, wgmma_dot

TILE_M = ROWS  # rows per program: wgmma's M
BLOCK_K = 64  # inputs per pipeline step (64 x 2 bytes: one 128-byte swizzle row)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_STEPS_PER_SPLIT = 8  # a split shorter than this is mostly pipeline prologue
TARGET_PROGRAMS = 128  # S is raised until one 64-row tile's programs reach this (~132 SMs)


def tile_n_for(n: int) -> int:
    """Outputs per program for N outputs: 128, or 64 when N is not a multiple of 128."""
    return 128 if n % 128 == 0 else 64


def k_splits_for(k: int, n: int) -> int:
    """Split-K S for a [K, N] weight, from its shape alone (never from M): the smallest S that
    divides K / 64, leaves every split at least MIN_STEPS_PER_SPLIT steps and gives one 64-row
    tile TARGET_PROGRAMS programs; the largest such S that divides when none reaches it."""
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
    interpret: bool | None = None,
    device: jax.Device | None = None,
) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype, each row's bits independent of M and of the
    other rows (module docstring). `interpret` runs the GPU interpreter (default: when `device`,
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
    kernel = _build_kernel(m_pad=m_pad, k=k, n=n, dtype=jnp.dtype(x.dtype), num_stages=stages,
                           k_splits=splits, interpret=interpret)  # fmt: skip
    (out,) = kernel(jnp.pad(x, ((0, m_pad - m), (0, 0))), w)
    if splits == 1:
        return out[:m]
    total = out[0, :m]
    for s in range(1, splits):  # in split order: a fixed sequence of fp32 adds per element
        total = total + out[s, :m]
    return total.astype(x.dtype)


@functools.cache
def _build_kernel(*, m_pad: int, k: int, n: int, dtype, num_stages: int, k_splits: int,
                  interpret: bool):  # fmt: skip
    tile_n = tile_n_for(n)
    steps = k // BLOCK_K // k_splits
    split = k_splits > 1

    def body(x, w, out, x_s, w_s, o_s, bar):
        m0 = pl.multiple_of(lax.axis_index("m") * TILE_M, TILE_M)
        n0 = pl.multiple_of(lax.axis_index("n") * tile_n, tile_n)
        k_blk = lax.axis_index("k") if split else 0
        b0 = k_blk * steps

        def issue(i, slot):
            b = b0 + i if split else i  # the K block of step i
            start = b * BLOCK_K
            ks = pl.ds(start if isinstance(b, int) else pl.multiple_of(start, BLOCK_K), BLOCK_K)
            plgpu.copy_gmem_to_smem(x.at[pl.ds(m0, TILE_M), ks], x_s.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(w.at[ks, pl.ds(n0, tile_n)], w_s.at[slot], bar.at[slot])

        for st in range(num_stages):  # the pipeline's prologue
            issue(st, st)

        def step(i, acc):
            slot = lax.rem(i, jnp.int32(num_stages))
            plgpu.barrier_wait(bar.at[slot])
            acc = acc + wgmma_dot(x_s.at[slot], w_s.at[slot], interpret=interpret)

            @pl.when(i + num_stages < steps)
            def _refill():  # (the slot's wgmma was waited for inside wgmma_dot)
                issue(i + num_stages, slot)

            return acc

        zeros = jnp.zeros((TILE_M, tile_n), jnp.float32)
        acc0 = zeros if interpret else plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
        acc = lax.fori_loop(0, steps, step, acc0)
        store_tile(acc, o_s, out, m0, n0, k_blk, split=split, dtype=dtype)

    out_dtype = jnp.float32 if split else dtype
    scratch = [
        swizzled_smem((num_stages, TILE_M, BLOCK_K), dtype),  # x tiles
        swizzled_smem((num_stages, BLOCK_K, tile_n), dtype),  # weight tiles [K, N]
        swizzled_smem((TILE_M, tile_n), out_dtype),  # output stage
        plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
    ]
    return split_k_kernel(body, m_pad=m_pad, n=n, tile_m=TILE_M, tile_n=tile_n,
                          k_splits=k_splits, out_dtype=out_dtype, scratch=scratch,
                          interpret=interpret)  # fmt: skip
