"""`jaxinfer sweep`: planning and validation, the results layout, resume after an interrupted
point, failed points, and worker processes."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf
from rich.console import Console

from jaxinfer.cli import main
from jaxinfer.experiment import sweep as sweep_mod
from jaxinfer.experiment.sweep import (
    merge_results,
    parse_axes,
    plan_sweep,
    point_name,
    run_sweep,
)
from jaxinfer.metrics import write_tables
from jaxinfer.metrics.requests import REQUEST_COLUMNS

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
# Few jit buckets (max_num_batched_tokens=16, decode_steps=1): compiling takes seconds.
TINY = [
    "workload.num_requests=4", "workload.output_len.hi=20", "workload.prompt_len.hi=40",
    "engine.max_num_batched_tokens=16", "engine.max_num_seqs=2", "engine.max_model_len=128",
    "engine.num_pages=64", "engine.decode_steps=1", "workload.arrival.rate=1000",
]  # fmt: skip
QUIET = Console(quiet=True)


def sweep_config(tmp_path: Path, sweep: dict | None = None) -> Path:
    """quickstart.yaml with out_dir in tmp_path and an optional `sweep:` section."""
    cfg = OmegaConf.load(QUICKSTART)
    cfg.out_dir = str(tmp_path / "out")
    if sweep is not None:
        cfg.sweep = sweep
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "sweep.yaml"
    OmegaConf.save(cfg, path)
    return path


def counting(monkeypatch, fail_on: dict[int, BaseException] | None = None) -> list[str]:
    """Wrap run_experiment: record each call's scheduler; raise at the given call numbers."""
    calls: list[str] = []
    real = sweep_mod.run_experiment

    def wrapped(rc, **kwargs):
        calls.append(rc.engine.scheduler)
        if fail_on and len(calls) in fail_on:
            out = Path(rc.out_dir)  # a half-written point: must not count as finished
            (out / "metrics.json").write_text(json.dumps({"num_completed": 1}))
            raise fail_on[len(calls)]
        return real(rc, **kwargs)

    monkeypatch.setattr(sweep_mod, "run_experiment", wrapped)
    return calls


def fake_results(out: Path, **metrics) -> dict:
    """The files of a finished run of TINY's 4 requests (metrics.json with the counts, a blank
    row per request, no steps), no engine."""
    metrics = {"num_requests": 4, "num_completed": 4, "num_failed": 0, "failed_errors": [],
               **metrics}  # fmt: skip
    (out / "metrics.json").write_text(json.dumps(metrics))
    rows = [dict.fromkeys(REQUEST_COLUMNS) for _ in range(metrics["num_requests"])]
    write_tables(out, rows, [])
    return metrics


def test_plan_grid_times_zip_cli_axes_and_names(tmp_path):
    cfg = sweep_config(
        tmp_path,
        {
            "grid": {"engine.scheduler": ["fcfs", "static"], "workload.seed": [0, 1]},
            "zip": {"engine": {"page_size": [8, 16]}, "workload.output_len.lo": [8, 12]},
        },
    )
    plan = plan_sweep(cfg, TINY, grid=parse_axes(["workload.seed=3,4,5"]))
    assert plan.grid == {"engine.scheduler": ["fcfs", "static"], "workload.seed": [3, 4, 5]}
    assert plan.zip == {"engine.page_size": [8, 16], "workload.output_len.lo": [8, 12]}
    assert len(plan.points) == 2 * 3 * 2
    first = plan.points[0]
    assert first.overrides == {
        "engine.scheduler": "fcfs", "workload.seed": 3,
        "engine.page_size": 8, "workload.output_len.lo": 8,
    }  # fmt: skip
    assert first.name == (
        "engine.scheduler=fcfs,workload.seed=3,engine.page_size=8,workload.output_len.lo=8"
    )
    assert len({p.name for p in plan.points}) == len(plan.points)
    rc = plan.run_configs[plan.points[-1].name]
    assert (rc.engine.scheduler, rc.workload.seed, rc.engine.page_size) == ("static", 5, 16)
    assert rc.workload.num_requests == 4  # plain overrides apply to every point
    assert Path(rc.out_dir) == tmp_path / "out" / "points" / plan.points[-1].name
    assert not (tmp_path / "out").exists()  # planning writes nothing
    # Command-line values are typed like overrides; names are filesystem-safe.
    assert parse_axes(["a.b=1,2.5,x,[1,2],null"]) == {"a.b": [1, 2.5, "x", [1, 2], None]}
    assert point_name({"w.trace_path": "../data/x y.jsonl"}) == "w.trace_path=.._data_x_y.jsonl"


