"""Benchmark metrics: per-request latencies, run summaries, and Parquet tables."""

from jaxinfer.metrics.requests import REQUEST_COLUMNS, request_row, request_rows
from jaxinfer.metrics.steps import STEP_COLUMNS, StepRecord, step_row
from jaxinfer.metrics.summary import SLO, stats, summarize
from jaxinfer.metrics.tables import read_tables, write_tables

__all__ = [
    "REQUEST_COLUMNS",
    "SLO",
    "STEP_COLUMNS",
    "StepRecord",
    "read_tables",
    "request_row",
    "request_rows",
    "stats",
    "step_row",
    "summarize",
    "write_tables",
]
