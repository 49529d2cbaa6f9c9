"""Weight-only (4-bit and 8-bit) matmul on the GPU: our Triton kernel against XLA's bf16 dot
and XLA's in-graph dequantization (the format's own XLA `matmul` from jaxinfer.quant), at decode
batch sizes.

Rows per (format, m, n, k): `w4_triton` (pallas_kernels.matmul.w4_matmul's Pallas Triton
kernel, every format), `xla_dequant` (jaxinfer's format `matmul` with its XLA backend:
dequantize in the graph, then a bf16 dot; int8: a dot of its values, scaled after), and once per shape `xla_bf16` (a plain bf16
dot of the dequantized weight). XLA does not convert an int4 weight inside its GEMM (it writes
the bf16 weight first; experiments/results/h100/quant_matmul_native.json, whose products were
deleted).
Bandwidth is `weight_TBps`: the bytes of the weight as each impl reads it (values plus
per-group parts for the quantized rows, the bf16 matrix for `xla_bf16`) over the time. Every
row carries `rel_err` against the fp32 reference on the same inputs. Results are written after
every row.

    PYTHONPATH=. python3 experiments/bench_quant_matmul.py --out $OUT/quant_matmul.json
    python experiments/bench_quant_matmul.py --smoke --out /tmp/qm.json   # CPU, interpreter

`--configs` times the kernel under each set of its options (`default`, or e.g.
`num_splits=4,num_stages=3`; a kernel row per config, its `config` field naming it);
`--impls` picks which impls run; `--shapes 14336:4096` picks (n, k).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.provenance import provenance, require_gpu
from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight
from pallas_kernels.matmul import FORMATS, w4_matmul, w4_matmul_ref

SHAPES = ((14336, 4096), (4096, 14336))  # (n, k): Llama-3-8B's up/gate and down projections
MS = (1, 16, 64)
IMPLS = ("w4_triton", "xla_dequant", "xla_bf16")
SMOKE = dict(shapes=((128, 256),), ms=(1,))
TIMING_METHOD = (
    "one jitted lax.fori_loop of N iterations (N traced, so one compile) around the op; each "
    "iteration calls the op once on each of `sets` distinct copies of the weight arrays in turn "
    "(sets = clip(ceil(2 x L2 / weight bytes), 4, 16), L2 = 50 MB: a weight is never re-read "
    "from L2, and the loop's per-iteration cost, ~20 us on the H200, is shared by >= 4 calls), "
    "passing x and that copy through lax.optimization_barrier (so XLA cannot hoist the in-graph "
    "dequantization out of the loop) and feeding 1e-3 * y[:, :1] back into x. After a warm-up "
    "call, N doubles until one loop call takes >= min_loop_ms; time_us = median of `repeats` "
    "loop calls / (N * sets). On a CPU (smoke runs) sets = 1."
)
L2_BYTES = 50 * 2**20


def weight_sets(w) -> int:
    """How many distinct copies of the weight arrays `w` the timing loop rotates through (one
    off a GPU: the CPU smoke runs time the interpreter, not memory)."""
    if jax.devices()[0].platform != "gpu":
        return 1
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w))
    return int(min(16, max(4, -(-2 * L2_BYTES // max(nbytes, 1)))))


def loop_timer(op, min_loop_ms: float, repeats: int):
    """Median time (s) of one `op(x, w)` call inside a jitted loop (see TIMING_METHOD)."""

    @jax.jit
    def run(x, ws, n):
        def body(_, x):
            for w in ws:
                x, w = lax.optimization_barrier((x, w))
                y = op(x, w)
                x = x + (1e-3 * y[:, :1]).astype(x.dtype)
            return x

        return lax.fori_loop(0, n, body, x)

    def time_it(x, w) -> float:
        ws = [w] + [jax.tree.map(jnp.copy, w) for _ in range(weight_sets(w) - 1)]
        run(x, ws, 1).block_until_ready()  # compile + warm-up
        n = 1
        while True:
            t0 = time.perf_counter()
            run(x, ws, n).block_until_ready()
            dt = time.perf_counter() - t0
            if dt * 1e3 >= min_loop_ms or n >= 1 << 16:
                break
            n *= 2
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(x, ws, n).block_until_ready()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / (n * len(ws))

    return time_it


def quantized_weight(fmt: str, k: int, n: int, key) -> dict:
    """A random bf16-scaled weight [k, n] quantized by jaxinfer's format: its arrays."""
    w = jax.random.normal(key, (k, n), jnp.float32) * (k**-0.5)
    return jax.jit(lambda w: WEIGHT_FORMATS[fmt].quantize(w, 1))(w)


