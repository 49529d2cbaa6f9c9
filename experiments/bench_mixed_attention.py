"""Attention of one engine-like mixed step: many decode rows plus a few prefill chunks.

The engine's mixed step runs one ragged batch of `--tokens` query tokens over `--rows` sequence
slots: `--decode-rows` sequences with one new token each (contexts drawn uniformly from
`--decode-context LO HI`) and `--prefill-chunks` chunks of `--chunk` tokens (each after
`--prefill-context` cached tokens). This times the attention call alone, for each configuration of
our kernel (`split_decode_rows` on: decode rows get a decode launch; off: every sequence takes
prefill-shaped query blocks) and XLA's reference, with the relative error against the reference.

    PYTHONPATH=. python3 experiments/bench_mixed_attention.py --out $OUT/mixed_attention.json
    python experiments/bench_mixed_attention.py --smoke --out /tmp/mixed.json   # CPU, tiny

Timing: `bench_paged_attention.time_op` (a jitted loop of N calls, median of repeats).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.provenance import provenance, require_gpu
from pallas_kernels.paged_attention import PagedAttentionInputs, paged_attention
from pallas_kernels.paged_attention.mosaic_gpu import KernelOptions

HERE = Path(__file__).resolve().parent
VARIANTS = {  # name -> (backend, kernel options)
    "pallas_split": ("pallas", {"split_decode_rows": True}),
    "pallas_nosplit": ("pallas", {"split_decode_rows": False}),
    "xla": ("xla", {}),
}


class _Skip(Exception):
    pass


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_paged_attention",
                                                  HERE / "bench_paged_attention.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_step(args, seed: int = 0):
    """(q, k_pages, v_pages, page_table, seq_lens, query_start_loc, stats) of one mixed step."""
    rng = np.random.default_rng(seed)
    lo, hi = args.decode_context
    q_lens = [1] * args.decode_rows + [args.chunk] * args.prefill_chunks
    ctx = list(rng.integers(lo, hi + 1, args.decode_rows)) + [args.prefill_context] * (
        args.prefill_chunks
    )
    if len(q_lens) > args.rows:
        raise SystemExit(f"--decode-rows + --prefill-chunks = {len(q_lens)} > --rows {args.rows}")
    if sum(q_lens) > args.tokens:
        raise SystemExit(f"{sum(q_lens)} query tokens > --tokens {args.tokens}")
    seq_lens = np.zeros(args.rows, np.int32)
    seq_lens[: len(q_lens)] = np.array(ctx) + np.array(q_lens)
    qsl = np.zeros(args.rows + 1, np.int32)
    qsl[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1 :] = sum(q_lens)
    ps = args.page_size
    pages_per_seq = -(-int(seq_lens.max()) // ps)
    need = [-(-int(n) // ps) for n in seq_lens]
    num_pages = sum(need) + 1
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((args.rows, pages_per_seq), np.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[used : used + n]
        used += n
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    shape = (num_pages, ps, hkv, d)
    k_pages = jax.random.normal(kk, shape, jnp.bfloat16)
    v_pages = jax.random.normal(kv, shape, jnp.bfloat16)
    q = jax.random.normal(kq, (args.tokens, hq, d), jnp.bfloat16)
    kv_tokens = int(seq_lens.sum())
    stats = {
        "query_tokens": int(sum(q_lens)),
        "kv_tokens": kv_tokens,
        "kv_bytes": kv_tokens * hkv * d * 2 * 2,
        "decode_kv_bytes": int(sum(c + 1 for c in ctx[: args.decode_rows])) * hkv * d * 2 * 2,
    }
    arrays = (q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(seq_lens), jnp.asarray(qsl))
    return arrays, stats


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, default=Path("experiments/results/h200/mixed_attention.json")
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, interpret mode)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--decode-rows", type=int, default=500)
    ap.add_argument("--decode-context", type=int, nargs=2, default=[128, 256], metavar=("LO", "HI"))
    ap.add_argument("--prefill-chunks", type=int, default=12)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--prefill-context", type=int, default=0)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--min-loop-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-timing", action="store_true", help="only check against the reference")
    args = ap.parse_args(argv)
    if args.smoke:  # few sequences and tokens: each kernel program costs the GPU interpreter an
        # XLA compile per warpgroup (a padding slot and padding tokens stay)
        args.tokens, args.rows, args.decode_rows, args.prefill_chunks = 24, 4, 2, 1
        args.chunk, args.decode_context, args.prefill_context = 20, [10, 40], 7
        args.q_heads, args.kv_heads, args.head_dim = 4, 1, 64
        args.min_loop_ms, args.repeats = 1.0, 2
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.smoke:
        require_gpu("bench_mixed_attention.py", "--smoke")
    bench = _bench_module()
    arrays, stats = make_step(args)
    q, *operands = arrays
    n = stats["query_tokens"]
    result = {
        **provenance([sys.executable, *(sys.argv if argv is None else [__file__, *argv])]),
        "timing_method": bench.TIMING_METHOD,
        "step": {k: v for k, v in vars(args).items() if k not in ("out", "variants")},
        **stats,
        "rows": [],
    }
    ref = paged_attention(PagedAttentionInputs(q, *operands, max_q_len=args.chunk), backend="xla")
    ref = np.asarray(ref[:n], np.float32)
    for name in args.variants:
        backend, opts = VARIANTS[name]

        def op(q, *ops, backend=backend, opts=opts):
            return paged_attention(PagedAttentionInputs(q, *ops, max_q_len=args.chunk),
                                   backend=backend, options=KernelOptions(**opts))  # fmt: skip

        row = {"variant": name, "backend": backend, **opts}
        try:
            out = np.asarray(jax.jit(op)(q, *operands)[:n], np.float32)
            row["rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            if args.no_timing:
                raise _Skip
            prep = bench.Prepared(op, q, [tuple(operands)], lambda o: o, {})
            t = bench.time_op(prep, min_loop_s=args.min_loop_ms / 1e3, repeats=args.repeats)
            row.update(time_ms=float(f"{t['time_s'] * 1e3:.5g}"), n_iters=t["n_iters"],
                       kv_TBps=float(f"{stats['kv_bytes'] / t['time_s'] / 1e12:.4g}"))  # fmt: skip
        except _Skip:
            pass
        except Exception as e:  # one failing variant must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        result["rows"].append(row)
        print(row, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
