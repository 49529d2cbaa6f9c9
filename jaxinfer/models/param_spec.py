"""`ParamSpec`: the abstract description of one weight (shape, dtype, logical axes, initializer),
the unit every spec function declares weights in (`jaxinfer.models.spec` builds the tree)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import jax.numpy as jnp

Init = Literal["normal", "ones", "zeros"]


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: jnp.dtype
    axes: tuple[str | None, ...]
    init: Init = "normal"
    # Standard deviation for "normal": 1/sqrt(fan_in) keeps activations O(1) through random layers.
    scale: float = 1.0
    # A linear weight [*in, *out] (y = x @ w over its first `in_dims` axes, `layers.linear`) has
    # in_dims >= 1; other arrays 0. Weight formats quantize only linear weights.
    in_dims: int = 0

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axes):
            raise ValueError(f"ParamSpec: shape {self.shape} and axes {self.axes} differ in rank")
        if not 0 <= self.in_dims < max(len(self.shape), 1):
            raise ValueError(f"ParamSpec: in_dims={self.in_dims} for a {len(self.shape)}-d array")


def is_spec(x: object) -> bool:
    return isinstance(x, ParamSpec)


def linear_spec(shape: tuple[int, ...], dtype, axes, in_dims: int = 1) -> ParamSpec:
    """A random-normal linear weight [*in, *out], scaled 1/sqrt(fan_in)."""
    fan_in = math.prod(shape[:in_dims])
    return ParamSpec(shape, dtype, axes, "normal", 1.0 / math.sqrt(fan_in), in_dims)
