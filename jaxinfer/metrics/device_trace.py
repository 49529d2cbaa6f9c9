"""Device time per op from a `jax.profiler` trace, read without TensorBoard's profile plugin.

`jax.profiler.stop_trace()` writes `<log_dir>/plugins/profile/<run>/<host>.trace.json.gz`, a Chrome
trace: complete events (`"ph": "X"`, `ts`/`dur` in microseconds) on threads of processes. Which
events are device work:

- GPU: events on the threads named `Stream #...` of a `/device:GPU:N` process (kernels and
  memcpys; XLA's kernels carry `hlo_op` / `hlo_module` arguments). Derived timelines that repeat
  the same work ("XLA Ops", "XLA Modules", "Steps", ...) are left out so nothing is counted twice.
- CPU (no GPU process): XLA's thunks, which run on host threads and carry an `hlo_op` argument;
  control-flow thunks (`while`, `conditional`, `call`) are left out: they enclose their bodies' thunks.

Times are summed per event name (the kernel), per HLO op category (`loop_add_fusion.3` ->
`loop_add_fusion`: the 32 copies of a layer's op add up), per XLA module (`jit_decode_loop`,
`jit_mixed_step`) and per kind of work (`KINDS`: matmul, attention, kv_write, fusion, copy, other),
the coarse account of where a step's time goes. A kernel replayed from a command buffer (a CUDA
graph) carries the `command_buffer` thunk as its hlo_op, so there the kernel's own name gives its
category. `idle_ms` and `top_gaps`:
where no stream was busy, charged to the ops on either side; `overlapped_starts`, how often an op
started before the ones before it ended. Kernels on concurrent streams
overlap, so `device_ms` may exceed `span_ms`.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

DERIVED_LINES = frozenset(
    {"XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Framework Ops", "Framework Name Scope",
     "Source code", "TensorFlow Ops", "TensorFlow Name Scope", "Launch Stats"}
)  # fmt: skip
MAX_NAME_CHARS = 120  # CUTLASS / Triton kernel names run to hundreds of characters
_INSTANCE_SUFFIX = re.compile(r"([._]\d+)+$")
CONTROL_FLOW = frozenset({"while", "conditional", "call"})
COMMAND_BUFFERS = frozenset({"command_buffer"})  # thunks that launch a captured CUDA graph


# Kinds of device work, by substrings of the HLO category or kernel name (lower case), tried in
# order: the first kind with a match wins (`gemm_fusion_dot` is a matmul, `input_scatter_fusion`
# the K/V write, before either reads as a fusion). On the CPU, XLA runs dots as YNNPACK fusions.
KINDS = (
    ("attention", ("mosaic", "mpmd_map", "attention", "fmha", "flash")),
    ("matmul", ("gemm", "nvjet", "cublas", "cutlass", "xmma", "dot", "matmul", "ynn_fusion")),
    ("kv_write", ("scatter",)),
    ("copy", ("memcpy", "memset", "copy")),
    ("fusion", ("fusion", "reduce", "select", "sort", "transpose", "concatenate", "slice")),
)


def kind_of(category: str, name: str = "") -> str:
    """The kind of work (`KINDS`) an op of HLO category `category` / kernel `name` does."""
    text = f"{category} {name}".lower()
    for kind, keys in KINDS:
        if any(k in text for k in keys):
            return kind
    return "other"


def find_trace(log_dir: str | Path) -> Path | None:
    """The newest `*.trace.json.gz` under `log_dir/plugins/profile/*/`, or None."""
    traces = list(Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"))
    return max(traces, key=lambda p: p.stat().st_mtime) if traces else None


def hlo_category(hlo_op: str) -> str:
    """`fusion.12` -> `fusion`, `loop_add_fusion_3` -> `loop_add_fusion` (instance numbers off)."""
    return _INSTANCE_SUFFIX.sub("", hlo_op) or hlo_op


def device_events(trace: dict) -> tuple[str, list[dict]]:
    """(source, the complete events that are device work); source: "gpu_streams" | "cpu_thunks"."""
    events = trace.get("traceEvents", [])
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            processes[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu_pids = {pid for pid, name in processes.items() if name.startswith("/device:GPU")}
    if gpu_pids:
        lines = {key: name for key, name in threads.items() if key[0] in gpu_pids}
        streams = {key for key, name in lines.items() if name.startswith("Stream")}
        keep = streams or {key for key, name in lines.items() if name not in DERIVED_LINES}
        return "gpu_streams", [e for e in complete if (e["pid"], e.get("tid")) in keep]
    thunks = [e for e in complete if "hlo_op" in e.get("args", {})]
    return "cpu_thunks", [
        e for e in thunks if hlo_category(e["args"]["hlo_op"]) not in CONTROL_FLOW
    ]


def _top(totals: dict[str, list[float]], total_us: float, top: int) -> list[dict]:
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [
        {
            "name": name[:MAX_NAME_CHARS],
            "time_ms": round(us / 1e3, 3),
            "count": int(count),
            "share": round(us / total_us, 4) if total_us > 0 else None,
        }
        for name, (us, count) in ranked
    ]


def idle_gaps(events: list[dict], top: int = 10) -> dict:
    """Where the device sat idle: gaps in the union of all streams' busy intervals.

    Each gap is charged to the pair (op that ended before it -> op that started after it), by HLO
    category, so e.g. a host round trip between decode scans or a launch gap inside a command buffer
    shows up under the ops that border it. `idle_ms` = span minus busy time. `overlapped_starts`:
    the share of ops (after the first) that start before every op before them has ended: kernels
    on concurrent streams, or, on one stream, a kernel launched while its predecessor drains
    (SmolLM2's fast and slow speculative engines: 76% against 3%, docs/speculative.md).
    """
    spans = sorted(
        ((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in events),
        key=lambda s: s[:2],  # events can tie on both times; never compare the dicts
    )
    by_pair: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    idle_us, busy_end, last, overlapped = 0.0, None, None, 0
    for start, end, e in spans:
        overlapped += busy_end is not None and start < busy_end
        if busy_end is not None and start > busy_end:
            gap = start - busy_end
            idle_us += gap
            pair = f"{_category_of(last)} -> {_category_of(e)}"
            by_pair[pair][0] += gap
            by_pair[pair][1] += 1
        if busy_end is None or end >= busy_end:
            busy_end, last = end, e
    share = round(overlapped / (len(spans) - 1), 4) if len(spans) > 1 else None
    return {"idle_ms": round(idle_us / 1e3, 3), "overlapped_starts": share,
            "top_gaps": _top(by_pair, idle_us, top)}  # fmt: skip


def _category_of(e: dict) -> str:
    """The event's HLO op category; for a kernel launched inside a command buffer (a CUDA graph,
    whose hlo_op is the `command_buffer` thunk) the category of the kernel's own name
    (`loop_add_fusion_12` -> `loop_add_fusion`)."""
    op = e.get("args", {}).get("hlo_op")
    if op is None or hlo_category(op) in COMMAND_BUFFERS:
        return hlo_category(e.get("name", "?"))
    return hlo_category(op)


def summarize_events(source: str, events: list[dict], top: int = 15) -> dict:
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_category: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        dur, args = float(e["dur"]), e.get("args", {})
        category = _category_of(e) if "hlo_op" in args else "(not an HLO op)"
        for table, key in (
            (by_name, e.get("name", "?")),
            (by_category, category),
            (by_module, args.get("hlo_module", "(no module)")),
            (by_kind, kind_of(category, e.get("name", ""))),
        ):
            table[key][0] += dur
            table[key][1] += 1
    total_us = sum(float(e["dur"]) for e in events)
    span_us = (
        max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events) if events else 0.0
    )
    return {
        "source": source,
        "num_events": len(events),
        "device_ms": round(total_us / 1e3, 3),
        "span_ms": round(span_us / 1e3, 3),
        "top_ops": _top(by_name, total_us, top),
        "top_hlo_categories": _top(by_category, total_us, top),
        "modules": _top(by_module, total_us, top),
        "kinds": _top(by_kind, total_us, len(KINDS) + 1),
        **idle_gaps(events),
    }


def summarize_trace(log_dir: str | Path, top: int = 15) -> dict:
    """Device-time summary of the newest trace under `log_dir`; `{"error": ...}` when there is none
    or it holds no device events (never raises for a missing or unreadable trace)."""
    path = find_trace(log_dir)
    if path is None:
        return {"error": f"no plugins/profile/*/*.trace.json.gz under {log_dir}"}
    try:
        with gzip.open(path, "rt") as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        return {"trace": str(path), "error": f"unreadable trace: {type(e).__name__}: {e}"}
    source, events = device_events(trace)
    if not events:
        return {"trace": str(path), "source": source, "error": "no device events in the trace"}
    return {"trace": str(path), **summarize_events(source, events, top)}
