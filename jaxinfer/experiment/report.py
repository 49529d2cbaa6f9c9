"""`jaxinfer report RESULTS...`: a Markdown report with PNG plots of run or sweep results.

RESULTS is a run folder (`metrics.json`, `env.json`, `config.yaml`, `requests.parquet`,
`steps.parquet`) or a sweep folder (`sweep.json`, `results.parquet`, `points/<name>/` run
folders). Several folders are compared as points (a run is named by its folder, a sweep's points
by `<sweep folder>/<point>`).

The varying keys are the dotted config keys whose values differ between points (sweep overrides
first, then `config.yaml` differences). The x key orders the latency-throughput curve: `--x`, else
`workload.arrival.rate` when it varies, else the first varying key; every other varying key splits
the curve into one line per value, unless it is one-to-one with x (zipped with it in a sweep).

Writes `report.md` and `*.png` into the output folder: by default `RESULTS/report/`, but for
committed results (under `experiments/results/`) `runs/report-<path below it>/` (e.g.
`runs/report-cpu-chunked_prefill/`), so that their tracked report is rewritten only when asked
for (`--out RESULTS/report`). Plots use matplotlib's `Figure` API (Agg
canvas, no pyplot global state), so rendering is headless.
"""

from __future__ import annotations

import datetime
import json
import math
import numbers
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from jaxinfer.metrics.tables import REQUESTS_FILE, STEPS_FILE

DEFAULT_X = "workload.arrival.rate"
IGNORED_KEYS = frozenset({"name", "out_dir"})  # differ per point by construction
COMMITTED_RESULTS = ("experiments", "results")  # a tracked folder: reports of it go elsewhere
PROVENANCE_KEYS = ("device", "jax", "commit", "date")
# (header, metrics.json key, scale): latencies are stored in seconds and shown in ms.
TABLE_COLUMNS = (
    ("output tok/s", "output_throughput", 1.0),
    ("req/s", "request_throughput", 1.0),
    ("TTFT p50 (ms)", "ttft_median", 1e3),
    ("TTFT p99 (ms)", "ttft_p99", 1e3),
    ("TPOT p50 (ms)", "tpot_median", 1e3),
    ("TPOT p99 (ms)", "tpot_p99", 1e3),
    ("goodput (req/s)", "goodput", 1.0),
    ("KV use (mean)", "kv_use_mean", 1.0),
    ("wasted KV slots (mean)", "wasted_slot_fraction_mean", 1.0),
    ("preemptions", "total_preemptions", 1.0),
    ("compiles after warmup", "compiles_after_warmup", 1.0),
)


@dataclass
class Point:
    """One run: its metrics, provenance, flattened config (+ sweep overrides) and tables."""

    name: str
    dir: Path | None
    metrics: dict
    env: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    override_keys: tuple[str, ...] = ()
    zipped: frozenset[str] = frozenset()  # the sweep's zip keys (advanced together)
    requests: pd.DataFrame | None = None
    steps: pd.DataFrame | None = None


# ---------------------------------------------------------------- loading


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _table(d: Path, name: str) -> pd.DataFrame | None:
    return pd.read_parquet(d / name) if (d / name).is_file() else None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _py(v):
    """A plain Python value: numpy scalars unwrapped, NaN as None."""
    if isinstance(v, np.generic):
        v = v.item()
    return None if isinstance(v, float) and math.isnan(v) else v


def _run_point(name: str, d: Path, overrides: dict | None = None, row: dict | None = None):
    """A Point from run folder `d` (metrics.json over the sweep's results row); None if neither."""
    metrics = {k: _py(v) for k, v in (row or {}).items()}
    metrics.update(_json(d / "metrics.json") or {})
    if not metrics:
        return None
    cfg = d / "config.yaml"
    params = _flatten(yaml.safe_load(cfg.read_text()) or {}) if cfg.is_file() else {}
    params.update(overrides or {})
    return Point(
        name, d, metrics, env=_json(d / "env.json") or {}, params=params,
        override_keys=tuple(overrides or ()), requests=_table(d, REQUESTS_FILE),
        steps=_table(d, STEPS_FILE),
    )  # fmt: skip


