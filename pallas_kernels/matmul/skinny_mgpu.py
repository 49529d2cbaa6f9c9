"""Skinny matmul for Hopper in Mosaic GPU (Pallas): y[M, N] = x[M, K] @ w[K, N] with M <= 64.

Decode multiplies a few activation rows by every weight matrix, so it is bound by reading the
weights: the kernel is a weight stream. Why it exists: XLA's GEMVs for the 8B model's decode run
at ~4.1 TB/s for gate/up and down but ~3.3 TB/s for QKV and O at batch 1, and the QKV GEMM at
batch 64 at ~2.2 TB/s (`profile_decode` of the end-to-end run of that time, commit 99b3e78; since
replaced by newer runs of `experiments/results/h200/e2e_llama3_8b.json`).

How the work is cut
-------------------
- Grid: (N tile of `block_n` columns, K split). Each program streams its share of K in tiles of
  `block_k` rows: one TMA copy of the weight tile [block_k, block_n] and one of the (64-row padded)
  activation tile [64, block_k] per step, through `num_stages` shared-memory buffers, so the copies
  of the next stages are in flight while a tile is multiplied (one wgmma, fp32 accumulation).
- The tensor cores do 64 rows of work whatever M is: free, the FLOPs per weight byte stay far
  under the balance point.
- K splits (default: enough programs to cover the SMs twice) write fp32 partial sums that a small
  XLA epilogue adds; with one split the kernel writes the output dtype directly.

Status: correct against `jnp.dot` under the GPU interpreter (tests/test_skinny_matmul.py) and
compiled on the H200 (its `-m gpu` test passes), but slower than XLA's dot on every 8B decode shape
and M (e.g. QKV at M=1: 33 vs 24.5 us per call in the benchmark's loop) except the fused gate+up
weight at M=1 with one K split (82 vs 84 us) (`experiments/results/h200/skinny_matmul.json`). The
model does not use it. Likely costs, not yet profiled: one wgmma per TMA tile with a wait on every
stage, and each program's ramp-up on these ~25-60 us problems.
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

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def default_k_splits(n_tiles: int, k_steps: int, sms: int) -> int:
    """K splits so that (N tiles x splits) covers the SMs about twice, never past the K steps."""
    if n_tiles >= 2 * sms:
        return 1
    return max(1, min(k_steps, -(-2 * sms // n_tiles)))


def skinny_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    block_n: int = 128,
    block_k: int = 64,
    num_stages: int = 4,
    k_splits: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in x.dtype, fp32 accumulation; M <= 64, bf16 or f16.

    `block_n`/`block_k`: the weight tile; `num_stages`: shared-memory pipeline depth; `k_splits`:
    programs per N tile along K (default: fill the GPU). `interpret` runs under the GPU
    interpreter (default: when there is no GPU).
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x {x.shape} @ w {w.shape}: want x [M, K] and w [K, N]")
    m, k = x.shape
    n = w.shape[1]
    if m > ROWS:
        raise ValueError(f"x has {m} rows; the skinny matmul takes at most {ROWS}")
    if jnp.dtype(x.dtype) not in DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x {x.dtype} and w {w.dtype} must both be bfloat16 or float16")
    if block_n % 64 or block_k % 64:
        raise ValueError(f"block_n ({block_n}) and block_k ({block_k}) must be multiples of 64")
    if n % block_n or k % block_k:
        raise ValueError(f"N={n} and K={k} must be multiples of block_n={block_n} and "
                         f"block_k={block_k}")  # fmt: skip
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    interpret = _compat.default_interpret() if interpret is None else interpret
    n_tiles, k_steps = n // block_n, k // block_k
    if k_splits is None:
        k_splits = default_k_splits(n_tiles, k_steps, _compat.num_sms())
    k_splits = max(1, min(int(k_splits), k_steps))
    xp = jnp.pad(x, ((0, ROWS - m), (0, 0)))
    out_dtype = jnp.dtype(x.dtype) if k_splits == 1 else jnp.dtype(jnp.float32)
    kernel = _build_kernel(
        n_tiles=n_tiles,
        k_steps=k_steps,
        k_splits=k_splits,
        block_n=block_n,
        block_k=block_k,
        num_stages=num_stages,
        dtype=jnp.dtype(x.dtype),
        out_dtype=out_dtype,
        interpret=interpret,
    )
    out = kernel(xp, w)  # [splits, 64, N]
    out = out.sum(axis=0) if k_splits > 1 else out[0]
    return out[:m].astype(x.dtype)


@functools.cache
def _build_kernel(*, n_tiles, k_steps, k_splits, block_n, block_k, num_stages, dtype, out_dtype,
                  interpret):  # fmt: skip
    per = -(-k_steps // k_splits)  # K steps per split (the last may have fewer)

    mma = functools.partial(wgmma_dot, interpret=interpret)

    def body(x_ref, w_ref, o_ref, x_smem, w_smem, o_smem, bar):
        nt = lax.axis_index("n")
        split = lax.axis_index("split")
        first = split * per
        steps = jnp.clip(k_steps - first, 0, per)

        def issue(i, slot):
            kk = pl.multiple_of((first + i) * block_k, block_k)
            col = pl.multiple_of(nt * block_n, block_n)
            plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(kk, block_k)], x_smem.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(
                w_ref.at[pl.ds(kk, block_k), pl.ds(col, block_n)], w_smem.at[slot], bar.at[slot]
            )

        for st in range(num_stages):

            @pl.when(st < steps)
            def _(st=st):
                issue(st, st)

        def step(i, acc):
            slot = lax.rem(i, jnp.int32(num_stages))
            plgpu.barrier_wait(bar.at[slot])
            acc = acc + mma(x_smem.at[slot], w_smem.at[slot])  # the slot is read once this returns

            @pl.when(i + num_stages < steps)
            def _():
                issue(i + num_stages, slot)

            return acc

        acc = jnp.zeros((ROWS, block_n), jnp.float32)
        if not interpret:
            acc = plgpu.layout_cast(acc, plgpu.Layout.WGMMA)
        acc = lax.fori_loop(0, steps, step, acc)
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        col = pl.multiple_of(nt * block_n, block_n)
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, :, pl.ds(col, block_n)])
        plgpu.wait_smem_to_gmem(0)

    kwargs = dict(
        out_type=jax.ShapeDtypeStruct((k_splits, ROWS, n_tiles * block_n), out_dtype),
        scratch_types=[
            swizzled_smem((num_stages, ROWS, block_k), dtype),
            swizzled_smem((num_stages, block_k, block_n), dtype),
            swizzled_smem((ROWS, block_n), out_dtype),
            plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
        ],
        grid=(n_tiles, k_splits),
        grid_names=("n", "split"),
    )
    if interpret:
        kwargs["interpret"] = _compat.gpu_interpret_params()
    return plgpu.kernel(body, **kwargs)
