"""Weight-only 4-bit and 8-bit GEMM for decode-sized batches on Pallas's Triton backend.

y [M, N] = x [M, K] @ dequant(W) [K, N] for M in 1..128, W in one of `reference.py`'s layouts as
stored (no re-packing), every format through its `W4Decode` (`w4_decode.py`). Pallas's Triton
backend is deprecated from jax 0.11 on; it is here because it measured faster than a Mosaic GPU
kernel of ours (warp-specialised, wgmma with the decoded weight as the register operand; deleted,
git log keeps it) at every decode size: H200 int4 m = 1 and 16, 26.7-28.6 us against 34.4-40.3
(experiments/results/h200/w4_triton_probe.json); H100 m = 32, 28.5-29.1 against 37.6-38.7, a
tie at 64 (h100/quant_matmul_m32_64_configs.json).

How the work is cut
-------------------
- A program owns `bn` outputs (128, or 64 where N is not a multiple of 128) and one of
  `num_splits` equal ranges of K; it loops over K in steps of 128 inputs (64 where K is not a
  multiple of 128, and for 8 bits), Triton pipelining the loads `num_stages` deep.
- 4 bits: byte i of a column holds inputs 2i (low nibble) and 2i + 1 (high). A step loads its
  [step / 2, bn] byte tile once and contracts the low nibbles with x's even inputs and the high
  ones with its odd inputs (x's step tile split into its pairs in the kernel): two dots, no
  interleave of the codes.
- tl.dot needs 16 rows: x's M rows are read masked into a [M padded to 16, step] tile.
- Per-group parts (`W4Decode.grouped`): a part whose group spans the step or more (int4_g128's
  scale) multiplies the step's product, row by row; a smaller group's row is broadcast over its
  inputs and decoded with the codes. An output scale (int8's, nvfp4's tensor scale) multiplies
  the fp32 sum of the splits' partials [S, M, N], which XLA adds after the kernel.

- int4_g128_sym's nibbles become bf16 (q - 8) by inline PTX, two a 32-bit register (`PTX_MINUS`,
  `ptx_nibbles`): a byte permute puts two bytes 16 bits apart, one lop3 ORs their nibbles into
  bf16 128.0's mantissa, one bf16x2 fma subtracts 136; exact, about 1.5 instructions a weight
  against about 5 for `W4Decode.value`'s fp32 arithmetic. 13-17% faster on the H200's 8B shapes
  at m = 1 and 16 (int4 m = 1, 14336 x 4096: 23.1 us against 26.8; bf16 34.8:
  experiments/results/h200/w4_triton_variants.json). Inline PTX has no interpreter: under it the
  kernel decodes with `value`.
- nvfp4's and mxfp4's E2M1 codes by inline PTX too (`PTX_E2M1`, `ptx_e2m1`): a code's sign and
  3 magnitude bits placed in a bf16 (sign at 15, magnitude at 6-8) are 2^-126 times its value;
  two bf16x2 fma multiply by 2^126 and by the group scale (bf16, exact). They take int4's time
  (H100, m = 1: 25.5-26.7 us against 40-42 with `value`:
  experiments/results/h100/quant_matmul_e2m1.json).
- q4_1's nibbles into fp16 the same way, then one f16x2 fma d * q + m with its fp16 d and m
  (`PTX_AFFINE`, `ptx_affine`), converted to bf16 through fp32. With d and m rounded to bf16
  and a bf16x2 fma the engine-level error against the reference was 1.4e-2 (d's rounding is a
  per-group scale error, coherent over the group's 32 products; h100/gpu_tests_quant_q4_1_bf16.json).
- Split-K's fp32 partials grow with M: `max_splits_for` keeps them within a quarter of the
  weight's bytes (unless an SM would go without a program). A weight too small for a
  power-of-two split of 2 steps or more to give every SM a program (SmolLM2's: 9-36 programs)
  splits into any divisor of its steps, down to one step a program.

What limits it (w4_triton_probe.json, w4_triton_variants.json): int4 and int8 take about the
same time, ~2.2e12 weights a second (2.5e12 with the PTX decode), bound by weights, not bytes.
Taking the weight as the dot's first operand (y^T = W^T x^T) was 15-25% slower; at m = 1,
fp32 products accumulated on the CUDA cores (no MMA) were slower for int4 and int8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _compat
from pallas_kernels.matmul.reference import FORMATS, PARTS
from pallas_kernels.matmul.w4_decode import DECODERS, W4Decode

TILE_K = 128  # inputs a K step where K allows; every format's group size divides it
SIZE_MULTIPLE = 64  # K and N: multiples of this (of TILE_K for a group of 128), K >= TILE_K
MAX_M = 128  # tokens

NUM_STAGES = 3
# split-K aims at about this many programs a streaming multiprocessor, in a power-of-two split
# (H200 probe, int4 at m = 1: 14336 x 4096 best at 8 splits of 112 blocks, 4096 x 14336 at 8-16
# of 32; 7 or 14 splits 8-11% slower than 8 or 16: w4_triton_probe.json)
PROGRAMS_PER_SM = 6


# formats whose value is (code - c), no grouped row, decoded by `ptx_nibbles`: {format: c}
PTX_MINUS = {"int4_g128_sym": 8}


def _ptx_nibbles(shift: int, minus: int) -> str:
    """PTX: the 4 bytes of $2 -> their nibbles at bit `shift` (0: low, 4: high) minus `minus`,
    as 4 bf16 in $0 (bytes 0, 1) and $1 (bytes 2, 3). prmt puts two bytes 16 bits apart; lop3
    (lut 0xEA: a & b | c) makes (t & 0x000F000F) | 0x43004300, bf16 128 + q twice; the fma
    adds -(128 + minus) to each half, exactly (both small integers)."""
    neg = int(np.array(-(128 + minus), np.float32).view(np.uint32)) >> 16
    shr = f"shr.b32 t0, t0, {shift};\nshr.b32 t1, t1, {shift};\n" if shift else ""
    return ("{\n.reg .b32 z, t0, t1, one, neg;\nmov.b32 z, 0;\nmov.b32 one, 0x3F803F80;\n"
            f"mov.b32 neg, {neg << 16 | neg:#010x};\nprmt.b32 t0, $2, z, 0x4140;\n"
            "prmt.b32 t1, $2, z, 0x4342;\n" + shr
            + "lop3.b32 t0, t0, 0x000F000F, 0x43004300, 0xEA;\n"
            "lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;\n"
            "fma.rn.bf16x2 $0, t0, one, neg;\nfma.rn.bf16x2 $1, t1, one, neg;\n}")  # fmt: skip


def ptx_nibbles(raw: jax.Array, minus: int) -> tuple[jax.Array, jax.Array]:
    """uint8 bytes -> (low nibble - minus, high nibble - minus) as bf16, 4 bytes an inline-asm
    instance; one op per half, since Pallas's lowering of the primitive takes one result."""
    sd = jax.ShapeDtypeStruct(raw.shape, jnp.bfloat16)
    return tuple(plt.elementwise_inline_asm(_ptx_nibbles(s, minus), args=[raw], pack=4,
                                            constraints="=r,=r,r", result_shape_dtypes=[sd])[0]
                 for s in (0, 4))  # fmt: skip