def test_two_point_grid_writes_table_and_sweep_json(tmp_path):
    cfg = sweep_config(tmp_path, {"grid": {"engine.scheduler": ["fcfs", "static"]}})
    assert main(["sweep", str(cfg), *TINY, "--no-progress"]) == 0
    out = tmp_path / "out"
    table = pd.read_parquet(out / "results.parquet")
    names = ["engine.scheduler=fcfs", "engine.scheduler=static"]
    assert table["point"].tolist() == names
    assert table["engine.scheduler"].tolist() == ["fcfs", "static"]
    assert list(table.columns[:2]) == ["point", "engine.scheduler"]
    assert table["num_completed"].tolist() == [4, 4]
    assert (table["output_throughput"] > 0).all()
    assert "failed_errors" not in table.columns  # lists are not table columns
    spec = json.loads((out / "sweep.json").read_text())
    assert spec["config"] == str(cfg) and spec["overrides"] == TINY
    assert spec["grid"] == {"engine.scheduler": ["fcfs", "static"]} and spec["zip"] == {}
    assert [{k: p[k] for k in ("name", "overrides")} for p in spec["points"]] == [
        {"name": names[0], "overrides": {"engine.scheduler": "fcfs"}},
        {"name": names[1], "overrides": {"engine.scheduler": "static"}},
    ]
    assert {"device", "jax", "commit", "date", "command"} <= spec["provenance"].keys()
    assert spec["provenance"]["ran"] == names
    for name, scheduler in zip(names, ["fcfs", "static"], strict=True):
        point = out / "points" / name
        assert json.loads((point / "metrics.json").read_text())["num_completed"] == 4
        config = OmegaConf.load(point / "config.yaml")
        assert config.engine.scheduler == scheduler and config.out_dir == str(point)
        # Each point's provenance is its run's; its config hash is of its config.yaml.
        (entry,) = [p for p in spec["points"] if p["name"] == name]
        assert entry["provenance"] == json.loads((point / "env.json").read_text())
        stored = yaml.safe_load((point / "config.yaml").read_text())
        del stored["out_dir"]
        assert (point / "config.sha256").read_text().strip() == entry["config_sha256"]
        assert entry["config_sha256"] == sweep_mod.config_hash(stored)
    assert sorted(p.name for p in (out / "points").iterdir()) == names  # no tmp folders left


def test_interrupted_sweep_resumes_with_only_the_remaining_points(tmp_path, monkeypatch):
    schedulers = ["fcfs", "static", "shortest_first"]
    cfg = sweep_config(tmp_path, {"grid": {"engine.scheduler": schedulers}})
    points = tmp_path / "out" / "points"
    calls = counting(monkeypatch, fail_on={2: KeyboardInterrupt()})
    with pytest.raises(KeyboardInterrupt):
        run_sweep(plan_sweep(cfg, TINY), show_progress=False, console=QUIET)
    assert calls == ["fcfs", "static"]
    assert (points / "engine.scheduler=fcfs" / "metrics.json").is_file()
    assert not (points / "engine.scheduler=static").exists()
    (tmp,) = points.glob(".engine.scheduler=static.tmp-*")  # left behind, with a metrics.json
    assert (tmp / "metrics.json").is_file()
    tmp = tmp.rename(tmp.with_name(".engine.scheduler=static.tmp-999999999"))  # another process
    assert pd.read_parquet(tmp_path / "out" / "results.parquet")["point"].tolist() == [
        "engine.scheduler=fcfs"
    ]

    result = run_sweep(plan_sweep(cfg, TINY), show_progress=False, console=QUIET)
    assert calls[2:] == ["static", "shortest_first"]  # the finished point is skipped
    assert result.ok and result.skipped == ["engine.scheduler=fcfs"]
    assert not tmp.exists() and not list(points.glob(".*"))
    table = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert table["engine.scheduler"].tolist() == schedulers
    assert table["num_completed"].tolist() == [4, 4, 4]