def nbytes(arrays: dict) -> int:
    """Bytes as the device stores them (int4: two values a byte)."""
    return int(sum(a.size * jax.dtypes.itemsize_bits(a.dtype) // 8 for a in arrays.values()))


def parse_config(text: str) -> dict:
    """`default` -> {}; `num_splits=4,num_stages=3` -> {"num_splits": 4, "num_stages": 3}."""
    if text == "default":
        return {}
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key not in ("num_splits", "num_stages") or not value.isdigit():
            raise ValueError(f"--configs: {item!r} is not num_splits=N or num_stages=N")
        out[key] = int(value)
    return out


def bench_case(fmt, m, n, k, args, *, with_bf16: bool, interpret: bool) -> list[dict]:
    key = jax.random.key(zlib.crc32(f"{fmt} {m} {n} {k}".encode()))
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    arrays = quantized_weight(fmt, k, n, kw)
    ref = np.asarray(w4_matmul_ref(x, **arrays, fmt=fmt))
    wf = dataclasses.replace(WEIGHT_FORMATS[fmt], backend="xla")  # "auto" picks the kernel
    kernel_opts = {"interpret": True} if interpret else {}
    impls = []  # (impl, config, op, weight arrays)
    for config in args.configs if "w4_triton" in args.impls else ():
        opts = {**kernel_opts, **parse_config(config)}
        impls.append(("w4_triton", config, lambda x, w, o=opts: w4_matmul(
            x, **w, fmt=fmt, backend="triton", **o), arrays))  # fmt: skip
    if "xla_dequant" in args.impls:
        impls.append(("xla_dequant", None,
                      lambda x, w: wf.matmul(x, QuantizedWeight(w, wf, 1)), arrays))  # fmt: skip
    if with_bf16 and "xla_bf16" in args.impls:
        w_bf16 = {"w": wf.dequantize(QuantizedWeight(arrays, wf, 1)).astype(jnp.bfloat16)}
        impls.append(("xla_bf16", None, lambda x, w: jnp.dot(x, w["w"]), w_bf16))
    rows = []
    for impl, config, op, w in impls:
        row = dict(impl=impl, fmt=fmt if impl != "xla_bf16" else "bf16", m=m, n=n, k=k,
                   weight_bytes=nbytes(w))  # fmt: skip
        if config is not None:
            row["config"] = config
        try:
            err = np.asarray(jax.jit(op)(x, w), np.float32) - ref
            row["rel_err"] = float(np.linalg.norm(err) / np.linalg.norm(ref))
            t = loop_timer(op, args.min_loop_ms, args.repeats)(x, w)
            row.update(time_us=t * 1e6, weight_TBps=row["weight_bytes"] / t / 1e12)
        except Exception as e:  # one failing impl is an error row, not a crashed run
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--m", type=int, nargs="+", default=None, help=f"tokens (default {MS})")
    p.add_argument(
        "--configs",
        nargs="+",
        default=["default"],
        help="kernel options per kernel row: default, or num_splits=N,num_stages=N",
    )
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        metavar="N:K",
        help=f"(n, k) weight shapes (default {' '.join(f'{n}:{k}' for n, k in SHAPES)})",
    )
    p.add_argument("--min-loop-ms", type=float, default=50.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU, the kernel under the GPU interpreter")  # fmt: skip
    args = p.parse_args(argv)
    if any(not 1 <= m <= 256 for m in args.m or ()):
        p.error(f"--m: tokens must be in 1..256, got {args.m}")
    for config in args.configs:
        try:
            parse_config(config)
        except ValueError as e:
            p.error(str(e))
    if args.shapes is not None:
        try:
            args.shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes]
        except ValueError:
            p.error(f"--shapes: each must be N:K (integers), got {args.shapes}")
        if any(len(s) != 2 for s in args.shapes):
            p.error(f"--shapes: each must be N:K, got {args.shapes}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.smoke:
        require_gpu("bench_quant_matmul.py", "--smoke")
    shapes = args.shapes or (SMOKE["shapes"] if args.smoke else SHAPES)
    ms = args.m or (SMOKE["ms"] if args.smoke else MS)
    if args.smoke:
        args.min_loop_ms, args.repeats = 0.0, 1
    result = {**provenance([sys.executable, *(sys.argv if argv is None else [__file__, *argv])]),
              "timing_method": TIMING_METHOD, "rows": []}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for n, k in shapes:
        for m in ms:
            for i, fmt in enumerate(args.formats):
                result["rows"] += bench_case(fmt, m, n, k, args, with_bf16=i == 0,
                                             interpret=args.smoke)  # fmt: skip
                args.out.write_text(json.dumps(result, indent=1))
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
