"""experiments/claims_table.py and the H200 claim configs of experiments/run_claims_h200.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import experiment_scripts
import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_RESULTS = ROOT / "experiments" / "results" / "cpu"


claims_table = experiment_scripts.load("claims_table")


def test_cpu_column_is_what_the_cpu_results_say():
    assert claims_table.main([str(CPU_RESULTS), "--column", "CPU", "--check"]) == 0


def _rows(text: str) -> dict[str, list[str]]:
    return {
        cells[0]: cells
        for line in text.splitlines()
        if line.startswith("| ") and (cells := claims_table._cells(line))[0].isdigit()
    }


@pytest.fixture
def readme(tmp_path: Path) -> Path:
    path = tmp_path / "experiments" / "README.md"
    path.parent.mkdir()
    shutil.copy(claims_table.README, path)
    return path


def test_fill_writes_one_column_and_its_links_and_nothing_else(readme: Path, tmp_path: Path):
    results = tmp_path / "experiments" / "results" / "h200"
    shutil.copytree(CPU_RESULTS, results)  # a stand-in: the CPU figures in the H200 column
    before = readme.read_text()
    assert claims_table.main([str(results), "--column", "H200", "--readme", str(readme)]) == 0
    after = readme.read_text()

    old, new = _rows(before), _rows(after)
    heads = claims_table._cells(next(x for x in before.splitlines() if x.startswith("| # |")))
    h200, cpu, plots = (claims_table._col(heads, n) for n in ("H200", "CPU", "plots"))
    for c in claims_table.CLAIMS:
        assert new[c.row][h200] == new[c.row][cpu] == c.figure(results)
        cpu_link = re.search(r"\[CPU\]\([^)]*\)", old[c.row][plots]).group(0)
        assert cpu_link in new[c.row][plots]
        assert f"[H200](results/h200/{c.link})" in new[c.row][plots]
        assert (results / c.link).is_file()
        unchanged = [i for i in range(len(heads)) if i not in (h200, plots)]
        assert [new[c.row][i] for i in unchanged] == [old[c.row][i] for i in unchanged]
    outside = [x for x in before.splitlines() if not x.startswith("| ")]
    assert outside == [x for x in after.splitlines() if not x.startswith("| ")]
    claims_table.main([str(results), "--column", "H200", "--readme", str(readme)])
    assert readme.read_text() == after  # idempotent


def test_a_claim_without_results_keeps_its_cells(readme: Path, tmp_path: Path):
    results = tmp_path / "h200"
    results.mkdir()
    vs = json.loads((CPU_RESULTS / "vs_transformers.json").read_text())
    vs["rows"][0]["output_tok_s"] *= 3
    vs["speedup_vs_best_transformers"] = 2.08
    (results / "vs_transformers.json").write_text(json.dumps(vs))
    before = _rows(readme.read_text())
    claims_table.main([str(results), "--column", "H200", "--readme", str(readme)])
    after = _rows(readme.read_text())
    assert {k for k in before if before[k] != after[k]} == {"3"}
    assert "**2.08×** (8,260 vs 3,977 tok/s, HF at batch 64)" in after["3"]


def test_h200_claim_configs_share_one_engine_and_validate(tmp_path: Path):
    from jaxinfer.experiment.run import load_run_config
    from jaxinfer.experiment.sweep import plan_sweep

    driver = experiment_scripts.load("run_claims_h200")
    driver.check_shared_engine()  # raises SystemExit when an executable-shaping key differs
    for claim in driver.CLAIMS:
        if claim.name == "vs_transformers":
            engine = load_run_config(claim.config).engine
        else:
            plan = plan_sweep(claim.config, [f"out_dir={tmp_path / claim.name}"])
            assert len(plan.points) == 2
            engine = plan.run_configs[plan.points[0].name].engine
        assert (engine.model, engine.attention_backend) == ("preset:llama3-8b", "auto")