def test_failed_point_is_recorded_and_the_sweep_continues(tmp_path, monkeypatch):
    calls: list[int] = []
    broken = {1}

    def fake(rc, **kwargs):  # no engine: writes the results files only
        calls.append(rc.workload.seed)
        if rc.workload.seed in broken:
            raise RuntimeError(f"boom at seed {rc.workload.seed}")
        return fake_results(Path(rc.out_dir), goodput=1.5 * rc.workload.seed)

    monkeypatch.setattr(sweep_mod, "run_experiment", fake)
    cfg = sweep_config(tmp_path)
    args = ["sweep", str(cfg), *TINY, "--grid", "workload.seed=0,1,2", "--no-progress"]
    assert main(args) == 1  # a point failed
    assert calls == [0, 1, 2]
    points = tmp_path / "out" / "points"
    assert "boom at seed 1" in (points / "workload.seed=1.error.txt").read_text()
    assert not (points / "workload.seed=1").exists() and not list(points.glob(".*"))
    table = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert table["workload.seed"].tolist() == [0, 2]
    assert table["goodput"].tolist() == [0.0, 3.0]
    assert "failed_errors" not in table.columns
    # A re-run retries only the failed point; its error file goes once it succeeds.
    broken.clear()
    assert main(args) == 0
    assert calls == [0, 1, 2, 1]
    assert not (points / "workload.seed=1.error.txt").exists()
    table = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert table["workload.seed"].tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("sweep", "overrides", "grid", "names"),
    [
        ({"grid": {"engine.no_such": [1, 2]}}, [], [], r"engine\.no_such.*engine\.no_such=1"),
        ({"grid": {"engine.scheduler": ["fcfs", "lifo"]}}, [], [], r"engine\.scheduler=lifo"),
        ({}, [], ["engine.page_size=16,0"], r"engine\.page_size.*engine\.page_size=0"),
        (
            {"zip": {"engine.page_size": [8, 16], "workload.seed": [0, 1, 2]}}, [], [],
            r"zip.*engine\.page_size.*workload\.seed",
        ),
        ({"grid": {"out_dir": ["a", "b"]}}, [], [], "out_dir"),
        ({"grid": {"engine.max_num_seqs": [2, 4]}}, ["engine.max_num_seqs=8"], [], "max_num_seqs"),
        ({"grid": {"workload.seed": [1, 1]}}, [], [], "twice"),
    ],
)  # fmt: skip
def test_invalid_sweep_fails_before_any_point_runs(
    tmp_path, monkeypatch, capsys, sweep, overrides, grid, names
):
    calls = counting(monkeypatch)
    cfg = sweep_config(tmp_path, sweep)
    with pytest.raises(ValueError, match=names):
        plan_sweep(cfg, [*TINY, *overrides], grid=parse_axes(grid))
    cli = [f"--grid={g}" for g in grid]
    assert main(["sweep", str(cfg), *TINY, *overrides, *cli, "--no-progress"]) == 2
    assert "jaxinfer sweep: error:" in capsys.readouterr().err
    assert calls == [] and not (tmp_path / "out").exists()


