"""Benchmark workloads: length distributions, arrival processes, synthetic and trace requests."""

from jaxinfer.workload.arrivals import (
    AllAtOnce,
    ArrivalProcess,
    Gamma,
    all_at_once,
    gamma,
    poisson,
)
from jaxinfer.workload.generate import (
    allowed_token_ids,
    multi_turn_requests,
    shared_prefix_requests,
    synthetic_requests,
)
from jaxinfer.workload.lengths import (
    Fixed,
    LengthDist,
    LogNormal,
    Uniform,
    fixed,
    lognormal,
    uniform,
)
from jaxinfer.workload.request import WorkloadRequest
from jaxinfer.workload.spec import ArrivalSpec, LengthSpec, WorkloadSpec, build_workload
from jaxinfer.workload.traces import load_jsonl_trace

__all__ = [
    "AllAtOnce",
    "ArrivalProcess",
    "ArrivalSpec",
    "Fixed",
    "Gamma",
    "LengthDist",
    "LengthSpec",
    "LogNormal",
    "Uniform",
    "WorkloadRequest",
    "WorkloadSpec",
    "all_at_once",
    "allowed_token_ids",
    "build_workload",
    "fixed",
    "gamma",
    "load_jsonl_trace",
    "lognormal",
    "multi_turn_requests",
    "poisson",
    "shared_prefix_requests",
    "synthetic_requests",
    "uniform",
]
