"""How fast an offline throughput workload could run at best, from a `bench_e2e.py` results file.

    python3 experiments/throughput_bound.py --results experiments/results/h200/e2e_llama3_8b.json \\
        --out experiments/results/h200/throughput_bound.json

The bound for one throughput workload (default `fixed_128_128`) of the results file's preset:

- **GEMM time**: the dense layers' FLOPs (2 x tokens x weights) over every token a layer sees
  (each prompt token once, each output token after the first once: the first comes from the
  prompt's last position), plus the output head for each output token (the engine computes logits
  only for the rows it samples), at `--gemm-tflops` (default: the bf16 8192^3 matmul ceilings of
  `experiments/results/h200/anchors.json`, XLA's and torch's, on normal-distributed inputs). The prompts' causal attention FLOPs are added
  at the same rate (a few TFLOP for short prompts).
- **Decode attention time**: the K/V bytes the decode steps read (output token j of a request
  attends over its prompt plus j tokens, every layer, K and V) at the HBM roofline (4.3 TB/s).
- Nothing else: no sampling, no small kernels, no host gaps, and perfect overlap. `with_measured_
  small_kernels` adds, per decode step the run made, the per-step XLA fusion and K/V-write time its
  `profile_decode` trace measured at its largest batch (they do not depend on the context).

Each bound is reported as output tok/s and set against the run's measured output tok/s. The file
records the inputs it used (FLOPs, bytes, steps) and provenance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from jaxinfer.models.config import ModelConfig  # noqa: E402
from jaxinfer.models.presets import preset  # noqa: E402
from jaxinfer.provenance import provenance  # noqa: E402

# bytes per K/V element (FP8 pools' per-page scales are left out: a few bytes per 64-token page)
KV_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def layer_weights(cfg: ModelConfig) -> int:
    """Weights of the dense layers' matmuls (q, k, v, o, gate, up, down), all layers."""
    e, d = cfg.hidden_size, cfg.head_dim
    attn = e * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * e
    mlp = 3 * e * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp)