def test_two_workers_match_one_worker(tmp_path):
    deterministic = ["point", "engine.scheduler", "num_completed", "total_output_tokens"]
    tables = []
    for workers in (1, 2):
        cfg = sweep_config(
            tmp_path / f"w{workers}", {"grid": {"engine.scheduler": ["fcfs", "static"]}}
        )
        log = io.StringIO()
        result = run_sweep(
            plan_sweep(cfg, TINY), workers=workers, show_progress=False,
            console=Console(file=log, width=10_000),
        )  # fmt: skip
        assert result.ok and len(result.ran) == 2
        # Each point's line names its final folder (it ran in a tmp folder, renamed after).
        out = tmp_path / f"w{workers}" / "out"
        said = [ln for ln in log.getvalue().splitlines() if ln.startswith(("done ", "results:"))]
        assert sorted(said) == [
            f"done {out / 'points' / 'engine.scheduler=fcfs'}",
            f"done {out / 'points' / 'engine.scheduler=static'}",
            f"results: {out / 'results.parquet'} (2 points)",
        ], log.getvalue()
        assert ".tmp-" not in log.getvalue()
        spec = json.loads((tmp_path / f"w{workers}" / "out" / "sweep.json").read_text())
        assert spec["workers"] == workers
        tables.append(result.table[deterministic])
    pd.testing.assert_frame_equal(tables[0], tables[1])
    assert tables[1]["num_completed"].tolist() == [4, 4]


