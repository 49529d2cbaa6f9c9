from pallas_kernels.paged_attention.dispatch import (
    BACKENDS,
    CALLER_OPTIONS,
    KERNEL_OPTIONS,
    paged_attention,
    resolve_backend,
)
from pallas_kernels.paged_attention.reference import ragged_paged_attention

paged_attention_dispatch = paged_attention  # the name jaxinfer's model code uses

__all__ = [
    "BACKENDS",
    "CALLER_OPTIONS",
    "KERNEL_OPTIONS",
    "paged_attention",
    "paged_attention_dispatch",
    "ragged_paged_attention",
    "resolve_backend",
]
