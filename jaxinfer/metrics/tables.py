"""Per-request and per-step tables as Parquet files (`requests.parquet`, `steps.parquet`)."""

from __future__ import annotations

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
        "finish_reason": pa.string(),
        "failed": pa.bool_(),
        "error": pa.string(),
    }
    return pa.schema([(c, types.get(c, f64)) for c in REQUEST_COLUMNS])


def _step_schema():
    import pyarrow as pa

    types = {"time": pa.float64(), "is_decode_only": pa.bool_()}
    types |= {"host_ms": pa.float64(), "device_ms": pa.float64()}
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
