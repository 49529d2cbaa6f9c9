"""The grouped matmul of mixture-of-experts layers (`lax.ragged_dot`'s semantics): a Mosaic GPU
kernel for Hopper (`grouped_mgpu.py`), its references (`reference.py`) and one dispatcher."""

from pallas_kernels.moe.dispatch import BACKENDS, KERNEL_OPTIONS, grouped_matmul
from pallas_kernels.moe.grouped_mgpu import DECODE, PREFILL, Tiling, default_tiling
from pallas_kernels.moe.reference import grouped_matmul_oracle, grouped_matmul_ref

__all__ = ["BACKENDS", "DECODE", "KERNEL_OPTIONS", "PREFILL", "Tiling", "default_tiling",
           "grouped_matmul", "grouped_matmul_oracle", "grouped_matmul_ref"]  # fmt: skip
