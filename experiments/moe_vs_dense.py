"""Seed 000's claim that an MoE serves like its active parameters: two `bench_e2e.py` results side
by side, the MoE preset and the dense preset with the same active parameters.

    python3 experiments/moe_vs_dense.py --moe e2e_qwen3_30b_a3b.json \
        --dense e2e_qwen3_a3b_dense.json --out moe_vs_dense.json --plot moe_vs_dense.png

Per decode (batch, context) row of both: step ms, roofline ms and the weight bytes each step
reads (the MoE's only from the experts its tokens were routed to), and the MoE/dense ratio of
step times; per throughput workload: output tok/s of both. The claim holds where the MoE's step
is near the dense one's at small batches (few experts routed to) and the gap grows with the
batch as more of the experts are read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _decode(result: dict) -> dict[tuple[int, int], dict]:
    return {(r["batch"], r["context"]): r for r in result.get("decode", []) if "step_ms" in r}


def _throughput(result: dict) -> dict[str, float]:
    return {r["workload"]: r["output_tok_s"] for r in result.get("throughput", [])
            if r.get("impl") == "jaxinfer" and "output_tok_s" in r}  # fmt: skip


def compare(moe: dict, dense: dict) -> dict:
    """The side-by-side rows (see the module docstring)."""
    d_moe, d_dense = _decode(moe), _decode(dense)
    decode = []
    for key in sorted(set(d_moe) & set(d_dense)):
        a, b = d_moe[key], d_dense[key]
        decode.append({
            "batch": key[0], "context": key[1],
            "moe_step_ms": a["step_ms"], "dense_step_ms": b["step_ms"],
            "moe_over_dense": round(a["step_ms"] / b["step_ms"], 3),
            "moe_roofline_ms": a["roofline_ms"], "dense_roofline_ms": b["roofline_ms"],
            "moe_weight_bytes": a["weight_bytes_per_step"],
            "dense_weight_bytes": b["weight_bytes_per_step"],
            "moe_experts_active_per_layer": a.get("experts_active_per_layer"),
        })  # fmt: skip
    t_moe, t_dense = _throughput(moe), _throughput(dense)
    throughput = [{"workload": w, "moe_output_tok_s": t_moe[w], "dense_output_tok_s": t_dense[w],
                   "moe_over_dense": round(t_moe[w] / t_dense[w], 3)}
                  for w in sorted(set(t_moe) & set(t_dense))]  # fmt: skip
    if not decode and not throughput:
        raise ValueError("the two results share no decode (batch, context) row and no "
                         "throughput workload")  # fmt: skip
    sources = {name: {k: r.get(k) for k in ("preset", "device", "jax", "commit", "date", "command")}
               for name, r in (("moe", moe), ("dense", dense))}  # fmt: skip
    return {"sources": sources, "decode": decode, "throughput": throughput}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for context in sorted({r["context"] for r in rows}):
        sub = [r for r in rows if r["context"] == context]
        batches = [r["batch"] for r in sub]
        ax.plot(batches, [r["moe_step_ms"] for r in sub], "o-", label=f"MoE, context {context}")
        ax.plot(batches, [r["dense_step_ms"] for r in sub], "s--",
                label=f"dense (same active), context {context}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch")
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moe", type=Path, required=True)
    ap.add_argument("--dense", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    result = compare(*(json.loads(p.read_text()) for p in (args.moe, args.dense)))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot is not None and result["decode"]:
        plot(result["decode"], args.plot)
    for r in result["decode"]:
        print(f"batch {r['batch']:4d} context {r['context']:5d}: MoE {r['moe_step_ms']:.3f} ms, "
              f"dense {r['dense_step_ms']:.3f} ms ({r['moe_over_dense']}x)")  # fmt: skip
    for r in result["throughput"]:
        print(f"{r['workload']}: MoE {r['moe_output_tok_s']:.0f} tok/s, dense "
              f"{r['dense_output_tok_s']:.0f} tok/s ({r['moe_over_dense']}x)")  # fmt: skip


if __name__ == "__main__":
    main()
