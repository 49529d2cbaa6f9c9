from pallas_kernels.paged_attention.reference import ragged_paged_attention

__all__ = ["ragged_paged_attention"]
