"""Matmul kernels for quantized weights: a weight-only 4-bit and 8-bit GEMM for decode-sized
batches (`w4_triton.py`, on Pallas's Triton backend) with its pure-JAX reference (`reference.py`),
a block-scaled FP8 GEMM (`fp8_block_mgpu.py`, its reference beside it; behind the `fp8_block`
format on one GPU), and the batch-invariant bf16 GEMM (`invariant_mgpu.py`)."""

from pallas_kernels.matmul.dispatch import BACKENDS, KERNEL_OPTIONS, w4_matmul
from pallas_kernels.matmul.reference import FORMATS, PARTS, dequantize, w4_matmul_ref

__all__ = ["BACKENDS", "FORMATS", "KERNEL_OPTIONS", "PARTS", "dequantize", "w4_matmul",
           "w4_matmul_ref"]  # fmt: skip
