"""Probe: split-K chosen per projection in the model (a batched dot over K chunks with fp32
partials, summed by the consumer fusion) against XLA's own split-K choice, for the 8B layer's four
matmuls at decode batch sizes.

One decoder layer without attention (deferred norm, QKV, O over the query part, residual, deferred
norm, gate/up, silu * up, down, residual) is jitted per (variant, rows) and called over 32 layers
of distinct weights (8B shapes: 436 MB a layer, more than L2), so every call streams its weights
from HBM as the engine's decode step does. Time per layer is wall time over many back-to-back
layer calls divided by their count (the host dispatches ahead; the GPU is the bottleneck).

    python3 experiments/scratch/probe_split_k.py --out $OUT/split_k_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from datetime import UTC, datetime

import jax
import jax.numpy as jnp

E, F, HQ, HKV, D = 4096, 14336, 32, 8, 128
NOSPLIT = {"xla_gpu_experimental_force_split_k": 1}
VARIANTS = {
    "xla": ({}, {}),
    "nosplit": (NOSPLIT, {}),
    "o2": (NOSPLIT, {"o": 2}),
    "o4": (NOSPLIT, {"o": 4}),
    "o2_qkv2": (NOSPLIT, {"o": 2, "qkv": 2}),
    "o2_qkv2_down2": (NOSPLIT, {"o": 2, "qkv": 2, "down": 2}),
    "o4_qkv2_down2": (NOSPLIT, {"o": 4, "qkv": 2, "down": 2}),
    "all2": (NOSPLIT, {"o": 2, "qkv": 2, "down": 2, "gate_up": 2}),
    "xla_o2": ({}, {"o": 2}),
}


def dot(x, w, splits):
    """x [M, K] @ w [K, N]; with splits > 1 as a batched dot over K chunks, fp32 partials summed."""
    if splits <= 1:
        return x @ w
    m, k = x.shape
    xs = x.reshape(m, splits, k // splits)
    ws = w.reshape(splits, k // splits, w.shape[1])
    part = jnp.einsum("msk,skn->smn", xs, ws, preferred_element_type=jnp.float32)
    return part.sum(0).astype(x.dtype)


def layer(p, x, splits):
    def normed(v, g):
        v32 = v.astype(jnp.float32)
        r = jax.lax.rsqrt(jnp.mean(v32 * v32, -1, keepdims=True) + 1e-5)
        return (v * g).astype(v.dtype), r

    h, r = normed(x, p["g1"])
    qkv = (dot(h, p["qkv"], splits.get("qkv", 1)) * r).astype(x.dtype)
    o = dot(qkv[:, : HQ * D], p["o"], splits.get("o", 1))  # stands in for attention's output
    x = x + o
    h, r = normed(x, p["g2"])
    gu = (dot(h, p["gate_up"], splits.get("gate_up", 1)) * r).astype(x.dtype)
    a = jax.nn.silu(gu[:, :F]) * gu[:, F:]
    return x + dot(a, p["down"], splits.get("down", 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--calls", type=int, default=20, help="passes over the layers per timing")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    key = jax.random.PRNGKey(0)
    dt = jnp.bfloat16

    def w(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(dt)

    layers = []
    for i in range(args.layers):
        ks = jax.random.split(jax.random.fold_in(key, i), 4)
        layers.append({
            "qkv": w(ks[0], (E, (HQ + 2 * HKV) * D)), "o": w(ks[1], (HQ * D, E)),
            "gate_up": w(ks[2], (E, 2 * F)), "down": w(ks[3], (F, E)),
            "g1": jnp.ones((E,), dt), "g2": jnp.ones((E,), dt),
        })  # fmt: skip
    weight_bytes = sum(v.size * 2 for k, v in layers[0].items() if k not in ("g1", "g2"))
    rows = []
    for m in args.rows:
        x0 = (jax.random.normal(jax.random.PRNGKey(m), (m, E), jnp.float32)).astype(dt)
        ref = None
        for name in args.variants:
            opts, splits = VARIANTS[name]
            fn = jax.jit(lambda p, x, s=splits: layer(p, x, s))
            exe = fn.lower(layers[0], x0).compile(compiler_options=opts or None)
            y = exe(layers[0], x0)
            if ref is None:
                ref = y
            err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32))))
            for p in layers[:4]:  # warm
                exe(p, x0).block_until_ready()
            times = []
            for _ in range(args.repeats):
                x = x0
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    for p in layers:
                        x = exe(p, x0)
                x.block_until_ready()
                times.append((time.perf_counter() - t0) / (args.calls * args.layers))
            us = 1e6 * min(times)
            row = {"rows": m, "variant": name, "us_per_layer": round(us, 2),
                   "median_us": round(1e6 * sorted(times)[len(times) // 2], 2),
                   "weights_TBps": round(weight_bytes / us / 1e6, 3), "max_abs_diff_vs_xla": err}  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    commit = os.environ.get("JAXINFER_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()  # fmt: skip
    out = {"device": f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}",
           "jax": jax.__version__, "commit": commit,
           "date": datetime.now(UTC).isoformat(timespec="seconds"),
           "command": "python3 experiments/scratch/probe_split_k.py " + " ".join(
               f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items()),
           "weight_bytes_per_layer": weight_bytes,
           "roofline_us_per_layer": round(weight_bytes / 4.3e12 * 1e6, 2), "rows": rows}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
