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
- Grid (M / 64, N / 128, S); M is padded to a multiple of 64 by the dispatcher. With S = 1 (no
  split) each program walks all of K and writes its bf16 tile. Split-K (S > 1, `k_splits`) cuts
  K's K/128 blocks into S contiguous ranges of K/128/S blocks (S must divide K/128): program
  (i, j, s) reduces range s only, promoting per block as above, and writes its fp32 sum to
  partials [S, M, N]; XLA sums the partials over S in fp32 and casts to bf16 after the kernel
  (one fused reduction). This is for decode-sized M, where (M/64)(N/128) programs leave most SMs
  idle (M = 64, N = 4096: 32 programs on 132 SMs) and the weight is read far below bandwidth.
  The sum over blocks is reassociated (S partial sums, then their sum), so S > 1 differs from
  S = 1 at fp32 rounding. `choose_k_splits` picks S when the caller does not.

Not yet done: asynchronous wgmma with the promotion of step i overlapping the product of step
i + 1, two consumer warpgroups (128 x 128 tiles), a producer warpgroup, a persistent grid, and a
split-K reduction inside the kernel (semaphores or atomics instead of fp32 partials in HBM and
a second XLA kernel).

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

BLOCK = 128  # inputs per scale block and per pipeline step; outputs per weight-scale block
TILE_M = ROWS  # tokens per program: wgmma's M
TILE_N = BLOCK  # outputs per program: one weight-scale block
E4M3 = jnp.float8_e4m3fn

# choose_k_splits: each split keeps at least this many 128-input steps (a pipeline of
# `num_stages` = 4 to fill), and the fp32 partials stay under this fraction of the weight's bytes.
MIN_STEPS_PER_SPLIT = 4
MAX_PARTIAL_BYTES_FRACTION = 0.25
WAVE_FILL = 7 / 8  # S programs per output tile reach "a wave" at this fraction of the SMs


def pack_scales(scales: jax.Array) -> jax.Array:
    """`fp8_block`'s weight scales fp32 [N/128, K/128] in the kernel's layout [N/128, K/128, 64]
    (each repeated once per row of a token tile)."""
    return jnp.broadcast_to(scales.astype(jnp.float32)[:, :, None], (*scales.shape, TILE_M))


