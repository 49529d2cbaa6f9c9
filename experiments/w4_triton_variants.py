"""Probe of the Triton weight-only kernel's limit: three changes to `w4_triton.py`'s kernel, each
a hypothesis for why it decodes ~2.2e12 weights a second whatever the bits
(experiments/results/h200/w4_triton_probe.json), timed beside the committed kernel and bf16.

- `asm`: the decode's instructions per weight. int4_g128_sym's codes become bf16 (q - 8) with
  bit tricks on two values a 32-bit register (inline PTX: a byte permute puts two nibbles 16
  bits apart, one lop3 ORs them into bf16 128.0's mantissa, one bf16x2 fma subtracts 136: exact,
  ~1.5 instructions a weight against ~5 for the int32/fp32 decode).
- `trans`: the decoded tile's path to the tensor cores. The product is taken as
  y^T [bn, M] = W^T [bn, K] x^T [K, M], the weight the dot's first operand (which Hopper's MMA
  may read from registers) instead of its second.
- `fma` (M = 1 only): no tensor cores. Each program accumulates x_k * w_kn elementwise in fp32
  over its K range and reduces over K once at the end.

Rows per (shape, m): `xla_bf16`, `triton` (the committed kernel, `w4_matmul(backend="triton")`)
and `variant` rows, each with its options; every row carries `rel_err` against the fp32
reference, and the file carries this script's source (`source`), since the variants are not
kept in the package unless they win. Timing as `bench_quant_matmul.py`'s (`timing_method`).

    PYTHONPATH=. python3 experiments/w4_triton_variants.py --out $OUT/w4_triton_variants.json
    python experiments/w4_triton_variants.py --smoke --out /tmp/v.json   # CPU, interpreter

`kernel_times.py --op w4_variant:FMT:M:N:K:trans=1,asm=1` profiles a variant under ncu. The
`asm` decode has no interpreter: `--smoke` leaves its rows out (the tests lower it for CUDA).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pallas_kernels import _compat
from pallas_kernels.matmul import w4_matmul, w4_matmul_ref
from pallas_kernels.matmul.w4_decode import DECODERS
from pallas_kernels.matmul.w4_triton import default_num_splits

SHAPES = ((14336, 4096), (4096, 14336))
MS = (1, 16)
SMOKE = dict(shapes=((256, 512),), ms=(1, 5))
# each (format, options) timed per (shape, m); `fma` rows only at m = 1, `asm` ones only on a GPU
VARIANTS = (
    ("int4_g128_sym", dict(trans=True, asm=True)),
    ("int4_g128_sym", dict(asm=True)),
    ("int4_g128_sym", dict(trans=True)),
    ("int4_g128_sym", dict(fma=True)),
    ("int4_g128_sym", dict(trans=True, asm=True, num_warps=8)),
    ("int8", dict(trans=True)),
    ("int8", dict(fma=True)),
    ("q4_1", dict(trans=True)),
)
FORMATS = ("int4_g128_sym", "int8", "q4_1")


def _asm_nibbles(shift: int) -> str:
    """PTX: the 4 bytes in $2 -> their nibbles at bit `shift` (0: low, 4: high) minus 8, as 4
    bf16 in $0 (bytes 0, 1) and $1 (bytes 2, 3). prmt spreads two bytes 16 bits apart, lop3
    computes (t & 0x000F000F) | 0x43004300 (bf16 128 + q twice), fma subtracts 136."""
    shr = f"shr.b32 t0, t0, {shift};\nshr.b32 t1, t1, {shift};\n" if shift else ""
    return ("{\n.reg .b32 z, t0, t1, one, neg;\nmov.b32 z, 0;\nmov.b32 one, 0x3F803F80;\n"
            "mov.b32 neg, 0xC308C308;\nprmt.b32 t0, $2, z, 0x4140;\nprmt.b32 t1, $2, z, 0x4342;\n"
            + shr + "lop3.b32 t0, t0, 0x000F000F, 0x43004300, 0xEA;\n"
            "lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;\n"
            "fma.rn.bf16x2 $0, t0, one, neg;\nfma.rn.bf16x2 $1, t1, one, neg;\n}")  # fmt: skip


def asm_int4_sym(codes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 codes -> (low nibble - 8, high nibble - 8) as bf16, 4 codes an asm instance (one
    output each: Pallas's lowering of the primitive takes one result)."""
    sd = jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)
    return tuple(plt.elementwise_inline_asm(_asm_nibbles(s), args=[codes], constraints="=r,=r,r",
                                            pack=4, result_shape_dtypes=[sd])[0]
                 for s in (0, 4))  # fmt: skip


