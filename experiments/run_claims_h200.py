"""The four claims on one H200 with the Llama-3-8B shape, in one go, within a time budget.

    python3 experiments/run_claims_h200.py --out /tmp/claims/h200 --archive $OUT/h200.tar.gz
    python experiments/run_claims_h200.py --smoke --out /tmp/claims-smoke/h200   # CPU, tiny preset

Writes `OUT/<claim>/` sweep folders (points, results.parquet, report/) and `OUT/vs_transformers.json`
in the layout of `experiments/results/cpu/`, plus `OUT/claims_run.json` (what ran, how long, how
many compiles), and with --archive packs OUT into one .tar.gz whose top folder is OUT's name (the
device tool returns a few files from at most two folders down, not a results tree). Recording the
run: `tar -xzf h200.tar.gz -C experiments/results/`, then
`python experiments/claims_table.py experiments/results/h200 --column H200`.

This process never touches an accelerator. It starts one worker process that runs the claims in
order of cost and importance (continuous_vs_static, chunked_prefill, paged_vs_contiguous,
vs_transformers), all with one engine shape (the `engine` sections of `experiments/*/h200.yaml`), so
the 8B step functions compile once, for the first claim, and every later one reuses them: jit's
in-process cache, backed by JAX's persistent compilation cache in $JAX_COMPILATION_CACHE_DIR
(which also catches what jit's cache cannot, such as parameter init, and serves a re-run).
The worker skips a claim when less time is left than the claim needs with warm executables; this
process interrupts it at the deadline, then renders the reports and prints a summary.
`--smoke` runs the same configs with the tiny preset and a few requests, on whatever device.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
# Engine fields that decide the step executables (max_num_batched_tokens and decode_steps only
# decide which of them a run needs): equal in every claim's h200.yaml, or compiles are not shared.
SHARED_ENGINE_KEYS = (
    "model", "dtype", "kv_dtype", "attention_backend", "page_size", "num_pages", "max_num_seqs",
    "max_model_len", "num_logprobs",
)  # fmt: skip
SMOKE_ENGINE = ("engine.model=preset:tiny", "engine.dtype=float32")
LOG = ".worker_log.jsonl"
RUN_FILE = "claims_run.json"


@dataclass(frozen=True)
class Claim:
    name: str
    min_s: float  # seconds it needs once the executables exist; skipped when less is left
    smoke: tuple[str, ...]  # overrides (sweeps) or arguments (vs_transformers) for --smoke

    @property
    def config(self) -> Path:
        return EXPERIMENTS / self.name / "h200.yaml"


CLAIMS = (
    Claim("continuous_vs_static", 0, ("workload.num_requests=16",)),
    Claim("chunked_prefill", 70, ("workload.num_requests=8",)),
    Claim("paged_vs_contiguous", 45, ("workload.num_requests=24",)),
    Claim("vs_transformers", 35, (
        "--num-requests", "8", "--prompt-lo", "64", "--prompt-hi", "512", "--output-lo", "16",
        "--output-hi", "64", "--hf-batch-sizes", "8", "4", "--set", *SMOKE_ENGINE,
    )),
)  # fmt: skip
# The claim-3 workload. HF eager `generate` is slow (1.9-2.8k tok/s at batch 128 on the H200,
# results/h200/archive/e2e_llama3_8b_cc4f4be.json and earlier): one batch of all 128 requests, its best
# case offline.
VS_ARGS = (
    "--num-requests", "128", "--prompt-lo", "64", "--prompt-hi", "512", "--output-lo", "16",
    "--output-hi", "192", "--hf-batch-sizes", "128",
)  # fmt: skip


# ---------------------------------------------------------------------------- worker process


def _log(out: Path, **record) -> None:
    with open(out / LOG, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


class CompileStats:
    """Backend compiles (persistent-cache hits included), their seconds, and the cache hits."""

    COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # as engine/compile_counter.py
    HIT_EVENT = "/jax/compilation_cache/cache_hits"

    def __init__(self) -> None:
        import jax

        self.compiles, self.compile_s, self.cache_hits = 0, 0.0, 0
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event == self.COMPILE_EVENT:
            self.compiles += 1
            self.compile_s += duration

    def _on_event(self, event: str, **_) -> None:
        self.cache_hits += event == self.HIT_EVENT

    def snapshot(self) -> tuple[int, float, int]:
        return self.compiles, self.compile_s, self.cache_hits


def _run_sweep_claim(claim: Claim, out: Path, overrides: list[str]) -> dict:
    from rich.console import Console

    from jaxinfer.experiment.sweep import plan_sweep, run_sweep

    plan = plan_sweep(claim.config, [f"out_dir={out / claim.name}", *overrides])
    result = run_sweep(plan, show_progress=False, console=Console(quiet=True))
    return {
        "points": result.ran,
        "failed_points": {k: v.strip().splitlines()[-1] for k, v in result.failed.items()},
    }


def _run_vs_transformers(claim: Claim, out: Path, args: list[str]) -> dict:
    path = EXPERIMENTS / claim.name / "run.py"
    spec = importlib.util.spec_from_file_location("vs_transformers_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--config", str(claim.config.relative_to(ROOT)), *args,
            "--out", str(out / f"{claim.name}.json")]  # fmt: skip
    module.main(argv)
    return {}


def worker(out: Path, deadline: float, smoke: bool, names: list[str]) -> int:
    from jaxinfer.provenance import provenance

    stats = CompileStats()
    _log(out, event="start", provenance=provenance())
    try:
        for claim in (c for c in CLAIMS if c.name in names):
            _run_claim(claim, out, deadline, smoke, stats)
    except KeyboardInterrupt:  # the deadline: a sweep has already merged its finished points
        print("[claims] worker interrupted", flush=True)
        return 130
    return 0


def _run_claim(claim: Claim, out: Path, deadline: float, smoke: bool, stats: CompileStats) -> None:
    left = deadline - time.time()
    if left < claim.min_s:
        why = f"{left:.0f} s left, it needs ~{claim.min_s:.0f} s"
        print(f"[claims] skip {claim.name}: over budget ({why})", flush=True)
        _log(out, event="claim", claim=claim.name, status="skipped", reason=why)
        return
    print(f"[claims] {claim.name}: start ({left:.0f} s left)", flush=True)
    _log(out, event="begin", claim=claim.name)
    t0, before = time.time(), stats.snapshot()
    try:
        if claim.name == "vs_transformers":
            detail = _run_vs_transformers(claim, out, list(claim.smoke if smoke else VS_ARGS))
        else:
            overrides = [*SMOKE_ENGINE, *claim.smoke] if smoke else []
            detail = _run_sweep_claim(claim, out, overrides)
        status = "failed" if detail.get("failed_points") else "ok"
    except Exception:
        detail, status = {"error": traceback.format_exc().strip().splitlines()[-1]}, "failed"
        traceback.print_exc()
    after = stats.snapshot()
    seconds = time.time() - t0
    record = dict(
        claim=claim.name, status=status, seconds=round(seconds, 1),
        compiles=after[0] - before[0], compile_s=round(after[1] - before[1], 1),
        persistent_cache_hits=after[2] - before[2], **detail,
    )  # fmt: skip
    _log(out, event="claim", **record)
    print(f"[claims] {claim.name}: {status} in {seconds:.0f} s "
          f"({record['compiles']} compiles, {record['compile_s']} s; "
          f"{record['persistent_cache_hits']} persistent-cache hits)", flush=True)  # fmt: skip
    gc.collect()  # the finished engines' params and KV cache, before the next claim's


# ---------------------------------------------------------------------------- this process


def check_shared_engine() -> None:
    """Fail fast, before any device time, if the claims' engines would not share executables."""
    import yaml

    from jaxinfer.engine.config import EngineConfig

    engines = {
        c.name: EngineConfig(**yaml.safe_load(c.config.read_text())["engine"]) for c in CLAIMS
    }
    for key in SHARED_ENGINE_KEYS:
        values = {name: getattr(e, key) for name, e in engines.items()}
        if len(set(values.values())) > 1:
            raise SystemExit(f"engine.{key} differs between the claims' h200.yaml: {values}")


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jaxinfer_jax_cache")  # bench_e2e's too
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # claim 3: torch gets the rest
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_worker(out: Path, deadline: float, args: argparse.Namespace, grace_s: float) -> str:
    """Run the worker until it exits or the deadline; 'finished' or what stopped it."""
    cmd = [sys.executable, __file__, "--worker", "--out", str(out), "--deadline", str(deadline),
           "--claims", *args.claims] + (["--smoke"] if args.smoke else [])  # fmt: skip
    proc = subprocess.Popen(cmd, env=worker_env(), cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        return "finished" if rc == 0 else f"worker exited with code {rc}"
    except subprocess.TimeoutExpired:
        print("[claims] deadline: interrupting the worker (finished points are kept)", flush=True)
        proc.send_signal(signal.SIGINT)  # a sweep merges its finished points on KeyboardInterrupt
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return "stopped at the deadline"


def remove_unfinished_points(out: Path) -> None:
    for tmp in out.glob("*/points/.*.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def write_reports(out: Path) -> None:
    from jaxinfer.experiment.report import write_report

    for claim in CLAIMS:
        folder = out / claim.name
        if (folder / "sweep.json").is_file() and any((folder / "points").glob("*/metrics.json")):
            write_report([folder], folder / "report")


def collect_log(out: Path, stopped: str, args: argparse.Namespace, started: float) -> dict:
    from jaxinfer.provenance import git_commit

    log = out / LOG
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    start = next((r for r in records if r["event"] == "start"), {})
    begun = {r["claim"] for r in records if r["event"] == "begin"}
    claims = {r["claim"]: {k: v for k, v in r.items() if k != "event"}
              for r in records if r["event"] == "claim"}  # fmt: skip
    for name in args.claims:  # the claim running when the worker stopped, and those never reached
        why = "interrupted (finished points kept)" if name in begun else "not reached"
        claims.setdefault(name, {"claim": name, "status": f"{why}: {stopped}"})
    run = {
        **start.get("provenance", {"commit": git_commit()}),
        "command": " ".join([sys.executable, *sys.argv]),
        "smoke": args.smoke,
        "budget_s": args.budget_s,
        "total_s": round(time.time() - started, 1),
        "worker": stopped,
        "compilation_cache_dir": worker_env()["JAX_COMPILATION_CACHE_DIR"],
        "claims": [claims[name] for name in args.claims],
    }
    (out / RUN_FILE).write_text(json.dumps(run, indent=2))
    log.unlink(missing_ok=True)
    return run


def pack(out: Path, archive: Path) -> None:
    """`archive` (.tar.gz) holding `out` under its own name: `tar -xzf` in results/ records it."""
    import tarfile

    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(out, arcname=out.name)
    print(f"[claims] packed {out} into {archive} ({archive.stat().st_size / 2**20:.1f} MiB)")


def point_rows(out: Path) -> list[dict]:
    """One row per finished point of every sweep claim: the numbers to judge the run by."""
    from jaxinfer.experiment.report import load_points

    rows = []
    for claim in CLAIMS:
        folder = out / claim.name
        if not (folder / "sweep.json").is_file():
            continue
        for p in load_points([folder])[0]:
            m = p.metrics
            name = p.name.replace("engine.", "")  # the summary's width: keys are engine keys
            rows.append(dict(point=f"{claim.name}/{name}", **{
                "out tok/s": m.get("output_throughput"), "tok/s": m.get("total_token_throughput"),
                "TTFT p50 ms": _ms(m.get("ttft_median")), "TPOT p50 ms": _ms(m.get("tpot_median")),
                "ITL p99 ms": _ms(m.get("itl_p99")), "seqs/step": m.get("mean_num_seqs"),
                "KV waste": m.get("wasted_slot_fraction_mean"),
                "preempt": m.get("total_preemptions"), "warm-up s": m.get("warmup_s"),
                "serve s": m.get("duration_s"), "late compiles": m.get("compiles_after_warmup"),
            }))  # fmt: skip
    vs = out / "vs_transformers.json"
    if vs.is_file():
        for r in json.loads(vs.read_text())["rows"]:
            name = r["impl"] + (f" b{r['batch_size']}" if "batch_size" in r else "")
            rows.append({"point": f"vs_transformers/{name}", "out tok/s": r["output_tok_s"],
                         "warm-up s": r.get("warmup_s"), "serve s": r["elapsed_s"],
                         "late compiles": r.get("compiles_after_warmup")})  # fmt: skip
    return rows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def print_summary(out: Path, run: dict) -> None:
    import claims_table  # experiments/, this script's folder, is on sys.path
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    figures = {c.name: c.figure(out) for c in claims_table.CLAIMS}
    table = Table(title=f"claims on {run.get('device', '?')} (commit {run.get('commit')})")
    for col in ("claim", "status", "wall s", "compiles", "compile s", "cache hits", "figure"):
        table.add_column(col, overflow="fold")
    for r in run["claims"]:
        cells = [r.get(k) for k in ("seconds", "compiles", "compile_s", "persistent_cache_hits")]
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        status += "".join(f"; {k}: {v}" for k, v in r.get("failed_points", {}).items())
        status += f"; {r['error']}" if r.get("error") else ""
        table.add_row(r["claim"], status, *("-" if c is None else str(c) for c in cells),
                      figures.get(r["claim"]) or "-")  # fmt: skip
    console.print(table)
    rows = point_rows(out)
    if rows:
        points = Table(title="points")
        points.add_column("point", no_wrap=True, min_width=max(len(r["point"]) for r in rows))
        for col in list(rows[0])[1:]:
            points.add_column(col, justify="right")
        for row in rows:
            points.add_row(*(_fmt(row.get(col)) for col in rows[0]))
        console.print(points)
    console.print(f"total {run['total_s']} s of a {run['budget_s']} s budget; worker "
                  f"{run['worker']}; results in {out}")  # fmt: skip


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1 else f"{v:,.1f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="results folder, e.g. /tmp/claims/h200")
    ap.add_argument("--archive", type=Path, default=None, help="also pack it into this .tar.gz")
    ap.add_argument("--budget-s", type=float, default=540.0, help="for the whole run")
    ap.add_argument("--report-reserve-s", type=float, default=30.0,
                    help="kept back from the worker for reports and the summary")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="tiny preset, a few requests")
    ap.add_argument("--claims", nargs="+", default=[c.name for c in CLAIMS],
                    choices=[c.name for c in CLAIMS], help="a subset (run in the usual order)")  # fmt: skip
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.out, args.deadline, args.smoke, args.claims)

    started = time.time()
    check_shared_engine()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / LOG).unlink(missing_ok=True)
    deadline = started + args.budget_s - args.report_reserve_s
    args.claims = [c.name for c in CLAIMS if c.name in args.claims]
    print(f"[claims] {', '.join(args.claims)} into {args.out}; budget {args.budget_s:.0f} s; "
          f"compilation cache {worker_env()['JAX_COMPILATION_CACHE_DIR']}", flush=True)  # fmt: skip
    stopped = run_worker(args.out, deadline, args, grace_s=args.report_reserve_s / 2)
    remove_unfinished_points(args.out)
    try:
        write_reports(args.out)
    except Exception:
        traceback.print_exc()
    run = collect_log(args.out, stopped, args, started)
    if args.archive is not None:
        pack(args.out, args.archive)
    print_summary(args.out, run)
    return 0 if all(r["status"] == "ok" for r in run["claims"]) else 1


if __name__ == "__main__":
    sys.exit(main())
