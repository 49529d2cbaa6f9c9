"""The format registry: `WeightFormat`, `QuantizedWeight` and `WEIGHT_FORMATS` (see the package
docstring). The format modules register into it; `jaxinfer.quant` imports them all."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax


@dataclass(frozen=True)
class WeightFormat:
    """How one weight is stored (subclass it, frozen, and `register_format` an instance)."""

    name: str

    def part_specs(self, spec: Any) -> dict[str, Any]:
        raise NotImplementedError

    def quantize(self, w: jax.Array, in_dims: int) -> dict[str, jax.Array]:
        raise NotImplementedError

    def dequantize(self, qw: QuantizedWeight) -> jax.Array:
        raise NotImplementedError

    def matmul(self, x: jax.Array, qw: QuantizedWeight) -> jax.Array:
        raise NotImplementedError


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight of logical shape [*in, *out] stored as `arrays` by `format`; `in_dims` leading
    logical axes are the matmul's input. A pytree: the arrays are its children, the rest static."""

    arrays: dict[str, Any]
    format: WeightFormat
    in_dims: int = 1

    def replace(self, **changes: Any) -> QuantizedWeight:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    QuantizedWeight, data_fields=["arrays"], meta_fields=["format", "in_dims"]
)

WEIGHT_FORMATS: dict[str, WeightFormat] = {}


def register_format(fmt: WeightFormat) -> WeightFormat:
    """Make `fmt` known by its name (to `ModelConfig.weight_format`); returns it."""
    WEIGHT_FORMATS[fmt.name] = fmt
    return fmt


def is_quantized(x: object) -> bool:
    return isinstance(x, QuantizedWeight)
