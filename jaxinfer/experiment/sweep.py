"""`jaxinfer sweep CONFIG [key=value ...] [--grid key=v1,v2 ...] [--zip key=v1,v2 ...]`.

A sweep config is a run config (see `run.py`) plus an optional top-level section

    sweep:
      grid: {engine.scheduler: [fcfs, static], workload.arrival.rate: [2, 4, 8]}
      zip:  {engine.max_num_seqs: [8, 16], engine.max_num_batched_tokens: [128, 256]}

The points are the cartesian product of the grid lists times the zip lists advanced together
(all zip lists have one length). `--grid`/`--zip` on the command line add axes or replace the
file's; plain `key=value` overrides apply to every point. Every point's config is built and
validated by `load_run_config` before anything runs.

Results folder (`out_dir` of the base config; the experiment configs point it under `runs/`, and
their committed results are remade only with an explicit `out_dir=experiments/results/...`):

    sweep.json               config path, overrides, grid, zip, points [{name, overrides,
                             config_sha256, provenance: the env.json of the run that made it}],
                             provenance of the last invocation that ran points (`ran`: which)
    points/<name>/           one run's results folder (metrics.json, config.yaml, ...) and
                             config.sha256, the hash of its resolved config (`point_config`)
    points/<name>.error.txt  traceback of a point that raised
    points/<name>.broken-<time>/  the files of a point found broken, moved aside before its re-run
    .sweep.lock              the pid of the sweep running in the folder, which holds a lock on it:
                             a second sweep on the folder is refused, naming that pid

An out_dir that holds a run's results (`RUN_FILES`: `jaxinfer run`'s folder) is refused.
    results.parquet          one row per finished point: `point`, one column per swept key,
                             then every scalar metric of the point's metrics.json

A point runs into `points/.<name>.tmp-<pid>/` and is renamed to `points/<name>/` once its
`metrics.json` is written, so an interrupted sweep loses only the points in progress; running
the same sweep again skips finished points, removes stale tmp folders and re-merges. A point is
finished when its files are whole and agree (`point_problem`): a `metrics.json` holding a JSON
object with the counts every run writes (and no `interrupted` mark) and, written by the sweep, the
`config_sha256` of its folder's `config.sha256`; readable `requests.parquet` and `steps.parquet`;
as many request rows as `num_requests`, which is `num_completed + num_failed` and the workload's
`num_requests` (at most that, for a trace). A point folder that is not is moved aside and the
point run again. A finished
point run with another config than the one asked for (`config_difference`: other base overrides,
an edited config file) is an error before anything runs or is written: its results are not this
sweep's, and rerunning over them would lose them. `sweep.json` and `results.parquet` are left
untouched when an invocation changes nothing in them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import hashlib
import itertools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxinfer.experiment.run import RunConfig, load_run_config, run_experiment
from jaxinfer.provenance import provenance, typed_command

SWEEP_FILE = "sweep.json"
RESULTS_FILE = "results.parquet"
POINTS_DIR = "points"
ERROR_SUFFIX = ".error.txt"
_TMP_MARK = ".tmp-"
_MAX_NAME = 160  # leaves room for ".<name>.tmp-<pid>" and ".error.txt" within 255 bytes
_UNSWEEPABLE = ("out_dir",)
_BROKEN_MARK = ".broken-"
RUN_FILES = ("config.yaml", "env.json", "metrics.json")  # of a run's folder (run.py)
LOCK_FILE = ".sweep.lock"  # held (flock) by the sweep running in the folder
# Keys every run's metrics.json has (from `summarize`): without them the file is not a run's.
REQUIRED_METRICS = ("num_requests", "num_completed", "num_failed")
TABLES = ("requests.parquet", "steps.parquet")
CONFIG_HASH_FILE = "config.sha256"  # in a point folder, next to its resolved config.yaml
METRICS_CONFIG_KEY = "config_sha256"  # the same hash, in the point's metrics.json
_SHOWN_DIFFERENCES = 3


@dataclass(frozen=True)
class SweepPoint:
    name: str  # filesystem-safe, stable: built from the swept keys and values
    overrides: dict[str, Any]  # swept key -> value, as given in the sweep


@dataclass
class SweepPlan:
    config: str | None
    overrides: list[str]
    grid: dict[str, list]
    zip: dict[str, list]
    out_dir: Path
    points: list[SweepPoint]
    run_configs: dict[str, RunConfig]  # point name -> validated config (out_dir: its folder)

    @property
    def keys(self) -> list[str]:
        return [*self.grid, *self.zip]

    @property
    def points_dir(self) -> Path:
        return self.out_dir / POINTS_DIR

    def is_done(self, name: str) -> bool:
        """Finished, with the config asked for (see `config_difference`)."""
        point = self.points_dir / name
        return (
            point.is_dir()
            and point_problem(point, self.run_configs[name]) is None
            and config_difference(point, self.run_configs[name]) is None
        )


@dataclass
class SweepResult:
    ran: list[str] = field(default_factory=list)  # points that finished in this invocation
    skipped: list[str] = field(default_factory=list)  # already finished before
    failed: dict[str, str] = field(default_factory=dict)  # point -> error (traceback)
    table: Any = None  # pandas DataFrame of results.parquet

    @property
    def ok(self) -> bool:
        return not self.failed


# ---------------------------------------------------------------------------- axes and points


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and quotes: `1,[2,3],"a,b"` -> 3 items."""
    items, depth, quote, cur = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    items.append("".join(cur))
    return items