def _sweep_points(d: Path, prefix: str) -> tuple[list[Point], list[str]]:
    spec = _json(d / "sweep.json") or {}
    rows = {}
    if (d / "results.parquet").is_file():
        rows = {
            str(r["point"]): r for r in pd.read_parquet(d / "results.parquet").to_dict("records")
        }
    # Provenance of a point whose env.json is gone: its own in sweep.json, else (sweep.json of
    # before per-point provenance) the sweep's.
    fallback = {} if "ran" in (spec.get("provenance") or {}) else spec.get("provenance") or {}
    entries = [
        (str(p["name"]), dict(p.get("overrides") or {}), p.get("provenance") or fallback)
        for p in spec.get("points", [])
    ]
    if not entries:  # results.parquet alone: its dotted columns are the overrides
        entries = [(n, {k: _py(v) for k, v in r.items() if "." in k}, {}) for n, r in rows.items()]
    points, notes = [], []
    for name, ov, env in entries:
        row = {k: v for k, v in rows.get(name, {}).items() if k != "point" and k not in ov}
        p = _run_point(prefix + name, d / "points" / name, ov, row)
        if p is not None:
            p.zipped = frozenset(spec.get("zip") or ())
            p.env = p.env or dict(env)
            points.append(p)
        elif (d / "points" / f"{name}.error.txt").is_file():
            notes.append(f"point `{name}` of `{d}` failed: see `points/{name}.error.txt`")
        else:
            notes.append(f"point `{name}` of `{d}` has no results (not run yet?)")
    return points, notes


def load_points(paths: list[Path]) -> tuple[list[Point], list[str]]:
    """Points of run and sweep folders, in the order given, and notes on points left out."""
    points, notes = [], []
    from jaxinfer.experiment.sweep import read_metrics

    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such folder")
        sweep_files = [f for f in ("sweep.json", "results.parquet") if (path / f).is_file()]
        if sweep_files and (path / "metrics.json").is_file():  # which of the two is meant?
            raise ValueError(
                f"{path}: holds both a sweep's ({', '.join(sweep_files)}) and a run's "
                f"(metrics.json) results; move one of them to a folder of its own"
            )
        if sweep_files:
            found, missing = _sweep_points(path, f"{path.name}/" if len(paths) > 1 else "")
            points += found
            notes += missing
        elif (path / "metrics.json").is_file():
            try:  # (a `jaxinfer quickstart` folder has a metrics.json, of no run)
                read_metrics(path / "metrics.json", finished=False)
            except ValueError as e:
                raise ValueError(f"{path}: not a run folder that report can read: {e}") from None
            points.append(_run_point(path.name, path))
        else:
            raise FileNotFoundError(
                f"{path}: neither a run folder (metrics.json) nor a sweep folder "
                "(sweep.json or results.parquet)"
            )
    seen: dict[str, int] = {}
    for p in points:  # distinct names: runs of the same folder name in different parents
        seen[p.name] = seen.get(p.name, 0) + 1
        if seen[p.name] > 1:
            p.name = f"{p.name}-{seen[p.name]}"
    return points, notes


def _h(v) -> str:
    return json.dumps(_py(v), sort_keys=True, default=str)


def varying_keys(points: list[Point]) -> list[str]:
    """Config keys with different values in the points that have them (a point with no
    config.yaml does not make every key vary): sweep overrides first, then config order."""
    order = [k for p in points for k in p.override_keys] + [k for p in points for k in p.params]
    return [
        k
        for k in dict.fromkeys(order)
        if k not in IGNORED_KEYS and len({_h(p.params[k]) for p in points if k in p.params}) > 1
    ]


def choose_x(keys: list[str], x: str | None) -> str | None:
    if x is not None:
        if keys and x not in keys:
            raise ValueError(f"--x {x}: not a varying key; the varying keys are {keys}")
        return x if x in keys else None
    return DEFAULT_X if DEFAULT_X in keys else (keys[0] if keys else None)


def short_names(keys: list[str]) -> dict[str, str]:
    """Each dotted key's shortest unique suffix (`workload.arrival.rate` -> `rate`)."""
    out = {}
    for k in keys:
        parts = k.split(".")
        for n in range(1, len(parts) + 1):
            s = ".".join(parts[-n:])
            if sum(o == s or o.endswith("." + s) for o in keys) == 1:
                out[k] = s
                break
        else:
            out[k] = k
    return out


def _sort_key(v):
    v = _py(v)
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0.0, str(v)) if v is not None else (2, 0.0, "")


# ---------------------------------------------------------------- table and header


def _fmt(v, scale: float = 1.0) -> str:
    v = _py(v)
    if v is None:
        return "–"
    if isinstance(v, bool | str) or (isinstance(v, int) and scale == 1.0):
        return str(v)
    x = float(v) * scale
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _md(s) -> str:
    return str(s).replace("|", "\\|")


