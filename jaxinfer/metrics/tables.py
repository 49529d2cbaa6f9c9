"""Per-request and per-step tables as Parquet files (`requests.parquet`, `steps.parquet`), written
at once (`write_tables`) or appended to as a run goes (`TableAppender`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from jaxinfer.metrics.requests import REQUEST_COLUMNS
from jaxinfer.metrics.steps import STEP_COLUMNS, StepRecord, step_row

REQUESTS_FILE = "requests.parquet"
STEPS_FILE = "steps.parquet"


def _request_schema():
    import pyarrow as pa

    f64, i64 = pa.float64(), pa.int64()
    types = {
        "seq_id": i64,
        "prompt_len": i64,
        "output_len": i64,
        "itls": pa.list_(f64),
        "num_preemptions": i64,
        "cached_tokens": i64,
        "finish_reason": pa.string(),
        "failed": pa.bool_(),
        "error": pa.string(),
    }
    return pa.schema([(c, types.get(c, f64)) for c in REQUEST_COLUMNS])


def _step_schema():
    import pyarrow as pa

    types = {"time": pa.float64(), "is_decode_only": pa.bool_(), "speculative": pa.bool_()}
    types |= {"host_ms": pa.float64(), "device_ms": pa.float64()}
    types |= {"expert_tokens": pa.list_(pa.int64()), "expert_device_tokens": pa.list_(pa.int64())}
    types |= {"experts_active": pa.float64(), "accepted_hist": pa.list_(pa.int64())}
    return pa.schema([(c, types.get(c, pa.int64())) for c in STEP_COLUMNS])


def write_tables(
    out_dir: str | Path,
    request_rows: Iterable[dict],
    step_rows: Iterable[StepRecord | dict] = (),
) -> tuple[Path, Path]:
    """Write `out_dir/requests.parquet` and `out_dir/steps.parquet` (fixed schemas, so empty or
    all-None columns keep their types); return their paths. Creates `out_dir` if needed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reqs = [{c: r[c] for c in REQUEST_COLUMNS} for r in request_rows]
    steps = [step_row(s) for s in step_rows]
    paths = (out / REQUESTS_FILE, out / STEPS_FILE)
    pq.write_table(pa.Table.from_pylist(reqs, schema=_request_schema()), paths[0])
    pq.write_table(pa.Table.from_pylist(steps, schema=_step_schema()), paths[1])
    return paths


def read_tables(out_dir: str | Path):
    """(requests, steps) pandas DataFrames from a directory written by `write_tables`."""
    import pandas as pd

    out = Path(out_dir)
    return pd.read_parquet(out / REQUESTS_FILE), pd.read_parquet(out / STEPS_FILE)


PARTS_SUFFIX = ".parts"  # `requests.parquet.parts/`: the parts of a table still being written


class TableAppender:
    """The requests and steps tables of `out_dir`, appended to while a run goes.

    `flush()` writes the rows appended since the last flush as one part per table,
    `<table>.parquet.parts/<n>.parquet`: a complete Parquet file, written under a temporary name
    and renamed, so a run killed at any moment leaves only whole parts (`pd.read_parquet` reads the
    folder). `finish()` merges the parts into `requests.parquet` (in seq_id order, the order of
    arrival) and `steps.parquet` (in step order), the layout `write_tables` writes, and returns
    both as rows. Memory: only the rows since the last flush stay here.
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.out = Path(out_dir)
        self.request_rows: list[dict] = []  # appended, not yet flushed
        self.steps: list[StepRecord | dict] = []
        self.num_requests = 0  # appended in all
        self.num_steps = 0
        self._parts = 0
        for name in (REQUESTS_FILE, STEPS_FILE):  # an earlier run's, in the same folder
            parts = self.out / f"{name}{PARTS_SUFFIX}"
            for old in (parts, _removing(parts)):
                shutil.rmtree(old, ignore_errors=True)
            (self.out / name).unlink(missing_ok=True)

    def add_requests(self, rows: Iterable[dict]) -> None:
        rows = [{c: r[c] for c in REQUEST_COLUMNS} for r in rows]
        self.request_rows += rows
        self.num_requests += len(rows)

    def add_steps(self, steps: Iterable[StepRecord | dict]) -> None:
        steps = list(steps)
        self.steps += steps
        self.num_steps += len(steps)

    def flush(self) -> None:
        """Write the rows since the last flush as a part of each table (nothing if none)."""
        import pyarrow as pa

        if not self.request_rows and not self.steps:
            return
        name = f"{self._parts:06d}.parquet"
        steps = [step_row(s) for s in self.steps]
        for table, rows, schema in (
            (REQUESTS_FILE, self.request_rows, _request_schema()),
            (STEPS_FILE, steps, _step_schema()),
        ):
            parts = self.out / f"{table}{PARTS_SUFFIX}"
            parts.mkdir(parents=True, exist_ok=True)
            _write_atomic(pa.Table.from_pylist(rows, schema=schema), parts / name)
        # Cleared only once both parts are in place: a flush cut short is written again whole.
        self._parts += 1
        self.request_rows, self.steps = [], []

    def finish(self) -> tuple[list[dict], list[dict]]:
        """Flush, merge the parts into the two tables, remove the parts; (request rows, step rows).

        Rows come back as `pyarrow`'s `to_pylist` gives them: None stays None (a DataFrame would
        make it NaN), so they equal the rows appended. Safe to call again after an interruption:
        a table whose parts are gone was merged already and is read back."""
        self.flush()
        reqs = self._merge(REQUESTS_FILE, _request_schema(), sort_by="seq_id")
        steps = self._merge(STEPS_FILE, _step_schema())
        return reqs.to_pylist(), steps.to_pylist()

    def _merge(self, table: str, schema, sort_by: str | None = None):
        import pyarrow as pa
        import pyarrow.parquet as pq

        path, parts = self.out / table, self.out / f"{table}{PARTS_SUFFIX}"
        if not parts.is_dir() and path.is_file():
            return pq.read_table(path, schema=schema)
        files = sorted(parts.glob("*.parquet")) if parts.is_dir() else []
        merged = pa.concat_tables(
            [pq.read_table(f, schema=schema) for f in files] or [schema.empty_table()]
        )
        if sort_by is not None:
            merged = merged.sort_by(sort_by)
        _write_atomic(merged, path)
        if parts.is_dir():  # renamed first: a removal cut short never leaves part of the parts
            gone = _removing(parts)
            shutil.rmtree(gone, ignore_errors=True)
            os.replace(parts, gone)
            shutil.rmtree(gone, ignore_errors=True)
        return merged


def _removing(parts: Path) -> Path:
    return parts.with_name(f".{parts.name}.removing")


def _write_atomic(table, path: Path) -> None:
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