def _parse_value(text: str) -> Any:
    """A command-line value, typed the way `key=value` overrides are (omegaconf's YAML rules)."""
    value = OmegaConf.from_dotlist([f"v={text}"])["v"]
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value)
    return value


def parse_axes(items: Iterable[str] | None) -> dict[str, list]:
    """`["engine.scheduler=fcfs,static", "workload.arrival.rate=2,4"]` -> {key: [values]}."""
    axes: dict[str, list] = {}
    for item in items or ():
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ValueError(f"sweep axis {item!r}: expected key=v1,v2,...")
        axes[key] = [_parse_value(v.strip()) for v in _split_top_level(values)]
    return axes


def _flatten(section: Any, where: str, prefix: str = "") -> dict[str, list]:
    """`{engine: {scheduler: [a, b]}, workload.seed: [0, 1]}` -> dotted key -> list."""
    if not isinstance(section, dict):
        raise ValueError(
            f"{where}{'.' + prefix if prefix else ''}: expected a mapping of key: [values]"
        )
    out: dict[str, list] = {}
    for k, v in section.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, list):
            out[key] = v
        elif isinstance(v, dict):
            out.update(_flatten(v, where, key))
        else:
            raise ValueError(f"{where}.{key}={v!r}: expected a list of values")
    return out


def _format_value(v: Any) -> str:
    """A value as text that omegaconf's dotlist parser reads back as the same value."""
    if isinstance(v, float) and not math.isfinite(v):
        return ".nan" if math.isnan(v) else (".inf" if v > 0 else "-.inf")
    return json.dumps(v)


def _label(v: Any) -> str:
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, int | float | str):
        return str(v)
    return json.dumps(v, separators=(",", ":"))


def _digest(overrides: dict[str, Any]) -> str:
    text = json.dumps(overrides, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def point_name(overrides: dict[str, Any]) -> str:
    """`engine.scheduler=static,workload.arrival.rate=4`, with unsafe characters replaced."""
    if not overrides:
        return "base"
    text = ",".join(f"{k}={_label(v)}" for k, v in overrides.items())
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)
    if name.startswith("."):
        name = "_" + name[1:]
    if len(name) > _MAX_NAME:
        name = f"{name[: _MAX_NAME - 11]}-{_digest(overrides)}"
    return name


def _points(grid: dict[str, list], zipped: dict[str, list]) -> list[SweepPoint]:
    for where, axes in (("grid", grid), ("zip", zipped)):
        for key, values in axes.items():
            if not values:
                raise ValueError(f"sweep.{where}.{key}: empty list of values")
    lengths = {k: len(v) for k, v in zipped.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"sweep.zip lists must have equal lengths; got {lengths}")
    n_zip = next(iter(lengths.values()), 1)
    points, seen = [], {}
    for combo in itertools.product(*grid.values(), range(n_zip)):
        ov = dict(zip(grid, combo[:-1], strict=True))
        ov.update({k: v[combo[-1]] for k, v in zipped.items()})
        key = json.dumps(ov, sort_keys=True, default=str)
        if key in seen:
            raise ValueError(f"sweep has the point {ov} twice")
        seen[key] = True
        points.append(SweepPoint(point_name(ov), ov))
    names = [p.name for p in points]
    dups = {n for n in names if names.count(n) > 1}  # distinct values, same sanitised name
    return [
        SweepPoint(f"{p.name[: _MAX_NAME - 11]}-{_digest(p.overrides)}", p.overrides)
        if p.name in dups
        else p
        for p in points
    ]


