"""A served model's latency-throughput curve: `jaxinfer serve` once, `jaxinfer bench serve` at
each request rate against it, and the points gathered into one results file and a plot.

    python experiments/serve_curve.py configs/bench/engine_llama3_8b.yaml --rates 4 8 16 32 64 inf \
        --num-prompts 256 --out $OUT/serve_llama3_8b.json --plot $OUT/serve_llama3_8b.png \
        --serve engine.max_num_seqs=128 engine.max_model_len=1024 engine.num_pages=8192 \
        --bench workload.prompt_len.value=512 workload.output_len.value=128 slo.ttft=0.5 slo.tpot=0.05
    python experiments/serve_curve.py --model tiny --rates inf --num-prompts 8 --out /tmp/c.json
    python experiments/serve_curve.py --model tiny --rates inf --num-prompts 3000 --offline \
        --out experiments/results/cpu/serve_load_tiny.json --bench max_concurrency=256 \
        workload.prompt_len.value=16 workload.output_len.value=8      # a load test, and the HTTP cost

The server is one child process (its own process group, stopped at the end or on an error); each
rate is one `bench serve` child writing its run folder under `--work` (`rate_<r>/`). The results
file is rewritten after every rate, so an interrupted curve keeps the rates it finished, and a
rate whose bench fails is an error row (the next rate still runs). Each row carries the client's
metrics of that rate (the definitions of `jaxinfer/serve/bench.py`), the server's compiles after
warm-up, the server's resident memory after the rate (`server_rss_mb`, Linux), and its run folder.

`--offline` then runs the `inf` rate's workload (the bench's resolved workload, sampling and SLOs)
through `jaxinfer run` with the server's engine config, in-process, no HTTP: `offline` is its row
and `http_overhead` = 1 - served output tok/s / offline output tok/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from jaxinfer.provenance import provenance

ROW_KEYS = (
    "num_completed", "num_failed", "duration_s", "request_throughput", "output_throughput",
    "total_token_throughput", "ttft_median", "ttft_p99", "tpot_median", "tpot_p99", "itl_p99",
    "e2e_median", "e2e_p99", "goodput", "slo_attainment", "compiles_after_warmup",
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until GET url answers 200; RuntimeError if the server exits or time runs out."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not healthy within --start-timeout-s {timeout_s:g}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def rss_mb(pid: int) -> float | None:
    """Resident memory of process `pid` in MB (None where /proc is not there)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def run_offline(args, work: Path, cli: list[str]) -> dict:
    """The `inf` rate's workload through `jaxinfer run` (no server): its metrics row."""
    from omegaconf import OmegaConf

    bench = OmegaConf.load(work / "rate_inf" / "config.yaml")
    base = OmegaConf.load(args.config) if args.config else OmegaConf.create(
        {"engine": {"model": args.model}})  # fmt: skip
    engine = [o for o in args.serve if o.startswith("engine.")]  # (serve.* is the server's)
    cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(engine))
    cfg = OmegaConf.merge({k: v for k, v in cfg.items() if k == "engine"}, {
        "name": "offline", "out_dir": str(work / "offline"), "workload": bench.workload,
        "sampling": bench.sampling, "slo": bench.slo})  # fmt: skip
    OmegaConf.save(cfg, work / "offline.yaml")
    cmd = [*cli, "run", str(work / "offline.yaml"), "--overwrite", "--no-progress"]
    row = {"rate": "offline", "run_dir": str(work / "offline"), "command": cmd}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bench_timeout_s)
        if proc.returncode:
            raise RuntimeError(f"jaxinfer run exited {proc.returncode}: {proc.stderr[-800:]}")
        metrics = json.loads((work / "offline" / "metrics.json").read_text())
        row.update({k: metrics.get(k) for k in ROW_KEYS})
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
        row["error"] = f"{type(e).__name__}: {e}"[:1000]
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if "error" not in r]
    x = [r["output_throughput"] for r in good]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, label) in zip(axes, (("ttft", "TTFT (s)"), ("tpot", "TPOT (s)")), strict=True):
        for q, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(x, [r[f"{key}_{q}"] for r in good], style, label=q)
        for r in good:
            ax.annotate(r["rate"], (r["output_throughput"], r[f"{key}_median"]), fontsize=7)
        ax.set_xlabel("output tok/s (client)")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=None, help="the server's config (serve)")
    ap.add_argument("--model", default=None, help="serve --model (instead of a config)")
    ap.add_argument(
        "--rates", nargs="+", type=float, required=True, help="req/s (inf: all at once)"
    )
    ap.add_argument("--num-prompts", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None, help="run folders (default: next to --out)")
    ap.add_argument("--serve", nargs="*", default=[], metavar="KEY=VALUE", help="serve overrides")
    ap.add_argument("--bench", nargs="*", default=[], metavar="KEY=VALUE", help="bench overrides")
    ap.add_argument("--start-timeout-s", type=float, default=900.0)
    ap.add_argument("--bench-timeout-s", type=float, default=1800.0, help="per rate")
    ap.add_argument(
        "--offline",
        action="store_true",
        help="also run the inf rate's workload offline (jaxinfer run): the HTTP cost",
    )
    args = ap.parse_args(argv)
    if (args.config is None) == (args.model is None):
        ap.error("give the server's config or --model (one of them)")
    if any(r <= 0 for r in args.rates):
        ap.error(f"--rates: each must be > 0 (inf: all at once), got {args.rates}")
    if args.offline and not any(math.isinf(r) for r in args.rates):
        ap.error("--offline compares with the inf rate: add inf to --rates")
    work = args.work or args.out.with_suffix("").with_name(args.out.stem + "_runs")
    work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cli = [sys.executable, "-m", "jaxinfer.cli"]
    serve_cmd = [*cli, "serve", *([args.config] if args.config else ["--model", args.model]),
                 "--port", str(port), "serve.log_level=warning", *args.serve]  # fmt: skip
    result = {**provenance([sys.executable, *(sys.argv if argv is None else [__file__, *argv])]),
              "serve_command": serve_cmd, "port": port, "rows": []}  # fmt: skip

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    log = open(work / "server.log", "w")  # noqa: SIM115 (the server's whole life)
    server = subprocess.Popen(serve_cmd, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        result["server_start_s"] = round(wait_healthy(f"{base}/health", server,
                                                      args.start_timeout_s), 1)  # fmt: skip
        save()
        for rate in args.rates:
            run_dir = work / f"rate_{rate_name(rate)}"
            cmd = [*cli, "bench", "serve", "--base-url", f"{base}/v1", "--request-rate",
                   rate_name(rate), "--num-prompts", str(args.num_prompts), "--out", str(run_dir),
                   "--overwrite", "--no-progress", *args.bench]  # fmt: skip
            row = {"rate": rate_name(rate), "run_dir": str(run_dir), "command": cmd}
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      timeout=args.bench_timeout_s)  # fmt: skip
                if proc.returncode:
                    raise RuntimeError(f"bench exited {proc.returncode}: {proc.stderr[-800:]}")
                metrics = json.loads((run_dir / "metrics.json").read_text())
                row.update({k: metrics.get(k) for k in ROW_KEYS})
            except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
                row["error"] = f"{type(e).__name__}: {e}"[:1000]
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            row["server_rss_mb"] = rss_mb(server.pid)
            result["rows"].append(row)
            save()
            print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
            if server.poll() is not None:
                result["error"] = f"the server exited with {server.returncode} (server.log)"
                break
    except RuntimeError as e:
        result["error"] = str(e)
    finally:
        stop(server)
        log.close()
        save()
    served = [r for r in result["rows"] if r["rate"] == "inf" and "error" not in r]
    if args.offline and served:
        offline = result["offline"] = run_offline(args, work, cli)
        if offline.get("output_throughput") and served[0]["output_throughput"]:
            result["http_overhead"] = round(
                1 - served[0]["output_throughput"] / offline["output_throughput"], 4
            )
        save()
        print(json.dumps({k: v for k, v in offline.items() if k != "command"}), flush=True)
    if args.plot is not None and any("error" not in r for r in result["rows"]):
        plot(result["rows"], args.plot, f"{args.model or args.config}: served, client-side")
    rows = [*result["rows"], *([result["offline"]] if "offline" in result else [])]
    return 1 if "error" in result or any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
