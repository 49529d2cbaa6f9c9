from pallas_kernels.paged_attention.dispatch import (
    BACKENDS,
    CALLER_OPTIONS,
    KERNEL_OPTIONS,
    paged_attention,
    resolve_backend,
)
from pallas_kernels.paged_attention.reference import ragged_paged_attention

__all__ = [
    "BACKENDS",
    "CALLER_OPTIONS",
    "KERNEL_OPTIONS",
    "paged_attention",
    "ragged_paged_attention",
    "resolve_backend",
]
