"""The batch-invariant GEMM against XLA's bf16 dot on the Llama-3-8B projections, per row count:
what `engine.batch_invariant` costs the matmuls (docs/batch_invariance.md).

Rows per (m, n, k, impl): `xla_bf16` (jnp.dot, XLA's choice of cuBLAS/Triton kernel) and
`invariant` (`invariant_matmul_mgpu`, with its split-K from the weight's shape), each with its
time, TB/s of weight bytes and TFLOP/s; `invariant` rows add `x_xla` (its time over XLA's).

    PYTHONPATH=. python3 experiments/batch_invariance/bench_gemm.py --out $OUT/gemm.json
    python experiments/batch_invariance/bench_gemm.py --smoke --out /tmp/g.json   # CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_quant_matmul import TIMING_METHOD, loop_timer  # noqa: E402

from jaxinfer.provenance import provenance, require_gpu  # noqa: E402
from pallas_kernels.matmul.invariant_mgpu import (  # noqa: E402
    invariant_matmul_mgpu,
    k_splits_for,
)

# Llama-3-8B: qkv, o, gate/up, down, the LM head
PROJECTIONS = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
ROWS = (1, 16, 64, 256)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="one small shape in the interpreter")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--min-loop-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-stages", type=int, default=None, help="the kernel's pipeline depth")
    args = ap.parse_args(argv)
    if not args.smoke:
        require_gpu("bench_gemm.py", "--smoke")
    shapes = [(m, 128, 512) for m in (1, 8)] if args.smoke else [
        (m, n, k) for n, k in PROJECTIONS for m in args.rows]  # fmt: skip
    stages = {} if args.num_stages is None else {"num_stages": args.num_stages}
    impls = {"xla_bf16": jnp.dot,
             "invariant": lambda x, w: invariant_matmul_mgpu(x, w, interpret=args.smoke, **stages)}  # fmt: skip
    result = {**provenance(), "timing": TIMING_METHOD, "rows": []}
    rng = np.random.default_rng(0)
    for m, n, k in shapes:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
        times = {}
        for name, op in impls.items():
            repeats = 1 if args.smoke else args.repeats
            t = loop_timer(op, 0.0 if args.smoke else args.min_loop_ms, repeats)(x, w)
            times[name] = t
            row = {"m": m, "n": n, "k": k, "impl": name, "us": round(t * 1e6, 2),
                   "weight_tb_s": round(n * k * 2 / t / 1e12, 3),
                   "tflop_s": round(2 * m * n * k / t / 1e12, 2)}  # fmt: skip
            if name == "invariant":
                row["k_splits"] = k_splits_for(k, n)
                row["num_stages"] = args.num_stages or "default"
                row["x_xla"] = round(t / times["xla_bf16"], 3)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
