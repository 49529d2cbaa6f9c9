"""Multi-GPU run (one host): sweeps with one worker per GPU, and data-parallel engine replicas.

    python experiments/run_multi_gpu.py --gpus 2 --out experiments/results/h200x2/multi_gpu.json

1. Sweeps: each claim sweep (`--sweeps`, default the continuous-vs-static and chunked-prefill
   configs) runs twice from scratch, `--workers 1` and `--workers N` (`jaxinfer sweep`, one worker
   process per GPU), each into its own folder. Recorded: wall time of each, the speed-up, and per
   point the largest relative difference of every numeric metric between the two runs (token
   counts should match exactly; timings differ by noise: the point runs once in each).
2. Data parallel: `experiments/bench_data_parallel.py --replicas 1 N --backend B` in a child
   process (8B shape by default) for each B in `--dp-backends` (worker processes): output
   tok/s of one engine replica per GPU behind one queue against one GPU.

Each part runs in a child process, so this one never holds GPU memory. The result file records
device count, jax, commit, date and the exact command (also those of every child).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SWEEPS = (
    "experiments/continuous_vs_static/config.yaml",
    "experiments/chunked_prefill/config.yaml",
)
# Columns that count things: equal in both runs unless the engine is nondeterministic.
COUNT_COLUMNS = (
    "num_requests",
    "num_completed",
    "num_failed",
    "total_prompt_tokens",
    "total_output_tokens",
)


def run_child(cmd: list[str], log: Path, timeout_s: float) -> tuple[int, float]:
    """(exit code, wall seconds) of cmd, stdout+stderr to log; 124 when it ran past timeout_s."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, round(time.perf_counter() - t0, 2)


def compare_tables(one, many) -> dict:
    """Per metric: the largest relative difference over points between two results tables."""
    import numpy as np
    import pandas as pd

    key = "point" if "point" in one.columns else one.columns[0]
    a, b = one.set_index(key).sort_index(), many.set_index(key).sort_index()
    out: dict = {"points": sorted(map(str, a.index)), "same_points": list(a.index) == list(b.index)}
    if not out["same_points"]:
        return out
    diffs = {}
    for col in a.columns:
        if col not in b.columns or not pd.api.types.is_numeric_dtype(a[col]):
            continue
        x, y = a[col].to_numpy(float), b[col].to_numpy(float)
        both = ~(np.isnan(x) | np.isnan(y))
        if not both.any():
            continue
        rel = np.abs(x[both] - y[both]) / np.maximum(np.abs(x[both]), 1e-12)
        diffs[col] = round(float(rel.max()), 4)
    out["max_rel_diff"] = diffs
    counts = {c: diffs[c] for c in COUNT_COLUMNS if c in diffs}
    out["counts_identical"] = all(v == 0 for v in counts.values()) if counts else None
    return out


def sweep_part(args, work: Path) -> list[dict]:
    import pandas as pd

    rows = []
    for config in args.sweeps:
        name = Path(config).parent.name
        row: dict = {"config": config, "runs": {}}
        tables = {}
        for workers in (1, args.gpus):
            out_dir = work / f"{name}_w{workers}"
            cmd = [sys.executable, "-m", "jaxinfer.cli", "sweep", config, f"out_dir={out_dir}",
                   "--workers", str(workers), "--no-progress", *args.sweep_args]  # fmt: skip
            rc, wall = run_child(cmd, work / f"{name}_w{workers}.log", args.timeout_s)
            row["runs"][workers] = {"command": cmd, "rc": rc, "wall_s": wall}
            results = out_dir / "results.parquet"
            if rc == 0 and results.exists():
                tables[workers] = pd.read_parquet(results)
                row["runs"][workers]["points"] = len(tables[workers])
            print(json.dumps({name: row["runs"][workers]}), flush=True)
        if len(tables) == 2:
            w1, wn = row["runs"][1]["wall_s"], row["runs"][args.gpus]["wall_s"]
            row["speedup"] = round(w1 / wn, 3)
            row["parallel_efficiency"] = round(w1 / wn / args.gpus, 3)
            row["compare"] = compare_tables(tables[1], tables[args.gpus])
        rows.append(row)
    return rows


