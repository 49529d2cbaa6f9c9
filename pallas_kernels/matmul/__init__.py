"""Matmul kernels for decode: skinny (M <= 64) weight-streaming matmuls (`skinny_mgpu.py`)."""

from pallas_kernels.matmul.skinny_mgpu import skinny_matmul

__all__ = ["skinny_matmul"]