def test_worker_gpu_pinning(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert sweep_mod.worker_devices(2, 1) == ["3", "5"]
    assert sweep_mod.worker_devices(2, 2) == ["3,5", "6,7"]
    assert sweep_mod.worker_devices(3, 0) == [None, None, None]  # not pinned
    with pytest.raises(ValueError, match="need 6 GPUs; 4 visible"):
        sweep_mod.worker_devices(3, 2)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # CPU: nothing is set
    assert sweep_mod.worker_devices(2, 1) == [None, None]
    # With GPU workers the sweep's provenance comes from a separate short-lived process.
    monkeypatch.setattr(sweep_mod, "visible_gpus", lambda: ["0", "1"])
    prov = sweep_mod._sweep_provenance(2)
    assert {"device", "jax", "commit", "command"} <= prov.keys()


VALID = {"num_requests": 4, "num_completed": 4, "num_failed": 0, "goodput": 2.0}
CORRUPT_METRICS = {
    "truncated": json.dumps(VALID).encode()[:20],
    "empty": b"",
    "binary": bytes(range(256)),
    "a list": b"[4, 4, 0]",
    "wrong keys": json.dumps({"completed": 4, "goodput": 2.0}).encode(),
    "counts not ints": json.dumps({**VALID, "num_completed": "4"}).encode(),
    "interrupted": json.dumps({**VALID, "interrupted": "SIGINT"}).encode(),
}


def _seed_sweep(tmp_path, monkeypatch) -> tuple[Path, list[int]]:
    """A two-point sweep (workload.seed=0,1) run with a fake run_experiment; (config, calls)."""
    calls: list[int] = []

    def fake(rc, **kwargs):
        calls.append(rc.workload.seed)
        return fake_results(Path(rc.out_dir), goodput=1.5 * rc.workload.seed)

    monkeypatch.setattr(sweep_mod, "run_experiment", fake)
    cfg = sweep_config(tmp_path, {"grid": {"workload.seed": [0, 1]}})
    assert run_sweep(plan_sweep(cfg, TINY), show_progress=False, console=QUIET).ok
    assert calls == [0, 1]
    return cfg, calls


@pytest.mark.parametrize(
    ("file", "content"),
    [*(("metrics.json", c) for c in CORRUPT_METRICS.values()),
     ("requests.parquet", b"PAR1 cut short"), ("steps.parquet", b"")],
    ids=[*CORRUPT_METRICS, "truncated requests.parquet", "empty steps.parquet"],
)  # fmt: skip
def test_broken_point_is_run_again_and_its_files_kept_aside(tmp_path, monkeypatch, file, content):
    cfg, calls = _seed_sweep(tmp_path, monkeypatch)
    points = tmp_path / "out" / "points"
    (points / "workload.seed=1" / file).write_bytes(content)
    log = io.StringIO()
    result = run_sweep(
        plan_sweep(cfg, TINY), show_progress=False, console=Console(file=log, width=1000)
    )
    assert calls == [0, 1, 1] and result.ok and result.skipped == ["workload.seed=0"]
    (aside,) = points.glob("workload.seed=1.broken-*")
    assert (aside / file).read_bytes() == content  # kept as found
    said = [line for line in log.getvalue().splitlines() if " is broken " in line]
    assert len(said) == 1 and "point workload.seed=1" in said[0], log.getvalue()
    assert str(points / "workload.seed=1" / file) in said[0] and str(aside) in said[0]
    table = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert table["workload.seed"].tolist() == [0, 1] and table["goodput"].tolist() == [0.0, 1.5]
    assert json.loads((points / "workload.seed=1" / "metrics.json").read_text())["goodput"] == 1.5


def _requests(n: int) -> bytes:
    """requests.parquet of `n` blank rows."""
    with tempfile.TemporaryDirectory() as tmp:
        write_tables(tmp, [dict.fromkeys(REQUEST_COLUMNS) for _ in range(n)])
        return (Path(tmp) / "requests.parquet").read_bytes()


def _edit_metrics(point: Path, **changes) -> None:
    metrics = json.loads((point / "metrics.json").read_text())
    (point / "metrics.json").write_text(json.dumps({**metrics, **changes}))


def _fewer_than_the_workload(point: Path) -> None:
    """Rows and counts that agree, but of 3 requests where the workload has 4."""
    _edit_metrics(point, num_requests=3, num_completed=3)
    (point / "requests.parquet").write_bytes(_requests(3))


INCONSISTENT = {  # damage to point workload.seed=1 of `_seed_sweep` (4 requests)
    "0 request rows": lambda point: (point / "requests.parquet").write_bytes(_requests(0)),
    "3 request rows": lambda point: (point / "requests.parquet").write_bytes(_requests(3)),
    "num_completed 9999": lambda point: _edit_metrics(point, num_completed=9999),
    "another point's metrics": lambda point: shutil.copy(
        point.with_name("workload.seed=0") / "metrics.json", point / "metrics.json"
    ),
    "fewer requests than the workload": _fewer_than_the_workload,
}


@pytest.mark.parametrize("case", INCONSISTENT)
def test_point_whose_files_disagree_is_run_again_from_scratch(tmp_path, monkeypatch, case):
    cfg, calls = _seed_sweep(tmp_path, monkeypatch)
    points = tmp_path / "out" / "points"
    point = points / "workload.seed=1"
    INCONSISTENT[case](point)
    log = io.StringIO()
    result = run_sweep(
        plan_sweep(cfg, TINY), show_progress=False, console=Console(file=log, width=1000)
    )
    assert calls == [0, 1, 1] and result.ok and result.skipped == ["workload.seed=0"]
    assert "point workload.seed=1 is broken" in log.getvalue()
    assert len(list(points.glob("workload.seed=1.broken-*"))) == 1
    assert json.loads((point / "metrics.json").read_text())["goodput"] == 1.5
    assert pd.read_parquet(point / "requests.parquet").shape[0] == 4
    table = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert table["goodput"].tolist() == [0.0, 1.5] and "config_sha256" not in table


@pytest.mark.parametrize("content", CORRUPT_METRICS.values(), ids=CORRUPT_METRICS)
def test_merge_error_names_the_broken_file(tmp_path, monkeypatch, content):
    cfg, _ = _seed_sweep(tmp_path, monkeypatch)
    metrics = tmp_path / "out" / "points" / "workload.seed=1" / "metrics.json"
    metrics.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(metrics))):
        merge_results(plan_sweep(cfg, TINY))


ROOT = QUICKSTART.parent.parent
EXPERIMENT_CONFIGS = sorted((ROOT / "experiments").glob("*/config.yaml"))


@pytest.mark.parametrize("config", EXPERIMENT_CONFIGS, ids=lambda p: p.parent.name)
def test_experiment_sweep_writes_under_runs_and_only_an_override_remakes_committed_results(config):
    name = config.parent.name
    assert plan_sweep(config).out_dir == Path("runs") / name  # a user's run: no tracked file
    committed = f"experiments/results/cpu/{name}"
    readme = config.with_name("README.md")
    if readme.is_file():
        text = readme.read_text()
    else:  # the experiments README gives the command for every claim
        text = (ROOT / "experiments" / "README.md").read_text().replace("<claim>", name)
    assert f"jaxinfer sweep experiments/{name}/config.yaml out_dir={committed}" in text
    assert f"jaxinfer report {committed} --out {committed}/report" in text
    # That command plans exactly the points of the committed folder.
    spec = json.loads((ROOT / committed / "sweep.json").read_text())
    plan = plan_sweep(config, [f"out_dir={ROOT / committed}"])
    assert [p.name for p in plan.points] == [p["name"] for p in spec["points"]]