# ---------------------------------------------------------------------------- planning


def plan_sweep(
    config: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    grid: dict[str, list] | None = None,
    zipped: dict[str, list] | None = None,
) -> SweepPlan:
    """Read the sweep, build and validate every point's run config; nothing is run or written.

    `grid`/`zipped` (e.g. from `parse_axes`) add axes to the file's `sweep:` section or replace
    them. Raises ValueError naming the offending key (and point) when anything is invalid.
    """
    overrides = list(overrides)
    raw = OmegaConf.load(config) if config is not None else OmegaConf.create({})
    if not isinstance(raw, DictConfig):
        raise ValueError(f"sweep config {config}: expected a mapping at the top level")
    section = raw.pop("sweep", None)
    section = OmegaConf.to_container(section) if section is not None else {}
    if not isinstance(section, dict) or set(section) - {"grid", "zip"}:
        raise ValueError(f"sweep config {config}: `sweep:` takes only `grid:` and `zip:`")
    file_grid = _flatten(section.get("grid") or {}, "sweep.grid")
    file_zip = _flatten(section.get("zip") or {}, "sweep.zip")
    cli_grid, cli_zip = dict(grid or {}), dict(zipped or {})
    both = set(cli_grid) & set(cli_zip)
    if both:
        raise ValueError(f"sweep keys both in --grid and --zip: {sorted(both)}")
    # The command line wins: a key given there leaves the file's grid and zip alike.
    grid_axes = {k: v for k, v in file_grid.items() if k not in cli_zip} | cli_grid
    zip_axes = {k: v for k, v in file_zip.items() if k not in cli_grid} | cli_zip
    both = set(grid_axes) & set(zip_axes)
    if both:
        raise ValueError(f"sweep keys both in sweep.grid and sweep.zip: {sorted(both)}")
    fixed = {o.partition("=")[0].strip() for o in overrides}
    for key in [*grid_axes, *zip_axes]:
        if key in _UNSWEEPABLE:
            raise ValueError(f"sweep key {key!r} cannot be swept (each point gets its own)")
        if key in fixed:
            raise ValueError(f"sweep key {key!r} is also a plain override; give it once")
    points = _points(grid_axes, zip_axes)

    with tempfile.TemporaryDirectory(prefix="jaxinfer-sweep-") as tmp:
        base = Path(tmp) / "base.yaml"
        OmegaConf.save(raw, base)

        def named(e: ValueError) -> str:  # the user's file, not the tmp copy, in messages
            return str(e).replace(f"invalid run config {base}", f"invalid run config {config}")

        try:
            base_rc = load_run_config(base, overrides)
        except ValueError as e:
            raise ValueError(f"sweep config without its sweep section: {named(e)}") from e
        out_dir = Path(base_rc.out_dir)
        run_configs = {}
        for p in points:
            point_dir = out_dir / POINTS_DIR / p.name
            ov = [f"{k}={_format_value(v)}" for k, v in p.overrides.items()]
            try:
                run_configs[p.name] = load_run_config(
                    base, [*overrides, *ov, f"out_dir={_format_value(str(point_dir))}"]
                )
            except ValueError as e:
                culprits = [
                    k for k, o in zip(p.overrides, ov, strict=True) if _fails(base, [*overrides, o])
                ]
                keys = culprits or list(p.overrides)
                raise ValueError(
                    f"sweep key {', '.join(keys)} invalid at point {p.name!r}: {named(e)}"
                ) from e
    return SweepPlan(
        config=str(config) if config is not None else None,
        overrides=overrides,
        grid=grid_axes,
        zip=zip_axes,
        out_dir=out_dir,
        points=points,
        run_configs=run_configs,
    )


def _fails(base: Path, overrides: list[str]) -> bool:
    try:
        load_run_config(base, overrides)
    except ValueError:
        return True
    return False


# ---------------------------------------------------------------------------- finished points


