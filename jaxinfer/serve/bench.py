"""`jaxinfer bench serve`: an online benchmark of any OpenAI-compatible server, measured at the client.

The project's workloads (`WorkloadSpec`: synthetic, shared prefix, multi-turn, traces; arrivals
all at once, Poisson or gamma at `workload.arrival.rate`) are sent as streaming requests
(`stream_options.include_usage`) at their arrival times, at most `max_concurrency` at once when
set. A request waits for a free slot after its arrival; its clock starts when it is sent.

Per request, as `vllm bench serve` measures it (client clock, seconds):
  TTFT   first SSE chunk with content (text, or token ids) minus the send time
  ITL    the gaps between consecutive content chunks: per chunk, not per token, so a chunk
         carrying several tokens (a jaxinfer decode scan's, a speculative step's) counts once
  E2E    the last content chunk minus the send time (vLLM's `latency`)
  TPOT   (E2E - TTFT) / (output tokens - 1), for requests of two or more tokens
  output tokens: the server's `usage.completion_tokens`; without usage, the token ids the chunks
  carried, else the number of content chunks (vLLM re-tokenizes the text instead)
Run level: jaxinfer's `metrics.summarize` over those rows (mean / median / p90 / p99, numpy's
linear interpolation, over completed requests; goodput = requests meeting every SLO of `slo`
per second). Where it differs from vLLM: the duration is first send to last content chunk
(`duration_s`); vLLM divides by the wall time of the whole benchmark, which this also reports
(`benchmark_duration_s`); and goodput's SLOs are TTFT and TPOT (vLLM also takes E2E).

Results: a run folder `jaxinfer report` reads (config.yaml, env.json, requests.parquet,
steps.parquet (empty: steps are the server's), metrics.json), so rate sweeps plot as
latency-throughput curves. Against a jaxinfer server, metrics.json also carries the server's
`compiles_after_warmup` (from /metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from jaxinfer.config_file import load_config, to_yaml
from jaxinfer.metrics import SLO, summarize, write_tables
from jaxinfer.workload import WorkloadSpec, build_workload

ENDPOINTS = ("completions", "chat")


@dataclass
class BenchSampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # (vLLM's extension; sent only when not 0)
    min_p: float = 0.0  # (vLLM's extension; sent only when not 0)
    ignore_eos: bool = True  # exact workload output lengths (vLLM's extension)


@dataclass
class BenchSLO:
    ttft: float | None = None
    tpot: float | None = None


@dataclass
class BenchConfig:
    name: str = "bench_serve"
    out_dir: str = "runs/${name}"
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # null: the first model of GET /v1/models
    endpoint: str = "completions"  # "completions" or "chat" (chat sends text: needs tokenizer)
    max_concurrency: int | None = None  # null: no limit (the arrival process alone)
    # A model name or directory whose tokenizer turns workload token ids into text prompts;
    # null: prompts go as token ids (completions only)
    tokenizer: str | None = None
    vocab_size: int | None = None  # synthetic token ids' range; null: /v1/models' vocab_size
    timeout_s: float = 600.0  # per request
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    sampling: BenchSampling = field(default_factory=BenchSampling)
    slo: BenchSLO = field(default_factory=BenchSLO)


def load_bench_config(path: str | Path | None, overrides: Seq[str] = ()) -> BenchConfig:
    """Schema <- YAML <- dotted overrides. A run config works too: its `workload` and `slo`
    are used, its `engine` (the server's business) ignored, `sampling` read where it matches."""

    def select(file_cfg: DictConfig) -> dict:
        keep = {k: v for k, v in file_cfg.items() if k in BenchConfig.__dataclass_fields__}
        if "sampling" in keep:
            fields = BenchSampling.__dataclass_fields__
            keep["sampling"] = {k: v for k, v in keep["sampling"].items() if k in fields}
        return keep

    bc = load_config(BenchConfig, path, overrides, what="bench", select=select)
    if bc.endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint={bc.endpoint!r} is invalid: must be one of {ENDPOINTS}")
    if bc.endpoint == "chat" and bc.tokenizer is None and bc.workload.kind != "trace":
        raise ValueError("endpoint=chat sends text: set tokenizer=MODEL (its tokenizer turns "
                         "the workload's token ids into text)")  # fmt: skip
    if bc.max_concurrency is not None and bc.max_concurrency < 1:
        raise ValueError(f"max_concurrency={bc.max_concurrency} is invalid: must be >= 1 or null")
    try:
        bc.workload.validate()
    except ValueError as e:
        raise ValueError(f"workload.{e}") from None
    return bc


@dataclass
class _Result:
    """What the client saw of one request (times on the client clock, from the bench start)."""

    index: int
    sent: float
    prompt_len: int | None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    token_ids: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def row(self) -> dict:
        times = self.chunk_times
        failed = self.error is not None or not times
        out = self.output_tokens
        if out is None:
            out = self.token_ids or len(times)
        ttft = times[0] - self.sent if times else None
        e2e = times[-1] - self.sent if times else None
        tpot = (e2e - ttft) / (out - 1) if times and out > 1 else None
        return {
            "seq_id": self.index, "prompt_len": self.prompt_len or 0, "output_len": out,
            "arrival_time": self.sent, "scheduled_time": None,
            "first_token_time": times[0] if times else None,
            "finish_time": times[-1] if times else None, "queue_time": None, "ttft": ttft,
            "tpot": tpot, "e2e": e2e, "itls": [b - a for a, b in itertools.pairwise(times)],
            "num_preemptions": 0, "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason, "failed": failed,
            "error": self.error or (None if times else "no content received"),
        }  # fmt: skip


class _Client:
    def __init__(self, bc: BenchConfig, client, model: str, tokenizer) -> None:
        self.bc, self.client, self.model, self.tokenizer = bc, client, model, tokenizer

    def body(self, req) -> dict:
        s, bc = self.bc.sampling, self.bc
        body = {"model": self.model, "max_tokens": req.output_len, "temperature": s.temperature,
                "top_p": s.top_p, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        if s.top_k:
            body["top_k"] = s.top_k
        if s.min_p:
            body["min_p"] = s.min_p
        if s.ignore_eos:
            body["ignore_eos"] = True
        text = req.prompt
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(req.prompt_token_ids)
        if bc.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text if self.tokenizer is not None or req.prompt_token_ids is None \
                else req.prompt_token_ids  # fmt: skip
        if self.tokenizer is None:
            # token ids in, so token ids back: a model without a tokenizer (random weights, a
            # `preset:`) streams no text, and its chunks are counted by their ids
            body["return_token_ids"] = True
        return body

    async def send(self, index: int, req, t0: float) -> _Result:
        path = "/chat/completions" if self.bc.endpoint == "chat" else "/completions"
        res = _Result(index, time.perf_counter() - t0, req.prompt_len)
        try:
            async with self.client.stream("POST", path, json=self.body(req)) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    res.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    self._chunk(res, json.loads(data), time.perf_counter() - t0)
        except Exception as e:  # a connection error, a timeout, a broken stream
            res.error = f"{type(e).__name__}: {e}"
        return res

    @staticmethod
    def _chunk(res: _Result, chunk: dict, now: float) -> None:
        if "error" in chunk:
            res.error = str(chunk["error"].get("message", chunk["error"]))
            return
        for choice in chunk.get("choices") or []:
            content = choice.get("text")
            if content is None:
                content = (choice.get("delta") or {}).get("content")
            ids = choice.get("token_ids") or []
            res.token_ids += len(ids)
            if content or ids:
                res.chunk_times.append(now)
            if choice.get("finish_reason"):
                res.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            res.output_tokens = usage.get("completion_tokens")
            res.prompt_len = usage.get("prompt_tokens", res.prompt_len)
            details = usage.get("prompt_tokens_details") or {}
            res.cached_tokens = details.get("cached_tokens") or 0


async def _server_compiles(client, base_url: str) -> int | None:
    """`jaxinfer_compiles_after_warmup` of a jaxinfer server's /metrics (None elsewhere)."""
    from prometheus_client.parser import text_string_to_metric_families

    root = base_url.rstrip("/").removesuffix("/v1")
    with contextlib.suppress(Exception):
        resp = await client.get(root + "/metrics")
        for family in text_string_to_metric_families(resp.text):
            if family.name == "jaxinfer_compiles_after_warmup":
                return int(family.samples[0].value)
    return None


async def bench(bc: BenchConfig, progress=None) -> tuple[list[dict], dict]:
    """Run the benchmark; (request rows, metrics). `progress(done, total)` after each request."""
    import httpx

    limits = httpx.Limits(max_connections=bc.max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=bc.base_url, timeout=bc.timeout_s,
                                 limits=limits) as client:  # fmt: skip
        try:
            resp = await client.get("/models")
            resp.raise_for_status()
        except httpx.HTTPError as e:
            raise ValueError(f"cannot list the models of {bc.base_url} (GET /models): {e}; is "
                             f"the server up, and is base_url its API root (…/v1)?") from None  # fmt: skip
        served = resp.json()["data"]
        model = bc.model or served[0]["id"]
        vocab = bc.vocab_size or next((m.get("vocab_size") for m in served if m["id"] == model),
                                      None)  # fmt: skip
        tokenizer = None
        if bc.tokenizer is not None:
            from jaxinfer.engine.loading import model_tokenizer

            tokenizer = model_tokenizer(bc.tokenizer)
            vocab = vocab or tokenizer.get_vocab_size()
        if vocab is None and bc.workload.kind != "trace":
            raise ValueError("the server does not say its vocabulary size (vocab_size in "
                             "/v1/models): set vocab_size=N or tokenizer=MODEL")  # fmt: skip
        encode = (lambda s: tokenizer.encode(s).ids) if tokenizer is not None else None
        workload = build_workload(bc.workload, vocab or 2**31 - 1, encode)
        sender = _Client(bc, client, model, tokenizer)
        slots = asyncio.Semaphore(bc.max_concurrency) if bc.max_concurrency else None
        done = 0
        t0 = time.perf_counter()

        async def one(i: int, req) -> _Result:
            nonlocal done
            await asyncio.sleep(max(0.0, t0 + req.arrival_time - time.perf_counter()))
            async with slots or contextlib.nullcontext():
                res = await sender.send(i, req, t0)
            done += 1
            if progress is not None:
                progress(done, len(workload))
            return res

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(workload)))
        wall = time.perf_counter() - t0
        compiles = await _server_compiles(client, bc.base_url)
    rows = [r.row() for r in results]
    metrics = summarize(rows, [], SLO(bc.slo.ttft, bc.slo.tpot))
    completed = [r for r in rows if not r["failed"]]
    metrics.update(
        benchmark_duration_s=wall,
        benchmark_request_throughput=len(completed) / wall if wall > 0 else None,
        benchmark_output_throughput=sum(r["output_len"] for r in completed) / wall
        if wall > 0 else None,
        compiles_after_warmup=compiles,
        base_url=bc.base_url, model=model, endpoint=bc.endpoint,
        max_concurrency=bc.max_concurrency,
        request_rate=bc.workload.arrival.rate if bc.workload.arrival.process in ("poisson", "gamma")
        else math.inf,
        failed_errors=sorted({r["error"] for r in rows if r["error"]})[:20],
        metric_definitions="client side, as vllm bench serve (jaxinfer/serve/bench.py)",
    )  # fmt: skip
    return rows, metrics


def run_bench(bc: BenchConfig, *, show_progress: bool = True) -> dict:
    """Run `bc` into its `out_dir` (a run folder `jaxinfer report` reads); the metrics."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from jaxinfer.experiment.run import summary_table
    from jaxinfer.provenance import provenance

    out = Path(bc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").unlink(missing_ok=True)
    (out / "config.yaml").write_text(to_yaml(bc))
    env = provenance()
    env["device"] = f"client of {bc.base_url}"  # (the server's device is its own)
    (out / "env.json").write_text(json.dumps(env, indent=2))
    console = Console()
    with Progress(TextColumn(f"[bold]{bc.name}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=not show_progress) as bar:  # fmt: skip
        task = bar.add_task("requests", total=None)
        rows, metrics = asyncio.run(bench(bc, lambda d, n: bar.update(task, completed=d, total=n)))
    write_tables(out, rows, [])
    metrics = {**env, **metrics}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))  # (last: a complete run)
    console.print(summary_table(bc.name, metrics))
    return metrics
