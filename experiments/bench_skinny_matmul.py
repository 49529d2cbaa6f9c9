"""Decode matmuls of the Llama-3-8B shape: our skinny Mosaic GPU kernel against XLA's dot.

For each weight shape (QKV, O, gate, up, down, LM head) and each batch M (rows of x), times
`x [M, K] @ w [K, N]` in bf16 and reports TB/s of weight read. Every row carries its relative
error against an fp32 dot. Kernel configurations are swept with `--configs` (block_n, block_k,
num_stages, k_splits; `auto` = the default splits). The JSON is rewritten after every row.

    PYTHONPATH=. python3 experiments/bench_skinny_matmul.py --out $OUT/skinny_matmul.json
    python experiments/bench_skinny_matmul.py --smoke --out /tmp/skinny.json   # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.provenance import provenance
from pallas_kernels.matmul import skinny_matmul

L2_BYTES = 50e6
SHAPES_8B = {  # name: (K, N)
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate": (4096, 14336),
    "gate_up": (4096, 28672),  # gate and up as one weight, if fusing them pays
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
SHAPES_SMOKE = {"a": (256, 128), "b": (128, 256)}
TIMING_METHOD = (
    "one jitted lax.fori_loop of N iterations around the matmul; each iteration adds 1e-3 * "
    "out[0, 0] into x[0, 0] so no call can be hoisted, and cycles through `weight_sets` distinct "
    "copies of the weight (enough that they do not fit the 50 MB L2 together). N grows until one "
    "loop call takes >= min_loop_ms; time = median of `repeats` loop calls / (N * weight_sets)."
)


def parse_config(text: str) -> dict:
    """'128,64,4,auto' -> block_n, block_k, num_stages, k_splits."""
    bn, bk, st, ks = text.split(",")
    return dict(block_n=int(bn), block_k=int(bk), num_stages=int(st),
                k_splits=None if ks == "auto" else int(ks))  # fmt: skip


def time_matmul(op, x, weights, *, min_loop_s: float, repeats: int) -> tuple[float, int]:
    @jax.jit
    def loop(n, x, weights):
        def body(_, x):
            for w in weights:
                x, w = lax.optimization_barrier((x, w))
                out = op(x, w)
                x = x.at[0, 0].add((1e-3 * out[0, 0]).astype(x.dtype))
            return x

        return lax.fori_loop(0, n, body, x)

    def run(n):
        t0 = time.perf_counter()
        loop(n, x, weights).block_until_ready()
        return time.perf_counter() - t0

    run(1)
    n, t = 2, run(2)
    while t < min_loop_s and n < 20_000:
        n = min(20_000, max(2 * n, math.ceil(1.2 * n * min_loop_s / max(t, 1e-6))))
        t = run(n)
    loop_s = statistics.median(run(n) for _ in range(repeats))
    return loop_s / (n * len(weights)), n


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("experiments/results/h200/skinny_matmul.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, interpret mode)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--shapes", nargs="+", default=None, help="subset of " + ",".join(SHAPES_8B))
    ap.add_argument("--configs", nargs="+", default=["128,64,4,auto", "256,64,4,auto",
                    "128,128,3,auto", "128,64,6,auto", "128,64,4,1"],
                    help="block_n,block_k,stages,k_splits (1 split: bf16 output, no f32 partials)")  # fmt: skip
    ap.add_argument("--no-xla", action="store_true")
    ap.add_argument("--min-loop-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.smoke:
        args.batches, args.configs = [1, 5], ["128,64,2,auto", "128,64,2,2"]
        args.min_loop_ms, args.repeats = 1.0, 2
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    shapes = SHAPES_SMOKE if args.smoke else SHAPES_8B
    if args.shapes:
        unknown = set(args.shapes) - set(shapes)
        if unknown:
            raise SystemExit(f"--shapes {sorted(unknown)} not in {sorted(shapes)}")
        shapes = {k: shapes[k] for k in args.shapes}
    configs = {c: parse_config(c) for c in args.configs}
    result = {
        **provenance([sys.executable, *(sys.argv if argv is None else [__file__, *argv])]),
        "timing_method": TIMING_METHOD,
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    key = jax.random.key(0)
    for name, (k, n) in shapes.items():
        w_bytes = k * n * 2
        sets = max(1, math.ceil(2 * L2_BYTES / w_bytes)) if not args.smoke else 1
        keys = jax.random.split(jax.random.fold_in(key, k * n), sets + 1)
        weights = [jax.random.normal(kk, (k, n), jnp.bfloat16) / math.sqrt(k) for kk in keys[1:]]
        for m in args.batches:
            x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
            ref = np.asarray(x, np.float32) @ np.asarray(weights[0], np.float32)
            impls = {} if args.no_xla else {"xla": lambda x, w: x @ w}
            for label, cfg in configs.items():
                impls[f"pallas {label}"] = lambda x, w, cfg=cfg: skinny_matmul(x, w, **cfg)
            for impl, op in impls.items():
                row = {"shape": name, "K": k, "N": n, "M": m, "impl": impl, "weight_sets": sets}
                try:
                    out = np.asarray(jax.jit(op)(x, weights[0]), np.float32)
                    row["rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                    t, iters = time_matmul(op, x, weights, min_loop_s=args.min_loop_ms / 1e3,
                                           repeats=args.repeats)  # fmt: skip
                    row.update(time_us=float(f"{t * 1e6:.5g}"), n_iters=iters,
                               weight_TBps=float(f"{w_bytes / t / 1e12:.4g}"))  # fmt: skip
                except Exception as e:  # one failing config must not lose the others
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
                result["rows"].append(row)
                print({k_: row.get(k_) for k_ in ("shape", "M", "impl", "time_us", "weight_TBps",
                                                  "rel_err", "error")}, flush=True)  # fmt: skip
                args.out.write_text(json.dumps(result, indent=1) + "\n")
        del weights
    return result


if __name__ == "__main__":
    main()
