"""`jaxinfer run CONFIG [key=value ...]`: one serving experiment, arrivals honoured on the wall clock.

Writes a results folder: `config.yaml` (resolved) and `env.json` (device, jax, commit, date,
command) first; `requests.parquet` and `steps.parquet` (per request / per step) as the run goes
(parts in `<table>.parts/`, merged at the end: `TableAppender`); `metrics.json` (summary) last.
Finished sequences and step records leave the engine once they are in the tables, so host memory
does not grow with the number of requests (the summary reads the tables back once, at the end).

A run stopped by SIGINT (or SIGTERM, inside `stop_on_signals`) keeps what it did: the tables of
the requests that finished and the steps that ran, and a `metrics.json` of that part marked
`"interrupted": "SIGINT"`; then it raises `RunInterrupted`, whose message says what was kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.loading import load_model
from jaxinfer.engine.request import SamplingParams, Sequence
from jaxinfer.metrics import SLO, request_rows, summarize
from jaxinfer.metrics.tables import TableAppender
from jaxinfer.parallel.sharding import EngineShardings
from jaxinfer.provenance import provenance
from jaxinfer.workload import WorkloadSpec, build_workload

# Table parts are written 1, 2, 4 and 8 s into serving, then every 10 s: a short run has its
# tables early, a long one writes few parts (each flush stalls the serving loop a few ms).
FIRST_FLUSH_S = 1.0
MAX_FLUSH_INTERVAL_S = 10.0


class SweepConfigError(ValueError):
    """`jaxinfer run` of a config with a `sweep:` section (that is `jaxinfer sweep`'s)."""


class Signalled(KeyboardInterrupt):
    """Raised by `stop_on_signals`' handler; `signum` is the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by a signal once it kept what it did; the message says what it kept.

    `compiling`: stopped during the warm-up, whose XLA compiles go on in their threads (a compile
    cannot be cancelled, and the interpreter's exit waits for the thread pool's threads)."""

    def __init__(self, message: str, signum: int, compiling: bool) -> None:
        super().__init__(message)
        self.signum, self.compiling = signum, compiling

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's code for a process ended by the signal

    def exit_now_if_compiling(self) -> None:
        """For a command line stopped during the warm-up: end the process now (`os._exit`), as
        its exit would wait for the compiles still running (seconds to minutes). The kept files
        are written and closed by then; only stdout and stderr need flushing."""
        if self.compiling:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self.exit_code)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM raise `Signalled` in the main thread (SIGTERM would otherwise
    end the process at once), so a run stops cleanly. Elsewhere than the main thread: no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame) -> None:
        raise Signalled(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


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
            file_cfg = OmegaConf.load(path)
            if isinstance(file_cfg, DictConfig) and "sweep" in file_cfg:
                raise SweepConfigError(
                    f"config {path} has a `sweep:` section: run it with `jaxinfer sweep {path}`"
                )
            cfg = OmegaConf.merge(cfg, file_cfg)
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        rc = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ValueError(f"invalid run config {path or ''}: {e}") from e
    rc.workload.validate()
    return rc


def run_experiment(rc: RunConfig, *, show_progress: bool = True, console: Console | None = None):
    """Run `rc` into its `out_dir` (see the module docstring); the metrics. A KeyboardInterrupt
    (SIGINT, or `Signalled`) stops it: what it did is kept, then `RunInterrupted` is raised."""
    console = console or Console()
    if rc.engine.data_parallel > 1:
        raise ValueError(
            f"engine.data_parallel={rc.engine.data_parallel}: an experiment run measures one "
            f"engine replica (its timings are per replica); replicas are served through the LLM "
            f"API (experiments/bench_data_parallel.py). To use N GPUs for a sweep, run `jaxinfer "
            f"sweep --workers N` (one worker per GPU)."
        )  # fmt: skip
    out = Path(rc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").unlink(missing_ok=True)  # an earlier run's: the folder is this run's
    tables = TableAppender(out)  # (removes an earlier run's tables)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(rc)))
    env = provenance()  # every results file says where, on what and how it was made
    (out / "env.json").write_text(json.dumps(env, indent=2))

    phase, engine, warmup_s, workload = "model loading", None, 0.0, []
    try:
        mesh = EngineShardings.for_config(rc.engine.mesh).mesh
        cfg, params, tokenizer = load_model(rc.engine.model, rc.engine.dtype, rc.engine.seed, mesh)
        engine = Engine(rc.engine, cfg, params, tokenizer)
        encode = (lambda s: tokenizer.encode(s).ids) if tokenizer is not None else None
        workload = build_workload(rc.workload, cfg.vocab_size, encode)
        phase = "warm-up"
        console.print(f"{rc.name}: warm-up (compiling every batch shape)")
        warmup_s = _warm_up(engine)
        phase = "serving"
        _serve(rc, engine, workload, tables, show_progress=show_progress, console=console)
        metrics = _metrics(rc, env, *tables.finish(), engine, warmup_s, len(workload))
        _write_json(out / "metrics.json", metrics)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        name = signal.Signals(signum).name
        if phase != "serving":
            raise RunInterrupted(
                f"interrupted by {name} during the {phase}: kept config.yaml and env.json in "
                f"{out}; no request ran, so no tables and no metrics.json",
                signum, compiling=phase == "warm-up",
            ) from e  # fmt: skip
        _take_rest(engine, tables)
        rows, steps = tables.finish()
        metrics = _metrics(rc, env, rows, steps, engine, warmup_s, len(workload))
        _write_json(out / "metrics.json", {**metrics, "interrupted": name})
        raise RunInterrupted(
            f"interrupted by {name} after {len(rows)} of {len(workload)} requests: kept in {out} "
            f"config.yaml, env.json, requests.parquet ({len(rows)} finished requests), "
            f"steps.parquet ({len(steps)} steps) and metrics.json of the finished part",
            signum, compiling=False,
        ) from e  # fmt: skip
    console.print(summary_table(rc.name, metrics))
    console.print(f"results: {out}")
    return metrics


def _warm_up(engine: Engine) -> float:
    """`engine.warmup()` in a helper thread while this one waits with a timeout, so a signal acts
    at once: a KeyboardInterrupt raised inside the warm-up itself would wait for every compile
    already queued in the runner's thread pool (`model_runner.py` does not cancel them).
    (JAX's thread-local settings, e.g. `jax.default_device(...)`, do not reach the helper.)"""
    result: dict = {}

    def target() -> None:
        try:
            result["s"] = engine.warmup()
        except BaseException as e:  # re-raised in the calling thread
            result["error"] = e

    thread = threading.Thread(target=target, name="jaxinfer-warmup", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if "error" in result:
        raise result["error"]
    return result["s"]


def _serve(rc: RunConfig, engine: Engine, workload, tables: TableAppender, *,
           show_progress: bool, console: Console) -> None:  # fmt: skip
    """Feed the workload at its arrival times until every request has finished, moving finished
    sequences and step records from the engine into `tables` as they come."""
    pending = deque(sorted(workload, key=lambda r: r.arrival_time))
    s = rc.sampling
    t0 = engine.clock()
    next_flush = FIRST_FLUSH_S
    columns = (
        TextColumn(f"[bold]{rc.name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )  # fmt: skip
    with Progress(*columns, console=console, disable=not show_progress) as progress:
        task = progress.add_task("requests", total=len(workload))
        while pending or engine.has_unfinished():
            now = engine.clock() - t0
            finished = []
            while pending and pending[0].arrival_time <= now:
                req = pending.popleft()
                prompt = req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt
                sampling = SamplingParams(
                    max_tokens=_max_tokens(rc, req), temperature=s.temperature, top_k=s.top_k,
                    top_p=s.top_p, min_p=s.min_p, ignore_eos=s.ignore_eos,
                    eos_after=None if s.max_tokens is None else req.output_len,
                )  # fmt: skip
                seq = engine.add_request(prompt, sampling, arrival_time=t0 + req.arrival_time)
                if seq.is_finished:  # rejected on arrival
                    finished.append(seq)
            if engine.has_unfinished():
                finished += [out.seq for out in engine.step() if out.finished]
            elif pending:
                time.sleep(max(0.0, min(0.01, pending[0].arrival_time - now)))
            _take(engine, tables, finished)
            if now >= next_flush:
                tables.flush()
                next_flush = now + min(MAX_FLUSH_INTERVAL_S, max(FIRST_FLUSH_S, now))
            progress.update(task, completed=tables.num_requests)
    _take_rest(engine, tables)


def _take(engine: Engine, tables: TableAppender, finished: list[Sequence]) -> None:
    """Finished sequences into request rows and step records into step rows, out of the engine."""
    if finished:
        tables.add_requests(request_rows(finished))
        engine.release(finished)
    n = len(engine.step_records)
    if n:
        tables.add_steps(engine.step_records[:n])
        del engine.step_records[:n]


def _take_rest(engine: Engine, tables: TableAppender) -> None:
    """`_take` what is still in the engine: finished sequences no step reported, and, after an
    interruption (which can fall between any two lines of `_take`), what `_take` had not moved.
    Rows appended but not yet out of the engine are still in `tables`' unflushed buffer (`_take`
    appends, then removes; a flush comes only after it), so they are not appended twice."""
    appended = {r["seq_id"] for r in tables.request_rows}
    rest = [q for q in engine.sequences if q.is_finished and q.seq_id not in appended]
    kept_steps = {id(r) for r in tables.steps}
    engine.step_records[:] = [r for r in engine.step_records if id(r) not in kept_steps]
    _take(engine, tables, rest)


def _metrics(rc: RunConfig, env: dict, rows: list[dict], steps: list[dict], engine: Engine,
             warmup_s: float, num_requests: int) -> dict:  # fmt: skip
    metrics = summarize(
        rows, steps, SLO(rc.slo.ttft, rc.slo.tpot), max_num_seqs=rc.engine.max_num_seqs
    )
    metrics.update(
        warmup_s=round(warmup_s, 3),
        compiles_after_warmup=engine.compiles_after_warmup,
        num_requests=num_requests,
        failed_errors=sorted({r["error"] for r in rows if r["error"]}),
    )
    return {**env, **metrics}


def _write_json(path: Path, data: dict) -> None:
    """Written whole or not at all (a tmp file renamed): a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


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
