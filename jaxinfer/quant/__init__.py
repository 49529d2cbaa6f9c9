"""Weight formats: a quantized weight is a pytree of its arrays plus the static format reading them.

A `QuantizedWeight` stands wherever a plain weight array stands in the param tree, and
`jaxinfer.models.layers.linear` multiplies by either, so nothing above `models/layers.py` knows
the format. A format (a `WeightFormat` registered in `WEIGHT_FORMATS`) says how one weight is
stored and used:

- `part_specs(spec)`: the `ParamSpec`s of the arrays that store a weight `spec` describes (its
  shape is the logical [*in, *out] weight's; the arrays take whatever layout the format's product
  reads fastest: the FP8 formats store K-major [*out, *in], what fp8 tensor cores take). The spec of a formatted weight is then a
  `QuantizedWeight` whose leaves are those ParamSpecs, so random init, shardings (each array has
  its own logical axes), loading targets and orbax restore derive from the spec tree unchanged;
- `quantize(w, in_dims)` / `dequantize(qw)`: its arrays from a plain weight, and back;
- `matmul(x, qw)`: `x [..., *in] @ w [*in, *out]`, e.g. a dot over the stored values with the
  scales applied to the output, or a kernel.

Fused weights (`w_qkv`, `w_gate_up`) are one logical output per fused axis: a block-scaled format
must take its blocks within the last (output) axis so that no block mixes q, k and v.
"""

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


# The formats of this package register themselves on import (they use the API above).
from jaxinfer.quant import fp4, fp8, gguf_formats, intq  # noqa: E402, F401