def _kernel(x_ref, v_ref, *refs, dec, names, steps, step_k, bn, m, mp, trans, fma, asm):
    *p_refs, o_ref = refs
    parts = dict(zip(names, p_refs, strict=True))
    j, split = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bn, bn)
    rows = step_k // 2 if dec.bits == 4 else step_k
    x_mask = lax.broadcasted_iota(jnp.int32, (mp, step_k), 0) < m

    def x_tile(k0):
        return plt.load(x_ref.at[pl.ds(0, mp), pl.ds(k0, step_k)], mask=x_mask, other=0)

    def group_rows(step):
        out = {}
        for name, _ in dec.grouped:
            if name == dec.step_scale:
                continue
            per_row = dec.group // (2 if dec.bits == 4 else 1)
            g = rows // per_row
            row = dec.to_f32(name, parts[name][pl.ds(step * g, g), cols])
            out[name] = jnp.broadcast_to(row[:, None, :], (g, per_row, bn)).reshape(rows, bn)
        return out

    def step_scale(k0):  # [1, bn]
        return dec.to_f32(dec.step_scale, parts[dec.step_scale][pl.ds(k0 // dec.group, 1), cols])

    def mm(xt, w):  # xt [mp, r], w [r, bn]
        if trans:
            return jnp.dot(w.T, xt.T, preferred_element_type=jnp.float32)  # [bn, mp]
        return jnp.dot(xt, w, preferred_element_type=jnp.float32)

    def body(i, acc):
        step = split * steps + i
        k0 = step * step_k
        raw = v_ref[pl.ds(step * rows, rows), cols]
        codes = raw.astype(jnp.int32)
        grouped = group_rows(step)
        if fma:  # m == 1: elementwise products, reduced over K after the loop
            xt = x_ref[pl.ds(0, 1), pl.ds(k0, step_k)].astype(jnp.float32).reshape(step_k)
            if dec.bits == 4:
                ev, od = lax.split(xt.reshape(rows, 2), (1, 1), axis=1)
                p = ev * dec.value(codes & 15, grouped) + od * dec.value(codes >> 4, grouped)
            else:
                p = xt.reshape(rows, 1) * dec.value(codes, grouped)
            return acc + (p * step_scale(k0) if dec.step_scale is not None else p)
        if dec.bits == 4:
            if asm:
                lo, hi = asm_int4_sym(raw)
            else:
                lo = dec.value(codes & 15, grouped).astype(x_ref.dtype)
                hi = dec.value(codes >> 4, grouped).astype(x_ref.dtype)
            even, odd = lax.split(x_tile(k0).reshape(mp, rows, 2), (1, 1), axis=2)
            part = mm(even.reshape(mp, rows), lo) + mm(odd.reshape(mp, rows), hi)
        else:
            part = mm(x_tile(k0), dec.value(codes, grouped).astype(x_ref.dtype))
        if dec.step_scale is not None:
            s = step_scale(k0)
            part *= s.T if trans else s
        return acc + part

    if fma:
        acc = lax.fori_loop(0, steps, body, jnp.zeros((rows, bn), jnp.float32))
        plt.store(o_ref.at[split, pl.ds(0, 1), cols], acc.sum(0, keepdims=True))
        return
    shape = (bn, mp) if trans else (mp, bn)
    acc = lax.fori_loop(0, steps, body, jnp.zeros(shape, jnp.float32))
    mask = lax.broadcasted_iota(jnp.int32, shape, 1 if trans else 0) < m
    out = o_ref.at[split, cols, pl.ds(0, mp)] if trans else o_ref.at[split, pl.ds(0, mp), cols]
    plt.store(out, acc, mask=mask)


@functools.partial(jax.jit, static_argnames=("fmt", "num_splits", "num_stages", "num_warps",
                                             "trans", "fma", "asm", "bn", "interpret"))  # fmt: skip
def variant_matmul(x, values, *, fmt, num_splits=None, num_stages=3, num_warps=4, trans=False,
                   fma=False, asm=False, bn=128, interpret=None, **parts):  # fmt: skip
    """`w4_triton.w4_matmul_triton`'s product under a variant's options (see the docstring)."""
    dec = DECODERS[fmt]
    m, k = x.shape
    n = values.shape[1]
    if (asm and fmt != "int4_g128_sym") or (fma and m != 1) or n % bn:
        raise ValueError(f"variant asm={asm} fma={fma} bn={bn}: asm takes int4_g128_sym, fma "
                         f"one row, bn must divide N; got {fmt}, m={m}, n={n}")  # fmt: skip
    step_k = 128 if dec.bits == 4 else 64
    if k % step_k:
        raise ValueError(f"variant: K must be a multiple of {step_k} for {fmt}, got {k}")
    k_steps = k // step_k
    if num_splits is None:
        num_splits = default_num_splits(k_steps, n // bn, _compat.num_sms(None))
    if interpret is None:
        interpret = _compat.default_interpret(None)
    trans = trans and not fma
    names = tuple(name for name, _ in dec.grouped)
    kernel = functools.partial(_kernel, dec=dec, names=names, steps=k_steps // num_splits,
                               step_k=step_k, bn=bn, m=m, mp=max(16, -(-m // 16) * 16),
                               trans=trans, fma=fma, asm=asm)  # fmt: skip
    out_shape = (num_splits, n, m) if trans else (num_splits, m, n)
    partials = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(n // bn, num_splits),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * (2 + len(names)),
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(x, values, *(parts[name] for name in names))
    y = partials.sum(0)
    y = y.T if trans else y
    if dec.output_scale is not None:
        y = y * jnp.asarray(parts[dec.output_scale], jnp.float32)
    return y.astype(x.dtype)


def parse_options(text: str) -> dict:
    """`trans=1,asm=1,num_warps=8` -> {"trans": True, "asm": True, "num_warps": 8}."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            raise ValueError(f"variant option {item!r} is not KEY=INT")
        out[key] = bool(int(value)) if key in ("trans", "fma", "asm") else int(value)
    return out


def triton_product(x, w, *, fmt):
    return w4_matmul(x, **w, fmt=fmt, backend="triton")


def variant_product(x, w, *, fmt, opts):
    return variant_matmul(x, **w, fmt=fmt, **opts)


def time_row(row: dict, op, x, w, ref, args) -> dict:
    """`row` with the weight's bytes, `op(x, w)`'s error against `ref` and its time (or an error
    message: one failing variant is an error row)."""
    from experiments.bench_quant_matmul import loop_timer

    leaves = jax.tree.leaves(w)
    row["weight_bytes"] = int(sum(a.size * jax.dtypes.itemsize_bits(a.dtype) // 8 for a in leaves))
    try:
        y = np.asarray(jax.jit(op)(x, w), np.float32)
        row["rel_err"] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
        t = loop_timer(op, args.min_loop_ms, args.repeats)(x, w)
        row.update(time_us=t * 1e6, weight_TBps=row["weight_bytes"] / t / 1e12)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return row


def main(argv=None) -> None:
    from experiments.bench_quant_matmul import TIMING_METHOD, quantized_weight
    from jaxinfer.provenance import provenance, require_gpu

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--m", type=int, nargs="+", default=None)
    p.add_argument("--min-loop-ms", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpreted")
    args = p.parse_args(argv)
    if not args.smoke:
        require_gpu("w4_triton_variants.py", "--smoke")
    shapes, ms = (SMOKE["shapes"], SMOKE["ms"]) if args.smoke else (SHAPES, MS)
    ms = args.m or ms
    if args.smoke:
        args.min_loop_ms, args.repeats = 0.0, 1
    rows = []
    argv_ = sys.argv if argv is None else [__file__, *argv]
    result = {**provenance([sys.executable, *argv_]), "timing_method": TIMING_METHOD,
              "source": Path(__file__).read_text(), "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for n, k in shapes:
        arrays = {f: quantized_weight(f, k, n, jax.random.key(i)) for i, f in enumerate(FORMATS)}
        w_bf16 = {"w": jax.random.normal(jax.random.key(9), (k, n), jnp.bfloat16)}
        for m in ms:
            x = jax.random.normal(jax.random.key(zlib.crc32(f"{m} {n} {k}".encode())), (m, k))
            x = x.astype(jnp.bfloat16)
            refs = {f: np.asarray(w4_matmul_ref(x, **a, fmt=f)) for f, a in arrays.items()}
            refs["bf16"] = np.asarray(
                jnp.dot(x.astype(jnp.float32), w_bf16["w"].astype(jnp.float32))
            )

            cases = [("xla_bf16", "bf16", lambda x, w: jnp.dot(x, w["w"]), w_bf16, {})]
            for f in ("int4_g128_sym", "int8"):
                op = functools.partial(triton_product, fmt=f)
                cases.append(("triton", f, op, arrays[f], {}))
            for f, opts in VARIANTS:
                if (opts.get("fma") and m != 1) or (opts.get("asm") and args.smoke):
                    continue
                op = functools.partial(variant_product, fmt=f, opts=opts)
                cases.append(("variant", f, op, arrays[f], opts))
            for impl, fmt, op, w, opts in cases:
                row = dict(impl=impl, fmt=fmt, m=m, n=n, k=k, **opts)
                rows.append(time_row(row, op, x, w, refs[fmt], args))
                print(json.dumps(rows[-1]), flush=True)
                args.out.write_text(json.dumps(result, indent=1))
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
