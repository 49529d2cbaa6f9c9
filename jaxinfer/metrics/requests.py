"""Per-request latency metrics from finished requests (engine clock, seconds): any record with
the fields of `FinishedRequest`, such as the engine's `Sequence`.

    ttft       = first_token_time - arrival_time
    e2e        = finish_time - arrival_time
    tpot       = (e2e - ttft) / (output_len - 1)     None when output_len <= 1
    itls       = every gap between consecutive token_times
    queue_time = scheduled_time - arrival_time

A metric whose timestamps are missing (e.g. a request that failed before its first token) is None.
`failed` is True for status "failed" or finish_reason "error".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from enum import Enum
from typing import Protocol

REQUEST_COLUMNS = (
    "seq_id",
    "prompt_len",
    "output_len",
    "arrival_time",
    "scheduled_time",
    "first_token_time",
    "finish_time",
    "queue_time",
    "ttft",
    "tpot",
    "e2e",
    "itls",
    "num_preemptions",
    "cached_tokens",
    "finish_reason",
    "failed",
    "error",
)


class FinishedRequest(Protocol):
    """What `request_row` reads of a request."""

    seq_id: int
    status: Enum  # its value: "finished" or "failed" once finished
    is_finished: bool
    num_prompt_tokens: int
    output_token_ids: list[int]
    arrival_time: float
    scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    token_times: list[float]  # when each output token was produced
    num_preemptions: int
    num_cached_tokens: int
    finish_reason: str | None
    error: str | None


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else float(a) - float(b)


def request_row(seq: FinishedRequest) -> dict:
    """The metrics of one finished (or failed) sequence, keyed by REQUEST_COLUMNS."""
    if not seq.is_finished:
        raise ValueError(
            f"sequence {seq.seq_id} is not finished (status {seq.status.value}): "
            "metrics need finished or failed sequences"
        )
    output_len = len(seq.output_token_ids)
    ttft = _diff(seq.first_token_time, seq.arrival_time)
    e2e = _diff(seq.finish_time, seq.arrival_time)
    tpot = None
    if output_len > 1 and ttft is not None and e2e is not None:
        tpot = (e2e - ttft) / (output_len - 1)
    times = [float(t) for t in seq.token_times]
    return {
        "seq_id": seq.seq_id,
        "prompt_len": seq.num_prompt_tokens,
        "output_len": output_len,
        "arrival_time": float(seq.arrival_time),
        "scheduled_time": seq.scheduled_time,
        "first_token_time": seq.first_token_time,
        "finish_time": seq.finish_time,
        "queue_time": _diff(seq.scheduled_time, seq.arrival_time),
        "ttft": ttft,
        "tpot": tpot,
        "e2e": e2e,
        "itls": [b - a for a, b in itertools.pairwise(times)],
        "num_preemptions": seq.num_preemptions,
        "cached_tokens": seq.num_cached_tokens,  # prefill skipped by prefix-cache hits
        "finish_reason": seq.finish_reason,
        "failed": seq.status.value == "failed" or seq.finish_reason == "error",
        "error": seq.error,
    }


def request_rows(seqs: Iterable[FinishedRequest]) -> list[dict]:
    """One row per sequence (see `request_row`), in the given order."""
    return [request_row(s) for s in seqs]
