"""One entry point for the weight-only matmul (4-bit and 8-bit formats), whatever the backend.

- `triton`: the Pallas Triton kernel (`w4_triton.py`); on CPU it runs under Pallas's interpreter.
- `xla`: the pure-JAX reference (`reference.py`: dequantize to fp32, one fp32 dot); runs
  anywhere, the oracle in tests.
- `auto`: `triton` on a GPU, `xla` elsewhere.

Both check the arguments the same way (`w4_triton.check_inputs`: errors name the argument).
"""

from __future__ import annotations

import jax

from pallas_kernels.matmul.reference import w4_matmul_ref
from pallas_kernels.matmul.w4_triton import check_inputs, w4_matmul_triton

BACKENDS = ("auto", "xla", "triton")
KERNEL_OPTIONS = ("num_stages", "num_splits", "interpret")


def w4_matmul(
    x: jax.Array,
    values: jax.Array,
    *,
    fmt: str,
    backend: str = "auto",
    device: jax.Device | None = None,
    **parts_and_options,
) -> jax.Array:
    """x [M, K] bf16 @ a weight-only quantized weight [K, N] -> [M, N] in x's dtype.

    `values` (uint8 [K/2, N] for 4 bits, int8 [K, N] for 8) and the format's parts by name
    (`reference.PARTS`: `scales` for int4_g128_sym, mxfp4 and int8, `block_scales` and
    `tensor_scale` for nvfp4, `d` and `m` for q4_1, `d` for q8_0),
    so a jaxinfer weight passes as `w4_matmul(x, **qw.arrays, fmt=qw.format.name)`. Kernel
    options (`KERNEL_OPTIONS`: num_stages, num_splits, interpret) go to the kernel.
    `device` (static) decides `auto` and the kernel's defaults (None: `jax.devices()[0]`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    options = {k: parts_and_options.pop(k) for k in KERNEL_OPTIONS if k in parts_and_options}
    parts = parts_and_options
    if backend == "auto":
        platform = (jax.devices()[0] if device is None else device).platform
        backend = "triton" if platform == "gpu" else "xla"
    if backend == "triton":
        return w4_matmul_triton(x, values, fmt=fmt, device=device, **options, **parts)
    if options:
        raise ValueError(f"kernel options {sorted(options)} apply to the kernel only")
    check_inputs(x, values, fmt, parts)
    return w4_matmul_ref(x, values, fmt=fmt, **parts).astype(x.dtype)
