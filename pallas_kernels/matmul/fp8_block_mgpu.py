"""Block-scaled FP8 GEMM (W8A8, DeepSeek-V3's fine-grained scheme) on Hopper, in Mosaic GPU.

    y [M, N] = sum over 128-input blocks b of (xq[:, b] @ w[b, :]) * sx[:, b] * sw[b, n // 128]

xq e4m3 [M, K] with sx fp32 [M, K/128] (one scale per token per 128 inputs, "1 x 128"); the
weight e4m3 K-major wt [N, K] with its block scales (one per 128 x 128 block); y in bf16. This is
the product of `jaxinfer.quant`'s `fp8_block` format (DeepSeek-V3 technical report, sec. 3.3;
DeepGEMM does the same in CUDA); XLA has no block-scaled dot, and its per-block `dot_general`
materialises every block's fp32 partial product.

How the work is cut
-------------------
- fp8 wgmma reads both operands from shared memory K-minor (only 16-bit wgmma can transpose), so
  the weight is K-major, wt e4m3 [N, K] (as `fp8_block` stores it), and each [128, 128] tile of
  it goes to wgmma as a transposed view.
- Warp-specialised: a program (CTA) runs one producer warpgroup, which only issues TMA copies
  (with 40 registers), and C = 2 consumer warpgroups (232 registers each), each owning a
  [64, 128] output tile (wgmma's M is 64; one weight-scale block wide). The CTA's tile is
  [128, 128] (consumers along M, from 128 token rows) or [64, 256] (along N, for decode-sized M,
  where a second token tile would be padding); `tile_layout` picks. The consumers share each
  step's operands: along M the weight tile, along N the token tile.
- Each consumer walks K in 128-input steps. A step's product goes into a fresh fp32 accumulator
  (synchronous wgmma), which is then promoted into the running sum, scaled by the step's token
  scales (a [64] row vector) times the block's weight scale. Promotion once per 128 inputs is the
  scheme's point: the e4m3 products are summed in fp32 over one block only. While one consumer
  promotes (CUDA cores) the other's wgmma runs (tensor cores): the two overlap without either
  holding two accumulators.
- A step's operands (the token tile, the weight tile, the step's token scales and the blocks'
  weight scales) arrive by TMA on one "full" barrier per stage, `num_stages` deep; each consumer
  arrives on the stage's "free" barrier once its wgmma has read the stage, and the producer
  refills it after both did. The scales are laid out so that each step's are whole rows: the
  token scales as sx transposed [K/128, M/64, 64], the weight scales as [K/128, N/128, 64]
  (`pack_scales`, per call: 1/16384 of the weight's elements, x 64), each repeated once per row
  of a token tile so that it loads in the same row-vector layout as the token scales (TMA needs
  a contiguous inner box of at least 16 bytes; one scale is 4).
- Tiles: (M / tile_m) x (N / tile_n) x S, M padded to whole CTA tiles. With S = 1 (no split)
  each tile walks all of K and is written in bf16. Split-K (S > 1, `k_splits`) cuts K's K/128
  blocks into S contiguous ranges (S must divide K/128): tile (i, j, s) reduces range s only,
  promoting per block as above, and writes its fp32 sums to partials [S, M, N]; XLA sums them
  over S in fp32 and casts to bf16 after the kernel (one fused reduction). This is for
  decode-sized M, where few output tiles leave most SMs idle and the weight is read far below
  bandwidth. The sum over blocks is reassociated (S partial sums, then their sum), so S > 1
  differs from S = 1 at fp32 rounding. `choose_k_splits` picks S when the caller does not.
- Persistent: one program per SM (at most one per tile) takes tiles pid, pid + P, ... in an
  L2-friendly order (`_mgpu.tile_coords`; the loop is `_mgpu.ws_gemm`, shared with the
  batch-invariant GEMM). Its producer runs on into the next tile's steps while the
  consumers finish and store the last (the stage ring and its barrier phases continue across
  tiles), so a tile's pipeline fill and output store are hidden behind its neighbours'.

Not yet done: the split-K reduction inside the kernel, and the activations' 1 x 128
quantization fused into it.

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

BLOCK = 128  # inputs per scale block and per pipeline step; outputs per weight-scale block
E4M3 = jnp.float8_e4m3fn
TILE_LAYOUTS = {"m": (CONSUMERS, 1), "n": (1, CONSUMERS)}  # (64-row tiles, 128-column tiles)
SMEM_BYTES = 200 * 1024  # the stages are cut to fit this much shared memory (227 KiB on Hopper)

# choose_k_splits: each split keeps at least this many 128-input steps (a pipeline of
# `num_stages` = 4 to fill), and the fp32 partials stay under this fraction of the weight's bytes.
MIN_STEPS_PER_SPLIT = 4
MAX_PARTIAL_BYTES_FRACTION = 0.25
WAVE_FILL = 7 / 8  # S programs per output tile reach "a wave" at this fraction of the SMs


def pack_scales(scales: jax.Array) -> jax.Array:
    """`fp8_block`'s weight scales fp32 [N/128, K/128] in the kernel's layout [K/128, N/128, 64]
    (each repeated once per row of a token tile)."""
    s = scales.astype(jnp.float32).T
    return jnp.broadcast_to(s[:, :, None], (*s.shape, ROWS))


def choose_tile_layout(m: int, n: int) -> str:
    """ "m" (a [128, 128] tile: consumers along M) from 65 token rows, else "n" ([64, 256]: along
    N, where a second token tile would be all padding) when N allows it, else "m"."""
    if m > ROWS or n % (BLOCK * CONSUMERS):
        return "m"
    return "n"


def tile_shape(layout: str) -> tuple[int, int]:
    """A program's output tile (rows, columns) for a tile layout."""
    cm, cn = TILE_LAYOUTS[layout]
    return ROWS * cm, BLOCK * cn


