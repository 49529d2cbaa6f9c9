"""Decode attention of the 8B shapes (GQA 32/8, d128, bf16 pages): our Pallas kernel alone, by
page size, batch, context and kernel option set, one JSON row per case.

What it is for: tuning the kernel's decode launch (`num_splits`, `num_stages`, `warp_specialized`,
`block_kv`, `token_major_decode`) on the GPU, where `bench_paged_attention.py` compares whole
implementations. Each row is timed with `bench_paged_attention`'s loop (K/V sets rotated past the
L2, `TIMING_METHOD`) and checked against the XLA reference (`rel_err`). Until 23f5bb9 this was
`experiments/scratch/probe_decode_attention.py`, which wrote `archive/decode_attention_page_size_probe`,
`_tuning_probe`, `_stages_probe`, `_context_sweep` and `_persistent_probe.json` (the last with
options since removed: docs/decisions.md, "Paged attention kernel").

    PYTHONPATH=. python3 experiments/bench_decode_attention.py --out $OUT/decode_attention.json
    PYTHONPATH=. python3 experiments/bench_decode_attention.py --out $OUT/probe.json \
        --page-sizes 64 --configs auto num_stages=3 num_splits=8,num_stages=4
    python experiments/bench_decode_attention.py --smoke --out /tmp/da.json  # CPU, interpreted
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_paged_attention as bpa

from jaxinfer.provenance import provenance, require_gpu
from pallas_kernels.paged_attention import PagedAttentionInputs, paged_attention
from pallas_kernels.paged_attention.mosaic_gpu import KernelOptions

# The kernel's tuning options and which are booleans.
TUNING_OPTIONS = tuple(f.name for f in dataclasses.fields(KernelOptions))
BOOL_OPTIONS = ("split_decode_rows", "warp_specialized", "token_major_decode")


def parse_config(text: str) -> dict:
    """'auto' -> {}; 'num_stages=3,warp_specialized=1' -> {'num_stages': 3, 'warp_specialized':
    True}. Names must be kernel tuning options (`TUNING_OPTIONS`)."""
    if text == "auto":
        return {}
    opts = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or name not in TUNING_OPTIONS:
            raise ValueError(f"config item {item!r}: expected name=value, name one of "
                             f"{TUNING_OPTIONS}")  # fmt: skip
        opts[name] = bool(int(value)) if name in BOOL_OPTIONS else int(value)
    return opts


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes (GQA 4/2, d64), interpreted on the CPU")  # fmt: skip
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 8 32 64")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="default 512 2048")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=None, help="default 16 32 64")
    ap.add_argument("--splits", default="auto,1,2,4", help="comma list; auto = kernel default")
    ap.add_argument("--configs", nargs="*", default=None,
                    help="kernel option sets instead of --splits, each 'auto' or 'name=value,...' "
                         "(e.g. num_stages=3,warp_specialized=1)")  # fmt: skip
    ap.add_argument("--min-loop-ms", type=float, default=None, help="default 20 (smoke: 0)")
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (smoke: 1)")
    args = ap.parse_args(argv)
    small = dict(batches=[2], contexts=[40], page_sizes=[16], min_loop_ms=0.0, repeats=1)
    full = dict(batches=[1, 8, 32, 64], contexts=[512, 2048], page_sizes=[16, 32, 64],
                min_loop_ms=20.0, repeats=5)  # fmt: skip
    for name, value in (small if args.smoke else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.configs is None:
        args.configs = [
            "auto" if s == "auto" else f"num_splits={s}" for s in args.splits.split(",")
        ]
    try:
        args.options = [parse_config(c) for c in args.configs]
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.smoke:
        require_gpu("bench_decode_attention.py", "--smoke")
    heads, head_dim = ((4, 2), 64) if args.smoke else ((32, 8), 128)
    result = {
        **provenance([sys.executable, *(sys.argv if argv is None else [__file__, *argv])]),
        "timing_method": bpa.TIMING_METHOD,
        "min_loop_ms": args.min_loop_ms,
        "repeats": args.repeats,
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for ps in args.page_sizes:
        for b in args.batches:
            for ctx in args.contexts:
                case = bpa.Case("decode", b, ctx, *heads, head_dim, ps, "bfloat16")
                inp = bpa.make_decode_inputs(case, bpa.kv_sets_for(case), jax.random.key(b + ctx))
                sets = [(s.k_pages, s.v_pages, s.page_table, inp.seq_lens, inp.query_start_loc)
                        for s in inp.sets]  # fmt: skip
                ref = np.asarray(bpa.decode_reference(inp, inp.sets[0]), np.float32)
                for config, opts in zip(args.configs, args.options, strict=True):

                    def op(q, *ops, opts=opts):
                        x = PagedAttentionInputs(q, *ops, max_q_len=1)
                        return paged_attention(x, backend="pallas", options=KernelOptions(**opts))

                    row = {"batch": b, "context": ctx, "page_size": ps, "config": config,
                           "q_heads": heads[0], "kv_heads": heads[1], "head_dim": head_dim}  # fmt: skip
                    try:
                        out = np.asarray(jax.jit(op)(inp.q, *sets[0]), np.float32)
                        row["rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                        prep = bpa.Prepared(op, inp.q, sets, lambda o: o, opts)
                        t = bpa.time_op(prep, min_loop_s=args.min_loop_ms / 1e3,
                                        repeats=args.repeats)  # fmt: skip
                        # (significant digits: the interpreted smoke run is ~1e6 x slower)
                        row.update(time_us=float(f"{t['time_s'] * 1e6:.5g}"),
                                   kv_TBps=float(f"{case.kv_bytes / t['time_s'] / 1e12:.4g}"))  # fmt: skip
                    except Exception as e:  # a config that does not compile is a row, not a crash
                        row["error"] = f"{type(e).__name__}: {e}"[:500]
                    print(row, flush=True)
                    result["rows"].append(row)
                    args.out.write_text(json.dumps(result, indent=1))
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
