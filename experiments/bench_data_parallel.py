"""Data-parallel replicas behind one request queue: output tok/s with 1 replica against N.

    python experiments/bench_data_parallel.py --replicas 2 --out results.json           # N GPUs
    python experiments/bench_data_parallel.py --cpu-devices 2 --replicas 2 --model tiny  # CPU

Offline (all requests at t=0), fixed prompt/output lengths (default 128/128, the issue's
throughput workload), greedy with ignore_eos. One engine configuration for every replica count;
each count gets its own engine(s), warmed up before timing. Also checks that the replicas return
the same tokens as one engine (greedy decoding is batch-independent here up to float noise: the
count of identical outputs is recorded, not asserted). On a CPU the "devices" share the same cores,
so no speed-up is expected there: the CPU run checks the plumbing only.

`--backend process` runs every replica count (1 included) as worker processes, one per GPU
(`engine.data_parallel_backend=process`); this process then initialises JAX only after the runs,
for the provenance fields.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path


def trim_buckets(engine, max_num_seqs: int) -> None:
    """Compile only token buckets >= max_num_seqs and decode buckets >= 64 (runs in each worker)."""
    r = engine.runner
    r.token_buckets = tuple(b for b in r.token_buckets if b >= max_num_seqs)
    r.seq_buckets = tuple(b for b in r.seq_buckets if b >= 64) or r.seq_buckets[-1:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--replicas", type=int, nargs="+", default=[2])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--backend", default="process", choices=["process"],
                    help="engine.data_parallel_backend")  # fmt: skip
    ap.add_argument("--cpu-devices", type=int, default=0, help="force this many CPU devices")
    ap.add_argument("--compile-workers", type=int, default=0,
                    help="engine.compile_workers per replica (0: one per core)")  # fmt: skip
    ap.add_argument("--trim-buckets", action="store_true",
                    help="compile only token buckets >= max_num_seqs and decode buckets >= 64 "
                         "(smaller batches pad up): a shorter warm-up")  # fmt: skip
    ap.add_argument("--compile-cache", default="",
                    help="JAX persistent compilation cache directory ('' : none)")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not args.cpu_devices:  # (asked of a child: the GPUs are the workers')
        from jaxinfer.provenance import require_gpu

        require_gpu("bench_data_parallel.py", "--cpu-devices 2 --model tiny", ask_a_child=True)
    if args.cpu_devices:  # before jax initialises its backends
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.cpu_devices}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"

    if args.compile_cache:  # read by JAX in this process and in every worker process
        os.environ["JAX_COMPILATION_CACHE_DIR"] = args.compile_cache
    import numpy as np

    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams

    max_len = -(-(args.input_len + args.output_len) // args.page_size) * args.page_size
    engine_kw = dict(
        dtype=args.dtype, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
        num_pages=args.max_num_seqs * (max_len // args.page_size) + 1,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
        decode_steps=8, attention_backend=args.attention_backend,
        compile_workers=args.compile_workers, data_parallel_backend=args.backend,
    )  # fmt: skip
    setup = functools.partial(trim_buckets, max_num_seqs=args.max_num_seqs) if args.trim_buckets \
        else None  # fmt: skip
    num_devices = max(args.replicas)  # do not touch a GPU here: the workers need them
    result = {"engine": engine_kw, "trim_buckets": args.trim_buckets, "backend": args.backend,
              "workload": {"num_requests": args.num_requests, "input_len": args.input_len,
                           "output_len": args.output_len, "arrivals": "all at t=0"},
              "rows": []}  # fmt: skip
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    tokens = {}
    vocab = None
    for n in sorted({1, *args.replicas}):
        if n > num_devices:
            result["rows"].append({"replicas": n, "error": f"only {num_devices} devices"})
            continue
        t0 = time.perf_counter()
        llm = LLM(args.model, data_parallel=n, warmup=False, setup=setup, **engine_kw)
        llm.engine.warmup()
        warmup_s = time.perf_counter() - t0
        if vocab is None:
            from jaxinfer.engine.loading import model_vocab_size

            vocab = model_vocab_size(args.model)
        rng = np.random.default_rng(0)  # the same prompts for every replica count
        prompts = [rng.integers(1, vocab, args.input_len).tolist()
                   for _ in range(args.num_requests)]  # fmt: skip
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        wall = time.perf_counter() - t0
        out_tokens = sum(len(o.token_ids) for o in outs)
        row = {"replicas": n, "warmup_s": round(warmup_s, 2), "wall_s": round(wall, 3),
               "output_tokens": out_tokens, "output_tok_s": round(out_tokens / wall, 1),
               "compiles_after_warmup": llm.engine.compiles_after_warmup}  # fmt: skip
        if n > 1 or args.backend == "process":
            row["requests_per_replica"] = np.bincount(
                list(llm.engine.assignments.values()), minlength=n).tolist()  # fmt: skip
        if args.backend == "process":
            row["replica_stats"] = llm.engine.replica_stats
            row["workers"] = llm.engine.worker_info
            llm.engine.close()
        tokens[n] = [o.token_ids for o in outs]
        if n > 1 and 1 in tokens:
            row["identical_to_one_replica"] = sum(
                a == b for a, b in zip(tokens[1], tokens[n], strict=True))  # fmt: skip
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        del llm
    import jax

    from jaxinfer.provenance import provenance

    result = {**provenance(sys.argv), "device_count": len(jax.devices()),
              "devices": [str(d) for d in jax.devices()], **result}  # fmt: skip
    base = next((r["output_tok_s"] for r in result["rows"] if r.get("replicas") == 1), None)
    for r in result["rows"]:
        if base and "output_tok_s" in r:
            r["speedup_vs_one"] = round(r["output_tok_s"] / base, 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
