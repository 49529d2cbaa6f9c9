"""`jaxinfer report`: Markdown + PNG report of fake run and sweep folders (no engine runs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from jaxinfer.cli import main
from jaxinfer.experiment.report import Point, _groups, load_points, varying_keys, write_report
from jaxinfer.metrics import REQUEST_COLUMNS, SLO, StepRecord, summarize, write_tables

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV = {"device": "gpu:NVIDIA H200 x1", "jax": "0.10.2", "commit": "abc123", "date": "2026-01-01"}


def _requests(n: int, rate: float, ttft: float, tpot: float, out_len: int = 6) -> list[dict]:
    rows = []
    for i in range(n):
        arrival = i / rate
        t, p = ttft * (1 + 0.15 * i), tpot * (1 + 0.05 * (i % 4))
        first = arrival + t
        row = dict.fromkeys(REQUEST_COLUMNS)
        row.update(
            seq_id=i, prompt_len=32, output_len=out_len, arrival_time=arrival,
            scheduled_time=arrival + 0.01, first_token_time=first,
            finish_time=first + p * (out_len - 1), queue_time=0.01, ttft=t, tpot=p,
            e2e=t + p * (out_len - 1), itls=[p] * (out_len - 1), num_preemptions=0,
            finish_reason="length", failed=False,
        )  # fmt: skip
        rows.append(row)
    return rows


def _steps(n: int, total: int = 16) -> list[StepRecord]:
    fixed = dict(num_seqs=2, num_batched_tokens=8, kv_pages_total=total, kv_slots_allocated=32)
    return [
        StepRecord(
            time=100.0 + 0.05 * k,
            kv_pages_used=(3 * k) % total,
            wasted_slots=k % 5,
            preemptions=int(k % 7 == 0),
            **fixed,
        )
        for k in range(n)
    ]


def make_run(d: Path, rate: float, scheduler: str = "fcfs", env: dict | None = None) -> dict:
    """A results folder as `jaxinfer run` writes it; returns its metrics."""
    rows, steps = _requests(12, rate, ttft=0.05 * rate, tpot=0.01 + 0.002 * rate), _steps(30)
    metrics = summarize(rows, steps, SLO(ttft=0.2, tpot=0.02), max_num_seqs=8)
    metrics.update(compiles_after_warmup=0, warmup_s=1.0)
    d.mkdir(parents=True)
    cfg = {"name": d.name, "out_dir": str(d), "engine": {"scheduler": scheduler, "page_size": 16},
           "workload": {"arrival": {"process": "poisson", "rate": rate}, "seed": 0}}  # fmt: skip
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "env.json").write_text(json.dumps({**ENV, **(env or {}), "command": "jaxinfer run"}))
    (d / "metrics.json").write_text(json.dumps(metrics))
    write_tables(d, rows, steps)
    return metrics


def table(md: str) -> dict[str, dict[str, str]]:
    """The metrics table of report.md as {point: {header: cell}}."""
    lines = [ln for ln in md.splitlines() if ln.startswith("| point |")]
    assert len(lines) == 1, "one metrics table"
    rows = md.splitlines()
    i = rows.index(lines[0])
    heads = [h.strip() for h in rows[i].strip("|").split("|")]
    out = {}
    for ln in rows[i + 2 :]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        out[cells[0]] = dict(zip(heads, cells, strict=True))
    return out


def check_row(cells: dict[str, str], m: dict) -> None:
    for header, key, scale in [
        ("output tok/s", "output_throughput", 1), ("req/s", "request_throughput", 1),
        ("TTFT p50 (ms)", "ttft_median", 1e3), ("TTFT p99 (ms)", "ttft_p99", 1e3),
        ("TPOT p50 (ms)", "tpot_median", 1e3), ("TPOT p99 (ms)", "tpot_p99", 1e3),
        ("goodput (req/s)", "goodput", 1), ("KV use (mean)", "kv_use_mean", 1),
        ("wasted KV slots (mean)", "wasted_slot_fraction_mean", 1),
    ]:  # fmt: skip
        assert float(cells[header]) == pytest.approx(m[key] * scale, rel=1e-3), header
    assert cells["preemptions"] == str(m["total_preemptions"])
    assert cells["compiles after warmup"] == "0"
    assert cells["done"] == "12/12"


def check_pngs(report: Path) -> list[str]:
    """Every PNG report.md links to exists next to it and is a non-empty PNG; their names."""
    names = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.read_text())
    for name in names:
        data = (report.parent / name).read_bytes()
        assert name.endswith(".png") and data[:8] == PNG_MAGIC and len(data) > 2000, name
    return names


def test_compare_run_folders(tmp_path):
    rates = {"a": 1.0, "b": 2.0, "c": 4.0}
    metrics = {
        n: make_run(tmp_path / n, r, env={"device": "cpu:cpu x1"} if n == "c" else None)
        for n, r in rates.items()
    }
    report = write_report([tmp_path / n for n in rates], tmp_path / "rep", title="Rate compare")
    md = report.read_text()
    assert md.startswith("# Rate compare")
    rows = table(md)
    assert list(rows) == ["a", "b", "c"]
    for n, m in metrics.items():
        assert rows[n]["`workload.arrival.rate`"] == f"{rates[n]:g}"
        check_row(rows[n], m)
    # provenance: shared values once, the differing device flagged
    assert "| jax | 0.10.2 |" in md and "| commit | abc123 |" in md
    assert "`device` differs" in md and "cpu:cpu x1 (c)" in md
    names = check_pngs(report)
    assert {"latency_throughput.png", "cdf_all.png", "kv_use.png", "bars.png"} <= set(names)
    assert {f"cdf_{n}.png" for n in rates} <= set(names)
    assert "_Skipped" not in md


def test_sweep_folder(tmp_path):
    """Points as `jaxinfer sweep` writes them, plus one with only a results row, one that
    raised (`<name>.error.txt`) and one not run yet."""
    sweep = tmp_path / "sweep"
    grid = {"engine.scheduler": ["fcfs", "sjf"], "workload.arrival.rate": [1.0, 4.0]}
    ran = [{"engine.scheduler": s, "workload.arrival.rate": r} for s in grid[
        "engine.scheduler"] for r in grid["workload.arrival.rate"]]  # fmt: skip
    rows, metrics = [], {}
    for ov in ran:
        name = f"{ov['engine.scheduler']}-r{ov['workload.arrival.rate']:g}"
        m = make_run(sweep / "points" / name, ov["workload.arrival.rate"], ov["engine.scheduler"])
        metrics[name] = m
        scalars = {k: v for k, v in m.items() if isinstance(v, int | float)}
        rows.append({"point": name, **ov, **scalars})
    row_only = {**rows[-1], "point": "row-only", "workload.arrival.rate": 2.0}
    rows.append(row_only)
    (sweep / "points" / "crashed.error.txt").write_text("Traceback ...")
    points = [{"name": r["point"], "overrides": {k: r[k] for k in grid}} for r in rows]
    points += [
        {"name": "crashed", "overrides": {"engine.scheduler": "sjf", "workload.arrival.rate": 8}},
        {
            "name": "never-ran",
            "overrides": {"engine.scheduler": "fcfs", "workload.arrival.rate": 9},
        },
    ]
    (sweep / "sweep.json").write_text(json.dumps({"grid": grid, "zip": {}, "points": points}))
    pd.DataFrame(rows).to_parquet(sweep / "results.parquet")

    assert main(["report", str(sweep)]) == 0
    report = sweep / "report" / "report.md"
    md = report.read_text()
    table_rows = table(md)
    assert list(table_rows) == [*metrics, "row-only"]
    for name, m in metrics.items():
        check_row(table_rows[name], m)
    assert float(table_rows["row-only"]["output tok/s"]) == pytest.approx(
        row_only["output_throughput"], rel=1e-3
    )
    assert "Varying keys: `engine.scheduler`, `workload.arrival.rate` (x)\n" in md
    left_out = md.split("## Left out")[1]
    assert "`never-ran`" in left_out and "`crashed`" in left_out and "crashed.error.txt" in left_out
    assert "`row-only`: no requests.parquet" in md
    assert "| device | gpu:NVIDIA H200 x1 |" in md and "differs" not in md
    assert "no env.json for row-only" in md
    names = check_pngs(report)
    assert "latency_throughput.png" in names and "bars.png" in names
    assert {f"cdf_{n}.png" for n in metrics} <= set(names)
    # one curve per scheduler, ordered by rate
    pts, _ = load_points([sweep])
    assert set(_groups(pts, varying_keys(pts), "workload.arrival.rate")) == {
        "scheduler=fcfs", "scheduler=sjf"
    }  # fmt: skip


def test_single_run_skips_curve(tmp_path):
    m = make_run(tmp_path / "one", 2.0)
    assert main(["report", str(tmp_path / "one"), "--out", str(tmp_path / "r")]) == 0
    report = tmp_path / "r" / "report.md"
    md = report.read_text()
    check_row(table(md)["one"], m)
    curve = md.split("## Latency vs throughput")[1].split("##")[0]
    assert "_Skipped: a curve needs at least two points" in curve
    assert "Per-point comparison\n\n_Skipped" in md
    assert set(check_pngs(report)) == {"cdf_one.png", "kv_use.png"}


def test_zipped_keys_do_not_split_the_curve():
    def pt(rate, seed, sched):
        params = {"workload.arrival.rate": rate, "workload.seed": seed, "engine.scheduler": sched}
        return Point(f"{sched}{rate}", None, {}, params=params, override_keys=tuple(params))

    pts = [pt(r, s, sched) for sched in ("a", "b") for r, s in ((1, 10), (2, 20), (4, 40))]
    keys = varying_keys(pts)
    assert keys == ["workload.arrival.rate", "workload.seed", "engine.scheduler"]
    assert set(_groups(pts, keys, "workload.arrival.rate")) == {"scheduler=a", "scheduler=b"}
    # schedulers measured at different rates still get a line each; the sweep's zip says that
    # the seed goes with the rate
    for p in pts[3:]:
        p.params["workload.arrival.rate"] += 0.5
        p.params["workload.seed"] += 1
    assert set(_groups(pts, keys, "workload.arrival.rate")) == {"scheduler=a", "scheduler=b"}
    for p in pts[:3]:
        p.params["workload.seed"] += 1
    assert len(_groups(pts, keys, "workload.arrival.rate")) == 6  # rate, seed: not one-to-one
    for p in pts:
        p.zipped = frozenset({"workload.arrival.rate", "workload.seed"})
    assert set(_groups(pts, keys, "workload.arrival.rate")) == {"scheduler=a", "scheduler=b"}
    # a lone key one-to-one with x does not split
    assert set(_groups(pts[:3], ["workload.arrival.rate", "workload.seed"], "workload.seed")) == {
        ""
    }


def test_errors(tmp_path, capsys):
    make_run(tmp_path / "a", 1.0)
    make_run(tmp_path / "b", 2.0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a run folder"):
        write_report([tmp_path / "empty"], tmp_path / "r")
    with pytest.raises(ValueError, match=r"--x workload\.rate: not a varying key"):
        write_report([tmp_path / "a", tmp_path / "b"], tmp_path / "r", x="workload.rate")
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "neither a run folder" in capsys.readouterr().err


def test_folders_report_cannot_read_are_refused_in_one_line(tmp_path, capsys):
    quickstart = tmp_path / "quickstart"  # `jaxinfer quickstart` writes a metrics.json of no run
    quickstart.mkdir()
    (quickstart / "metrics.json").write_text(json.dumps({"model": "tiny", "output_tokens": 9}))
    both = tmp_path / "both"  # a sweep written into a run's folder
    make_run(both, 1.0)
    (both / "sweep.json").write_text(json.dumps({"points": []}))
    for folder, says in [
        (quickstart, f"{quickstart}: not a run folder that report can read: "),
        (both, f"{both}: holds both a sweep's (sweep.json) and a run's (metrics.json) results"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            write_report([folder], tmp_path / "r")
        assert main(["report", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "r").exists()


def test_report_of_committed_results_never_rewrites_their_report_unasked(
    tmp_path, monkeypatch, capsys
):
    committed = tmp_path / "repo" / "experiments" / "results" / "cpu"
    make_run(committed / "one", 1.0)
    make_run(committed / "two", 2.0)
    make_run(tmp_path / "mine", 1.0)
    mine = tmp_path / "mine"
    monkeypatch.chdir(tmp_path / "repo")
    assert main(["report", "experiments/results/cpu/one"]) == 0
    assert capsys.readouterr().out == "report: runs/report-cpu-one/report.md\n"
    assert main(["report", str(committed / "one"), str(committed / "two")]) == 0
    assert capsys.readouterr().out == "report: runs/report-cpu/report.md\n"
    assert table((tmp_path / "repo" / "runs" / "report-cpu" / "report.md").read_text()).keys() == {
        "one", "two"
    }  # fmt: skip
    assert not (committed / "one" / "report").exists() and not (committed / "report").exists()
    # Asked for by name, the committed report is written; results elsewhere keep RESULTS/report.
    assert main(["report", str(committed / "one"), "--out", str(committed / "one" / "report")]) == 0
    assert (committed / "one" / "report" / "report.md").is_file()
    assert main(["report", str(mine)]) == 0
    assert (mine / "report" / "report.md").is_file()


def test_sweep_point_without_env_json_shows_its_own_provenance(tmp_path):
    sweep = tmp_path / "sweep"
    points = []
    for rate, commit in ((1.0, "c1"), (2.0, "c2")):
        name = f"r{rate:g}"
        make_run(sweep / "points" / name, rate, env={"commit": commit})
        env = json.loads((sweep / "points" / name / "env.json").read_text())
        (sweep / "points" / name / "env.json").unlink()
        points.append(
            {"name": name, "overrides": {"workload.arrival.rate": rate}, "provenance": env}
        )
    spec = {"grid": {"workload.arrival.rate": [1.0, 2.0]}, "zip": {}, "points": points,
            "provenance": {**ENV, "commit": "c3", "ran": ["r2"]}}  # fmt: skip
    (sweep / "sweep.json").write_text(json.dumps(spec))
    found, _ = load_points([sweep])
    assert [p.env["commit"] for p in found] == ["c1", "c2"]
    md = write_report([sweep], tmp_path / "rep").read_text()
    assert "| commit | c1 (r1); c2 (r2) |" in md and "c3" not in md