def data_parallel_part(args, work: Path, backend: str) -> dict:
    out = work / f"data_parallel_{backend}.json"
    cmd = [sys.executable, "experiments/bench_data_parallel.py", "--replicas", "1",
           str(args.gpus), "--backend", backend, "--out", str(out), *args.dp_args]  # fmt: skip
    rc, wall = run_child(cmd, work / f"data_parallel_{backend}.log", args.timeout_s)
    result = json.loads(out.read_text()) if out.exists() else {}
    result = {"command": cmd, "rc": rc, "wall_s": wall, **result}
    rows = {r.get("replicas"): r for r in result.get("rows", [])}
    one, many = rows.get(1, {}), rows.get(args.gpus, {})
    if "output_tok_s" in one and "output_tok_s" in many:
        result["speedup"] = round(many["output_tok_s"] / one["output_tok_s"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2, help="N: workers / replicas (one per GPU)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None, help="sweep folders and logs (default: "
                    "beside --out)")  # fmt: skip
    ap.add_argument("--parts", default="sweeps,data_parallel")
    ap.add_argument("--sweeps", nargs="+", default=list(DEFAULT_SWEEPS))
    ap.add_argument(
        "--sweep-args",
        default="",
        help="one string, split like a shell line, added to every `jaxinfer sweep`",
    )
    ap.add_argument(
        "--dp-args",
        default="",
        help="one string added to bench_data_parallel.py, e.g. '--max-num-seqs 512'",
    )
    ap.add_argument("--dp-backends", default="process",
                    help="engine.data_parallel_backend values to run; the first is recorded as "
                         "`data_parallel`, the others as `data_parallel_<backend>`")  # fmt: skip
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per child process")
    args = ap.parse_args(argv)
    args.sweep_args, args.dp_args = shlex.split(args.sweep_args), shlex.split(args.dp_args)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - {"sweeps", "data_parallel"})
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from sweeps, data_parallel")
    bad_backends = sorted(set(args.dp_backends.split(",")) - {"process"})
    if bad_backends or not args.dp_backends:
        ap.error(f"--dp-backends: unknown {bad_backends}; choose from process")
    if args.gpus < 2:
        ap.error(f"--gpus {args.gpus}: a multi-GPU run needs at least 2")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device KINDS.md)
    work = args.work or args.out.with_suffix("").with_name(args.out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)

    # provenance in a child: this process must not take GPU memory the workers need
    probe = subprocess.run(
        [sys.executable, "-c", "import json,sys,jax; from jaxinfer.provenance import provenance; "
         "p = provenance(sys.argv[1:]); p['device_count'] = jax.device_count(); "
         "p['platform'] = jax.devices()[0].platform; "
         "print(json.dumps(p))", *([sys.executable, *sys.argv] if argv is None else argv)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    result: dict = json.loads(probe.stdout.strip().splitlines()[-1])
    result["gpus_used"] = args.gpus
    if result["platform"] == "gpu" and result["device_count"] < args.gpus:
        print(f"only {result['device_count']} devices visible, --gpus {args.gpus}", file=sys.stderr)
        return 2

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))

    if "sweeps" in parts:
        result["sweeps"] = sweep_part(args, work)
        write()
    backends = [b for b in args.dp_backends.split(",") if b]
    dp_keys = ["data_parallel" if i == 0 else f"data_parallel_{b}" for i, b in enumerate(backends)]
    if "data_parallel" in parts:
        for key, backend in zip(dp_keys, backends, strict=True):
            result[key] = data_parallel_part(args, work, backend)
            write()
    write()
    bad = [r["config"] for r in result.get("sweeps", []) if "speedup" not in r]
    if "data_parallel" in parts:
        bad += [k for k in dp_keys if not math.isfinite(result[k].get("speedup", math.nan))]
    if bad:
        print(f"incomplete: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