def choose_k_splits(m: int, n: int, k: int, num_sms: int = 132) -> int:
    """Split-K factor S for an [m, k] @ [k, n] product (1: no split), the rule:

    - Split only when the (ceil(m/64)) (n/128) output tiles fill less than half of `num_sms`:
      past that one wave is mostly full and partials would cost more than the idle SMs.
    - S divides K/128 and leaves each split at least MIN_STEPS_PER_SPLIT steps (a short range
      is all prologue and epilogue: its TMA latency is never hidden).
    - The fp32 partials, S * M * N * 4 bytes written by the kernel and read back by the
      reduction, stay under MAX_PARTIAL_BYTES_FRACTION of the weight's N * K bytes (at M = 64:
      S <= K / 1024), since the product is bound by reading the weight.
    - Among those, the smallest S whose tiles * S programs reach WAVE_FILL * num_sms (about one
      wave), else the largest allowed.
    """
    m_pad = -(-m // TILE_M) * TILE_M
    tiles = (m_pad // TILE_M) * (n // TILE_N)
    blocks = k // BLOCK
    if 2 * tiles >= num_sms:
        return 1
    best = 1
    for s in range(2, blocks + 1):
        if blocks % s:
            continue
        if blocks // s < MIN_STEPS_PER_SPLIT:
            break
        if s * m_pad * n * 4 > MAX_PARTIAL_BYTES_FRACTION * n * k:
            break
        best = s
        if tiles * s >= WAVE_FILL * num_sms:
            break
    return best


def fp8_block_matmul_mgpu(
    xq: jax.Array,
    sx: jax.Array,
    wt: jax.Array,
    sw: jax.Array,
    *,
    num_stages: int = 4,
    k_splits: int | None = None,
    interpret: bool | None = None,
    device: jax.Device | None = None,
) -> jax.Array:
    """xq e4m3 [M, K] with token scales sx fp32 [M, K/128] @ the weight (wt e4m3 [N, K], K-major,
    sw fp32 [N/128, K/128, 64]: `pack_scales`) -> bf16 [M, N]. `num_stages`: pipeline depth.
    `k_splits`: split-K factor S, dividing K/128 (None: `choose_k_splits` for `device`'s SMs).
    `interpret` runs the GPU interpreter (default: when `device`, None for `jax.devices()[0]`,
    is not a GPU)."""
    check_inputs(xq, sx, wt, sw)
    m, k = xq.shape
    n = wt.shape[0]
    if k_splits is None:
        k_splits = choose_k_splits(m, n, k, num_sms=_compat.num_sms(device))
    check_k_splits(k_splits, k)
    m_pad = -(-m // TILE_M) * TILE_M
    stages = max(1, min(int(num_stages), k // BLOCK // k_splits))
    interpret = _compat.default_interpret(device) if interpret is None else bool(interpret)
    kernel = _build_kernel(m_pad=m_pad, k=k, n=n, num_stages=stages, k_splits=k_splits,
                           interpret=interpret)  # fmt: skip
    xp = jnp.pad(xq, ((0, m_pad - m), (0, 0)))
    sxt = jnp.pad(sx.astype(jnp.float32), ((0, m_pad - m), (0, 0))).T  # [K/128, M_pad]
    (out,) = kernel(xp, sxt, wt, sw)
    if k_splits == 1:
        return out[:m]
    return jnp.sum(out[:, :m], axis=0).astype(jnp.bfloat16)  # partials [S, M_pad, N], fp32


def check_k_splits(k_splits, k: int) -> None:
    """ValueError unless `k_splits` is a positive int dividing K/128."""
    blocks = k // BLOCK
    if not isinstance(k_splits, int) or k_splits < 1 or blocks % k_splits:
        raise ValueError(f"k_splits must be a positive int dividing K/{BLOCK} = {blocks}, got "
                         f"{k_splits!r}")  # fmt: skip


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
def _build_kernel(*, m_pad: int, k: int, n: int, num_stages: int, k_splits: int, interpret: bool):
    steps = k // BLOCK // k_splits  # 128-input steps per program
    split = k_splits > 1

    def body(x, sxt, wt, sw, out, x_s, w_s, sx_s, sw_s, o_s, bar):
        m_blk, n_blk = lax.axis_index("m"), lax.axis_index("n")
        m0 = pl.multiple_of(m_blk * TILE_M, TILE_M)
        n0 = pl.multiple_of(n_blk * TILE_N, TILE_N)
        # the program's first K block: its split's range is [b0, b0 + steps)
        k_blk = lax.axis_index("k") if split else 0
        b0 = k_blk * steps

        def issue(i, slot):
            b = b0 + i if split else i  # the K block of step i
            start = b * BLOCK  # (Mosaic GPU cannot lower multiple_of of the prologue's ints)
            cols = pl.ds(start if isinstance(b, int) else pl.multiple_of(start, BLOCK), BLOCK)
            plgpu.copy_gmem_to_smem(x.at[pl.ds(m0, TILE_M), cols], x_s.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(wt.at[pl.ds(n0, TILE_N), cols], w_s.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(sxt.at[b, pl.ds(m0, TILE_M)], sx_s.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(sw.at[n_blk, b], sw_s.at[slot], bar.at[slot])

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
        store_tile(acc, o_s, out, m0, n0, k_blk, split=split, dtype=jnp.bfloat16)

    out_dtype = jnp.float32 if split else jnp.bfloat16
    scratch = [
        swizzled_smem((num_stages, TILE_M, BLOCK), E4M3),  # x tiles
        swizzled_smem((num_stages, TILE_N, BLOCK), E4M3),  # weight tiles (outputs as rows)
        plgpu.SMEM((num_stages, TILE_M), jnp.float32),  # token scales of the step
        plgpu.SMEM((num_stages, TILE_M), jnp.float32),  # the block's weight scale, x 64
        swizzled_smem((TILE_M, TILE_N), out_dtype),  # output stage
        plgpu.Barrier(num_arrivals=4, num_barriers=num_stages),
    ]
    return split_k_kernel(body, m_pad=m_pad, n=n, tile_m=TILE_M, tile_n=TILE_N,
                          k_splits=k_splits, out_dtype=out_dtype, scratch=scratch,
                          interpret=interpret)  # fmt: skip