def choose_k_splits(m: int, n: int, k: int, num_sms: int = 132,
                    layout: str | None = None) -> int:  # fmt: skip
    """Split-K factor S for an [m, k] @ [k, n] product (1: no split), the rule:

    - Split only when the output tiles (of `layout`, None: `choose_tile_layout`) fill less than
      half of `num_sms`: past that one wave is mostly full and partials would cost more than the
      idle SMs.
    - S divides K/128 and leaves each split at least MIN_STEPS_PER_SPLIT steps (a short range
      is all prologue and epilogue: its TMA latency is never hidden).
    - The fp32 partials, S * M * N * 4 bytes written by the kernel and read back by the
      reduction, stay under MAX_PARTIAL_BYTES_FRACTION of the weight's N * K bytes (at M = 64:
      S <= K / 1024), since the product is bound by reading the weight.
    - Among those, the smallest S whose tiles * S programs reach WAVE_FILL * num_sms (about one
      wave), else the largest allowed.
    """
    tm, tn = tile_shape(layout or choose_tile_layout(m, n))
    m_pad = -(-m // tm) * tm
    tiles = (m_pad // tm) * (n // tn)
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
    tile_layout: str | None = None,
    num_programs: int | None = None,
    interpret: bool | None = None,
    device: jax.Device | None = None,
) -> jax.Array:
    """xq e4m3 [M, K] with token scales sx fp32 [M, K/128] @ the weight (wt e4m3 [N, K], K-major,
    sw fp32 [K/128, N/128, 64]: `pack_scales`) -> bf16 [M, N]. `num_stages`: pipeline depth (cut
    to the steps and to SMEM_BYTES). `k_splits`: split-K factor S, dividing K/128 (None:
    `choose_k_splits` for `device`'s SMs). `tile_layout`: "m" or "n" (None:
    `choose_tile_layout`). `num_programs`: the persistent programs (None: `device`'s SMs; never
    more than the tiles). `interpret` runs the GPU interpreter (default: when `device`, None for
    `jax.devices()[0]`, is not a GPU)."""
    check_inputs(xq, sx, wt, sw)
    m, k = xq.shape
    n = wt.shape[0]
    layout = choose_tile_layout(m, n) if tile_layout is None else tile_layout
    if layout not in TILE_LAYOUTS:
        raise ValueError(f"tile_layout must be one of {sorted(TILE_LAYOUTS)} or None, got "
                         f"{tile_layout!r}")  # fmt: skip
    if n % tile_shape(layout)[1]:
        raise ValueError(f"tile_layout {layout!r} needs N a multiple of "
                         f"{tile_shape(layout)[1]}, got N = {n}")  # fmt: skip
    if k_splits is None:
        k_splits = choose_k_splits(m, n, k, num_sms=_compat.num_sms(device), layout=layout)
    check_k_splits(k_splits, k)
    tm = tile_shape(layout)[0]
    m_pad = -(-m // tm) * tm
    interpret = _compat.default_interpret(device) if interpret is None else bool(interpret)
    stages = pipeline_stages(num_stages, steps=k // BLOCK // k_splits, layout=layout,
                             split=k_splits > 1)  # fmt: skip
    tiles = (m_pad // tm) * (n // tile_shape(layout)[1]) * k_splits
    programs = min(tiles, num_programs or _compat.num_sms(device))
    kernel = _build_kernel(m_pad=m_pad, k=k, n=n, layout=layout, num_stages=stages,
                           k_splits=k_splits, programs=programs, interpret=interpret)  # fmt: skip
    xp = jnp.pad(xq, ((0, m_pad - m), (0, 0)))
    sxt = jnp.pad(sx.astype(jnp.float32), ((0, m_pad - m), (0, 0))).T  # [K/128, M_pad]
    (out,) = kernel(xp, sxt.reshape(k // BLOCK, m_pad // ROWS, ROWS), wt, sw)
    if k_splits == 1:
        return out[:m]
    return jnp.sum(out[:, :m], axis=0).astype(jnp.bfloat16)  # partials [S, M_pad, N], fp32


def pipeline_stages(num_stages: int, *, steps: int, layout: str, split: bool) -> int:
    """The pipeline depth: `num_stages`, at most the steps, and what fits in SMEM_BYTES next to
    the output stages (bf16, or fp32 partials with split-K)."""
    tm, tn = tile_shape(layout)
    per_stage = (tm + tn) * BLOCK + (tm + tn) // BLOCK * ROWS * 4  # fp8 tiles + scale rows
    out = CONSUMERS * ROWS * BLOCK * (4 if split else 2)
    return max(1, min(int(num_stages), steps, (SMEM_BYTES - out) // per_stage))


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
    if n % BLOCK:
        raise ValueError(f"wt: N (outputs) must be a multiple of {BLOCK}, got {n}")
    want = (k // BLOCK, n // BLOCK, ROWS)
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
    w_scale = jnp.repeat(sw[:, :, 0], BLOCK, axis=1)  # [K/128, N]
    return jnp.sum(part * sx.T[:, :, None] * w_scale[:, None, :], axis=0).astype(jnp.bfloat16)


# ---- The kernel.


def _rows_vector(ref, interpret: bool) -> jax.Array:
    """A [64] vector of per-row values (one per token of the tile) broadcast to [64, 128]."""
    raw = ref[...] if interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return lax.broadcast_in_dim(raw, (ROWS, BLOCK), [0])


@functools.cache
def _build_kernel(*, m_pad: int, k: int, n: int, layout: str, num_stages: int, k_splits: int,
                  programs: int, interpret: bool):  # fmt: skip
    split = k_splits > 1
    cm, cn = TILE_LAYOUTS[layout]
    tm, tn = tile_shape(layout)
    plan = WsPlan(mt=m_pad // tm, nt=n // tn, k_splits=k_splits, steps=k // BLOCK // k_splits,
                  num_stages=num_stages, programs=programs)  # fmt: skip

    def body(x, sxt, wt, sw, out, x_s, w_s, sx_s, sw_s, o_s, full, free):
        def issue(t, i, slot):  # step i of tile t: its 4 copies
            b = t.b0 + i  # the K block
            cols = pl.ds(pl.multiple_of(b * BLOCK, BLOCK), BLOCK)
            m0, n0 = pl.multiple_of(t.m_blk * tm, tm), pl.multiple_of(t.n_blk * tn, tn)
            bar = full.at[slot]
            plgpu.copy_gmem_to_smem(x.at[pl.ds(m0, tm), cols], x_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(wt.at[pl.ds(n0, tn), cols], w_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(sxt.at[b, pl.ds(t.m_blk * cm, cm)], sx_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(sw.at[b, pl.ds(t.n_blk * cn, cn)], sw_s.at[slot], bar)

        def where(w):  # consumer w's [64, 128] within the tile: (64-row tile, 128-column tile)
            return (w, 0) if cm > 1 else (0, w)

        def step(w, slot, acc):
            wm, wn = where(w)
            scale = (_rows_vector(sx_s.at[slot, wm], interpret)
                     * _rows_vector(sw_s.at[slot, wn], interpret))  # fmt: skip
            x_t = x_s.at[slot].at[pl.ds(wm * ROWS, ROWS)]  # [64 tokens, 128 inputs]
            w_t = w_s.at[slot].at[pl.ds(wn * BLOCK, BLOCK)]  # [128 outputs, 128 inputs]
            if interpret:  # (the interpreter's dot takes no fp8 operands)
                part = lax.dot_general(x_t[...].astype(jnp.float32), w_t[...].astype(jnp.float32),
                                       (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)  # fmt: skip
            else:  # x tile @ weight tile^T, fp32; synchronous: the stage is read after it
                part = wgmma_dot(x_t, w_t, interpret=False, transpose_b=True)
            return acc + part * scale  # the promotion: once per 128 inputs

        def finish(w, t, acc):
            wm, wn = where(w)
            m0, n0 = t.m_blk * tm + wm * ROWS, t.n_blk * tn + wn * BLOCK
            store_tile(acc, o_s.at[w], out, m0, n0, t.k_blk, split=split, dtype=jnp.bfloat16)

        ws_gemm(plan, full=full, free=free, issue=issue, step=step, finish=finish,
                acc_shape=(ROWS, BLOCK), interpret=interpret)  # fmt: skip

    out_dtype = jnp.float32 if split else jnp.bfloat16
    scratch = [
        swizzled_smem((num_stages, tm, BLOCK), E4M3),  # token tiles
        swizzled_smem((num_stages, tn, BLOCK), E4M3),  # weight tiles (outputs as rows)
        plgpu.SMEM((num_stages, cm, ROWS), jnp.float32),  # the step's token scales
        plgpu.SMEM((num_stages, cn, ROWS), jnp.float32),  # the blocks' weight scales, x 64
        swizzled_smem((CONSUMERS, ROWS, BLOCK), out_dtype),  # output stages, one per consumer
        plgpu.Barrier(num_arrivals=4, num_barriers=num_stages),  # full: the 4 copies landed
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),  # free: all read it
    ]
    return ws_launch(body, plan, m_pad=m_pad, n=n, out_dtype=out_dtype, scratch=scratch,
                     interpret=interpret)  # fmt: skip
