"""The multi-GPU runner's comparison of a one-worker and an N-worker sweep's results tables."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from run_multi_gpu import compare_tables, main


def table(rng, tokens):
    return pd.DataFrame({
        "point": ["b", "a"], "engine.scheduler": ["static", "fcfs"], "total_output_tokens": tokens,
        "output_throughput": rng.uniform(100, 200, 2), "commit": ["x", "x"],
    })  # fmt: skip


def test_compare_tables_matches_points_by_name_and_flags_count_changes(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    one = table(rng, [500, 700])
    many = one.iloc[::-1].reset_index(drop=True).copy()  # other row order, same points
    many["output_throughput"] *= 1.01
    same = compare_tables(one, many)
    assert same["same_points"] and same["counts_identical"] is True
    assert same["max_rel_diff"]["output_throughput"] == pytest.approx(0.01, abs=1e-4)
    assert "commit" not in same["max_rel_diff"]  # text columns are not compared
    many.loc[0, "total_output_tokens"] += 1
    assert compare_tables(one, many)["counts_identical"] is False
    other = table(rng, [500, 700]).assign(point=["b", "c"])
    assert compare_tables(one, other)["same_points"] is False


def test_bad_arguments_are_named(tmp_path, refused):
    out = ["--out", str(tmp_path / "x.json")]
    for bad, message in [
        (["--gpus", "1"], "--gpus 1: a multi-GPU run needs at least 2"),
        (["--gpus", "2", "--parts", "sweeps,bogus"], "--parts: unknown ['bogus']; choose from"),
        (["--gpus", "2", "--dp-backends", "process,mpi"], "--dp-backends: unknown ['mpi']"),
    ]:
        assert message in refused(main, bad + out), bad
