"""Workloads read from JSONL traces.

Each non-blank line is one JSON object, in one of two formats:

    {"prompt": "text" | "prompt_token_ids": [int, ...], "output_len": int, "arrival": float?}
    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}

The second is ShareGPT's: the first human turn is the prompt and the token length of the first gpt
turn after it is `output_len` (this needs `encode`). "user"/"assistant" are accepted as aliases of
"human"/"gpt". When `encode` is given, text prompts are also tokenized into `prompt_token_ids`.

A malformed row raises ValueError naming its line number and field, unless `skip_invalid`, which
drops it. `max_requests` keeps the first that many valid rows. Arrival times: with `arrivals`
(an ArrivalProcess) they are generated; otherwise each row's "arrival" is used (all rows or none
must have one; none means all at t = 0). The result is sorted by arrival time (stable).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxinfer.workload.arrivals import ArrivalProcess
from jaxinfer.workload.request import WorkloadRequest

Encode = Callable[[str], list[int]]

_HUMAN = ("human", "user")
_GPT = ("gpt", "assistant")


class _RowError(ValueError):
    def __init__(self, field: str, msg: str) -> None:
        super().__init__(f"field {field!r}: {msg}")
        self.field = field


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_token_ids(ids: object, vocab_size: int | None) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
        raise _RowError("prompt_token_ids", "must be a non-empty list of ints")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
        raise _RowError("prompt_token_ids", f"token ids must be in [0, {vocab_size})")
    if vocab_size is None and any(t < 0 for t in ids):
        raise _RowError("prompt_token_ids", "token ids must be >= 0")
    return list(ids)


def _parse_sharegpt(row: dict, encode: Encode | None) -> tuple[list[int] | None, str, int]:
    conv = row["conversations"]
    if not isinstance(conv, list):
        raise _RowError("conversations", "must be a list of {from, value} objects")
    if encode is None:
        raise _RowError("conversations", "ShareGPT rows need a tokenizer: pass encode=")
    prompt: str | None = None
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise _RowError(f"conversations[{i}]", "must be an object with a string 'value'")
        who = turn.get("from")
        if prompt is None and who in _HUMAN:
            prompt = turn["value"]
            if not prompt:
                raise _RowError(f"conversations[{i}].value", "the human turn is empty")
        elif prompt is not None and who in _GPT:
            output_len = len(encode(turn["value"]))
            if output_len < 1:
                raise _RowError(f"conversations[{i}].value", "the gpt reply has no tokens")
            ids = list(encode(prompt))
            if not ids:
                raise _RowError("conversations", "the human turn encodes to no tokens")
            return ids, prompt, output_len
    if prompt is None:
        raise _RowError("conversations", "has no human turn")
    raise _RowError("conversations", "has no gpt reply after the first human turn")


def _parse_row(
    row: object, encode: Encode | None, vocab_size: int | None
) -> tuple[WorkloadRequest, float | None]:
    if not isinstance(row, dict):
        raise _RowError("<row>", f"must be a JSON object, got {type(row).__name__}")
    if "conversations" in row:
        ids, prompt, output_len = _parse_sharegpt(row, encode)
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
            raise _RowError("conversations", f"encoded token ids must be in [0, {vocab_size})")
    else:
        has_text, has_ids = "prompt" in row, "prompt_token_ids" in row
        if has_text == has_ids:
            raise _RowError(
                "prompt", "exactly one of 'prompt', 'prompt_token_ids' or 'conversations' needed"
            )
        if has_ids:
            ids, prompt = _parse_token_ids(row["prompt_token_ids"], vocab_size), None
        else:
            prompt = row["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise _RowError("prompt", "must be a non-empty string")
            ids = None
            if encode is not None:
                ids = _parse_token_ids(list(encode(prompt)), vocab_size)
        if "output_len" not in row:
            raise _RowError("output_len", "is missing")
        output_len = row["output_len"]
        if not _is_int(output_len) or output_len < 1:
            raise _RowError("output_len", f"must be an int >= 1, got {output_len!r}")
    arrival = row.get("arrival")
    if arrival is not None and (
        isinstance(arrival, bool)
        or not isinstance(arrival, int | float)
        or not math.isfinite(arrival)
        or arrival < 0
    ):
        raise _RowError("arrival", f"must be a finite number >= 0, got {arrival!r}")
    req = WorkloadRequest(ids, prompt, int(output_len), 0.0)
    return req, None if arrival is None else float(arrival)


def load_jsonl_trace(
    path: str | Path,
    *,
    encode: Encode | None = None,
    vocab_size: int | None = None,
    max_requests: int | None = None,
    arrivals: ArrivalProcess | None = None,
    rng: np.random.Generator | None = None,
    skip_invalid: bool = False,
) -> list[WorkloadRequest]:
    """Read a JSONL trace into requests (see the module docstring for the formats and options).

    `rng` draws the generated arrivals (default: a generator seeded with 0).
    """
    if max_requests is not None and (not _is_int(max_requests) or max_requests < 1):
        raise ValueError(f"max_requests={max_requests!r} is invalid: must be None or an int >= 1")
    requests: list[WorkloadRequest] = []
    row_arrivals: list[float | None] = []
    first_line_with: dict[bool, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if max_requests is not None and len(requests) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise _RowError("<json>", f"invalid JSON ({e.msg})") from None
                req, arrival = _parse_row(row, encode, vocab_size)
                has = arrival is not None
                if arrivals is None and (not has) in first_line_with:
                    other = first_line_with[not has]
                    raise _RowError(
                        "arrival",
                        f"{'present' if has else 'missing'} here but "
                        f"{'missing' if has else 'present'} on line {other}: "
                        "all rows or none must have it",
                    )
            except _RowError as e:
                if skip_invalid and e.field != "arrival":
                    continue
                raise ValueError(f"{path}: line {lineno}: {e}") from None
            first_line_with.setdefault(has, lineno)
            requests.append(req)
            row_arrivals.append(arrival)
    if arrivals is not None:
        times = arrivals.sample(rng if rng is not None else np.random.default_rng(0), len(requests))
    else:
        times = [0.0 if a is None else a for a in row_arrivals]
    for req, t in zip(requests, times, strict=True):
        req.arrival_time = float(t)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    return [requests[i] for i in order]