def metrics_table(points: list[Point], keys: list[str]) -> list[str]:
    """Markdown table: one row per point, the varying keys, then the key metrics."""
    heads = ["point", *(f"`{k}`" for k in keys), "done", *(h for h, _, _ in TABLE_COLUMNS)]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for p in points:
        m = p.metrics
        done = f"{_fmt(m.get('num_completed'))}/{_fmt(m.get('num_requests'))}"
        cells = [p.name, *(_fmt(p.params.get(k)) for k in keys), done]
        cells += [_fmt(m.get(key), scale) for _, key, scale in TABLE_COLUMNS]
        lines.append("| " + " | ".join(_md(c) for c in cells) + " |")
    return lines


def provenance_lines(points: list[Point]) -> list[str]:
    """Device / jax / commit / date of the runs, with a warning where they differ."""
    lines, warnings = ["| | |", "|---|---|"], []
    for key in PROVENANCE_KEYS:
        values: dict[str, list[str]] = {}
        for p in points:
            if p.env.get(key) is not None:
                values.setdefault(str(p.env[key]), []).append(p.name)
        if len(values) <= 1:
            text = next(iter(values), "unknown")
        elif key == "date":
            text = f"{min(values)} … {max(values)}"
        else:
            text = "; ".join(f"{v} ({', '.join(names)})" for v, names in values.items())
            warnings.append(f"> **Note:** `{key}` differs between points; compare with care.")
        lines.append(f"| {key} | {_md(text)} |")
    unknown = [p.name for p in points if not p.env]
    if unknown:
        warnings.append(f"> **Note:** no env.json for {', '.join(unknown)}.")
    if any(str(p.env.get("commit", "")).endswith("-dirty") for p in points):
        warnings.append("> **Note:** some runs were made with uncommitted changes (`-dirty`).")
    return [*lines, "", *warnings] if warnings else lines


# ---------------------------------------------------------------- plots


def _colors(n: int) -> list:
    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    return [colormaps["viridis"](i / (n - 1)) for i in range(n)]


def _save(fig: Figure, out: Path, name: str) -> str:
    fig.savefig(out / name, dpi=110, bbox_inches="tight")
    return name


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "point"


def _groups(points: list[Point], keys: list[str], x: str) -> dict[str, list[Point]]:
    """Points split by the other varying keys, except those zipped with x: in the sweep's zip
    with x, or (for folders outside a sweep) one-to-one with x."""
    tied = frozenset().union(*(p.zipped for p in points if x in p.zipped))
    split = []
    for k in keys:
        pairs = {(_h(p.params.get(x)), _h(p.params.get(k))) for p in points}
        one_to_one = len(pairs) == len({a for a, _ in pairs}) == len({b for _, b in pairs})
        if k != x and k not in tied and not one_to_one:
            split.append(k)
    short = short_names(keys)
    groups: dict[str, list[Point]] = {}
    for p in points:
        label = ", ".join(f"{short[k]}={_fmt(p.params.get(k))}" for k in split)
        groups.setdefault(label, []).append(p)
    return groups


def plot_latency_throughput(points, keys, x, out) -> tuple[str | None, str]:
    """TTFT and TPOT p50 (solid) / p99 (dashed) vs output throughput; (file, note)."""
    usable = [p for p in points if p.metrics.get("output_throughput") is not None]
    if len(usable) < 2:
        return None, "a curve needs at least two points with a measured output throughput"
    if x is None:
        return None, "no config key varies between the points, so there is no curve to order"
    groups = _groups(usable, keys, x)
    xname = short_names(keys)[x]
    fig = Figure(figsize=(11, 4.3))
    axes = fig.subplots(1, 2)
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        ys = []
        for (label, pts), color in zip(groups.items(), _colors(len(groups)), strict=True):
            pts = sorted(pts, key=lambda p: _sort_key(p.params.get(x)))
            for stat, style, marker in (("median", "-", "o"), ("p99", "--", "^")):
                xy = [
                    (p.metrics["output_throughput"], p.metrics[f"{metric}_{stat}"] * 1e3, p)
                    for p in pts
                    if p.metrics.get(f"{metric}_{stat}") is not None
                ]
                if not xy:
                    continue
                tx, ty, _ = zip(*xy, strict=True)
                ax.plot(tx, ty, style, marker=marker, color=color, label=label or None)
                ys += ty
                if stat == "median":
                    for a, b, p in xy:
                        ax.annotate(
                            _fmt(p.params.get(x)), (a, b), textcoords="offset points",
                            xytext=(4, -10), fontsize=7, color=color,
                        )  # fmt: skip
        if ys and min(ys) > 0 and max(ys) / min(ys) > 50:
            ax.set_yscale("log")
        ax.set(xlabel="achieved output throughput (tok/s)", ylabel=f"{metric.upper()} (ms)")
        ax.set_title(f"{metric.upper()}: p50 solid, p99 dashed", fontsize=10)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=c, lw=2, label=lab) for lab, c in
               zip(groups, _colors(len(groups)), strict=True) if lab]  # fmt: skip
    handles += [Line2D([], [], color="k", ls="-", marker="o", label="p50"),
                Line2D([], [], color="k", ls="--", marker="^", label="p99")]  # fmt: skip
    axes[1].legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(f"Latency vs throughput (points labelled and ordered by {xname})")
    return _save(fig, out, "latency_throughput.png"), ""