def fake_run(monkeypatch, commit: list[str]) -> list[int]:
    """run_experiment without an engine, writing what a run writes: config.yaml, env.json (of
    commit `commit[0]`), metrics.json and the tables. Returns the seeds it ran."""
    calls: list[int] = []

    def fake(rc, **kwargs):
        calls.append(rc.workload.seed)
        out = Path(rc.out_dir)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(rc)))
        (out / "env.json").write_text(json.dumps({"commit": commit[0], "date": f"d-{commit[0]}"}))
        return fake_results(out, goodput=1.5 * rc.workload.seed)

    monkeypatch.setattr(sweep_mod, "run_experiment", fake)
    return calls


def test_rerun_with_another_config_is_refused_naming_the_keys(tmp_path, monkeypatch, capsys):
    calls = fake_run(monkeypatch, ["c1"])
    cfg = sweep_config(tmp_path, {"grid": {"workload.seed": [0, 1]}})
    assert run_sweep(plan_sweep(cfg, TINY), show_progress=False, console=QUIET).ok
    out, points = tmp_path / "out", tmp_path / "out" / "points"
    files = {f: (out / f).read_bytes() for f in ("sweep.json", "results.parquet")}
    other = [o.replace("max_num_seqs=2", "max_num_seqs=4") for o in TINY]
    assert other != TINY

    with pytest.raises(ValueError) as e:
        run_sweep(plan_sweep(cfg, other), show_progress=False, console=QUIET)
    assert str(e.value) == (
        f"2 points in {out} were run with another config (workload.seed=0 differs in: "
        f"engine.max_num_seqs 2 -> 4); use a new out_dir, or delete {points / 'workload.seed=0'} "
        f"{points / 'workload.seed=1'}"
    )
    assert main(["sweep", str(cfg), *other, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "differs in: engine.max_num_seqs 2 -> 4" in err, err
    assert calls == [0, 1]  # nothing ran, nothing was written
    assert {f: (out / f).read_bytes() for f in files} == files

    # A folder without config.sha256 (made before it) is compared through its config.yaml.
    (points / "workload.seed=0" / "config.sha256").unlink()
    shutil.rmtree(points / "workload.seed=1")
    with pytest.raises(ValueError) as e:
        more = [o.replace("num_requests=4", "num_requests=5") for o in other]
        run_sweep(plan_sweep(cfg, more), show_progress=False, console=QUIET)
    assert str(e.value) == (
        f"point workload.seed=0 in {out} was run with another config (differs in: "
        f"engine.max_num_seqs 2 -> 4, workload.num_requests 4 -> 5); use a new out_dir, or "
        f"delete {points / 'workload.seed=0'}"
    )
    result = run_sweep(plan_sweep(cfg, TINY), show_progress=False, console=QUIET)
    assert result.skipped == ["workload.seed=0"] and calls == [0, 1, 1]  # same config: reused
    # A hash of another config refuses the point even when its config.yaml agrees. (Written in
    # config.sha256 alone, the files disagree: a broken point, run again.)
    (points / "workload.seed=1" / "config.sha256").write_text("0" * 64 + "\n")
    _edit_metrics(points / "workload.seed=1", config_sha256="0" * 64)
    with pytest.raises(ValueError, match=r"point workload\.seed=1 .*config\.sha256 is of another"):
        run_sweep(plan_sweep(cfg, TINY), show_progress=False, console=QUIET)


def test_rerun_keeps_provenance_of_the_points_it_did_not_run(tmp_path, monkeypatch):
    commit = ["old"]
    calls = fake_run(monkeypatch, commit)
    monkeypatch.setattr(sweep_mod, "provenance", lambda *a: {"commit": commit[0]})
    cfg = sweep_config(tmp_path, {"grid": {"workload.seed": [0, 1]}})
    assert run_sweep(plan_sweep(cfg, TINY), show_progress=False, console=QUIET).ok
    out = tmp_path / "out"
    files = ("sweep.json", "results.parquet")
    before = {f: ((out / f).read_bytes(), (out / f).stat()) for f in files}

    # Everything finished: a later commit's re-run rewrites neither file.
    commit[0] = "new"
    result = run_sweep(plan_sweep(cfg, TINY), show_progress=False, console=QUIET)
    assert result.skipped == ["workload.seed=0", "workload.seed=1"] and calls == [0, 1]
    for f, (data, stat) in before.items():
        now = (out / f).stat()
        assert (out / f).read_bytes() == data, f
        assert (now.st_ino, now.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns), f

    # One point run again: only it has the new commit; the sweep's provenance says what it ran.
    (out / "points" / "workload.seed=1" / "metrics.json").write_text("")
    assert run_sweep(plan_sweep(cfg, TINY), show_progress=False, console=QUIET).ok
    assert calls == [0, 1, 1]
    spec = json.loads((out / "sweep.json").read_text())
    assert [p["provenance"]["commit"] for p in spec["points"]] == ["old", "new"]
    assert spec["provenance"] == {"commit": "new", "ran": ["workload.seed=1"]}


def test_second_sweep_on_a_folder_in_use_is_refused_naming_the_holder(
    tmp_path, monkeypatch, capsys
):
    import fcntl

    calls = fake_run(monkeypatch, ["c1"])
    cfg = sweep_config(tmp_path, {"grid": {"workload.seed": [0, 1]}})
    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".sweep.lock"
    # A dead sweep's lock file (a pid, no lock held) blocks nothing.
    lock.write_text("999999999\n")
    assert run_sweep(plan_sweep(cfg, TINY), show_progress=False, console=QUIET).ok
    assert calls == [0, 1]
    shutil.rmtree(out / "points")
    before = sorted(p.name for p in out.iterdir())

    with lock.open("r+") as held:  # another sweep, running: it holds the lock
        fcntl.flock(held, fcntl.LOCK_EX)
        held.truncate()
        held.write("4242\n")
        held.flush()
        assert main(["sweep", str(cfg), *TINY, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out} is in use by another sweep (pid 4242" in err, err
    assert calls == [0, 1] and sorted(p.name for p in out.iterdir()) == before  # nothing touched

    # Released: the sweep runs, its pid in the lock file.
    assert run_sweep(plan_sweep(cfg, TINY), show_progress=False, console=QUIET).ok
    assert calls == [0, 1, 0, 1] and lock.read_text() == f"{os.getpid()}\n"


def test_sweep_and_run_refuse_each_others_folders(tmp_path, monkeypatch, capsys):
    from jaxinfer.experiment.run import fresh_results_dir

    calls = fake_run(monkeypatch, ["c1"])
    cfg = sweep_config(tmp_path)  # no `sweep:`: one point, in the run's out_dir
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text("name: quickstart\n")  # `make quickstart`'s run folder
    (out / "metrics.json").write_text(json.dumps({"num_requests": 4}))
    assert main(["sweep", str(cfg), *TINY, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and f"{out} holds a run's results (config.yaml, metrics.json)" in err
    )
    assert calls == [] and sorted(p.name for p in out.iterdir()) == ["config.yaml", "metrics.json"]

    sweep_out = tmp_path / "sweep"
    assert run_sweep(
        plan_sweep(cfg, [*TINY, f"out_dir={sweep_out}"]), show_progress=False, console=QUIET
    ).ok
    with pytest.raises(ValueError, match=r"holds a sweep's results \(sweep\.json\), not a run's"):
        fresh_results_dir(sweep_out, overwrite=True)
    assert fresh_results_dir(sweep_out) != sweep_out  # (without --overwrite: a folder of its own)
