"""Layer storage/iteration for decode: `unrolled` per-layer buffers vs `scan` over stacked weights.

For each layout and batch size: compile time of the decode step and its steady-state time against
the memory roofline (weights + K/V read once at 4.3 TB/s). Writes JSON incrementally, so a run cut
short still leaves its finished rows.

    python experiments/bench_layer_loop.py --preset llama3-8b --out results/layer_loop.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv.cache import init_kv_cache
from jaxinfer.models.batch import build_ragged_batch
from jaxinfer.models.dense import compute_logits, forward_paged, last_token_rows
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import abstract_params, init_params, num_params
from jaxinfer.provenance import provenance

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy on the H200 (DESIGN.md)


def decode_step(params, kv, batch, *, cfg):
    hidden, kv = forward_paged(params, cfg, batch, kv)
    logits = compute_logits(params, cfg, hidden[last_token_rows(batch)])
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv


def bench_case(cfg, params, batch_size, context, page_size, steps, compiler_options):
    pages_per_seq = math.ceil((context + 1) / page_size)
    kv = init_kv_cache(cfg, batch_size * pages_per_seq + 1, page_size)
    rng = np.random.default_rng(0)
    page_ids = 1 + np.arange(batch_size * pages_per_seq).reshape(batch_size, pages_per_seq)
    batch = build_ragged_batch(
        [[int(t)] for t in rng.integers(0, cfg.vocab_size, batch_size)],
        [context] * batch_size,
        page_ids.tolist(),
        num_tokens=batch_size,
        num_seqs=batch_size,
        pages_per_seq=pages_per_seq,
    )
    fn = jax.jit(lambda p, k, b: decode_step(p, k, b, cfg=cfg), donate_argnums=1)
    t0 = time.perf_counter()
    compiled = fn.lower(params, kv, batch).compile(compiler_options=compiler_options or None)
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        tok, kv = compiled(params, kv, batch)
    tok.block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(steps):
            tok, kv = compiled(params, kv, batch)
        tok.block_until_ready()
        times.append((time.perf_counter() - t0) / steps)
    step_s = statistics.median(times)
    weight_bytes = num_params(cfg) * jnp.dtype(cfg.param_dtype).itemsize
    kv_bytes = 2 * cfg.num_layers * batch_size * context * cfg.num_kv_heads * cfg.head_dim * 2
    roofline_s = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S
    del kv
    return {
        "batch": batch_size,
        "context": context,
        "compile_s": round(compile_s, 2),
        "step_ms": round(step_s * 1e3, 3),
        "roofline_ms": round(roofline_s * 1e3, 3),
        "ratio": round(step_s / roofline_s, 3),
    }


def compile_only(cfg, batch_size, context, page_size):
    """Compile time of the decode step from abstract shapes (models that do not fit in memory)."""
    pages_per_seq = math.ceil((context + 1) / page_size)
    num_pages = batch_size * pages_per_seq + 1
    kv = jax.eval_shape(lambda: init_kv_cache(cfg, num_pages, page_size))
    batch = build_ragged_batch(
        [[0]] * batch_size,
        [context] * batch_size,
        (1 + np.arange(batch_size * pages_per_seq).reshape(batch_size, -1)).tolist(),
        num_tokens=batch_size,
        num_seqs=batch_size,
        pages_per_seq=pages_per_seq,
    )
    fn = jax.jit(lambda p, k, b: decode_step(p, k, b, cfg=cfg), donate_argnums=1)
    t0 = time.perf_counter()
    fn.lower(abstract_params(cfg), kv, batch).compile()
    return {
        "batch": batch_size,
        "context": context,
        "compile_s": round(time.perf_counter() - t0, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--variants", nargs="+", default=["unrolled", "scan", "scan+dynamic_slice_fusion"]
    )
    ap.add_argument(
        "--compile-only",
        nargs="*",
        default=[],
        metavar="PRESET:LOOP:BATCH",
        help="compile-time-only rows, e.g. llama3-70b:unrolled:64 (no weights allocated)",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    result = {
        **provenance(),
        "preset": args.preset,
        "method": (
            f"median of 5 timings of {args.steps} back-to-back donated decode steps (async dispatch),"
            " greedy argmax on device, XLA reference paged attention; page size"
            f" {args.page_size}; roofline = (bf16 weights + K/V bytes) / 4.3 TB/s"
        ),
        "rows": [],
    }
    for variant in args.variants:
        loop = variant.split("+")[0]
        options = (
            {"xla_gpu_enable_dynamic_slice_fusion": True} if "dynamic_slice" in variant else None
        )
        cfg = preset(args.preset, layer_loop=loop)
        t0 = time.perf_counter()
        params = init_params(cfg, jax.random.key(0))
        jax.block_until_ready(params)
        init_s = time.perf_counter() - t0
        for b in args.batches:
            try:
                row = bench_case(cfg, params, b, args.context, args.page_size, args.steps, options)
            except Exception as e:  # record and go on: one failing variant must not lose the rest
                row = {
                    "batch": b,
                    "context": args.context,
                    "error": f"{type(e).__name__}: {e}"[:500],
                }
            row = {"variant": variant, "init_s": round(init_s, 2), **row}
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
        del params
        gc.collect()
    for item in args.compile_only:
        name, loop, b = item.split(":")
        cfg = preset(name, layer_loop=loop)
        row = {"variant": loop, "preset": name, "compile_only": True}
        row.update(compile_only(cfg, int(b), args.context, args.page_size))
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