# E2M1 formats decoded by `ptx_e2m1`: {format: its group-scale part}
PTX_E2M1 = {"nvfp4": "block_scales", "mxfp4": "scales"}


def _ptx_e2m1(low: bool) -> str:
    """PTX: the 4 bytes of $2 -> the E2M1 values of their low (or high) nibbles times the bf16
    scales $3 (bytes 0, 1) and $4 (bytes 2, 3), as 4 bf16 in $0 and $1. prmt puts two bytes at
    bits 8 and 24 (the low nibbles shifted up 4 more), so each code's sign bit is a bf16 sign bit;
    its 3 magnitude bits shifted down 6 are a bf16's exponent's low 2 bits and its mantissa's top
    bit: 2^-126 times the E2M1 value (e = 0, 0.5, is a bf16 subnormal), exact. Two bf16x2 fma
    multiply by 2^126 and by the scale, each exact where the weight is a bf16 (E2M1's 2
    significant bits times an e4m3 or a power of two)."""
    shl = "shl.b32 q0, q0, 4;\nshl.b32 q1, q1, 4;\n" if low else ""
    ops = "".join(f"shr.b32 t{i}, q{i}, 6;\nand.b32 t{i}, t{i}, 0x01C001C0;\n"
                  f"lop3.b32 t{i}, q{i}, 0x80008000, t{i}, 0xEA;\n"  # a & b | c
                  f"fma.rn.bf16x2 t{i}, t{i}, k, z;\nfma.rn.bf16x2 ${i}, t{i}, ${3 + i}, z;\n"
                  for i in (0, 1))  # fmt: skip
    return ("{\n.reg .b32 z, k, q0, q1, t0, t1;\nmov.b32 z, 0;\nmov.b32 k, 0x7E807E80;\n"
            "prmt.b32 q0, $2, z, 0x1404;\nprmt.b32 q1, $2, z, 0x3424;\n" + shl + ops + "}")  # fmt: skip


