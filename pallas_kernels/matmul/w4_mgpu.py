"""Weight-only 4-bit and 8-bit GEMM for decode-sized batches on Hopper, in Mosaic GPU (Pallas).

y [M, N] = x [M, K] (bf16) @ dequant(W) [K, N] for M in 1..128, W in one of the layouts of
`reference.py` (4-bit: `int4_g128_sym`, `nvfp4`, `mxfp4`, `q4_1`; 8-bit: `int8`, `q8_0`). One
kernel serves every format: what differs (code -> value, which per-group arrays, their dtypes and
group size, bits per code) is a `W4Decode` (`w4_decode.py`).

How the work is cut
-------------------
- wgmma takes a register operand only as A (its M side, 64 rows), and the decoded weights must be
  that operand (they are made in registers; a shared-memory round trip is what the fp8 paged
  attention showed to be slow). So the kernel computes y^T [N, M] = W^T [N, K] @ x^T [K, M]: an
  output tile is 128 outputs (each of two consumer warpgroups owns 64, wgmma's M) and every
  token of the batch (wgmma's N: M padded to a multiple of 8, at most `MAX_M`).
- Each K step (128 inputs) is two wgmmas over 64 inputs, "halves", each with its x tile as the
  shared-memory B operand (loaded [M_pad, 64], K-major, and used transposed; shared by the two
  consumers). 4-bit: byte i of a column holds inputs 2i and 2i+1; rather than interleave the two
  nibbles in registers, the contraction is split into even and odd inputs, y^T = W_even^T
  x_even^T + W_odd^T x_odd^T, the low nibbles of one [64 packed rows, 64 outputs] tile forming
  W_even and the high nibbles W_odd; the dispatcher splits x into x_even and x_odd ([M_pad, K/2]
  each; x is small). 8-bit: the halves are the step's first and second 64 inputs, each its own
  [64, 64] int8 tile, and x is read as it is.
- The loop is `_mgpu.ws_gemm`, the FP8 GEMM's: a producer warpgroup issues each step's TMA copies
  (128 inputs: the two x halves [M_pad, 64], and per consumer its weight tiles of [64 rows, 64
  outputs] bytes and each grouped part's [128 / group, 64] tile) into a `num_stages`-deep ring; the
  consumers decode and multiply while it fills the next stages, and persistent programs (one per
  SM) take the tiles in turn. A consumer loads a byte tile from the transposed view (outputs
  as rows) in `WGMMA_TRANSPOSED` layout, widens it to int32, relays it to the WGMMA layout,
  decodes it with the per-group rows broadcast along the row (a select per group boundary in the
  tile: 7 for nvfp4's 16-input groups), casts to bf16 and feeds wgmma with fp32 accumulation. A
  scale whose group is the whole step (int4_g128's) multiplies the step's [64, M_pad] product
  instead, row by row: M_pad / 2 multiplies a thread, not 32 per code.
- Sizes that are multiples of 64 but not of 128 (SmolLM2's hidden size, 576) take no reads
  out of bounds: the last K step's weight rows (and group entries) start 64 inputs early, at
  K - 128, and the dispatcher inserts 64 zero inputs into x before its last 64, so that step's
  first half multiplies zeros; the last output tile's second consumer takes the first's 64
  outputs (N - 64 on), computing and storing the same values. Groups must then divide 64
  (int4_g128_sym, whose scale spans a whole step, needs K a multiple of 128).
- Split-K S (`default_num_splits`): the K loop is cut into S ranges so that narrow weights still
  fill the SMs; each range writes fp32 [64, M_pad] partials and a small XLA epilogue adds them,
  transposes to [M, N], applies an output scale (nvfp4's, int8's) and casts to x's dtype.

Not yet done: the 4-bit x split and the epilogue inside the kernel, TMA multicast of x across a
cluster, per-group sub-tiles instead of selects for nvfp4.

On CPU the kernel runs under jax's GPU interpreter (`interpret=True`); its wgmma is a plain dot
and register layouts are not modelled there (`_mgpu.wgmma_dot`).
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
from pallas_kernels.matmul.reference import FORMATS, PARTS
from pallas_kernels.matmul.w4_decode import DECODERS, W4Decode

TILE_N = CONSUMERS * ROWS  # outputs per tile: 64 (wgmma's M) per consumer
TILE_K = 128  # inputs per pipeline step; every format's group size divides it
SIZE_MULTIPLE = 64  # K and N: multiples of this (of TILE_K for a group of 128), K >= TILE_K
HALF_K = TILE_K // 2  # inputs per wgmma (a "half" of the step); x tiles are [M_pad, HALF_K]
MAX_M = 128  # tokens: with two consumers' fp32 output stages, 256 would leave one stage
SMEM_BYTES = 200 * 1024  # the stages are cut to fit this much shared memory (227 KiB on Hopper)
MAX_STAGES = 4
FILL_STEPS = 2  # what a tile costs beyond its steps (the ring's fill, the store), in steps


def padded_m(m: int) -> int:
    """Tokens the kernel computes for a batch of `m`: wgmma's N is a multiple of 8."""
    return max(8, -(-m // 8) * 8)


def weight_tiles(decoder: W4Decode) -> int:
    """[64 rows, 64 outputs] byte tiles of the weight per consumer and step: 1 for 4 bits (both
    halves in one tile's nibbles), 2 for 8."""
    return decoder.bits * TILE_K // 8 // HALF_K


def default_num_stages(m_pad: int, decoder: W4Decode, steps: int) -> int:
    """As many stages (up to `MAX_STAGES`, never more than the steps) as fit `SMEM_BYTES` next
    to the consumers' fp32 output stages."""
    per_stage = 2 * m_pad * HALF_K * 2 + weight_tiles(decoder) * HALF_K * TILE_N  # x; weights
    per_stage += sum(TILE_K // decoder.group * TILE_N * jnp.dtype(dt).itemsize
                     for _, dt in decoder.grouped)  # fmt: skip
    out = CONSUMERS * ROWS * m_pad * 4
    return max(1, min(steps, MAX_STAGES, (SMEM_BYTES - out) // per_stage))


def default_num_splits(n_tiles: int, steps: int, sms: int) -> int:
    """The split-K factor S (a divisor of the steps) with the shortest critical path in steps:
    ceil(n_tiles * S / sms) rounds of persistent programs, each tile steps / S + `FILL_STEPS`
    long (the fewest S on a tie: fewer fp32 partials to write and add)."""
    divisors = [s for s in range(1, steps + 1) if steps % s == 0]
    return min(divisors, key=lambda s: (-(-n_tiles * s // sms) * (steps // s + FILL_STEPS), s))


def w4_matmul_mgpu(
    x: jax.Array,
    values: jax.Array,
    *,
    fmt: str,
    num_stages: int | None = None,
    num_splits: int | None = None,
    num_programs: int | None = None,
    interpret: bool | None = None,
    device: jax.Device | None = None,
    **parts: jax.Array,
) -> jax.Array:
    """x [M, K] bf16 @ the weight (`values`: uint8 [K/2, N] for 4 bits, int8 [K, N] for 8, and the
    format's `parts`, named as in `reference.PARTS`) -> [M, N] in x's dtype. Static tuning:
    `num_stages` (pipeline depth), `num_splits` (split-K parts, a divisor of ceil(K / 128)),
    `num_programs` (persistent programs, never more than the tiles); defaults from
    `default_num_stages` / `default_num_splits` / `device`'s SMs. `interpret` runs the GPU
    interpreter (default: when `device`, None for `jax.devices()[0]`, is not a GPU)."""
    check_inputs(x, values, fmt, parts)
    dec = DECODERS[fmt]
    m, k = x.shape
    n = values.shape[1]
    steps = -(-k // TILE_K)  # a last step of 64 inputs counts whole (see "Sizes" above)
    m_pad = padded_m(m)
    stages = default_num_stages(m_pad, dec, steps) if num_stages is None else int(num_stages)
    sms = _compat.num_sms(device)
    if num_splits is None:
        num_splits = default_num_splits(-(-n // TILE_N), steps, sms)
    num_splits = int(num_splits)
    if num_splits < 1 or steps % num_splits:
        raise ValueError(f"num_splits must divide the {steps} K steps (ceil(K / {TILE_K})), "
                         f"got {num_splits}")  # fmt: skip
    if stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {stages}")
    interpret = _compat.default_interpret(device) if interpret is None else bool(interpret)
    tiles = -(-n // TILE_N) * num_splits
    plan = WsPlan(mt=-(-n // TILE_N), nt=1, k_splits=num_splits, steps=steps // num_splits,
                  num_stages=min(stages, steps // num_splits),
                  programs=min(tiles, int(num_programs or sms)))  # fmt: skip
    kernel = _build_kernel(plan, m_pad=m_pad, n=n, k=k, fmt=fmt, interpret=interpret)
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, m_pad - m), (0, 0)))
    grouped = [parts[name] for name, _ in dec.grouped]
    xs = (xp[:, 0::2], xp[:, 1::2]) if dec.bits == 4 else (xp,)
    if k % TILE_K:  # the last step re-reads 64 inputs: zeros for them, before x's last 64
        z = HALF_K * dec.bits // 8  # x columns of 64 inputs: 32 of x_even / x_odd, or 64
        xs = tuple(jnp.concatenate([a[:, :-z], jnp.zeros((m_pad, z), a.dtype), a[:, -z:]], 1)
                   for a in xs)  # fmt: skip
    (out,) = kernel(*xs, values, *grouped)  # fp32 [N, M_pad] or [S, N, M_pad]
    y = (out if num_splits == 1 else jnp.sum(out, axis=0))[:, :m].T
    if dec.output_scale is not None:
        y = y * jnp.asarray(parts[dec.output_scale], jnp.float32)
    return y.astype(x.dtype)


def sizes_fit(fmt: str, k: int, n: int) -> bool:
    """Whether the kernel takes a [k, n] weight of `fmt` (see `check_inputs`)."""
    group = DECODERS[fmt].group
    return (k % SIZE_MULTIPLE == 0 and k >= TILE_K and n % SIZE_MULTIPLE == 0
            and (k % TILE_K == 0 or group is None or SIZE_MULTIPLE % group == 0))  # fmt: skip


def check_inputs(x, values, fmt: str, parts: dict) -> None:
    """ValueError naming the argument when a shape, dtype or part does not fit the kernel."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 [M, K], got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x: M (tokens) must be in 1..{MAX_M}, got {m}")
    if k % SIZE_MULTIPLE or k < TILE_K:
        raise ValueError(f"x: K must be a multiple of {SIZE_MULTIPLE} and at least {TILE_K}, "
                         f"got {k}")  # fmt: skip
    dec = DECODERS[fmt]
    if k % TILE_K and not (dec.group is None or SIZE_MULTIPLE % dec.group == 0):
        raise ValueError(f"x: K must be a multiple of {TILE_K} for fmt {fmt!r} (groups of "
                         f"{dec.group}), got {k}")  # fmt: skip
    per_byte = 8 // dec.bits  # codes a byte
    want_dtype, rows = (jnp.uint8, "K/2") if per_byte == 2 else (jnp.int8, "K")
    if values.ndim != 2 or values.dtype != want_dtype:
        raise ValueError(f"values must be {jnp.dtype(want_dtype)} [{rows}, N] for fmt {fmt!r}, "
                         f"got {values.dtype} {tuple(values.shape)}")  # fmt: skip
    if values.shape[0] * per_byte != k:
        raise ValueError(f"values: {values.shape[0]} rows hold {per_byte * values.shape[0]} "
                         f"inputs, but x has K = {k}")  # fmt: skip
    n = values.shape[1]
    if n % SIZE_MULTIPLE:
        raise ValueError(f"values: N (outputs) must be a multiple of {SIZE_MULTIPLE}, got {n}")
    want = PARTS[fmt]
    if set(parts) != set(want):
        raise ValueError(f"fmt {fmt!r} takes parts {sorted(want)}, got {sorted(parts)}")
    for name, dtype in want.items():
        a = parts[name]
        shapes = [(), (n,)] if name == dec.output_scale else [(k // dec.group, n)]
        if tuple(a.shape) not in shapes or a.dtype != jnp.dtype(dtype):
            shape = " or ".join(str(list(s)) for s in shapes)
            raise ValueError(f"{name} must be {jnp.dtype(dtype)} {shape} for fmt {fmt!r} "
                             f"(K={k}, N={n}), got {a.dtype} {list(a.shape)}")  # fmt: skip


# ---- The kernel.


def _cast(interpret: bool, x, layout):  # register layouts mean nothing to the GPU interpreter
    return x if interpret else plgpu.layout_cast(x, layout)


def _load_codes(v_ref, interpret: bool) -> jax.Array:
    """A byte tile [64 rows, 64 outputs] as int32 [64 outputs, 64 rows] (W^T's layout) in the
    WGMMA layout, loaded from the transposed view, then relaid (int8 sign-extends)."""
    if interpret:
        return v_ref[...].astype(jnp.int32).T
    raw = plgpu.load(plgpu.transpose_ref(v_ref, (1, 0)), (),
                     layout=plgpu.Layout.WGMMA_TRANSPOSED)  # fmt: skip
    return plgpu.layout_cast(raw.astype(jnp.int32), plgpu.Layout.WGMMA)


def _row(dec: W4Decode, name: str, src, shape, interpret: bool) -> jax.Array:
    """One group entry per output (a [64] row of a part's tile) as fp32, broadcast to `shape`."""
    raw = src[...] if interpret else plgpu.load(src, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return lax.broadcast_in_dim(dec.to_f32(name, raw), shape, [0])


def _group_rows(dec: W4Decode, p_refs, half: int, interpret: bool) -> dict:
    """Each grouped part of the step (but the step scale) as fp32 [64 outputs, 64 columns] for
    the codes of `half`, from its [groups, 64] tile. 4 bits: column j holds inputs 2j and 2j + 1
    of the step (either half), group (2j) // group; 8 bits: input 64 * half + j."""
    rows = {}
    for (name, _), ref in zip(dec.grouped, p_refs, strict=True):
        if name == dec.step_scale:
            continue
        shape = (ROWS, HALF_K)
        cols = dec.group // 2 if dec.bits == 4 else dec.group  # columns per group
        first = 0 if dec.bits == 4 else half * HALF_K // dec.group  # the half's first group
        col = None
        if cols < HALF_K:
            col = _cast(interpret, lax.broadcasted_iota(jnp.int32, shape, 1), plgpu.Layout.WGMMA)
        full = None
        for g in range(HALF_K // cols):
            b = _row(dec, name, ref.at[first + g], shape, interpret)
            full = b if full is None else jnp.where(col >= g * cols, b, full)
        rows[name] = full
    return rows


@functools.cache
def _build_kernel(plan: WsPlan, *, m_pad: int, n: int, k: int, fmt: str, interpret: bool):
    dec = DECODERS[fmt]
    n_parts = len(dec.grouped)
    n_x = 2 if dec.bits == 4 else 1  # x_even and x_odd, or x
    n_w = weight_tiles(dec)
    groups = TILE_K // dec.group if n_parts else 0  # group entries per step
    step_rows = n_w * HALF_K  # weight rows per step (bytes of a column)
    last_row = k * dec.bits // 8 - step_rows  # the last step's first row (K - 128 inputs)
    last_group = k // dec.group - groups if n_parts else 0
    row_align = SIZE_MULTIPLE * dec.bits // 8  # the rows of 64 inputs: every start's multiple

    def out_row(t, c):  # consumer c's first output; the last tile's second may repeat the first's
        return jnp.minimum(t.m_blk * TILE_N + c * ROWS, n - ROWS)

    split = plan.k_splits > 1
    names = [name for name, _ in dec.grouped]

    def body(*refs):
        xs, vals = refs[:n_x], refs[n_x]
        p_gmem, out = refs[n_x + 1 : n_x + 1 + n_parts], refs[n_x + 1 + n_parts]
        x_s, v_s, *rest = refs[n_x + 2 + n_parts :]
        p_s, (o_s, full, free) = rest[:n_parts], rest[n_parts:]

        def issue(t, i, slot):  # step i of tile t: the x halves, each consumer's weight tiles
            kk = t.b0 + i
            bar = full.at[slot]
            for h in range(2):  # x half h: x_even / x_odd's step columns, or x's h-th 64 inputs
                src = xs[h] if n_x == 2 else xs[0]
                c0 = kk * HALF_K if n_x == 2 else kk * TILE_K + h * HALF_K
                cols = pl.ds(pl.multiple_of(c0, HALF_K), HALF_K)
                plgpu.copy_gmem_to_smem(src.at[:, cols], x_s.at[h, slot], bar)
            r0 = jnp.minimum(kk * step_rows, last_row)  # (K - 128 on for a last half step)
            g0 = jnp.minimum(kk * groups, last_group)
            for c in range(CONSUMERS):
                outs = pl.ds(pl.multiple_of(out_row(t, c), ROWS), ROWS)
                for j in range(n_w):  # the step's weight rows, 64 bytes of a column each
                    rows = pl.ds(pl.multiple_of(r0 + j * HALF_K, row_align), HALF_K)
                    plgpu.copy_gmem_to_smem(vals.at[rows, outs], v_s.at[slot, c, j], bar)
                for src, dst in zip(p_gmem, p_s, strict=True):
                    plgpu.copy_gmem_to_smem(src.at[pl.ds(g0, groups), outs], dst.at[slot, c],
                                            bar)  # fmt: skip

        def step(c, slot, acc):  # consumer c's 64 outputs x every token, one K step
            p_refs = [ref.at[slot, c] for ref in p_s]
            prod, rows, codes = None, None, None
            for h in range(2):
                if dec.bits == 4:  # W_even^T from the low nibbles, W_odd^T from the high ones
                    codes = _load_codes(v_s.at[slot, c, 0], interpret) if h == 0 else codes
                    q = codes & 0xF if h == 0 else codes >> 4
                    rows = _group_rows(dec, p_refs, 0, interpret) if h == 0 else rows
                else:  # the step's h-th 64 inputs
                    q = _load_codes(v_s.at[slot, c, h], interpret)
                    rows = _group_rows(dec, p_refs, h, interpret)
                w = dec.value(q, rows).astype(jnp.bfloat16)
                # (wgmma_dot reads its accumulator: both products are done with the stage after)
                p = wgmma_dot(w, x_s.at[h, slot], interpret=interpret, transpose_b=True)
                prod = p if prod is None else prod + p
            if dec.step_scale is not None:  # one scale per output for the whole step
                ref = p_refs[names.index(dec.step_scale)]
                prod = prod * _row(dec, dec.step_scale, ref.at[0], (ROWS, m_pad), interpret)
            return acc + prod

        def finish(c, t, acc):
            store_tile(acc, o_s.at[c], out, out_row(t, c), 0, t.k_blk,
                       split=split, dtype=jnp.float32)  # fmt: skip

        ws_gemm(plan, full=full, free=free, issue=issue, step=step, finish=finish,
                acc_shape=(ROWS, m_pad), interpret=interpret)  # fmt: skip

    stages = plan.num_stages
    v_dtype = jnp.uint8 if dec.bits == 4 else jnp.int8
    scratch = [
        swizzled_smem((2, stages, m_pad, HALF_K), jnp.bfloat16),  # the two x halves' tiles
        swizzled_smem((stages, CONSUMERS, n_w, HALF_K, ROWS), v_dtype),  # weight tiles
        *[plgpu.SMEM((stages, CONSUMERS, groups, ROWS), dt) for _, dt in dec.grouped],
        plgpu.SMEM((CONSUMERS, ROWS, m_pad), jnp.float32),  # output stages, one per consumer
        # full: the step's copies landed (two x halves, and per consumer its weights and parts)
        plgpu.Barrier(num_arrivals=2 + CONSUMERS * (n_w + n_parts), num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # free: both read it
    ]
    return ws_launch(body, plan, m_pad=n, n=m_pad, out_dtype=jnp.float32, scratch=scratch,
                     interpret=interpret,
                     compiler_params=plgpu.CompilerParams(approx_math=True))  # fmt: skip