def _latencies_ms(p: Point, column: str) -> np.ndarray | None:
    """A column of the completed requests, in ms (None when there is none)."""
    df = p.requests
    if df is None or column not in df:
        return None
    if "failed" in df:
        df = df[~df["failed"].fillna(False).astype(bool)]
    v = pd.to_numeric(df[column], errors="coerce").dropna().to_numpy(dtype=float) * 1e3
    return v if v.size else None


def _ecdf(ax, v: np.ndarray, **kw) -> None:
    v = np.sort(v)
    ax.step(np.concatenate([[v[0]], v]), np.arange(len(v) + 1) / len(v), where="post", **kw)


def plot_cdf(p: Point, out: Path) -> tuple[str | None, str]:
    """TTFT and TPOT CDFs of one point, p50 and p99 marked; (file, note)."""
    data = {c: _latencies_ms(p, c) for c in ("ttft", "tpot")}
    if all(v is None for v in data.values()):
        why = "no requests.parquet" if p.requests is None else "no completed requests"
        return None, f"`{p.name}`: {why}"
    fig = Figure(figsize=(10, 3.6))
    for ax, (col, v) in zip(fig.subplots(1, 2), data.items(), strict=True):
        ax.set(xlabel=f"{col.upper()} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if v is None:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
            continue
        _ecdf(ax, v, color="C0")
        for q, ls in ((50, ":"), (99, "--")):
            val = float(np.percentile(v, q))
            ax.axvline(val, color="C3", ls=ls, lw=1, label=f"p{q} = {_fmt(val)} ms")
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title(f"{col.upper()} CDF ({len(v)} requests)", fontsize=10)
    fig.suptitle(p.name)
    return _save(fig, out, f"cdf_{_safe(p.name)}.png"), ""


def plot_cdf_overlay(points: list[Point], out: Path) -> tuple[str | None, str]:
    """TTFT and TPOT CDFs of every point on shared axes; (file, note)."""
    series = [(p, {c: _latencies_ms(p, c) for c in ("ttft", "tpot")}) for p in points]
    series = [(p, d) for p, d in series if any(v is not None for v in d.values())]
    if len(series) < 2:
        return None, "an overlay needs at least two points with request latencies"
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    for (p, d), color in zip(series, _colors(len(series)), strict=True):
        for ax, col in zip(axes, ("ttft", "tpot"), strict=True):
            if d[col] is not None:
                _ecdf(ax, d[col], color=color, label=p.name)
    for ax, col in zip(axes, ("TTFT", "TPOT"), strict=True):
        ax.set(xlabel=f"{col} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle("TTFT and TPOT CDFs, all points")
    return _save(fig, out, "cdf_all.png"), ""


def _kv_series(p: Point) -> tuple[np.ndarray, np.ndarray] | None:
    df = p.steps
    if df is None or not {"time", "kv_pages_used", "kv_pages_total"} <= set(df.columns):
        return None
    df = df[df["kv_pages_total"] > 0].sort_values("time")
    if df.empty:
        return None
    t = df["time"].to_numpy(dtype=float)
    return t - t[0], (df["kv_pages_used"] / df["kv_pages_total"]).to_numpy(dtype=float)


def plot_kv_use(points: list[Point], out: Path) -> tuple[str | None, str]:
    """Fraction of KV pages in use vs time since each point's first step; (file, note)."""
    series = [(p, s) for p in points if (s := _kv_series(p)) is not None]
    if not series:
        return None, "no point has steps.parquet with KV page counts"
    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    for (p, (t, kv)), color in zip(series, _colors(len(series)), strict=True):
        ax.step(t, kv, where="post", color=color, lw=1.2, label=p.name)
    ax.set(xlabel="time since first step (s)", ylabel="KV pages in use / total", ylim=(0, 1.05))
    ax.set_title("KV cache use over time", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(fig, out, "kv_use.png"), ""


def plot_bars(points: list[Point], out: Path) -> tuple[str | None, str]:
    """Per-point bars: output throughput and mean wasted KV slot fraction; (file, note)."""
    bars = (("output_throughput", "output throughput (tok/s)"),
            ("wasted_slot_fraction_mean", "wasted KV slot fraction (mean)"))  # fmt: skip
    if len(points) < 2:
        return None, "bar charts compare points; there is only one"
    if all(p.metrics.get(k) is None for p in points for k, _ in bars):
        return None, "no point has output throughput or wasted-slot fraction"
    n = len(points)
    fig = Figure(figsize=(11, max(2.4, 0.38 * n + 1.2)))
    axes = fig.subplots(1, 2, sharey=True)
    y = np.arange(n)
    for ax, (key, label) in zip(axes, bars, strict=True):
        vals = [_py(p.metrics.get(key)) for p in points]
        ax.barh(y, [v or 0.0 for v in vals], color=_colors(n))
        for yi, v in zip(y, vals, strict=True):
            ax.text(
                v or 0.0, yi, " " + (_fmt(v) if v is not None else "n/a"), va="center", fontsize=8
            )
        ax.set_xlabel(label)
        ax.margins(x=0.18)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, [p.name for p in points], fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("Per-point comparison")
    return _save(fig, out, "bars.png"), ""


# ---------------------------------------------------------------- report


def _figure(file: str | None, note: str, alt: str) -> list[str]:
    return [f"![{alt}]({file})", ""] if file else [f"_Skipped: {note}._", ""]


def _committed_part(path: Path) -> tuple[str, ...] | None:
    """The parts of `path` below an `experiments/results/` folder (committed results), or None."""
    parts = path.resolve().parts
    for i in range(len(parts) - 1):
        if parts[i : i + 2] == COMMITTED_RESULTS:
            return parts[i + 2 :]
    return None


def default_out(paths: list[Path], runs: Path = Path("runs")) -> Path:
    """`<RESULTS>/report`, or `<common parent>/report` for several folders; for committed results
    (under `experiments/results/`) `runs/report-<their path below it, joined by ->`, so that a
    report of them never rewrites a tracked one unless its folder is asked for by name."""
    if len(paths) == 1:
        folder = Path(paths[0])
    else:
        folder = Path(os.path.commonpath([Path(p).resolve() for p in paths]))
    below = _committed_part(folder)
    if below is None:
        return folder / "report"
    return runs / f"report-{'-'.join(below) or 'results'}"


def write_report(
    paths: list[Path], out: Path, x: str | None = None, title: str | None = None
) -> Path:
    """Render `out/report.md` and its PNG plots for run / sweep folders; return the report path."""
    paths = [Path(p) for p in paths]
    points, notes = load_points(paths)
    if not points:
        raise ValueError(f"no results in {', '.join(map(str, paths))}")
    keys = varying_keys(points)
    x = choose_x(keys, x)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = [p.name for p in paths]
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    title = title or "Report: " + ", ".join(names[:3]) + more
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    md = [f"# {title}", ""]
    md += [f"Results: {', '.join(f'`{p}`' for p in paths)}; {len(points)} point(s). "
           f"Rendered {now} by `jaxinfer report`.", ""]  # fmt: skip
    if keys:
        md += [
            "Varying keys: " + ", ".join(f"`{k}`" + (" (x)" if k == x else "") for k in keys),
            "",
        ]
    md += ["## Provenance", "", *provenance_lines(points), ""]
    md += ["## Metrics", "", *metrics_table(points, keys), ""]
    md += ["Latencies are over completed requests; TTFT and TPOT in ms; goodput in requests/s "
           "meeting the run's SLO (– when no SLO was set); KV use and wasted slots are per-step "
           "fractions averaged over steps.", ""]  # fmt: skip
    md += ["## Latency vs throughput", ""]
    md += _figure(*plot_latency_throughput(points, keys, x, out), "latency vs throughput")
    md += ["## TTFT and TPOT distributions", ""]
    if len(points) > 1:
        md += _figure(*plot_cdf_overlay(points, out), "CDFs, all points")
    for p in points:
        md += [f"### {_md(p.name)}", "", *_figure(*plot_cdf(p, out), f"CDF {p.name}")]
    md += ["## KV cache use over time", "", *_figure(*plot_kv_use(points, out), "KV use")]
    md += ["## Per-point comparison", "", *_figure(*plot_bars(points, out), "per-point bars")]
    if notes:
        md += ["## Left out", "", *(f"- {n}" for n in notes), ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path
