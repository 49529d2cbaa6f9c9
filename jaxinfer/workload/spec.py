"""Workload specifications (plain frozen dataclasses, usable as omegaconf structured configs) and
the one entry point `build_workload`.

    kind = "synthetic"      random token-id prompts, lengths from `prompt_len`
    kind = "shared_prefix"  one random system prefix of `system_prompt_len` tokens + a random
                            suffix of `prompt_len` tokens per request
    kind = "multi_turn"     chat conversations of `num_turns` turns, each turn's prompt the
                            conversation so far + a new user message of `prompt_len` tokens,
                            `turn_gap_s` apart (`generate.multi_turn_requests`); an optional
                            shared system prompt of `system_prompt_len` tokens
    kind = "trace"          rows of the JSONL file `trace_path` (see `traces.py`);
                            `num_requests` caps the count (None: every row); arrivals come from
                            the trace when `arrival.process == "trace"`, else are generated
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jaxinfer.workload import arrivals as _arrivals
from jaxinfer.workload import lengths as _lengths
from jaxinfer.workload.generate import (
    multi_turn_requests,
    shared_prefix_requests,
    synthetic_requests,
)
from jaxinfer.workload.request import WorkloadRequest
from jaxinfer.workload.traces import load_jsonl_trace

LENGTH_DISTS = ("fixed", "uniform", "lognormal")
ARRIVAL_PROCESSES = ("all_at_once", "poisson", "gamma", "trace")
WORKLOAD_KINDS = ("synthetic", "shared_prefix", "multi_turn", "trace")


def _bad(name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: must be {allowed}")


@dataclass(frozen=True)
class LengthSpec:
    """fixed: `value`; uniform: [lo, hi]; lognormal: `mean`, `sigma`, clipped to [lo, hi]."""

    dist: str = "fixed"
    value: int = 128
    lo: int = 1
    hi: int = 1024
    mean: float = 128.0
    sigma: float = 1.0

    def build(self, name: str = "length") -> _lengths.LengthDist:
        """The distribution; ValueError naming `name.<field>` when a field is invalid."""
        if self.dist not in LENGTH_DISTS:
            raise _bad(f"{name}.dist", self.dist, f"one of {LENGTH_DISTS}")
        try:
            if self.dist == "fixed":
                return _lengths.fixed(self.value)
            if self.dist == "uniform":
                return _lengths.uniform(self.lo, self.hi)
            return _lengths.lognormal(self.mean, self.sigma, self.lo, self.hi)
        except ValueError as e:  # lengths.py names its own fields ("uniform.lo"): name ours
            msg = str(e)
            for f in ("value", "lo", "hi", "mean", "sigma"):
                msg = msg.replace(f"{self.dist}.{f}=", f"{name}.{f}=")
            raise ValueError(msg if msg != str(e) else f"{name}: {msg}") from None


@dataclass(frozen=True)
class ArrivalSpec:
    """`rate` in requests/s (for poisson and gamma); `burstiness` is gamma's shape.

    "trace" keeps a trace's own arrival times (only for kind="trace").
    """

    process: str = "all_at_once"
    rate: float = 1.0
    burstiness: float = 1.0

    def build(self, name: str = "arrival") -> _arrivals.ArrivalProcess | None:
        """The process, or None for "trace"; ValueError naming `name.<field>` when invalid."""
        if self.process not in ARRIVAL_PROCESSES:
            raise _bad(f"{name}.process", self.process, f"one of {ARRIVAL_PROCESSES}")
        if self.process == "trace":
            return None
        if self.process == "all_at_once":
            return _arrivals.all_at_once()
        if not (isinstance(self.rate, int | float) and self.rate > 0 and self.rate == self.rate):
            raise _bad(f"{name}.rate", self.rate, "a number > 0 (requests/s; inf allowed)")
        if self.process == "poisson":
            return _arrivals.poisson(self.rate)
        if not (
            isinstance(self.burstiness, int | float)
            and np.isfinite(self.burstiness)
            and self.burstiness > 0
        ):
            raise _bad(f"{name}.burstiness", self.burstiness, "a finite number > 0")
        return _arrivals.gamma(self.rate, self.burstiness)


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "synthetic"
    num_requests: int | None = 16
    prompt_len: LengthSpec = field(default_factory=LengthSpec)
    output_len: LengthSpec = field(default_factory=lambda: LengthSpec(value=128))
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    seed: int = 0
    system_prompt_len: int = 0  # shared_prefix (>= 1) and multi_turn (>= 0)
    num_turns: int = 4  # multi_turn only: turns per conversation
    turn_gap_s: float = 2.0  # multi_turn only: seconds between a conversation's turns
    trace_path: str | None = None  # trace only
    trace_skip_invalid: bool = False  # trace only: drop malformed rows instead of raising
    avoid_token_ids: tuple[int, ...] = ()  # never drawn for synthetic prompts (e.g. BOS/EOS)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and its allowed values."""
        if self.kind not in WORKLOAD_KINDS:
            raise _bad("kind", self.kind, f"one of {WORKLOAD_KINDS}")
        n = self.num_requests
        is_int = isinstance(n, int) and not isinstance(n, bool)
        if self.kind == "trace":
            if n is not None and not (is_int and n >= 1):
                raise _bad("num_requests", n, "None (every row) or an int >= 1")
        elif not (is_int and n >= 1):
            raise _bad("num_requests", n, "an int >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise _bad("seed", self.seed, "an int >= 0")
        if self.kind != "trace":
            self.prompt_len.build("prompt_len")
            self.output_len.build("output_len")
        process = self.arrival.build("arrival")
        if process is None and self.kind != "trace":
            raise _bad(
                "arrival.process", "trace", f"one of {ARRIVAL_PROCESSES[:-1]} unless kind='trace'"
            )
        if self.kind == "shared_prefix":
            s = self.system_prompt_len
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise _bad("system_prompt_len", s, "an int >= 1 for kind='shared_prefix'")
        if self.kind == "multi_turn":
            s, t, g = self.system_prompt_len, self.num_turns, self.turn_gap_s
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise _bad("system_prompt_len", s, "an int >= 0 for kind='multi_turn'")
            if isinstance(t, bool) or not isinstance(t, int) or t < 1:
                raise _bad("num_turns", t, "an int >= 1")
            if (
                isinstance(g, bool)
                or not isinstance(g, int | float)
                or not (np.isfinite(g) and g >= 0)
            ):
                raise _bad("turn_gap_s", g, "a finite number >= 0 (seconds)")
        if self.kind == "trace" and not (isinstance(self.trace_path, str) and self.trace_path):
            raise _bad("trace_path", self.trace_path, "a path to a JSONL file for kind='trace'")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.avoid_token_ids):
            raise _bad("avoid_token_ids", self.avoid_token_ids, "a tuple of ints")


