"""A batch-invariant GEMM on Hopper, in Mosaic GPU: y [M, N] = x [M, K] @ w [K, N], bf16 or f16,
where each row's bits depend only on that row of x (and w), never on M or on the other rows.

XLA's GPU dots (cuBLAS, its Triton emitter) choose the kernel, the K tiling and split-K from the
whole operand's shape, and the autotuner per compile: the same row rounds differently in a batch
of 1 and a batch of 64. Here the reduction order is written into the kernel and depends on K and
N only:

- A program owns a [64, tile_n] output tile (wgmma's M is 64; tile_n 128, or 64 when N is not a
  multiple of 128: `tile_n_for`) and walks its K range in steps of 64 inputs, every step's
  wgmma accumulating into one fp32 accumulator (asynchronously: step i's wgmma is issued before
  step i - 1's is waited for). A row's sum is so the same sequence of tensor-core accumulations
  whatever tile, position or batch it sits in (wgmma's arithmetic for one output reads only its
  own row of A).
- M is padded to a multiple of 64 (zero rows); the grid is (M / 64, N / tile_n, S).
- Split-K S (`k_splits_for`) is a function of (K, N) alone, so the split is the same for every
  batch: program (i, j, s) sums K range s and writes fp32 partials [S, M, N], which are added in
  the fixed order 0, 1, ..., S - 1 (elementwise adds: no backend reorders them). S > 1 keeps the
  SMs busy at decode-sized M, where (M / 64)(N / tile_n) programs would leave most idle.

The operands arrive by TMA, `num_stages` deep, one barrier per stage. Compared with cuBLAS this
gives up larger tiles, a producer warpgroup and a persistent grid; the cost on the 8B model:
`experiments/batch_invariance/`, docs/batch_invariance.md.

On CPU the kernel runs under jax's GPU interpreter (`interpret=True`), its wgmma a plain fp32 dot
per step added to the running sum (other arithmetic than the GPU's, as invariant).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat
from pallas_kernels._mgpu import ROWS, swizzled_smem, wgmma_dot

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
    # (at least 2 stages when there are 2 steps: a slot is refilled one step after its use)
    stages = min(max(2, int(num_stages)), k // BLOCK_K // splits)
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

        if interpret:  # (the interpreter's wgmma is a plain dot: summed per step)

            def step(i, acc):
                slot = lax.rem(i, jnp.int32(num_stages))
                plgpu.barrier_wait(bar.at[slot])
                acc = acc + wgmma_dot(x_s.at[slot], w_s.at[slot], interpret=True)

                @pl.when(i + num_stages < steps)
                def _refill():
                    issue(i + num_stages, slot)

                return acc

            acc = lax.fori_loop(0, steps, step, jnp.zeros((TILE_M, tile_n), jnp.float32))
        else:
            acc = pl.run_scoped(functools.partial(accumulate, issue, x_s, w_s, bar),
                                plgpu.ACC((TILE_M, tile_n), jnp.float32))  # fmt: skip
        o_s[...] = acc if split else acc.astype(dtype)
        plgpu.commit_smem()
        tile = (pl.ds(m0, TILE_M), pl.ds(n0, tile_n))
        plgpu.copy_smem_to_gmem(o_s, out.at[(k_blk, *tile) if split else tile])
        plgpu.wait_smem_to_gmem(0)

    def accumulate(issue, x_s, w_s, bar, acc_ref):
        """The K loop into one wgmma accumulator, one wgmma in flight: step i's wgmma is issued,
        then step i - 1's is waited for and its slot refilled with step i - 1 + num_stages."""

        def step(i, carry):
            slot = lax.rem(i, jnp.int32(num_stages))
            plgpu.barrier_wait(bar.at[slot])
            plgpu.wgmma(acc_ref, x_s.at[slot], w_s.at[slot])
            plgpu.wgmma_wait(1)
            prev = i - 1

            @pl.when((i > 0) & (prev + num_stages < steps))
            def _refill():
                issue(prev + num_stages, lax.rem(prev, jnp.int32(num_stages)))

            return carry

        lax.fori_loop(0, steps, step, jnp.int32(0))
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    out_dtype = jnp.float32 if split else dtype
    out_shape = (m_pad, n)
    scratch = [
        swizzled_smem((num_stages, TILE_M, BLOCK_K), dtype),  # x tiles
        swizzled_smem((num_stages, BLOCK_K, tile_n), dtype),  # weight tiles [K, N]
        swizzled_smem((TILE_M, tile_n), out_dtype),  # output stage
        plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
    ]
    grid, names = (m_pad // TILE_M, n // tile_n), ("m", "n")
    if split:  # fp32 partials, one [M, N] per split
        out_shape, grid, names = (k_splits, m_pad, n), (*grid, k_splits), (*names, "k")
    kwargs = dict(
        out_type=(jax.ShapeDtypeStruct(out_shape, out_dtype),),
        scratch_types=scratch,
        grid=grid,
        grid_names=names,
    )
    if interpret:
        kwargs["interpret"] = _compat.gpu_interpret_params()
    return plgpu.kernel(body, **kwargs)
