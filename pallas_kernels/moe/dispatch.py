"""One entry point for the grouped matmul (the MoE expert matmul), whatever the backend.

- `pallas`: the Mosaic GPU kernel (`grouped_mgpu.py`); on CPU it runs under the GPU interpreter.
- `xla`: `lax.ragged_dot` with fp32 accumulation (`reference.py`); runs anywhere.
- `auto`: `pallas` on a GPU, `xla` elsewhere.

Both check the arguments the same way (`grouped_mgpu.check_inputs`: errors name the argument).
"""

from __future__ import annotations

import jax

from pallas_kernels.moe.grouped_mgpu import OPTIONS, check_inputs, grouped_matmul_mgpu
from pallas_kernels.moe.reference import grouped_matmul_ref

BACKENDS = ("auto", "xla", "pallas")
KERNEL_OPTIONS = (*OPTIONS, "num_sms", "interpret")


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    backend: str = "auto",
    device: jax.Device | None = None,
    **options,
) -> jax.Array:
    """lhs [M, K] @ rhs [G, K, N] by group -> [M, N] in lhs's dtype (`lax.ragged_dot`'s
    semantics: rows sorted by group, rows [offset_g, offset_g + group_sizes[g]) times rhs[g], the
    rows past sum(group_sizes) zero). `group_sizes` int32 [G] is data (traced); shapes are static.
    Kernel options (`KERNEL_OPTIONS`: block_m, block_n, block_k, num_stages, grid_block_n,
    num_sms, interpret) go to the Pallas kernel. `device` (static) decides `auto` and the
    kernel's defaults (None: `jax.devices()[0]`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    unknown = sorted(set(options) - set(KERNEL_OPTIONS))
    if unknown:
        raise ValueError(f"unknown kernel options {unknown}; allowed: {list(KERNEL_OPTIONS)}")
    if backend == "auto":
        platform = (jax.devices()[0] if device is None else device).platform
        backend = "pallas" if platform == "gpu" else "xla"
    if backend == "pallas":
        return grouped_matmul_mgpu(lhs, rhs, group_sizes, device=device, **options)
    if options:
        raise ValueError(f"kernel options {sorted(options)} apply to the pallas backend only")
    check_inputs(lhs, rhs, group_sizes)
    return grouped_matmul_ref(lhs, rhs, group_sizes).astype(lhs.dtype)
