from pallas_kernels.paged_attention.dispatch import BACKENDS, paged_attention, resolve_backend
from pallas_kernels.paged_attention.inputs import PagedAttentionInputs
from pallas_kernels.paged_attention.reference import ragged_paged_attention

__all__ = [
    "BACKENDS",
    "PagedAttentionInputs",
    "paged_attention",
    "ragged_paged_attention",
    "resolve_backend",
]
