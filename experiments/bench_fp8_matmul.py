"""Block-scaled FP8 GEMM on the GPU: our Mosaic GPU kernel against XLA's products of the same
weight, at DeepSeek-V3's shapes and 8192^3 (issue 28's targets).

Rows per (m, n, k): `fp8_block_pallas` (the `fp8_block` format's product on its Pallas
backend: the activations' 1 x 128 quantization in XLA, then `fp8_block_matmul_mgpu`, all in the
time), `xla_fp8_block` (the same format on its XLA backend: per-block fp8 dots), `xla_fp8_tensor`
and `xla_fp8_channel` (those formats: one fp8 dot with per-token and per-output scales, what
cuBLASLt runs) and `xla_bf16` (a bf16 dot of the same weight). Every FP8 weight is stored as
the formats store it, K-major [N, K]. Each row has TFLOP/s (2mnk over the time) and `rel_err` against x @ w in fp32.
A kernel row also has `k_splits`, its split-K factor: the kernel's own choice
(`choose_k_splits`, for this device's SMs) or, one row per value, those `--k-splits` forces; and
`tile_layout`, "m" ([128, 128] tiles) or "n" ([64, 256]): its own choice or those
`--tile-layouts` forces.
Results are written after every row; a failing impl is an error row.

    PYTHONPATH=. python3 experiments/bench_fp8_matmul.py --out $OUT/fp8_matmul.json
    PYTHONPATH=. python3 experiments/bench_fp8_matmul.py --out $OUT/fp8_splitk.json \
        --shapes 64:4096:14336 --impls fp8_block_pallas xla_bf16 --k-splits auto 1 2 4 8 \
        --tile-layouts auto m
    python experiments/bench_fp8_matmul.py --smoke --out /tmp/fm.json   # CPU, interpreter
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_matmul import TIMING_METHOD, loop_timer

from jaxinfer.provenance import provenance, require_gpu
from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight
from jaxinfer.quant.fp8 import Fp8Block
from pallas_kernels import _compat
from pallas_kernels.matmul.fp8_block_mgpu import choose_k_splits, choose_tile_layout

# (m, n, k): 8192^3, DeepSeek-V3's m x (n, k) (DeepGEMM's published table), and Llama-3-8B's
# four linears (qkv, o, gate/up, down) at decode batch sizes
SHAPE_SETS = {
    "square": ((8192, 8192, 8192),),
    "deepseek": tuple((m, n, k) for m in (64, 128, 4096)
                      for n, k in ((7168, 2048), (2048, 7168), (4096, 7168))),
    "llama3-8b": tuple((m, n, k) for m in (1, 8, 64, 256)
                       for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))),
}  # fmt: skip
SHAPES = tuple(s for shapes in SHAPE_SETS.values() for s in shapes)
SMOKE_SHAPES = ((64, 128, 256),)
IMPLS = ("fp8_block_pallas", "xla_fp8_block", "xla_fp8_tensor", "xla_fp8_channel", "xla_bf16")


def impls(w: jax.Array, names, m: int, k_splits=("auto",), layouts=("auto",)) -> list:
    """(name, op(x, arrays), arrays, fields for its row) per impl, the weight quantized by each
    format; the kernel once per `k_splits` value and tile layout ("auto": its own choice,
    recorded)."""
    out = []
    k, n = w.shape
    formats = {"xla_fp8_block": Fp8Block("fp8_block", backend="xla"),
               "xla_fp8_tensor": WEIGHT_FORMATS["fp8_tensor"],
               "xla_fp8_channel": WEIGHT_FORMATS["fp8_channel"]}  # fmt: skip
    for name in names:
        if name == "xla_bf16":
            out.append((name, lambda x, a: jnp.dot(x, a["w"]), {"w": w.astype(jnp.bfloat16)}, {}))
            continue
        if name == "fp8_block_pallas":
            arrays = jax.jit(lambda w: Fp8Block("fp8_block").quantize(w, 1))(w)
            for lay in layouts:
                layout = choose_tile_layout(m, n) if lay == "auto" else lay
                for s in k_splits:
                    chosen = (choose_k_splits(m, n, k, num_sms=_compat.num_sms(), layout=layout)
                              if s == "auto" else s)  # fmt: skip
                    wf = Fp8Block("fp8_block", backend="pallas", k_splits=chosen,
                                  tile_layout=layout)  # fmt: skip
                    op = lambda x, a, wf=wf: wf.matmul(x, QuantizedWeight(a, wf, 1))  # noqa: E731
                    out.append((name, op, arrays, {"k_splits": chosen, "k_splits_auto": s == "auto",
                                                   "tile_layout": layout}))  # fmt: skip
            continue
        wf = formats[name]
        arrays = jax.jit(lambda w, wf=wf: wf.quantize(w, 1))(w)
        out.append((name, lambda x, a, wf=wf: wf.matmul(x, QuantizedWeight(a, wf, 1)), arrays, {}))
    return out


def bench_shape(m: int, n: int, k: int, args) -> list[dict]:
    key = jax.random.key(zlib.crc32(f"{m} {n} {k}".encode()))
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32) * (k**-0.5)
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), w, precision="highest"))
    rows = []
    for name, op, arrays, fields in impls(w, args.impls, m, args.k_splits, args.tile_layouts):
        row = dict(impl=name, m=m, n=n, k=k, **fields)
        try:
            got = np.asarray(jax.jit(op)(x, arrays), np.float32)
            row["rel_err"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            t = loop_timer(op, args.min_loop_ms, args.repeats)(x, arrays)
            row.update(time_us=t * 1e6, tflops=2 * m * n * k / t / 1e12)
        except Exception as e:  # one failing impl is an error row, not a crashed run
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--shapes", nargs="+", default=None, metavar="M:N:K|SET",
                   help=f"(m, n, k) shapes or named sets {sorted(SHAPE_SETS)} (default: all)")  # fmt: skip
    p.add_argument("--k-splits", nargs="+", default=["auto"], metavar="S|auto",
                   help="the kernel's split-K factors, one fp8_block_pallas row each (S must "
                        "divide K/128; auto: the kernel's choose_k_splits; default: auto)")  # fmt: skip
    p.add_argument("--tile-layouts", nargs="+", default=["auto"], choices=["auto", "m", "n"],
                   help="the kernel's tile layouts, one fp8_block_pallas row (per --k-splits "
                        "value) each (auto: the kernel's choose_tile_layout; default: auto)")  # fmt: skip
    p.add_argument("--min-loop-ms", type=float, default=50.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny shape on the CPU, the kernel under the GPU interpreter")  # fmt: skip
    args = p.parse_args(argv)
    try:
        args.k_splits = [s if s == "auto" else int(s) for s in args.k_splits]
    except ValueError:
        p.error(f"--k-splits: each must be a positive integer or auto, got {args.k_splits}")
    if any(s != "auto" and s < 1 for s in args.k_splits):
        p.error(f"--k-splits: each must be a positive integer or auto, got {args.k_splits}")
    if args.shapes is not None:
        try:
            args.shapes = [
                shape
                for s in args.shapes
                for shape in (
                    SHAPE_SETS[s] if s in SHAPE_SETS else [tuple(int(v) for v in s.split(":"))]
                )
            ]
        except ValueError:
            p.error(f"--shapes: each must be M:N:K (integers) or one of {sorted(SHAPE_SETS)}, "
                    f"got {args.shapes}")  # fmt: skip
        if any(len(s) != 3 for s in args.shapes):
            p.error(f"--shapes: each must be M:N:K, got {args.shapes}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.smoke:
        require_gpu("bench_fp8_matmul.py", "--smoke")
    shapes = args.shapes or (SMOKE_SHAPES if args.smoke else SHAPES)
    if args.smoke:
        args.min_loop_ms, args.repeats = 0.0, 1
    result = {**provenance([sys.executable, *(sys.argv if argv is None else [__file__, *argv])]),
              "timing_method": TIMING_METHOD, "rows": []}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for m, n, k in shapes:
        result["rows"] += bench_shape(m, n, k, args)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
