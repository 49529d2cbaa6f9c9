"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own (no process globals).

Latencies are the engine's, per sequence (sample), from its timestamps (metrics/requests.py):
TTFT from arrival at the server (the HTTP handler's submit) to the first token, TPOT over the
rest, E2E to the finish. A client measures its own (serve/bench.py), network and SSE included.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxinfer.metrics.requests import request_row

# Seconds; the wide range covers a CPU test server and an H200 under load.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0)  # fmt: skip
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "jaxinfer_"
        self.waiting = Gauge(p + "requests_waiting", "sequences waiting in the engine", registry=r)
        self.running = Gauge(p + "requests_running", "sequences running in the engine", registry=r)
        self.kv_use = Gauge(p + "kv_cache_usage", "fraction of KV pages in use", registry=r)
        self.compiles_after_warmup = Gauge(p + "compiles_after_warmup",
                                           "XLA compiles since the warm-up (should stay 0)",
                                           registry=r)  # fmt: skip
        self.preemptions = Counter(p + "preemptions", "sequences preempted", registry=r)
        self.steps = Counter(p + "engine_steps", "engine steps run", registry=r)
        self.rejected = Counter(p + "requests_rejected_queue_full",
                                "requests answered 429 (queue full)", registry=r)  # fmt: skip
        self.requests = Counter(p + "requests_finished", "sequences finished, by reason",
                                ["finish_reason"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of finished sequences",
                                     registry=r)  # fmt: skip
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "TTFT (engine)",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram(p + "time_per_output_token_seconds", "TPOT (engine)",
                              buckets=TPOT_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "E2E latency (engine)",
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip

    def observe_finished(self, seqs) -> None:
        for seq in seqs:
            row = request_row(seq)
            self.requests.labels(row["finish_reason"] or "unknown").inc()
            self.prompt_tokens.inc(row["prompt_len"])
            self.generation_tokens.inc(row["output_len"])
            for hist, key in ((self.ttft, "ttft"), (self.tpot, "tpot"), (self.e2e, "e2e")):
                if row[key] is not None and row["finish_reason"] != "abort":
                    hist.observe(row[key])

    def text(self) -> bytes:
        return generate_latest(self.registry)
