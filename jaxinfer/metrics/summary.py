"""Run-level summary from per-request rows (`request_rows`) and per-step rows (`StepRecord`).

Definitions (all times in seconds):
  duration_s      first arrival to last finish, over every request (failed ones included)
  throughput      completed (not failed) requests, their output tokens, and their prompt + output
                  tokens, each divided by duration_s
  latency stats   mean / median / p90 / p99 (numpy's linear interpolation) over completed
                  requests: ttft, tpot (requests with output_len >= 2), e2e, queue_time, and itl
                  over every inter-token gap of every completed request
  goodput         completed requests with ttft <= slo.ttft and tpot <= slo.tpot (a None SLO is
                  not checked; a request without a tpot passes the tpot SLO) per second of
                  duration_s; slo_attainment is their fraction of all requests
  steps           KV use fraction = kv_pages_used / kv_pages_total per step (mean, max); mean
                  batch occupancy = mean num_seqs / max_num_seqs (when given); wasted KV slot
                  fraction = wasted_slots / kv_slots_allocated per step, averaged; MoE
                  expert (and expert-device) imbalance = max / mean rows per expert (device)
                  per step, averaged over the steps that routed rows (1: balanced);
                  speculative decoding: draft acceptance rate, tokens per verification (tau),
                  acceptance by draft position, and the fraction of decode-only steps that
                  took the speculative path (below 1 where adaptive speculation ran plain)

Undefined values (no data, zero duration) are None; everything else is a plain float or int.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxinfer.metrics.steps import StepRecord, step_row

PERCENTILES = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e", "queue_time")


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds; None means not checked."""

    ttft: float | None = None
    tpot: float | None = None