def ptx_e2m1(raw: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 bytes and their bf16 group scales -> (low nibble's weight, high nibble's) as bf16."""
    sd = jax.ShapeDtypeStruct(raw.shape, jnp.bfloat16)
    return tuple(plt.elementwise_inline_asm(_ptx_e2m1(low), args=[raw, scale], pack=4,
                                            constraints="=r,=r,r,r,r", result_shape_dtypes=[sd])[0]
                 for low in (True, False))  # fmt: skip


# formats w = d * q + m with nibble codes q, decoded by `ptx_affine`: {format: (d's part, m's)}
PTX_AFFINE = {"q4_1": ("d", "m")}


def _ptx_affine(shift: int) -> str:
    """PTX: the 4 bytes of $2 -> their nibbles q at bit `shift`, d * q + m with d in $3 (bytes 0,
    1) and $4 (bytes 2, 3), m in $5 and $6 (fp16), as 4 bf16 in $0 and $1. q becomes fp16 1024 +
    q (lop3 into 1024.0's mantissa), one f16x2 sub makes it q; one f16x2 fma d * q + m, rounded
    once to fp16 (the format's own arithmetic), then to bf16 through fp32 (exact, then rounded)."""
    shr = f"shr.b32 t0, t0, {shift};\nshr.b32 t1, t1, {shift};\n" if shift else ""
    return ("{\n.reg .b32 z, t0, t1, k;\n.reg .b16 h0, h1, h2, h3;\n.reg .f32 f0, f1, f2, f3;\n"
            "mov.b32 z, 0;\nmov.b32 k, 0x64006400;\nprmt.b32 t0, $2, z, 0x4140;\n"
            "prmt.b32 t1, $2, z, 0x4342;\n" + shr
            + "lop3.b32 t0, t0, 0x000F000F, 0x64006400, 0xEA;\n"
            "lop3.b32 t1, t1, 0x000F000F, 0x64006400, 0xEA;\n"
            "sub.f16x2 t0, t0, k;\nsub.f16x2 t1, t1, k;\n"
            "fma.rn.f16x2 t0, t0, $3, $5;\nfma.rn.f16x2 t1, t1, $4, $6;\n"
            "mov.b32 {h0, h1}, t0;\nmov.b32 {h2, h3}, t1;\n"
            "cvt.f32.f16 f0, h0;\ncvt.f32.f16 f1, h1;\ncvt.f32.f16 f2, h2;\ncvt.f32.f16 f3, h3;\n"
            "cvt.rn.bf16x2.f32 $0, f1, f0;\ncvt.rn.bf16x2.f32 $1, f3, f2;\n}")  # fmt: skip


def ptx_affine(raw: jax.Array, d: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 bytes and their fp16 group rows d, m -> (d * low nibble + m, d * high nibble + m)
    as bf16."""
    sd = jax.ShapeDtypeStruct(raw.shape, jnp.bfloat16)
    return tuple(plt.elementwise_inline_asm(_ptx_affine(s), args=[raw, d, m], pack=4,
                                            constraints="=r,=r,r,r,r,r,r",
                                            result_shape_dtypes=[sd])[0]
                 for s in (0, 4))  # fmt: skip


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


def step_inputs(dec: W4Decode, k: int) -> int:
    """Inputs a K step: 128 (`TILE_K`) for 4 bits where K allows, else 64."""
    return TILE_K if dec.bits == 4 and k % TILE_K == 0 else SIZE_MULTIPLE


def block_n(n: int) -> int:
    return 128 if n % 128 == 0 else 64


def default_num_splits(k_steps: int, n_blocks: int, sms: int, max_splits: int | None = None) -> int:
    """The power-of-two divisor S of the K steps (at least 2 steps a split) whose grid,
    n_blocks x S, comes nearest PROGRAMS_PER_SM programs an SM (ties to fewer splits), among
    those of at most `max_splits` (None: no cap) -- unless that leaves fewer programs than SMs:
    then the fewest such splits that give every SM one, and where none does (a small weight,
    SmolLM2's), the fewest of any divisor of the steps that do, else one step a split."""
    target = PROGRAMS_PER_SM * sms
    options = [1 << i for i in range(k_steps.bit_length())
               if k_steps % (1 << i) == 0 and k_steps >> i >= 2] or [1]  # fmt: skip
    near = lambda s: (abs(n_blocks * s - target), s)  # noqa: E731
    best = min(options, key=near)
    if max_splits is not None and best > max_splits:
        capped = min((s for s in options if s <= max_splits), key=near, default=options[0])
        if n_blocks * capped >= sms:
            return capped
        best = min((s for s in options if n_blocks * s >= sms), default=best)
    if n_blocks * best >= sms:
        return best
    divisors = [s for s in range(1, k_steps + 1) if k_steps % s == 0]
    return min((s for s in divisors if n_blocks * s >= sms), default=k_steps)


def max_splits_for(m: int, k: int, bits: int) -> int:
    """Splits whose fp32 partials (S x M x N, written by the kernel, read by XLA's sum) stay within
    a quarter of the weight's bytes (K x bits / 8 a column): at m = 64 on the 8B shapes the
    partials of 8 splits were as large as the weight, and 2 splits were 21% faster (H100,
    experiments/results/h100/quant_matmul_splits.json)."""
    return max(1, k * bits // 8 // (16 * m))


def _kernel(x_ref, v_ref, *refs, dec: W4Decode, names, steps, step_k, bn, m, mp, ptx):
    *p_refs, o_ref = refs
    parts = dict(zip(names, p_refs, strict=True))
    j, split = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bn, bn)
    rows = step_k // 2 if dec.bits == 4 else step_k  # weight rows a step
    x_mask = lax.broadcasted_iota(jnp.int32, (mp, step_k), 0) < m

    def x_tile(k0):  # [mp, step_k], rows past M read as zeros
        return plt.load(x_ref.at[pl.ds(0, mp), pl.ds(k0, step_k)], mask=x_mask, other=0)

    def group_rows(step):
        """Each small-group part's rows broadcast over this step's weight rows: fp32, or as a
        PTX decode takes them (E2M1 scales in bf16, q4_1's d and m in fp16 as stored)."""
        out = {}
        for name, _ in dec.grouped:
            if name == dec.step_scale:
                continue
            per_row = dec.group // (2 if dec.bits == 4 else 1)  # weight rows a group
            g = rows // per_row
            raw = parts[name][pl.ds(step * g, g), cols]
            row = dec.to_f32(name, raw)
            if ptx == "e2m1":  # the scale itself in bf16 (to_f32 halves it for `value`'s 2x)
                row = (2 * row).astype(jnp.bfloat16)
            elif ptx == "affine":  # the fp16 parts as stored
                row = raw
            out[name] = jnp.broadcast_to(row[:, None, :], (g, per_row, bn)).reshape(rows, bn)
        return out

    def body(i, acc):
        step = split * steps + i
        k0 = step * step_k
        raw = v_ref[pl.ds(step * rows, rows), cols]
        codes = raw.astype(jnp.int32)
        grouped = group_rows(step)
        if dec.bits == 4:
            if ptx == "minus":
                lo, hi = ptx_nibbles(raw, PTX_MINUS[dec.name])
            elif ptx == "e2m1":
                lo, hi = ptx_e2m1(raw, grouped[PTX_E2M1[dec.name]])
            elif ptx == "affine":
                lo, hi = ptx_affine(raw, *(grouped[name] for name in PTX_AFFINE[dec.name]))
            else:
                lo = dec.value(codes & 15, grouped).astype(x_ref.dtype)
                hi = dec.value(codes >> 4, grouped).astype(x_ref.dtype)
            # x's even and odd inputs (tt.split of the pairs: a strided load does not interpret)
            even, odd = lax.split(x_tile(k0).reshape(mp, rows, 2), (1, 1), axis=2)
            part = jnp.dot(even.reshape(mp, rows), lo, preferred_element_type=jnp.float32)
            part += jnp.dot(odd.reshape(mp, rows), hi, preferred_element_type=jnp.float32)
        else:
            w = dec.value(codes, grouped).astype(x_ref.dtype)
            part = jnp.dot(x_tile(k0), w, preferred_element_type=jnp.float32)
        if dec.step_scale is not None:  # the group spans the step: scale the product
            name = dec.step_scale
            part *= dec.to_f32(name, parts[name][pl.ds(k0 // dec.group, 1), cols])
        return acc + part

    acc = lax.fori_loop(0, steps, body, jnp.zeros((mp, bn), jnp.float32))
    out_mask = lax.broadcasted_iota(jnp.int32, (mp, bn), 0) < m
    plt.store(o_ref.at[split, pl.ds(0, mp), cols], acc, mask=out_mask)


def _ptx_kind(fmt: str) -> str | None:
    """Which inline-PTX decode `fmt` takes on a GPU ("minus", "e2m1", "affine"), None:
    `W4Decode.value`."""
    kinds = {**dict.fromkeys(PTX_MINUS, "minus"), **dict.fromkeys(PTX_E2M1, "e2m1"),
             **dict.fromkeys(PTX_AFFINE, "affine")}  # fmt: skip
    return kinds.get(fmt)


@functools.partial(jax.jit, static_argnames=("fmt", "num_splits", "num_stages", "interpret",
                                             "device"))  # fmt: skip
def w4_matmul_triton(x: jax.Array, values: jax.Array, *, fmt: str, num_splits: int | None = None,
                     num_stages: int = NUM_STAGES, interpret: bool | None = None,
                     device: jax.Device | None = None, **parts: jax.Array) -> jax.Array:  # fmt: skip
    """x [M, K] bf16 @ the `fmt` weight (`values` and its parts, `reference.py`'s layouts) ->
    [M, N] bf16 (arguments checked by `check_inputs`: errors name the argument).
    `num_splits` (None: `default_num_splits`) must divide K's steps; `interpret` (None: off a
    GPU) runs Pallas's interpreter."""
    check_inputs(x, values, fmt, parts)
    dec = DECODERS[fmt]
    m, k = x.shape
    n = values.shape[1]
    step_k, bn = step_inputs(dec, k), block_n(n)
    k_steps = k // step_k
    if num_splits is None:
        num_splits = default_num_splits(k_steps, n // bn, _compat.num_sms(device),
                                        max_splits_for(m, k, dec.bits))  # fmt: skip
    if num_splits < 1 or k_steps % num_splits:
        raise ValueError(f"num_splits must divide K's {k_steps} steps of {step_k}, got "
                         f"{num_splits}")  # fmt: skip
    if interpret is None:
        interpret = _compat.default_interpret(device)
    names = tuple(name for name, _ in dec.grouped)
    kernel = functools.partial(_kernel, dec=dec, names=names, steps=k_steps // num_splits,
                               step_k=step_k, bn=bn, m=m, mp=max(16, -(-m // 16) * 16),
                               ptx=None if interpret else _ptx_kind(fmt))  # fmt: skip
    partials = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_splits, m, n), jnp.float32),
        grid=(n // bn, num_splits),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * (2 + len(names)),
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=num_stages),
        interpret=interpret,
    )(x, values, *(parts[name] for name in names))
    y = partials[0] if num_splits == 1 else partials.sum(0)
    if dec.output_scale is not None:
        y = y * jnp.asarray(parts[dec.output_scale], jnp.float32)
    return y.astype(x.dtype)
