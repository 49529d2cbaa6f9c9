"""What a speculative verification costs on a real-sized model: the decode step with gamma + 1
rows per sequence (gamma drafts and the last token, scored and sampled) against the plain step,
per batch, so the speedup a proposer's acceptance buys is known before it is built.

    python3 experiments/speculative/verify_cost.py --out $OUT/speculative_verify_cost_8b.json \
        --plot $OUT/speculative_verify_cost_8b.png                     # H200, 8B shape, ~8 min
    python experiments/speculative/verify_cost.py --smoke --out /tmp/vc.json    # CPU, tiny, ~30 s

One `bench_e2e.py --parts decode --num-draft-tokens G` process per gamma (random weights of the
preset, bf16, context --context; n-gram drafts, whose acceptance is irrelevant here: every round
scores its 1 + G rows). Each row: gamma, rows per sequence, batch, step_ms, and `cost_x`, the
step over the plain (gamma 0) step at that batch: the tokens per verification (tau) a method
must reach to break even, before its own drafting cost. The file is rewritten after every gamma
(an interrupted run keeps what finished); a failed gamma is recorded with its error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxinfer.provenance import provenance

BENCH = Path(__file__).resolve().parents[1] / "bench_e2e.py"


def bench_command(args, gamma: int, out: Path) -> list[str]:
    batches = [str(b) for b in args.batches]
    return [sys.executable, str(BENCH), *(["--smoke"] if args.smoke else []),
            "--preset", args.preset, "--dtype", args.dtype,
            "--parts", "decode", "--workloads", "fixed", "--num-requests", "8",
            "--batches", *batches, "--contexts", str(args.context),
            "--decode-buckets", *batches, "--max-num-batched-tokens", str(max(args.batches)),
            "--num-draft-tokens", str(gamma), "--out", str(out),
            *(["--attention-options", *args.attention_options] if args.attention_options else [])]  # fmt: skip


def rows_of(run: dict, gamma: int) -> list[dict]:
    return [{"gamma": gamma, "rows_per_sequence": r.get("rows_per_sequence", 1 + gamma),
             "batch": r["batch"], "step_ms": r["step_ms"]} for r in run["decode"]]  # fmt: skip


def with_costs(rows: list[dict]) -> list[dict]:
    """`cost_x` on each row: its step over the gamma-0 step at the same batch (absent without)."""
    plain = {r["batch"]: r["step_ms"] for r in rows if r["gamma"] == 0}
    return [r | ({"cost_x": round(r["step_ms"] / plain[r["batch"]], 3)}
                 if r["batch"] in plain else {}) for r in rows]  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for batch in sorted({r["batch"] for r in rows}):
        sub = sorted((r for r in rows if r["batch"] == batch and "cost_x" in r),
                     key=lambda r: r["gamma"])  # fmt: skip
        ax.plot([r["rows_per_sequence"] for r in sub], [r["cost_x"] for r in sub], "o-",
                label=f"batch {batch}")  # fmt: skip
    ax.set_xlabel("rows per sequence (gamma + 1)")
    ax.set_ylabel("verification step / plain step\n(tau needed to break even)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gammas", type=int, nargs="+", default=[0, 1, 2, 3, 4, 6, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per gamma")
    ap.add_argument("--attention-options", nargs="*", default=[], metavar="KEY=VALUE",
                    help="bench_e2e.py's --attention-options (e.g. num_splits=4)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check: tiny, float32, gammas 0 2, batches 1 4, context 16")  # fmt: skip
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.dtype, args.gammas, args.batches, args.context = (
            "tiny", "float32", [0, 2], [1, 4], 16)  # fmt: skip
    if 0 not in args.gammas:
        ap.error("--gammas must include 0 (the plain step every cost is relative to)")
    result = {**provenance(), "args": vars(args) | {"out": str(args.out), "plot": str(args.plot)},
              "rows": [], "errors": []}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for gamma in sorted(args.gammas):
            out = Path(tmp) / f"g{gamma}.json"
            cmd = bench_command(args, gamma, out)
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                if done.returncode != 0 or not out.is_file():
                    raise RuntimeError(f"exit {done.returncode}: {done.stderr[-800:]}")
                run = json.loads(out.read_text())
                result["rows"] = with_costs(result["rows"] + rows_of(run, gamma))
                result.setdefault("engine", run.get("engine"))
            except (subprocess.TimeoutExpired, RuntimeError, json.JSONDecodeError, KeyError) as e:
                result["errors"].append({"gamma": gamma, "error": str(e)[-1000:]})
            args.out.write_text(json.dumps(result, indent=1) + "\n")
            print(f"gamma {gamma}: " + ", ".join(
                f"b{r['batch']} {r['step_ms']} ms x{r.get('cost_x', '-')}"
                for r in result["rows"] if r["gamma"] == gamma) or "failed", flush=True)  # fmt: skip
    if args.plot is not None and result["rows"]:
        plot(result["rows"], args.plot)


if __name__ == "__main__":
    main()
