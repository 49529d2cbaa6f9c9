"""GPU probe: decode attention of the 8B shapes (GQA 32/8, d128) by page size and context splits.

Times our kernel with `bench_paged_attention`'s loop (K/V sets rotated past the L2) for each
(batch, context, page size, num_splits) and writes one JSON row per case:

    PYTHONPATH=. python3 experiments/scratch/probe_decode_attention.py --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_paged_attention as bpa

from jaxinfer.provenance import provenance
from pallas_kernels.paged_attention import paged_attention


def parse_config(text: str) -> dict:
    """'auto' -> {}; 'num_stages=3,warp_specialized=1' -> {'num_stages': 3, 'warp_specialized': True}."""
    if text == "auto":
        return {}
    opts = {}
    for item in text.split(","):
        name, value = item.split("=")
        opts[name] = bool(int(value)) if name == "warp_specialized" else int(value)
    return opts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--splits", default="auto,1,2,4", help="comma list; auto = kernel default")
    ap.add_argument("--configs", nargs="*", default=None,
                    help="kernel option sets instead of --splits, each 'auto' or 'name=value,...' "
                         "(e.g. num_stages=3,warp_specialized=1)")  # fmt: skip
    args = ap.parse_args()
    result = {**provenance(), "rows": []}
    for ps in args.page_sizes:
        for b in args.batches:
            for ctx in args.contexts:
                case = bpa.Case("decode", b, ctx, 32, 8, 128, ps, "bfloat16")
                inp = bpa.make_decode_inputs(case, bpa.kv_sets_for(case), jax.random.key(b + ctx))
                configs = args.configs or [
                    "auto" if sp == "auto" else f"num_splits={sp}" for sp in args.splits.split(",")
                ]
                for sp in configs:
                    opts = parse_config(sp)

                    def op(q, k, v, table, lens, qsl, opts=opts):
                        return paged_attention(q, k, v, table, lens, qsl, max_q_len=1,
                                               backend="pallas", **opts)  # fmt: skip

                    sets = [(s.k_pages, s.v_pages, s.page_table, inp.seq_lens,
                             inp.query_start_loc) for s in inp.sets]  # fmt: skip
                    prep = bpa.Prepared(op, inp.q, sets, lambda o: o, opts)
                    row = {"batch": b, "context": ctx, "page_size": ps, "config": sp}
                    try:
                        t = bpa.time_op(prep, min_loop_s=0.02, repeats=5)
                        row.update(time_us=round(t["time_s"] * 1e6, 2),
                                   kv_TBps=round(case.kv_bytes / t["time_s"] / 1e12, 3))  # fmt: skip
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {e}"[:500]
                    print(row, flush=True)
                    result["rows"].append(row)
                    args.out.write_text(json.dumps(result, indent=1))
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
