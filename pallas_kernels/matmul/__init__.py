"""Matmul kernels for quantized weights go here."""