def _f(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _div(a: float, b: float) -> float | None:
    return _f(a / b) if b > 0 else None


def stats(values: Iterable[float], prefix: str) -> dict[str, float | None]:
    """`{prefix}_mean`, `_median`, `_p90`, `_p99` of the values (None when there are none)."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    out: dict[str, float | None] = {f"{prefix}_mean": _f(arr.mean()) if arr.size else None}
    for name, q in PERCENTILES:
        out[f"{prefix}_{name}"] = _f(np.percentile(arr, q)) if arr.size else None
    return out


def _meets(row: dict, slo: SLO) -> bool:
    if row["failed"]:
        return False
    if slo.ttft is not None and (row["ttft"] is None or row["ttft"] > slo.ttft):
        return False
    return slo.tpot is None or row["tpot"] is None or row["tpot"] <= slo.tpot


def _step_summary(steps: list[dict], max_num_seqs: int | None) -> dict:
    if not steps:
        return {
            "num_steps": 0,
            "decode_only_step_fraction": None,
            "kv_use_mean": None,
            "kv_use_max": None,
            "mean_num_seqs": None,
            "mean_batch_occupancy": None,
            "mean_batched_tokens": None,
            "wasted_slot_fraction_mean": None,
            "total_preemptions": 0,
            "host_ms_mean": None,
            "device_ms_mean": None,
            "expert_imbalance_mean": None,
            "expert_device_imbalance_mean": None,
            "experts_active_mean": None,
            **_speculation([]),
        }
    kv = [s["kv_pages_used"] / s["kv_pages_total"] for s in steps if s["kv_pages_total"] > 0]
    wasted = [s["wasted_slots"] / s["kv_slots_allocated"] for s in steps if s["kv_slots_allocated"]]
    mean_seqs = float(np.mean([s["num_seqs"] for s in steps]))
    return {
        "num_steps": len(steps),
        "decode_only_step_fraction": _f(np.mean([bool(s["is_decode_only"]) for s in steps])),
        "kv_use_mean": _f(np.mean(kv)) if kv else None,
        "kv_use_max": _f(np.max(kv)) if kv else None,
        "mean_num_seqs": _f(mean_seqs),
        "mean_batch_occupancy": _div(mean_seqs, max_num_seqs) if max_num_seqs else None,
        "mean_batched_tokens": _f(np.mean([s["num_batched_tokens"] for s in steps])),
        "wasted_slot_fraction_mean": _f(np.mean(wasted)) if wasted else None,
        "total_preemptions": int(sum(s["preemptions"] for s in steps)),
        "host_ms_mean": _f(np.mean([s["host_ms"] for s in steps])),
        "device_ms_mean": _f(np.mean([s["device_ms"] for s in steps])),
        "expert_imbalance_mean": _imbalance(s.get("expert_tokens") for s in steps),
        "expert_device_imbalance_mean": _imbalance(s.get("expert_device_tokens") for s in steps),
        "experts_active_mean": _mean_of(s.get("experts_active") for s in steps),
        **_speculation(steps),
    }


def _speculation(steps: list[dict]) -> dict:
    """Speculative decoding over the run: acceptance rate (kept / verified drafts), tokens per
    verification (mean kept drafts + 1: what a target pass makes per sequence, tau), and the
    acceptance by draft position (the fraction of verifications that kept draft j), and the
    fraction of decode-only steps on the speculative path (`StepRecord.speculative`)."""
    hist: list[int] = []
    for s in steps:
        for j, c in enumerate(s.get("accepted_hist") or []):
            hist += [0] * (j + 1 - len(hist))
            hist[j] += c
    n = sum(hist)
    if not n:
        return {"draft_acceptance_rate": None, "tokens_per_verification": None,
                "acceptance_by_position": None, "speculative_step_fraction": None}  # fmt: skip
    accepted = sum(j * c for j, c in enumerate(hist))
    decode = [bool(s.get("speculative")) for s in steps if s.get("is_decode_only")]
    return {
        "draft_acceptance_rate": _div(accepted, sum(s.get("draft_tokens", 0) for s in steps)),
        "tokens_per_verification": _f(1 + accepted / n),
        "acceptance_by_position": [_f(sum(hist[j + 1 :]) / n) for j in range(len(hist) - 1)],
        "speculative_step_fraction": _div(sum(decode), len(decode)),
    }


def _mean_of(values) -> float | None:
    values = [v for v in values if v is not None]
    return _f(np.mean(values)) if values else None


def _imbalance(loads) -> float | None:
    """Mean over the steps that routed rows of max / mean rows per expert (or per device): 1 is
    perfect balance; a step's time follows its busiest expert (device)."""
    ratios = [max(x) / np.mean(x) for x in loads if x is not None and sum(x) > 0]
    return _f(np.mean(ratios)) if ratios else None


def summarize(
    request_rows: Sequence[dict],
    step_rows: Iterable[StepRecord | dict] = (),
    slo: SLO | None = None,
    *,
    max_num_seqs: int | None = None,
) -> dict:
    """A flat, JSON-serialisable dict of run metrics (see the module docstring)."""
    rows = list(request_rows)
    ok = [r for r in rows if not r["failed"]]
    starts = [r["arrival_time"] for r in rows if r["arrival_time"] is not None]
    ends = [r["finish_time"] for r in rows if r["finish_time"] is not None]
    duration = max(ends) - min(starts) if starts and ends else None
    dur = duration if duration is not None and duration > 0 else 0.0
    out_toks = sum(r["output_len"] for r in ok)
    in_toks = sum(r["prompt_len"] for r in ok)
    summary: dict = {
        "num_requests": len(rows),
        "num_completed": len(ok),
        "num_failed": len(rows) - len(ok),
        "duration_s": _f(duration),
        "duration_definition": "first arrival to last finish",
        "total_prompt_tokens": in_toks,
        "total_output_tokens": out_toks,
        "request_throughput": _div(len(ok), dur),
        "output_throughput": _div(out_toks, dur),
        "total_token_throughput": _div(in_toks + out_toks, dur),
        # prefix caching: prompt tokens found cached (prefill skipped), over all prompt tokens
        "prefix_cache_hit_rate": _div(sum(r.get("cached_tokens") or 0 for r in ok), in_toks)
        if any(r.get("cached_tokens") for r in ok)
        else None,
    }
    for metric in LATENCY_METRICS:
        values = [g for r in ok for g in r["itls"]] if metric == "itl" else [r[metric] for r in ok]
        summary.update(stats(values, metric))
    summary["total_request_preemptions"] = int(sum(r["num_preemptions"] for r in rows))
    if slo is None:
        summary.update(slo_ttft=None, slo_tpot=None, good_requests=None)
        summary.update(goodput=None, slo_attainment=None)
    else:
        good = sum(_meets(r, slo) for r in rows)
        summary.update(slo_ttft=_f(slo.ttft), slo_tpot=_f(slo.tpot), good_requests=good)
        summary["goodput"] = _div(good, dur)
        summary["slo_attainment"] = _div(good, len(rows))
    summary.update(_step_summary([step_row(s) for s in step_rows], max_num_seqs))
    return summary
