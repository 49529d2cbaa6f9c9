"""`jaxinfer run CONFIG [key=value ...]`: one serving experiment, arrivals honoured on the wall clock.

Writes a results folder: `config.yaml` (resolved), `env.json` (device, jax, commit, date, command),
`metrics.json` (summary), `requests.parquet` and `steps.parquet` (per request / per step).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.loading import load_model
from jaxinfer.engine.request import SamplingParams
from jaxinfer.metrics import SLO, request_rows, summarize, write_tables
from jaxinfer.parallel.sharding import EngineShardings
from jaxinfer.provenance import provenance
from jaxinfer.workload import WorkloadSpec, build_workload


@dataclass
class SamplingDefaults:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    ignore_eos: bool = True  # benchmarks generate exactly the workload's output lengths
    # None: each request's max_tokens is its workload output length (the server knows it). A number:
    # max_tokens = min(this, max_model_len - prompt) and the request ends at its workload length
    # through `eos_after`, unknown to the server (what reserve-max allocation has to plan for).
    max_tokens: int | None = None


@dataclass
class SLOSpec:
    ttft: float | None = None
    tpot: float | None = None


@dataclass
class RunConfig:
    name: str = "run"
    out_dir: str = "runs/${name}"
    engine: EngineConfig = field(default_factory=EngineConfig)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    slo: SLOSpec = field(default_factory=SLOSpec)


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Schema <- YAML <- dotted overrides. Errors name the key, the value and what is allowed."""
    try:
        cfg = OmegaConf.structured(RunConfig)
        if path is not None:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        rc = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ValueError(f"invalid run config {path or ''}: {e}") from e
    rc.workload.validate()
    return rc


def run_experiment(rc: RunConfig, *, show_progress: bool = True, console: Console | None = None):
    console = console or Console()
    if rc.engine.data_parallel > 1:
        raise ValueError(
            f"engine.data_parallel={rc.engine.data_parallel}: an experiment run measures one "
            f"engine replica (its timings are per replica); replicas are served through the LLM "
            f"API (experiments/bench_data_parallel.py). To use N GPUs for a sweep, run `jaxinfer "
            f"sweep --workers N` (one worker per GPU)."
        )  # fmt: skip
    mesh = EngineShardings.for_config(rc.engine.mesh).mesh
    cfg, params, tokenizer = load_model(rc.engine.model, rc.engine.dtype, rc.engine.seed, mesh)
    engine = Engine(rc.engine, cfg, params, tokenizer)
    warmup_s = engine.warmup()
    encode = (lambda s: tokenizer.encode(s).ids) if tokenizer is not None else None
    workload = build_workload(rc.workload, cfg.vocab_size, encode)
    pending = deque(sorted(workload, key=lambda r: r.arrival_time))
    s = rc.sampling

    t0 = engine.clock()
    columns = (
        TextColumn(f"[bold]{rc.name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )  # fmt: skip
    with Progress(*columns, console=console, disable=not show_progress) as progress:
        task = progress.add_task("requests", total=len(workload))
        done = 0
        while pending or engine.has_unfinished():
            now = engine.clock() - t0
            while pending and pending[0].arrival_time <= now:
                req = pending.popleft()
                prompt = req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt
                sampling = SamplingParams(
                    max_tokens=_max_tokens(rc, req), temperature=s.temperature, top_k=s.top_k,
                    top_p=s.top_p, min_p=s.min_p, ignore_eos=s.ignore_eos,
                    eos_after=None if s.max_tokens is None else req.output_len,
                )  # fmt: skip
                seq = engine.add_request(prompt, sampling, arrival_time=t0 + req.arrival_time)
                done += seq.is_finished  # rejected on arrival
            if engine.has_unfinished():
                done += sum(out.finished for out in engine.step())
            elif pending:
                time.sleep(max(0.0, min(0.01, pending[0].arrival_time - now)))
            progress.update(task, completed=done)

    rows = request_rows(engine.sequences)
    metrics = summarize(
        rows, engine.step_records, SLO(rc.slo.ttft, rc.slo.tpot),
        max_num_seqs=rc.engine.max_num_seqs,
    )  # fmt: skip
    metrics.update(
        warmup_s=round(warmup_s, 3),
        compiles_after_warmup=engine.compiles_after_warmup,
        num_requests=len(workload),
        failed_errors=sorted({q.error for q in engine.sequences if q.error}),
    )
    out = Path(rc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(rc)))
    env = provenance()
    metrics = {**env, **metrics}  # every results file says where, on what and how it was made
    (out / "env.json").write_text(json.dumps(env, indent=2))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    write_tables(out, rows, engine.step_records)
    console.print(summary_table(rc.name, metrics))
    console.print(f"results: {out}")
    return metrics


def _max_tokens(rc: RunConfig, req) -> int:
    if rc.sampling.max_tokens is None:
        return req.output_len
    prompt_len = req.prompt_len if req.prompt_len is not None else 0
    return max(1, min(rc.sampling.max_tokens, rc.engine.max_model_len - prompt_len))


def summary_table(name: str, m: dict) -> Table:
    table = Table(title=f"{name}: summary")
    table.add_column("metric")
    table.add_column("value", justify="right")

    def fmt(v):
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    keys = (
        "num_completed", "num_failed", "duration_s", "request_throughput", "output_throughput",
        "total_token_throughput", "ttft_median", "ttft_p99", "tpot_median", "tpot_p99",
        "itl_median", "itl_p99", "e2e_median", "kv_use_mean", "kv_use_max",
        "wasted_slot_fraction_mean", "total_preemptions", "host_ms_mean", "device_ms_mean",
        "warmup_s", "compiles_after_warmup",
    )  # fmt: skip
    for k in keys:
        if k in m:
            table.add_row(k, fmt(m[k]))
    return table
