"""Length distributions for prompt and output lengths (in tokens).

Every distribution draws integer lengths >= 1 from a `numpy.random.Generator`:

    fixed(n)                       always n
    uniform(lo, hi)                integers in [lo, hi], both ends included
    lognormal(mean, sigma, lo, hi) round(exp(N(mu, sigma))) clipped to [lo, hi], with
                                   mu = ln(mean) - sigma**2 / 2 so that the unclipped mean is `mean`
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _check_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: must be an int >= {minimum}")
    return int(value)


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ValueError(f"{name}={value!r} is invalid: must be a finite number > 0")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} is invalid: must be a finite number > 0")
    return float(value)


@dataclass(frozen=True)
class LengthDist:
    """Base class: `sample(rng, n)` returns an int64 array of n lengths."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError

    @property
    def mean(self) -> float:
        """The distribution's mean before any clipping (exact for fixed and uniform)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Fixed(LengthDist):
    value: int

    def __post_init__(self) -> None:
        _check_int("fixed.value", self.value)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(_check_int("n", n, 0), self.value, dtype=np.int64)

    @property
    def mean(self) -> float:
        return float(self.value)


@dataclass(frozen=True)
class Uniform(LengthDist):
    lo: int
    hi: int

    def __post_init__(self) -> None:
        _check_int("uniform.lo", self.lo)
        _check_int("uniform.hi", self.hi)
        if self.hi < self.lo:
            raise ValueError(f"uniform.hi={self.hi} is invalid: must be >= lo={self.lo}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi, size=_check_int("n", n, 0), endpoint=True).astype(
            np.int64
        )

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2


@dataclass(frozen=True)
class LogNormal(LengthDist):
    target_mean: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        _check_positive("lognormal.mean", self.target_mean)
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(
                f"lognormal.sigma={self.sigma!r} is invalid: must be a finite float >= 0"
            )
        _check_int("lognormal.lo", self.lo)
        _check_int("lognormal.hi", self.hi)
        if self.hi < self.lo:
            raise ValueError(f"lognormal.hi={self.hi} is invalid: must be >= lo={self.lo}")

    @property
    def mu(self) -> float:
        """Mean of the underlying normal."""
        return math.log(self.target_mean) - self.sigma**2 / 2

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.lognormal(self.mu, self.sigma, size=_check_int("n", n, 0))
        return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)

    @property
    def mean(self) -> float:
        return float(self.target_mean)


def fixed(n: int) -> Fixed:
    return Fixed(n)


def uniform(lo: int, hi: int) -> Uniform:
    return Uniform(lo, hi)


def lognormal(mean: float, sigma: float, lo: int = 1, hi: int = 1 << 30) -> LogNormal:
    """Lengths whose unclipped mean is `mean`; `sigma` is the underlying normal's std."""
    return LogNormal(mean, sigma, lo, hi)