def build_workload(
    spec: WorkloadSpec,
    vocab_size: int,
    encode: Callable[[str], list[int]] | None = None,
) -> list[WorkloadRequest]:
    """The requests `spec` describes, sorted by arrival time; deterministic given `spec.seed`.

    `vocab_size` bounds synthetic token ids and checks a trace's; `encode` tokenizes trace text.
    """
    spec.validate()
    process = spec.arrival.build("arrival")
    if spec.kind == "trace":
        assert spec.trace_path is not None
        return load_jsonl_trace(
            spec.trace_path,
            encode=encode,
            vocab_size=vocab_size,
            max_requests=spec.num_requests,
            arrivals=process,
            rng=np.random.default_rng(np.random.SeedSequence(spec.seed).spawn(4)[2]),
            skip_invalid=spec.trace_skip_invalid,
        )
    assert spec.num_requests is not None
    common = dict(
        vocab_size=vocab_size, arrivals=process, seed=spec.seed, avoid_ids=spec.avoid_token_ids
    )
    out_dist = spec.output_len.build("output_len")
    if spec.kind == "multi_turn":
        return multi_turn_requests(
            spec.num_requests,
            spec.num_turns,
            spec.prompt_len.build("prompt_len"),
            out_dist,
            turn_gap_s=spec.turn_gap_s,
            system_prompt_len=spec.system_prompt_len,
            **common,
        )
    if spec.kind == "shared_prefix":
        return shared_prefix_requests(
            spec.num_requests,
            spec.system_prompt_len,
            spec.prompt_len.build("prompt_len"),
            out_dist,
            **common,
        )
    return synthetic_requests(
        spec.num_requests, spec.prompt_len.build("prompt_len"), out_dist, **common
    )