def read_metrics(path: Path, *, finished: bool = True) -> dict:
    """A (`finished`, else maybe interrupted) run's `metrics.json`; ValueError naming the file
    and what is wrong with it."""
    try:
        metrics = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(metrics, dict):
        raise ValueError(f"{path}: holds a JSON {type(metrics).__name__}, not an object")
    missing = [k for k in REQUIRED_METRICS if not _is_count(metrics.get(k))]
    if missing:
        raise ValueError(f"{path}: not a run's metrics: no integer {', '.join(missing)}")
    if finished and "interrupted" in metrics:
        raise ValueError(f"{path}: of a run interrupted by {metrics['interrupted']}")
    return metrics


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def point_problem(point: Path, rc: RunConfig | None = None) -> str | None:
    """What makes run folder `point` not a finished run (naming the file), or None if nothing:
    its files must be whole and agree with each other and, given `rc`, with its workload."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    metrics_file = point / "metrics.json"
    try:
        metrics = read_metrics(metrics_file)
    except ValueError as e:
        return str(e)
    rows = {}
    for name in TABLES:
        try:
            rows[name] = pq.read_metadata(point / name).num_rows
        except (OSError, pa.ArrowException) as e:
            return f"{point / name}: unreadable ({type(e).__name__}: {e})"
    n = metrics["num_requests"]
    if rows["requests.parquet"] != n:
        return (
            f"{point / 'requests.parquet'}: {rows['requests.parquet']} rows, {metrics_file} "
            f"says {n} requests"
        )
    if metrics["num_completed"] + metrics["num_failed"] != n:
        return (
            f"{metrics_file}: num_completed {metrics['num_completed']} + num_failed "
            f"{metrics['num_failed']} is not num_requests {n}"
        )
    # A metrics.json of another run (copied in): the config hash the sweep wrote into it is not
    # the folder's. (Folders written before either file have neither.)
    stored, ran = point / CONFIG_HASH_FILE, metrics.get(METRICS_CONFIG_KEY)
    if ran is not None and stored.is_file() and stored.read_text().strip() != ran:
        return f"{metrics_file}: of another config than its folder's {CONFIG_HASH_FILE}"
    if rc is not None:
        asked = rc.workload.num_requests
        if asked is not None and (n > asked if rc.workload.kind == "trace" else n != asked):
            return f"{metrics_file}: {n} requests, the workload has workload.num_requests={asked}"
    return None


def _move_aside(point: Path) -> Path:
    """`points/<name>/` -> `points/<name>.broken-<time>/` (kept for a look, never merged)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = point.with_name(f"{point.name}{_BROKEN_MARK}{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = point.with_name(f"{point.name}{_BROKEN_MARK}{stamp}-{n}")
    os.replace(point, aside)
    return aside


def point_config(rc: RunConfig) -> dict:
    """The resolved run config as plain data, as `config.yaml` holds it, without `out_dir` (a
    point's results do not depend on where they are written: tmp folder, renamed, moved)."""
    cfg = yaml.safe_load(OmegaConf.to_yaml(OmegaConf.structured(rc)))
    cfg.pop("out_dir", None)
    return cfg


def config_hash(cfg: dict) -> str:
    """sha256 of the canonical JSON of `cfg` (keys sorted)."""
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _dotted(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _differences(ran: dict, asked: dict) -> str:
    """`engine.max_num_seqs 8 -> 16, ...`: changed keys first, then keys only one side has."""
    a, b = _dotted(ran), _dotted(asked)
    keys = [k for k in dict.fromkeys([*b, *a]) if a.get(k, ...) != b.get(k, ...)]
    keys.sort(key=lambda k: (k not in a) or (k not in b))  # (stable: config order kept)

    def show(d: dict, k: str) -> str:
        return json.dumps(d[k], default=str) if k in d else "(absent)"

    shown = [f"{k} {show(a, k)} -> {show(b, k)}" for k in keys[:_SHOWN_DIFFERENCES]]
    more = len(keys) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def config_difference(point: Path, rc: RunConfig) -> str | None:
    """None when the run in folder `point` was made with config `rc` (`out_dir` aside), else how
    they differ (`engine.max_num_seqs 8 -> 16`). The point's `config.sha256` decides; a folder
    without one (made before it was written) is compared through its `config.yaml`."""
    asked = point_config(rc)
    stored = point / CONFIG_HASH_FILE
    if stored.is_file() and stored.read_text().strip() == config_hash(asked):
        return None
    try:
        ran = yaml.safe_load((point / "config.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return f"its config.yaml is unreadable ({type(e).__name__})"
    if not isinstance(ran, dict):
        return "its config.yaml is not a mapping"
    ran.pop("out_dir", None)
    if ran != asked:
        return _differences(ran, asked)
    # The same config.yaml under a hash of another config (one of the two edited by hand): not
    # provably the run asked for.
    return f"its {CONFIG_HASH_FILE} is of another config" if stored.is_file() else None


def _check_configs(plan: SweepPlan) -> None:
    """ValueError if a finished point of `plan.out_dir` was run with another config."""
    wrong = {}
    for p in plan.points:
        point = plan.points_dir / p.name
        # (Not against the asked workload: a point with other num_requests is run with another
        # config, an error, not a broken point to run again.)
        if point.is_dir() and point_problem(point) is None:
            why = config_difference(point, plan.run_configs[p.name])
            if why is not None:
                wrong[p.name] = why
    if not wrong:
        return
    (first, why), *_ = wrong.items()
    folders = " ".join(str(plan.points_dir / n) for n in wrong)
    if len(wrong) == 1:
        raise ValueError(
            f"point {first} in {plan.out_dir} was run with another config (differs in: {why}); "
            f"use a new out_dir, or delete {folders}"
        )
    raise ValueError(
        f"{len(wrong)} points in {plan.out_dir} were run with another config ({first} differs "
        f"in: {why}); use a new out_dir, or delete {folders}"
    )


# ---------------------------------------------------------------------------- one point


def _error_file(points_dir: Path, name: str) -> Path:
    return points_dir / f"{name}{ERROR_SUFFIX}"


def _run_point(
    name: str, rc: RunConfig, points_dir: Path, *, show_progress: bool, console: Console | None
) -> tuple[bool, str | None]:
    """Run one point into a tmp folder, then rename it into place. (ok, traceback-or-None).

    Exceptions are recorded in `<name>.error.txt`; KeyboardInterrupt (and other BaseExceptions)
    propagate and leave the tmp folder behind, to be removed by the next invocation.
    """
    final = points_dir / name
    tmp = points_dir / f".{name}{_TMP_MARK}{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        run_experiment(
            dataclasses.replace(rc, out_dir=str(tmp)), show_progress=show_progress, console=console
        )
        problem = point_problem(tmp, rc)
        if problem is not None:
            raise RuntimeError(f"the run left no finished results: {problem}")
        digest = config_hash(point_config(rc))
        (tmp / CONFIG_HASH_FILE).write_text(digest + "\n")
        metrics = read_metrics(tmp / "metrics.json")  # tied to its config (`point_problem`)
        (tmp / "metrics.json").write_text(
            json.dumps({**metrics, METRICS_CONFIG_KEY: digest}, indent=2)
        )
        cfg_file = tmp / "config.yaml"
        if cfg_file.is_file():  # record where the results live, not the tmp folder
            cfg = OmegaConf.load(cfg_file)
            cfg.out_dir = str(final)
            OmegaConf.save(cfg, cfg_file)
        if final.exists():  # appeared while the point ran (never ours): keep it aside
            _move_aside(final)
        os.replace(tmp, final)
    except Exception:
        error = traceback.format_exc()
        _error_file(points_dir, name).write_text(error)
        shutil.rmtree(tmp, ignore_errors=True)
        return False, error
    _error_file(points_dir, name).unlink(missing_ok=True)
    return True, None


def _remove_stale_tmp(points_dir: Path) -> list[Path]:
    stale = [p for p in points_dir.glob(f".*{_TMP_MARK}*") if p.is_dir()]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


# ---------------------------------------------------------------------------- merging


def _lookup(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, bool | int | float | str)


def _column_values(values: list[Any]) -> list[Any]:
    """Keep one type per column so Parquet can store it: mixed kinds become strings."""
    kinds = {
        "bool" if isinstance(v, bool) else "num" if isinstance(v, int | float) else "other"
        for v in values
        if v is not None
    }
    if len(kinds) <= 1 and "other" not in kinds:
        return values
    if kinds == {"other"} and all(isinstance(v, str) for v in values if v is not None):
        return values
    return [v if v is None else v if isinstance(v, str) else json.dumps(v) for v in values]


def merge_results(plan: SweepPlan):
    """Write `results.parquet` (one row per finished point; unless it already holds exactly
    that) and return it as a DataFrame."""
    import pandas as pd

    rows = []
    for p in plan.points:
        metrics_file = plan.points_dir / p.name / "metrics.json"
        if not metrics_file.is_file():
            continue
        metrics = read_metrics(metrics_file)  # (its errors name the file)
        row: dict[str, Any] = {"point": p.name}
        rc = plan.run_configs.get(p.name)
        for key, given in p.overrides.items():
            try:  # the validated (schema-typed) value, e.g. 4 -> 4.0 for a float field
                value = _lookup(rc, key) if rc is not None else given
            except (AttributeError, KeyError, TypeError):
                value = given
            row[key] = value if _is_scalar(value) else given
        row.update({
            k: v for k, v in metrics.items()
            if _is_scalar(v) and k not in row and k != METRICS_CONFIG_KEY
        })  # fmt: skip
        rows.append(row)
    columns = ["point", *plan.keys]
    for row in rows:
        columns += [k for k in row if k not in columns]
    data = {c: _column_values([row.get(c) for row in rows]) for c in columns}
    table = pd.DataFrame(data, columns=columns)
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    path = plan.out_dir / RESULTS_FILE
    tmp = path.with_name(f".{RESULTS_FILE}{_TMP_MARK}{os.getpid()}")
    try:
        table.to_parquet(tmp, index=False)
        if path.is_file() and filecmp.cmp(tmp, path, shallow=False):
            tmp.unlink()  # the same table: a committed file stays untouched
        else:
            os.replace(tmp, path)
    except (OSError, ValueError, TypeError) as e:  # pyarrow's errors are ValueError/TypeError
        tmp.unlink(missing_ok=True)
        raise ValueError(
            f"{path}: could not write the merged table ({type(e).__name__}: {e})"
        ) from e
    return table


# ---------------------------------------------------------------------------- workers


@contextlib.contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    """Set (or, for None, leave alone) environment variables for processes started inside."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is not None:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def visible_gpus() -> list[str]:
    """The NVIDIA GPUs this process may use, without initialising any accelerator runtime."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and "cuda" not in platforms and "gpu" not in platforms:
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    n = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    return [str(i) for i in range(n)] if out.returncode == 0 else []


def worker_devices(workers: int, gpus_per_worker: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES per worker: GPUs [i*g, (i+1)*g) for worker i; None on CPU."""
    gpus = visible_gpus() if gpus_per_worker > 0 else []
    if not gpus:
        return [None] * workers
    if workers * gpus_per_worker > len(gpus):
        raise ValueError(
            f"{workers} workers x {gpus_per_worker} GPUs each need {workers * gpus_per_worker} "
            f"GPUs; {len(gpus)} visible ({','.join(gpus)})"
        )
    g = gpus_per_worker
    return [",".join(gpus[i * g : (i + 1) * g]) for i in range(workers)]


def _worker_main(conn, points_dir: str) -> None:
    """Worker process: ask for a point, run it, report, until told to stop (None)."""
    console = Console(quiet=True)
    try:
        conn.send(("ready",))
        while (task := conn.recv()) is not None:
            name, rc = task
            ok, error = _run_point(name, rc, Path(points_dir), show_progress=False, console=console)
            conn.send(("done", name, ok, error))
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass


@dataclass
class _Worker:
    slot: int
    process: Any
    conn: Any
    current: str | None = None
    stopping: bool = False


def _run_in_workers(plan, pending, workers, devices, on_done) -> None:
    """Hand points to worker processes from one shared queue, each worker pulling the next when
    it is free. Per-worker pipes (no shared locks), so a killed worker cannot wedge the others;
    its point is recorded as failed and a replacement worker takes over the rest."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    queue = deque(pending)
    live: dict[int, _Worker] = {}

    def start(slot: int) -> None:
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_worker_main, args=(child, str(plan.points_dir)), name=f"sweep-worker-{slot}",
            daemon=True,
        )  # fmt: skip
        with _environ(CUDA_VISIBLE_DEVICES=devices[slot]):
            proc.start()
        child.close()
        live[slot] = _Worker(slot, proc, parent)

    def hand_out(w: _Worker) -> None:
        if queue:
            p = queue.popleft()
            try:
                w.conn.send((p.name, plan.run_configs[p.name]))
            except OSError:  # the worker just died: the point stays queued
                queue.appendleft(p)
                return
            w.current = p.name
        else:
            w.stopping = True
            with contextlib.suppress(OSError):
                w.conn.send(None)

    try:
        for slot in range(min(workers, len(queue))):
            start(slot)
        while live:
            waitables = [w.conn for w in live.values()] + [
                w.process.sentinel for w in live.values()
            ]
            ready = set(wait(waitables))
            for w in list(live.values()):
                exited = w.process.sentinel in ready
                if w.conn in ready or exited:
                    try:
                        msg = w.conn.recv() if w.conn.poll() else None
                    except (EOFError, OSError):  # the worker is gone (or going)
                        msg, exited = None, True
                    if msg is not None:
                        if msg[0] == "done":
                            _, name, ok, error = msg
                            w.current = None
                            on_done(name, ok, error)
                        hand_out(w)
                        continue
                if not exited:
                    continue
                w.process.join()
                del live[w.slot]
                w.conn.close()
                if w.current is not None:
                    error = f"worker process exited (code {w.process.exitcode}) during the point"
                    _error_file(plan.points_dir, w.current).write_text(error + "\n")
                    tmp = plan.points_dir / f".{w.current}{_TMP_MARK}{w.process.pid}"
                    shutil.rmtree(tmp, ignore_errors=True)
                    on_done(w.current, False, error)
                    if queue:  # the point took its worker down; a new one takes the rest
                        start(w.slot)
                elif queue and not live:
                    raise RuntimeError(
                        f"sweep workers exited (code {w.process.exitcode}) with "
                        f"{len(queue)} points not run"
                    )
    finally:
        for w in live.values():
            if w.process.is_alive():
                w.process.terminate()
        for w in live.values():
            w.process.join(timeout=10)
            w.conn.close()


def _sweep_provenance(workers: int) -> dict:
    """provenance() from this process, except when worker processes will use GPUs: then from a
    short-lived process, so that this one never holds GPU memory that the workers need."""
    if workers == 1 or not visible_gpus():
        return provenance()
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    command = typed_command()
    with (
        _environ(XLA_PYTHON_CLIENT_PREALLOCATE="false"),
        ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool,
    ):
        return pool.submit(provenance, command).result()


def _run_env(point: Path) -> dict | None:
    """The provenance a finished point's run wrote (`env.json`), or None."""
    try:
        env = json.loads((point / "env.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return env if isinstance(env, dict) else None


def _sweep_record(plan: SweepPlan, workers: int, invocation: dict, ran: list[str]) -> dict:
    """sweep.json: the plan, each point's config hash and the provenance of the run that made it
    (None until it has finished), and the provenance of this invocation with the points it ran."""
    points = []
    for p in plan.points:
        point = plan.points_dir / p.name
        done = point.is_dir() and point_problem(point, plan.run_configs[p.name]) is None
        points.append({
            "name": p.name,
            "overrides": p.overrides,
            "config_sha256": config_hash(point_config(plan.run_configs[p.name])),
            "provenance": _run_env(point) if done else None,
        })  # fmt: skip
    return {
        "config": plan.config,
        "overrides": plan.overrides,
        "grid": plan.grid,
        "zip": plan.zip,
        "out_dir": str(plan.out_dir),
        "workers": workers,
        "points": points,
        "provenance": {**invocation, "ran": list(ran)},
    }


_INVOCATION_KEYS = ("workers", "provenance")


def _write_sweep_file(plan: SweepPlan, record: dict) -> None:
    """Write sweep.json, unless this invocation ran nothing and the file already says the rest:
    then the earlier invocation's provenance stays (and a committed file stays untouched)."""
    path = plan.out_dir / SWEEP_FILE
    if not record["provenance"]["ran"] and path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            old = None
        new = json.loads(json.dumps(record, default=str))  # as it would read back
        if isinstance(old, dict) and all(
            old.get(k) == v for k, v in new.items() if k not in _INVOCATION_KEYS
        ):
            return
    tmp = path.with_name(f".{SWEEP_FILE}{_TMP_MARK}{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- the sweep


def run_sweep(
    plan: SweepPlan,
    *,
    workers: int = 1,
    gpus_per_worker: int = 1,
    show_progress: bool = True,
    console: Console | None = None,
) -> SweepResult:
    """Run the plan's unfinished points, then merge `results.parquet`.

    workers == 1 runs in this process (per-run progress bars shown when `show_progress`);
    more start that many "spawn" worker processes, worker i pinned to its GPUs through
    CUDA_VISIBLE_DEVICES when GPUs are visible and `gpus_per_worker` > 0.
    """
    if workers < 1:
        raise ValueError(f"workers={workers} is invalid: must be an int >= 1")
    if gpus_per_worker < 0:
        raise ValueError(f"gpus_per_worker={gpus_per_worker} is invalid: must be an int >= 0")
    console = console or Console()
    devices = worker_devices(workers, gpus_per_worker) if workers > 1 else [None]
    # A run's folder (`make quickstart`'s runs/quickstart, for a config without `sweep:`) is not
    # a sweep's: its files would sit beside the points, and `report` show either.
    run_files = [f for f in RUN_FILES if (plan.out_dir / f).exists()]
    if run_files:
        raise ValueError(
            f"{plan.out_dir} holds a run's results ({', '.join(run_files)}), not a sweep's: give "
            f"the sweep its own folder (out_dir=...)"
        )
    with _sweep_lock(plan.out_dir):
        return _run_sweep_locked(plan, workers, devices, show_progress, console)


@contextlib.contextmanager
def _sweep_lock(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive flock on `out_dir/.sweep.lock` (which holds our pid), so that a second
    sweep on the folder is refused instead of removing this one's points in progress. The
    kernel drops the lock when its process exits, so a dead sweep's lock file blocks nothing."""
    import fcntl

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise ValueError(
                f"{out_dir} is in use by another sweep (pid {holder}, lock {path}); wait for it "
                f"to finish, or use another out_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _run_sweep_locked(
    plan: SweepPlan, workers: int, devices: list[str | None], show_progress: bool, console: Console
) -> SweepResult:
    _check_configs(plan)  # before anything is written
    plan.points_dir.mkdir(parents=True, exist_ok=True)
    stale = _remove_stale_tmp(plan.points_dir)
    if stale:
        console.print(f"removed {len(stale)} unfinished point folder(s) of an earlier sweep")
    invocation = _sweep_provenance(workers)
    _write_sweep_file(plan, _sweep_record(plan, workers, invocation, []))

    for p in plan.points:
        point = plan.points_dir / p.name
        problem = point_problem(point, plan.run_configs[p.name]) if point.is_dir() else None
        if problem is not None:
            aside = _move_aside(point)
            console.print(
                f"point {p.name} is broken ({problem}): moved to {aside}; running it again",
                markup=False,
            )

    result = SweepResult()
    pending = [p for p in plan.points if not plan.is_done(p.name)]
    result.skipped = [p.name for p in plan.points if p not in pending]
    if result.skipped:
        console.print(
            f"{len(result.skipped)} of {len(plan.points)} points already finished in "
            f"{plan.points_dir}",
            markup=False,
        )
    columns = (
        TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )  # fmt: skip
    try:
        with Progress(*columns, console=console, disable=not show_progress) as progress:
            task = progress.add_task("points", total=len(plan.points))
            progress.update(task, completed=len(result.skipped))

            def on_done(name: str, ok: bool, error: str | None) -> None:
                if ok:  # its final folder (the one it ran in is renamed by now)
                    result.ran.append(name)
                    progress.console.print(f"[green]done[/] {escape(str(plan.points_dir / name))}")
                else:
                    result.failed[name] = error or "failed"
                    last = (error or "failed").strip().splitlines()[-1]
                    progress.console.print(f"[red]failed[/] {name}: {last}")
                progress.advance(task)

            if workers == 1:
                for p in pending:
                    ok, error = _run_point(
                        p.name, plan.run_configs[p.name], plan.points_dir,
                        show_progress=show_progress, console=progress.console,
                    )  # fmt: skip
                    on_done(p.name, ok, error)
            elif pending:
                _run_in_workers(plan, pending, workers, devices, on_done)
    finally:  # also on Ctrl-C: the table holds every point finished so far
        _write_sweep_file(plan, _sweep_record(plan, workers, invocation, result.ran))
        result.table = merge_results(plan)
    if result.failed:
        console.print(
            f"[red]{len(result.failed)} of {len(plan.points)} points failed[/]; tracebacks in "
            f"{plan.points_dir}/<name>{ERROR_SUFFIX}"
        )
    console.print(f"results: {plan.out_dir / RESULTS_FILE} ({len(result.table)} points)")
    console.print(f"report:  jaxinfer report {shlex.quote(str(plan.out_dir))}", markup=False)
    return result
