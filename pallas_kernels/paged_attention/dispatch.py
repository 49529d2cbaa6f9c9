"""One entry point for ragged paged attention, whatever the backend.

- `xla`: the pure-JAX reference (`reference.py`); runs anywhere, the oracle in tests.
- `pallas`: the Mosaic GPU kernel (`mosaic_gpu.py`); on CPU it runs under the GPU interpreter.
- `cudnn`: cuDNN's paged attention through jax's private API (`cudnn.py`), an ablation baseline;
  decode-only batches on a GPU with a jax that has it.
- `auto`: `pallas` on a GPU when the kernel supports the shape (head dim, page size, kv dtype),
  `xla` otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from pallas_kernels.paged_attention.inputs import PagedAttentionInputs
from pallas_kernels.paged_attention.invariant import ragged_paged_attention_invariant
from pallas_kernels.paged_attention.reference import ragged_paged_attention

if TYPE_CHECKING:
    from pallas_kernels.paged_attention.mosaic_gpu import KernelOptions

BACKENDS = ("auto", "xla", "pallas", "cudnn")


def resolve_backend(backend: str, q=None, k_pages=None, device: jax.Device | None = None) -> str:
    """The backend `backend` stands for on `device` (default: the default device); `auto` looks
    at the device and, given, the shapes."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    platform = jax.default_backend() if device is None else device.platform
    if platform != "gpu":
        return "xla"
    if q is not None and k_pages is not None:
        from pallas_kernels.paged_attention.mosaic_gpu import unsupported_reason

        _, page_size, hkv, d = k_pages.shape
        if unsupported_reason(q.shape[1], hkv, d, page_size, k_pages.dtype) is not None:
            return "xla"
    return "pallas"


def paged_attention(
    x: PagedAttentionInputs,
    *,
    backend: str = "auto",
    options: KernelOptions | None = None,
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    device: jax.Device | None = None,
    batch_invariant: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
    """Attention as `PagedAttentionInputs` describes it, on `backend`.

    `options`: the Pallas kernel's tuning (`mosaic_gpu.KernelOptions`; None: its defaults; other
    backends ignore it). Options measured and removed: docs/decisions.md, "Paged attention
    kernel".
    `device` (static): the device the call runs on, for `auto` and the kernel's defaults (None:
    the default backend's first device).
    `new_kv` = (k, v) [T, Hkv, D]: the Pallas kernel writes this step's K/V into the pages itself
    and the call returns (out, k_pages, v_pages) (see `ragged_paged_attention_mgpu`; other
    backends need the K/V written before the call).
    `batch_invariant` (static): each row's output is a fixed function of its own sequence: the
    Pallas kernel's invariant form (`ragged_paged_attention_mgpu(batch_invariant=True)`), or
    with a sliding window or on `xla` `invariant.ragged_paged_attention_invariant`
    (docs/batch_invariance.md).
    """
    backend = resolve_backend(backend, x.q, x.k_pages, device)
    if new_kv is not None and backend != "pallas":
        raise ValueError(
            f"new_kv: only the pallas backend writes K/V in the kernel, not {backend!r}"
        )
    if batch_invariant:
        if backend == "pallas" and x.sliding_window is None and new_kv is None:
            from pallas_kernels.paged_attention.mosaic_gpu import ragged_paged_attention_mgpu

            return ragged_paged_attention_mgpu(x, options, device=device, batch_invariant=True)
        if backend == "cudnn" or new_kv is not None:
            raise ValueError(f"batch-invariant attention runs on the pallas or xla backend "
                             f"without new_kv, not {backend!r}")  # fmt: skip
        return ragged_paged_attention_invariant(x)
    if backend == "xla":
        return ragged_paged_attention(x)
    if backend == "pallas":
        from pallas_kernels.paged_attention.mosaic_gpu import ragged_paged_attention_mgpu

        return ragged_paged_attention_mgpu(x, options, new_kv=new_kv, device=device)
    from pallas_kernels.paged_attention.cudnn import cudnn_paged_attention

    return cudnn_paged_attention(x)