def head_weights(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """K and V of one token, every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def workload_counts(prompt_lens, output_lens) -> dict:
    """Token counts of a workload given per-request prompt and output lengths (lists)."""
    if len(prompt_lens) != len(output_lens) or not prompt_lens:
        raise ValueError("prompt_lens and output_lens: one entry per request, at least one")
    if min(output_lens) < 1 or min(prompt_lens) < 1:
        raise ValueError("every request needs a prompt token and an output token")
    n = len(prompt_lens)
    decode_tokens = sum(o - 1 for o in output_lens)
    # output token j (1 <= j < o) is produced by a decode step attending over p + j tokens
    attended = sum(
        p * (o - 1) + (o - 1) * o // 2 for p, o in zip(prompt_lens, output_lens, strict=True)
    )
    causal_pairs = sum(p * (p + 1) // 2 for p in prompt_lens)  # (query, key) pairs of prefill
    return dict(requests=n, prompt_tokens=sum(prompt_lens), output_tokens=sum(output_lens),
                decode_tokens=decode_tokens, decode_attended_tokens=attended,
                prefill_causal_pairs=causal_pairs)  # fmt: skip


def bound(cfg: ModelConfig, counts: dict, *, gemm_flops_per_s: float, hbm_bytes_per_s: float,
          kv_itemsize: int, small_kernel_s: float = 0.0) -> dict:  # fmt: skip
    """Seconds and output tok/s of the bound (see the module docstring)."""
    layer_tokens = counts["prompt_tokens"] + counts["decode_tokens"]
    gemm_flops = 2 * layer_tokens * layer_weights(cfg) + 2 * counts["output_tokens"] * head_weights(
        cfg
    )
    attn_flops = 4 * counts["prefill_causal_pairs"] * cfg.num_heads * cfg.head_dim * cfg.num_layers
    kv_bytes = counts["decode_attended_tokens"] * kv_bytes_per_token(cfg, kv_itemsize)
    gemm_s = (gemm_flops + attn_flops) / gemm_flops_per_s
    attn_s = kv_bytes / hbm_bytes_per_s
    total = gemm_s + attn_s + small_kernel_s
    return dict(gemm_flops=gemm_flops, prefill_attention_flops=attn_flops, decode_kv_bytes=kv_bytes,
                gemm_s=round(gemm_s, 4), decode_attention_s=round(attn_s, 4),
                small_kernels_s=round(small_kernel_s, 4), total_s=round(total, 4),
                output_tok_s=round(counts["output_tokens"] / total, 1))  # fmt: skip


def _lengths(spec: dict, key: str, n: int) -> list[int]:
    v = spec.get(key)
    if isinstance(v, int):
        return [v] * n
    raise ValueError(f"workload {key}: only fixed lengths are supported here, got {v!r}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, required=True, help="a bench_e2e.py results file")
    ap.add_argument("--workload", default="fixed_128_128")
    ap.add_argument("--gemm-tflops", type=float, nargs="+", default=[647.0, 669.0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    res = json.loads(args.results.read_text())
    for key in ("preset", "workloads", "throughput", "hbm_bytes_per_s"):
        if key not in res:
            raise SystemExit(f"{args.results}: no {key!r}: not a bench_e2e.py results file?")
    if args.workload not in res["workloads"]:
        raise SystemExit(f"--workload {args.workload!r}: the file has {sorted(res['workloads'])}")
    spec = res["workloads"][args.workload]
    n = spec["num_requests"]
    try:
        counts = workload_counts(_lengths(spec, "prompt_len", n), _lengths(spec, "output_len", n))
    except ValueError as e:
        raise SystemExit(f"--workload {args.workload}: {e}") from None
    cfg = preset(res["preset"])
    kv_dtype = (res.get("engine") or {}).get("kv_dtype", "auto")
    kv_dtype = res.get("dtype", "bfloat16") if kv_dtype == "auto" else kv_dtype
    if kv_dtype not in KV_ITEMSIZE:
        raise SystemExit(
            f"{args.results}: K/V dtype {kv_dtype!r} is not one of {sorted(KV_ITEMSIZE)}"
        )
    kv_itemsize = KV_ITEMSIZE[kv_dtype]
    rows = [
        t for t in res["throughput"] if t["impl"] == "jaxinfer" and t["workload"] == args.workload
    ]
    if not rows or "output_tok_s" not in rows[0]:
        raise SystemExit(f"{args.results}: no jaxinfer throughput row for {args.workload}")
    measured = rows[0]

    # measured per-step small kernels (fusions, K/V writes) at the largest traced decode batch
    small = None
    prof = [p for p in res.get("profile_decode", []) if "kinds_ms_per_step" in p]
    if prof and "steps" in measured and "decode_steps" in res.get("engine", {}):
        p = max(prof, key=lambda r: r["batch"])
        per_step_ms = sum(p["kinds_ms_per_step"].get(k, 0.0) for k in ("fusion", "kv_write"))
        decode_steps = measured["steps"]["decode_scans"] * res["engine"]["decode_steps"]
        small = dict(batch=p["batch"], context=p["context"], ms_per_step=round(per_step_ms, 4),
                     decode_steps=decode_steps)  # fmt: skip

    bounds = []
    for tflops in args.gemm_tflops:
        kw = dict(gemm_flops_per_s=tflops * 1e12, hbm_bytes_per_s=res["hbm_bytes_per_s"],
                  kv_itemsize=kv_itemsize)  # fmt: skip
        row = {"gemm_tflops": tflops, **bound(cfg, counts, **kw)}
        if small is not None:
            s = small["ms_per_step"] * small["decode_steps"] / 1e3
            row["with_measured_small_kernels"] = bound(cfg, counts, small_kernel_s=s, **kw)
        row["measured_over_bound"] = round(measured["output_tok_s"] / row["output_tok_s"], 4)
        bounds.append(row)

    out = {
        **provenance(),
        "source": {k: res.get(k) for k in ("device", "jax", "commit", "date", "command")},
        "source_file": str(args.results),
        "workload": args.workload,
        "preset": res["preset"],
        "what": __doc__.split("\n\n")[1:3],
        "counts": counts,
        "layer_weights": layer_weights(cfg),
        "head_weights": head_weights(cfg),
        "small_kernels": small,
        "measured_output_tok_s": measured["output_tok_s"],
        "measured_wall_s": measured.get("wall_s"),
        "bounds": bounds,
    }
    text = json.dumps(out, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for b in bounds:
        extra = b.get("with_measured_small_kernels", {}).get("output_tok_s")
        print(f"GEMMs at {b['gemm_tflops']:.0f} TFLOP/s: bound {b['output_tok_s']:.0f} output tok/s"
              f" ({b['gemm_s']:.2f} s GEMM + {b['decode_attention_s']:.2f} s decode attention)"
              + (f", {extra:.0f} with the measured small kernels" if extra else "")
              + f"; measured {measured['output_tok_s']:.0f} = {b['measured_over_bound']:.0%}")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
