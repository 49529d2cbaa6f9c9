"""Arrival processes: when each request reaches the server (seconds from the start of a run).

    all_at_once()            every request at t = 0 (offline / batch benchmark)
    poisson(rate)            exponential gaps with mean 1 / rate
    gamma(rate, burstiness)  gamma gaps with shape = burstiness, scale = 1 / (rate * burstiness):
                             mean gap 1 / rate, coefficient of variation 1 / sqrt(burstiness);
                             burstiness 1 is Poisson, < 1 is burstier (vLLM's serving benchmark)

`sample(rng, n)` returns n sorted times; the first request arrives at exactly 0 and request i at
the sum of the first i gaps. `rate` is in requests per second; `math.inf` means all at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _check_n(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n={n!r} is invalid: must be an int >= 0")
    return int(n)


def _times_from_gaps(gaps: np.ndarray) -> np.ndarray:
    times = np.zeros(len(gaps), dtype=np.float64)
    if len(gaps) > 1:
        times[1:] = np.cumsum(gaps[:-1])
    return times


@dataclass(frozen=True)
class ArrivalProcess:
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class AllAtOnce(ArrivalProcess):
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.zeros(_check_n(n), dtype=np.float64)


@dataclass(frozen=True)
class Gamma(ArrivalProcess):
    """Gamma-distributed inter-arrival gaps (Poisson when burstiness == 1)."""

    rate: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.rate, int | float) and self.rate > 0 and not math.isnan(self.rate)):
            raise ValueError(f"rate={self.rate!r} is invalid: must be > 0 requests/s (inf allowed)")
        if not (
            isinstance(self.burstiness, int | float)
            and math.isfinite(self.burstiness)
            and self.burstiness > 0
        ):
            raise ValueError(
                f"burstiness={self.burstiness!r} is invalid: must be a finite float > 0"
            )

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        n = _check_n(n)
        if math.isinf(self.rate):
            return np.zeros(n, dtype=np.float64)
        if self.burstiness == 1:
            gaps = rng.exponential(1.0 / self.rate, size=n)
        else:
            gaps = rng.gamma(self.burstiness, 1.0 / (self.rate * self.burstiness), size=n)
        return _times_from_gaps(gaps)


def all_at_once() -> AllAtOnce:
    return AllAtOnce()


def poisson(rate: float) -> Gamma:
    return Gamma(rate, 1.0)


def gamma(rate: float, burstiness: float) -> Gamma:
    return Gamma(rate, burstiness)
