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

# The formats of this package register themselves on import.
from jaxinfer.quant import fp4, fp8, gguf_formats, intq  # noqa: F401
from jaxinfer.quant.format import (
    WEIGHT_FORMATS,
    QuantizedWeight,
    WeightFormat,
    is_quantized,
    register_format,
)

__all__ = ["WEIGHT_FORMATS", "QuantizedWeight", "WeightFormat", "is_quantized", "register_format"]
