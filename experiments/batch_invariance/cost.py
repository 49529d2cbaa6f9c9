"""What `engine.batch_invariant` costs on the Llama-3-8B shape: `bench_e2e.py` with the switch
off and on, back to back in one call (one process each), merged into one results file.

Per state: decode steps at context 512 (batches 1, 64, 256) and the offline 128/128 throughput;
the merged file has both runs whole (`runs`), a `summary` row per metric with the on/off ratio,
and the commands.

    PYTHONPATH=. python3 experiments/batch_invariance/cost.py --out $OUT/batch_invariance_8b.json
    python experiments/batch_invariance/cost.py --smoke --out /tmp/bi.json      # CPU, tiny

An interrupted call keeps the runs it finished (`--work`: one JSON per state, reused).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from jaxinfer.provenance import provenance  # noqa: E402

BENCH = ROOT / "experiments" / "bench_e2e.py"
EIGHT_B = ["--preset", "llama3-8b", "--dtype", "bfloat16", "--batches", "1", "64", "256",
           "--contexts", "512", "--max-num-seqs", "256", "--decode-buckets", "1", "64", "256",
           "--max-num-batched-tokens", "2048", "--workloads", "fixed"]  # fmt: skip
SMOKE = ["--smoke", "--batches", "1", "4", "--contexts", "16", "--max-num-seqs", "4",
         "--decode-buckets", "1", "4", "--max-num-batched-tokens", "16", "--workloads", "fixed",
         "--num-requests", "8"]  # fmt: skip


def run_state(name: str, args, work: Path) -> dict | None:
    """One bench_e2e.py process for state `name` ("off" or "on"), reusing a finished run."""
    out = work / f"{name}.json"
    if out.exists():
        return json.loads(out.read_text())
    cmd = [sys.executable, str(BENCH), *(SMOKE if args.smoke else EIGHT_B),
           "--parts", "decode,throughput", "--out", str(out)]  # fmt: skip
    if not args.smoke:
        cmd += ["--num-requests", str(args.num_requests)]
    if name == "on":
        cmd.append("--batch-invariant")
    try:
        subprocess.run(cmd, check=True, timeout=args.run_timeout_s, cwd=ROOT)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return None
    return json.loads(out.read_text())


def summarize(runs: dict) -> list[dict]:
    """Rows of (metric, off, on, on/off) from the runs' decode and throughput parts."""
    rows = []

    def metric(run):
        if run is None:
            return {}
        vals = {f"decode_step_ms_b{r['batch']}": r["step_ms"] for r in run.get("decode", [])}
        for r in run.get("throughput", []):
            vals[f"{r.get('workload', 'fixed')}_out_tok_s"] = r.get("output_tok_s")
        return vals

    off, on = metric(runs.get("off")), metric(runs.get("on"))
    for key in sorted(set(off) | set(on)):
        a, b = off.get(key), on.get(key)
        ratio = round(b / a, 3) if a and b else None
        rows.append({"metric": key, "off": a, "on": b, "on_over_off": ratio})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None, help="per-state runs (default: beside out)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--run-timeout-s", type=float, default=280.0)
    ap.add_argument("--states", nargs="+", default=["off", "on"], choices=["off", "on"])
    args = ap.parse_args(argv)
    work = args.work or args.out.with_name(args.out.stem + "_runs")
    work.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name in args.states:
        runs[name] = run_state(name, args, work)
        result = {**provenance(), "summary": summarize(runs),
                  "runs": {k: v for k, v in runs.items() if v is not None}}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["summary"]:
        print(json.dumps(row))
    return result


if __name__ == "__main__":
    main()
