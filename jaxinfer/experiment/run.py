"""`jaxinfer run CONFIG [key=value ...]`: one serving experiment, arrivals honoured on the wall clock.

Writes a results folder: `config.yaml` (resolved) and `env.json` (device, jax, commit, date,
command) first; `requests.parquet` and `steps.parquet` (per request / per step) as the run goes
(parts in `<table>.parts/`, merged at the end: `TableAppender`); `metrics.json` (summary) last.
Finished sequences and step records leave the engine once they are in the tables, so host memory
does not grow with the number of requests (the summary reads the tables back once, at the end).

The folder is the caller's: `run_experiment` writes into `out_dir` as given (a sweep gives each
point a fresh one). `jaxinfer run` never writes into another run's folder unasked: when `out_dir`
is not empty it takes a new timestamped sibling (`fresh_results_dir`) unless `--overwrite`.
Config errors are found before anything is written: values at `load_run_config`, what the model
cannot serve (from its config, no weights) at `preflight`.

A run stopped by SIGINT (or SIGTERM, inside `stop_on_signals`) keeps what it did: the tables of
the requests that finished and the steps that ran, and a `metrics.json` of that part marked
`"interrupted": "SIGINT"`; then it raises `RunInterrupted`, whose message says what was kept.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jaxinfer.config_file import load_config, to_yaml
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.loading import load_model, model_config
from jaxinfer.engine.request import SamplingParams, Sequence
from jaxinfer.metrics import SLO, request_rows, summarize
from jaxinfer.metrics.tables import TableAppender
from jaxinfer.parallel.sharding import EngineShardings
from jaxinfer.provenance import provenance
from jaxinfer.workload import LengthSpec, WorkloadSpec, build_workload

# Table parts are written 1, 2, 4 and 8 s into serving, then every 10 s: a short run has its
# tables early, a long one writes few parts (each flush stalls the serving loop a few ms).
FIRST_FLUSH_S = 1.0
MAX_FLUSH_INTERVAL_S = 10.0
MAX_FAILURE_KINDS = 3  # kinds of request error the run's failure summary shows (metrics: all)


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


# signals `stop_on_signals`' handler raised that no run has taken yet (`raise_caught_signal`)
_caught: list[int] = []


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM raise `Signalled` in the main thread (SIGTERM would otherwise
    end the process at once), so a run stops cleanly. Elsewhere than the main thread: no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame) -> None:
        _caught.append(signum)
        raise Signalled(signum)

    _caught.clear()
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _caught.clear()


def raise_caught_signal() -> None:
    """`Signalled` again for a signal whose handler's exception was lost: a handler runs between
    any two bytecodes, also inside a gc or finalizer callback (jax has one), where Python prints
    an exception and drops it. The run loop calls this, so such a signal still stops the run."""
    if _caught:
        raise Signalled(_caught[-1])


@dataclass
class SamplingDefaults:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # (penalties and logit biases need engine.penalties: true)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
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


def load_run_config(path: str | Path | None, overrides: Seq[str] = ()) -> RunConfig:
    """Schema <- YAML <- dotted overrides, then the sampling and workload values checked (before
    any model is loaded). One-line ValueErrors name the key, the value and what is allowed."""

    def no_sweep(file_cfg: DictConfig) -> DictConfig:
        if "sweep" in file_cfg:
            raise SweepConfigError(
                f"config {path} has a `sweep:` section: run it with `jaxinfer sweep {path}`"
            )
        return file_cfg

    rc = load_config(RunConfig, path, overrides, what="run", select=no_sweep)
    _check_values(rc)
    return rc


def _sampling_params(s: SamplingDefaults, max_tokens: int, eos_after: int | None = None):
    return SamplingParams(
        max_tokens=max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
        min_p=s.min_p, ignore_eos=s.ignore_eos, eos_after=eos_after,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
    )  # fmt: skip


def _check_values(rc: RunConfig) -> None:
    """The sampling and workload sections, and whether any request of the workload can fit the
    engine: every bad value is refused here, before a warm-up, naming its config key (at run
    time each request would fail alone, with the reason only in metrics.json)."""
    s = rc.sampling
    if s.max_tokens is not None and (isinstance(s.max_tokens, bool) or s.max_tokens < 1):
        raise ValueError(
            f"sampling.max_tokens={s.max_tokens!r} is invalid: must be null (each request's "
            f"workload output length) or an int >= 1"
        )
    try:
        sp = _sampling_params(s, max_tokens=s.max_tokens or 1)
    except ValueError as e:
        raise ValueError(str(e).replace("SamplingParams.", "sampling.", 1)) from None
    if sp.uses_penalties and not rc.engine.penalties:
        raise ValueError("sampling's penalties need engine.penalties=true (the engine compiles "
                         "its sampling with them)")  # fmt: skip
    try:
        rc.workload.validate()
    except ValueError as e:
        raise ValueError(f"workload.{e}") from None
    _check_shortest_request_fits(rc)


def _least(length: LengthSpec) -> int:
    return length.value if length.dist == "fixed" else length.lo  # (lognormal: clipped to lo)


def _check_shortest_request_fits(rc: RunConfig) -> None:
    """Refuse a workload none of whose requests the engine would admit (the scheduler refuses a
    prompt + max_tokens over max_model_len; EngineConfig a KV pool too small for one request of
    max_model_len tokens, so one that fits there fits the pool). A request's
    total is nondecreasing in its prompt and output lengths, so the shortest decides. (A trace's
    lengths are known only once it is read: its requests are checked one by one as they come.)"""
    w, e = rc.workload, rc.engine
    if w.kind == "trace":
        return
    shared = w.kind in ("shared_prefix", "multi_turn")  # (a first turn has the system prompt)
    prompt = _least(w.prompt_len) + (w.system_prompt_len if shared else 0)
    prompt_keys = "workload.prompt_len" + (" + workload.system_prompt_len" if shared else "")
    if rc.sampling.max_tokens is None:
        out, out_key = _least(w.output_len), "workload.output_len"
    else:  # as `_max_tokens`
        out = max(1, min(rc.sampling.max_tokens, e.max_model_len - prompt))
        out_key = "sampling.max_tokens, cut to engine.max_model_len"
    total = prompt + out
    shortest = (
        f"the shortest request has {prompt} prompt tokens ({prompt_keys}) + {out} output tokens "
        f"({out_key}) = {total}"
    )
    if total > e.max_model_len:
        raise ValueError(
            f"every request would be refused: {shortest} > engine.max_model_len={e.max_model_len}"
        )


def preflight(rc: RunConfig) -> None:
    """What the engine cannot run, refused before a results folder or a weight is touched:
    data-parallel replicas, and from the model's config (no weights), an `engine.max_model_len`
    over its positions (KV pools and page tables sized for it exhaust the device at warm-up) and
    a `sampling.top_k` over its vocabulary (every request would fail)."""
    if rc.engine.data_parallel > 1:
        raise ValueError(
            f"engine.data_parallel={rc.engine.data_parallel}: an experiment run measures one "
            f"engine replica (its timings are per replica); replicas are served through the LLM "
            f"API (experiments/bench_data_parallel.py). To use N GPUs for a sweep, run `jaxinfer "
            f"sweep --workers N` (one worker per GPU)."
        )  # fmt: skip
    cfg = model_config(rc.engine.model, rc.engine.dtype)
    positions = cfg.max_context
    if rc.engine.max_model_len > positions:
        raise ValueError(
            f"engine.max_model_len={rc.engine.max_model_len} exceeds the model's "
            f"{cfg.describe_context()} (engine.model={rc.engine.model}): set "
            f"engine.max_model_len <= {positions}"
        )
    try:
        _sampling_params(rc.sampling, max_tokens=1).validate(vocab_size=cfg.vocab_size)
    except ValueError as e:
        raise ValueError(
            f"{str(e).replace('SamplingParams.', 'sampling.', 1)} (engine.model={rc.engine.model})"
        ) from None


def fresh_results_dir(out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """`out_dir` when it does not exist, is empty, or `overwrite`; else a new sibling named by the
    time (`runs/quickstart-20261201-120301`, then `-2`, `-3` within one second), created here so
    that two runs started together cannot take the same one: a run never replaces another's."""
    out = Path(out_dir)
    out = out if out.name else out.resolve()  # ("." has no name to extend)
    if overwrite and (out / "sweep.json").exists():
        raise ValueError(
            f"{out} holds a sweep's results (sweep.json), not a run's: --overwrite would mix the "
            f"two; give the run its own folder"
        )
    if overwrite or not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return out
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        sibling = out.with_name(f"{out.name}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            sibling.mkdir(parents=True)
        except FileExistsError:
            continue
        return sibling
    raise AssertionError("unreachable")


def run_experiment(rc: RunConfig, *, show_progress: bool = True, console: Console | None = None):
    """Run `rc` into its `out_dir` (see the module docstring); the metrics. A KeyboardInterrupt
    (SIGINT, or `Signalled`) stops it: what it did is kept, then `RunInterrupted` is raised."""
    console = console or Console()
    preflight(rc)
    out = Path(rc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").unlink(missing_ok=True)  # an earlier run's: the folder is this run's
    tables = TableAppender(out)  # (removes an earlier run's tables)
    (out / "config.yaml").write_text(to_yaml(rc))
    env = provenance()  # every results file says where, on what and how it was made
    (out / "env.json").write_text(json.dumps(env, indent=2))

    phase, engine, warmup_s, workload = "model loading", None, 0.0, []
    try:
        mesh = EngineShardings.for_config(rc.engine.mesh).mesh
        cfg, params, tokenizer = load_model(rc.engine.model, rc.engine.dtype, rc.engine.seed, mesh,
                                            rc.engine.quant)  # fmt: skip
        engine = Engine(rc.engine, cfg, params, tokenizer)
        encode = (lambda s: tokenizer.encode(s).ids) if tokenizer is not None else None
        workload = build_workload(rc.workload, cfg.vocab_size, encode)
        phase = "warm-up"
        console.print(f"{rc.name}: warm-up (compiling every batch shape)")
        with Progress(TextColumn("  compiled"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True,
                      disable=not show_progress) as bar:  # fmt: skip
            task = bar.add_task("warm-up", total=None)
            warmup_s = _warm_up(engine, lambda done, total: bar.update(task, completed=done,
                                                                       total=total))  # fmt: skip
        raise_caught_signal()
        phase = "serving"
        _serve(rc, engine, workload, tables, show_progress=show_progress, console=console)
        rows, steps = tables.finish()
        metrics = _metrics(rc, env, rows, steps, engine, warmup_s, len(workload))
        _write_json(out / "metrics.json", metrics)
    except KeyboardInterrupt as e:
        _caught.clear()  # taken
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
    finally:
        if engine is not None:
            engine.close()  # (a multi-host engine's other processes exit)
    console.print(summary_table(rc.name, metrics))
    for line in [*summary_notes(metrics), failure_summary(rows)]:
        if line:
            console.print(line, markup=False, highlight=False, soft_wrap=True)  # (copyable)
    return metrics


def _warm_up(engine: Engine, progress=None) -> float:
    """`engine.warmup()` in a helper thread while this one waits with a timeout, so a signal acts
    at once: a KeyboardInterrupt raised inside the warm-up itself would wait for every compile
    already queued in the runner's thread pool (`model_runner.py` does not cancel them).
    (JAX's thread-local settings, e.g. `jax.default_device(...)`, do not reach the helper.)"""
    result: dict = {}

    def target() -> None:
        try:
            result["s"] = engine.warmup(progress=progress)
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
            raise_caught_signal()
            now = engine.clock() - t0
            finished = []
            while pending and pending[0].arrival_time <= now:
                req = pending.popleft()
                prompt = req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt
                sampling = _sampling_params(
                    s, _max_tokens(rc, req), None if s.max_tokens is None else req.output_len
                )
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
    raise_caught_signal()
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


# (row, metrics.json key, scale): metrics.json keeps seconds; latencies are shown in ms, as in
# `jaxinfer report`. Goodput rows come after the latencies when the config sets an SLO.
SUMMARY_ROWS = (
    ("completed requests", "num_completed", 1),
    ("failed requests", "num_failed", 1),
    ("duration (s)", "duration_s", 1),
    ("request throughput (req/s)", "request_throughput", 1),
    ("output throughput (tok/s)", "output_throughput", 1),
    ("total token throughput (tok/s)", "total_token_throughput", 1),
    ("TTFT median (ms)", "ttft_median", 1e3),
    ("TTFT p99 (ms)", "ttft_p99", 1e3),
    ("TPOT median (ms)", "tpot_median", 1e3),
    ("TPOT p99 (ms)", "tpot_p99", 1e3),
    ("ITL median (ms)", "itl_median", 1e3),
    ("ITL p99 (ms)", "itl_p99", 1e3),
    ("E2E latency median (ms)", "e2e_median", 1e3),
    ("E2E latency p99 (ms)", "e2e_p99", 1e3),
)
STEP_ROWS = (
    ("KV cache use, mean (fraction of pages)", "kv_use_mean", 1),
    ("KV cache use, max (fraction of pages)", "kv_use_max", 1),
    ("wasted KV slots, mean (fraction)", "wasted_slot_fraction_mean", 1),
    ("preemptions", "total_preemptions", 1),
    ("host time per step, mean (ms)", "host_ms_mean", 1),
    ("device time per step, mean (ms)", "device_ms_mean", 1),
    ("MoE expert load, max / mean per step (mean)", "expert_imbalance_mean", 1),
    ("MoE expert-device load, max / mean per step (mean)", "expert_device_imbalance_mean", 1),
    ("MoE experts with rows per layer, mean", "experts_active_mean", 1),
    ("prefix cache hit rate (of prompt tokens)", "prefix_cache_hit_rate", 1),
    ("draft acceptance rate", "draft_acceptance_rate", 1),
    ("tokens per verification (tau)", "tokens_per_verification", 1),
    ("decode steps on the speculative path (fraction)", "speculative_step_fraction", 1),
    ("warm-up (s)", "warmup_s", 1),
    ("compiles after warm-up", "compiles_after_warmup", 1),
)


def _slo_rows(m: dict) -> tuple[tuple[str, str, float], ...]:
    """Goodput rows, when the run had an SLO (`summarize` then counts the requests meeting it)."""
    slos = (("TTFT", m.get("slo_ttft")), ("TPOT", m.get("slo_tpot")))
    bounds = [f"{name} {s * 1e3:g} ms" for name, s in slos if s is not None]
    if not bounds:
        return ()
    return (
        (f"goodput (req/s within {', '.join(bounds)})", "goodput", 1),
        ("SLO attainment (% of requests)", "slo_attainment", 100),
    )


def summary_table(name: str, m: dict) -> Table:
    """The run's metrics, units in the row names (see `SUMMARY_ROWS`)."""
    table = Table(title=f"{name}: summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, key, scale in (*SUMMARY_ROWS, *_slo_rows(m), *STEP_ROWS):
        optional = key.startswith(("expert", "draft_", "tokens_per_verification", "prefix_",
                                   "speculative_"))  # fmt: skip
        if key in m and not (optional and m[key] is None):  # (MoE / speculative runs only)
            v = m[key]
            v = v * scale if isinstance(v, int | float) and scale != 1 else v
            table.add_row(
                label, "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
            )
    return table


def summary_notes(m: dict) -> list[str]:
    """Notes a reader of the summary needs to read it right."""
    notes = []
    if m.get("itl_median") == 0:
        notes.append(
            "note: ITL median 0 ms: the tokens of one decode scan (engine.decode_steps tokens per "
            "jitted call) reach the host together, so most gaps between tokens are 0; TPOT is the "
            "per-token pace"
        )
    return notes


def failure_summary(rows: list[dict]) -> str | None:
    """'N of M requests failed' and the kinds of error (the messages with their numbers masked),
    most frequent first, one example each; None when none failed. (metrics.json: every error.)"""
    errors = [r["error"] or "no error recorded" for r in rows if r["failed"]]
    if not errors:
        return None
    kinds = Counter(re.sub(r"\d+", "N", e) for e in errors)
    example: dict[str, str] = {}
    for e in errors:
        example.setdefault(re.sub(r"\d+", "N", e), e)
    lines = [f"{len(errors)} of {len(rows)} requests failed:"]
    lines += [f"  {n} x {example[k]}" for k, n in kinds.most_common(MAX_FAILURE_KINDS)]
    if len(kinds) > MAX_FAILURE_KINDS:
        lines.append(
            f"  and {len(kinds) - MAX_FAILURE_KINDS} more kinds of error (failed_errors in "
            f"metrics.json)"
        )
    return "\n".join(lines)
