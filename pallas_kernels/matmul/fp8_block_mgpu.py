"""Block-scaled FP8 GEMM (W8A8, DeepSeek-V3's fine-grained scheme) on Hopper, in Mosaic GPU.

    y [M, N] = sum over 128-input blocks b of (xq[:, b] @ w[b, :]) * sx[:, b] * sw[b, n // 128]

xq e4m3 [M, K] with sx fp32 [M, K/128] (one scale per token per 128 inputs, "1 x 128"); the
weight e4m3 K-major wt [N, K] with sw fp32 [N/128, K/128] (one per 128 x 128 block); y in bf16. This is the product
of `jaxinfer.quant`'s `fp8_block` format (DeepSeek-V3 technical report, sec. 3.3; DeepGEMM does the
same in CUDA); XLA has no block-scaled dot, and its per-block `dot_general` materialises every
block's fp32 partial product.

How the work is cut
-------------------
- fp8 wgmma reads both operands from shared memory K-minor (only 16-bit wgmma can transpose), so
  the weight is K-major, wt e4m3 [N, K] (as `fp8_block` stores it), and each [128, 128] tile of
  it goes to wgmma as a transposed view.
- A program owns a [64, 128] output tile (one warpgroup; wgmma's M is 64) and walks K in
  128-input steps. Each step's product goes into a fresh fp32 accumulator. It is then promoted
  into the running sum, scaled by the step's token scales (a [64] row vector) times the block's
  weight scale. Promotion once per 128 inputs is the scheme's point: the e4m3 products are summed
  in fp32 over one block only.
- A step's operands — the x tile [64, 128], the weight tile [128, 128], the token scales of the
  step, and the weight scale repeated 64 times — arrive by TMA on one barrier per stage,
  `num_stages` deep. The scales are stored so that each tile's are contiguous: sx transposed
  [K/128, M] (TMA needs a contiguous inner box of at least 16 bytes; one scale per row is 4), and
  the weight scale as [N/128, K/128, 64] (`pack_scales`, per call: 1/16384 of the weight's
  elements, x 64) so that it loads in the same row-vector layout as sx.
- Grid (M / 64, N / 128); M is padded to a multiple of 64 by the dispatcher.

Not yet done (first version; the H200 correctness run comes first): asynchronous wgmma with the
promotion of step i overlapping the product of step i + 1, two consumer warpgroups (128 x 128
tiles), a producer warpgroup, split-K for small M (at M = 64, N = 7168 the grid is 56 programs
for 132 SMs), and a persistent grid.

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
from pallas_kernels._mgpu import ROWS, swizzled_smem, wgmma_dot

BLOCK = 128  # inputs per scale block and per pipeline step; outputs per weight-scale block
TILE_M = ROWS  # tokens per program: wgmma's M
TILE_N = BLOCK  # outputs per program: one weight-scale block
E4M3 = jnp.float8_e4m3fn


def pack_scales(scales: jax.Array) -> jax.Array:
    """`fp8_block`'s weight scales fp32 [N/128, K/128] in the kernel's layout [N/128, K/128, 64]
    (each repeated once per row of a token tile)."""
    return jnp.broadcast_to(scales.astype(jnp.float32)[:, :, None], (*scales.shape, TILE_M))


def fp8_block_matmul_mgpu(
    xq: jax.Array,
    sx: jax.Array,
    wt: jax.Array,
    sw: jax.Array,
    *,
    num_stages: int = 4,
    interpret: bool | None = None,
    device: jax.Device | None = None,
) -> jax.Array:
    """xq e4m3 [M, K] with token scales sx fp32 [M, K/128] @ the weight (wt e4m3 [N, K], K-major,
    sw fp32 [N/128, K/128, 64]: `pack_scales`) -> bf16 [M, N]. `num_stages`: pipeline depth.
    `interpret` runs the GPU interpreter (default: when `device`, None for `jax.devices()[0]`,
    is not a GPU)."""
    check_inputs(xq, sx, wt, sw)
    m, k = xq.shape
    n = wt.shape[0]
    m_pad = -(-m // TILE_M) * TILE_M
    stages = max(1, min(int(num_stages), k // BLOCK))
    interpret = _compat.default_interpret(device) if interpret is None else bool(interpret)
    kernel = _build_kernel(m_pad=m_pad, k=k, n=n, num_stages=stages, interpret=interpret)
    xp = jnp.pad(xq, ((0, m_pad - m), (0, 0)))
    sxt = jnp.pad(sx.astype(jnp.float32), ((0, m_pad - m), (0, 0))).T  # [K/128, M_pad]
    (out,) = kernel(xp, sxt, wt, sw)
    return out[:m]


def check_inputs(xq, sx, wt, sw) -> None:
    """ValueError naming the argument when a shape or dtype does not fit the kernel."""
    if xq.ndim != 2 or xq.dtype != E4M3:
        raise ValueError(f"xq must be float8_e4m3fn [M, K], got {xq.dtype} {tuple(xq.shape)}")
    m, k = xq.shape
    if k % BLOCK:
        raise ValueError(f"xq: K must be a multiple of {BLOCK}, got {k}")
    if tuple(sx.shape) != (m, k // BLOCK) or sx.dtype != jnp.float32:
        raise ValueError(f"sx must be float32 [{m}, {k // BLOCK}] (per token per {BLOCK} inputs),"
                         f" got {sx.dtype} {list(sx.shape)}")  # fmt: skip
    if wt.ndim != 2 or wt.dtype != E4M3 or wt.shape[1] != k:
        raise ValueError(f"wt must be float8_e4m3fn [N, K={k}] (K-major), got {wt.dtype} "
                         f"{list(wt.shape)}")  # fmt: skip
    n = wt.shape[0]
    if n % TILE_N:
        raise ValueError(f"wt: N (outputs) must be a multiple of {TILE_N}, got {n}")
    want = (n // BLOCK, k // BLOCK, TILE_M)
    if tuple(sw.shape) != want or sw.dtype != jnp.float32:
        raise ValueError(f"sw must be float32 {list(want)} (pack_scales), got {sw.dtype} "
                         f"{list(sw.shape)}")  # fmt: skip


def fp8_block_matmul_ref(xq, sx, wt, sw) -> jax.Array:
    """The same product in plain JAX, fp32 throughout (the kernel's reference)."""
    m, k = xq.shape
    n = wt.shape[0]
    xb = xq.astype(jnp.float32).reshape(m, k // BLOCK, BLOCK)
    wb = wt.astype(jnp.float32).reshape(n, k // BLOCK, BLOCK)
    part = jnp.einsum("mbi,nbi->bmn", xb, wb)  # each block's product
    w_scale = jnp.repeat(sw[:, :, 0].T, TILE_N, axis=1)  # [K/128, N]
    return jnp.sum(part * sx.T[:, :, None] * w_scale[:, None, :], axis=0).astype(jnp.bfloat16)


# ---- The kernel.


def _rows_vector(ref, interpret: bool) -> jax.Array:
    """A [64] vector of per-row values (one per token of the tile) broadcast to [64, 128]."""
    raw = ref[...] if interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return lax.broadcast_in_dim(raw, (TILE_M, TILE_N), [0])


@functools.cache
def _build_kernel(*, m_pad: int, k: int, n: int, num_stages: int, interpret: bool):
    steps = k // BLOCK

    def body(x, sxt, wt, sw, out, x_s, w_s, sx_s, sw_s, o_s, bar):
        m_blk, n_blk = lax.axis_index("m"), lax.axis_index("n")
        m0 = pl.multiple_of(m_blk * TILE_M, TILE_M)
        n0 = pl.multiple_of(n_blk * TILE_N, TILE_N)

        def issue(i, slot):
            start = i * BLOCK  # (Mosaic GPU cannot lower multiple_of of the prologue's ints)
            cols = pl.ds(start if isinstance(i, int) else pl.multiple_of(start, BLOCK), BLOCK)
            plgpu.copy_gmem_to_smem(x.at[pl.ds(m0, TILE_M), cols], x_s.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(wt.at[pl.ds(n0, TILE_N), cols], w_s.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(sxt.at[i, pl.ds(m0, TILE_M)], sx_s.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(sw.at[n_blk, i], sw_s.at[slot], bar.at[slot])

        for st in range(num_stages):  # the pipeline's prologue
            issue(st, st)

        def step(i, acc):
            slot = lax.rem(i, jnp.int32(num_stages))
            plgpu.barrier_wait(bar.at[slot])
            if interpret:  # (the interpreter's dot takes no fp8 operands)
                part = lax.dot_general(x_s[slot].astype(jnp.float32),
                                       w_s[slot].astype(jnp.float32), (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)  # fmt: skip
            else:  # x tile [64, 128] @ (weight tile [128 outputs, 128 inputs])^T, fp32
                part = wgmma_dot(x_s.at[slot], w_s.at[slot], interpret=False, transpose_b=True)
            scale = _rows_vector(sx_s.at[slot], interpret) * _rows_vector(sw_s.at[slot], interpret)
            acc = acc + part * scale  # the promotion: once per 128 inputs

            @pl.when(i + num_stages < steps)
            def _refill():  # (the slot's wgmma was waited for inside wgmma_dot)
                issue(i + num_stages, slot)

            return acc

        zeros = jnp.zeros((TILE_M, TILE_N), jnp.float32)
        acc0 = zeros if interpret else plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
        acc = lax.fori_loop(0, steps, step, acc0)
        o_s[...] = acc.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, out.at[pl.ds(m0, TILE_M), pl.ds(n0, TILE_N)])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        swizzled_smem((num_stages, TILE_M, BLOCK), E4M3),  # x tiles
        swizzled_smem((num_stages, TILE_N, BLOCK), E4M3),  # weight tiles (outputs as rows)
        plgpu.SMEM((num_stages, TILE_M), jnp.float32),  # token scales of the step
        plgpu.SMEM((num_stages, TILE_M), jnp.float32),  # the block's weight scale, x 64
        swizzled_smem((TILE_M, TILE_N), jnp.bfloat16),  # output stage
        plgpu.Barrier(num_arrivals=4, num_barriers=num_stages),
    ]
    kwargs = dict(
        out_type=(jax.ShapeDtypeStruct((m_pad, n), jnp.bfloat16),),
        scratch_types=scratch,
        grid=(m_pad // TILE_M, n // TILE_N),
        grid_names=("m", "n"),
    )
    if interpret:
        kwargs["interpret"] = _compat.gpu_interpret_params()
    return plgpu.kernel(body, **kwargs)
