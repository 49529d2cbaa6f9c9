"""Matmul kernels for quantized weights: a weight-only 4-bit GEMM for decode-sized batches
(`w4_mgpu.py`, Mosaic GPU) with its pure-JAX reference (`reference.py`)."""

from pallas_kernels.matmul.dispatch import BACKENDS, KERNEL_OPTIONS, w4_matmul
from pallas_kernels.matmul.reference import FORMATS, PARTS, dequantize, w4_matmul_ref

__all__ = ["BACKENDS", "FORMATS", "KERNEL_OPTIONS", "PARTS", "dequantize", "w4_matmul",
           "w4_matmul_ref"]  # fmt: skip
