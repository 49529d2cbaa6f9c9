"""One entry point for ragged paged attention, whatever the backend.

- `xla`: the pure-JAX reference (`reference.py`); runs anywhere, the oracle in tests.
- `pallas`: the Mosaic GPU kernel (`mosaic_gpu.py`); on CPU it runs under the GPU interpreter.
- `cudnn`: cuDNN's paged attention through jax's private API (`cudnn.py`), an ablation baseline;
  decode-only batches on a GPU with a jax that has it.
- `auto`: `pallas` on a GPU when the kernel supports the shape (head dim, page size, kv dtype),
  `xla` otherwise.
"""

from __future__ import annotations

import jax

from pallas_kernels.paged_attention.invariant import ragged_paged_attention_invariant
from pallas_kernels.paged_attention.reference import ragged_paged_attention

BACKENDS = ("auto", "xla", "pallas", "cudnn")
# Tuning keywords of the Pallas kernel (`mosaic_gpu.ragged_paged_attention_mgpu`); other backends
# ignore them. Options measured and removed: docs/decisions.md, "Paged attention kernel".
KERNEL_OPTIONS = ("split_decode_rows", "num_splits", "num_stages", "warp_specialized", "block_kv",
                  "num_consumers", "token_major_decode", "fused_kv_write")  # fmt: skip
# Options the caller acts on, not the kernel: `fused_kv_write` (true, false or a token limit) lets
# a decode step's kernel write the new K/V itself (`new_kv`) instead of an XLA scatter before it
# (jaxinfer.models.attention.write_kv_and_attend).
CALLER_OPTIONS = ("fused_kv_write",)


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
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    max_q_len: int,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    v_page_offset: int = 0,
    backend: str = "auto",
    new_kv: tuple[jax.Array, jax.Array] | None = None,
    device: jax.Device | None = None,
    batch_invariant: bool = False,
    **kernel_options,
) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
    """Ragged paged attention (see `reference.ragged_paged_attention` for the layout).

    `k_scales`/`v_scales`: [num_pages, Hkv] float32 dequantization scales when the pages are FP8.
    `v_page_offset` (static): V's page ids are K's plus this (K and V sharing one pool).
    `kernel_options` go to the Pallas kernel (e.g. `num_splits`, `interpret`).
    `device` (static): the device the call runs on, for `auto` and the kernel's defaults (None:
    the default backend's first device).
    `new_kv` = (k, v) [T, Hkv, D]: the Pallas kernel writes this step's K/V into the pages itself
    and the call returns (out, k_pages, v_pages) (see `ragged_paged_attention_mgpu`; other
    backends need the K/V written before the call).
    `batch_invariant` (static): each row's output is a fixed function of its own sequence
    (`invariant.ragged_paged_attention_invariant`, the `xla` backend's form; the kernels have
    none yet: docs/batch_invariance.md).
    """
    backend = resolve_backend(backend, q, k_pages, device)
    if new_kv is not None and backend != "pallas":
        raise ValueError(
            f"new_kv: only the pallas backend writes K/V in the kernel, not {backend!r}"
        )
    common = dict(max_q_len=max_q_len, sm_scale=sm_scale, soft_cap=soft_cap,
                  sliding_window=sliding_window, v_page_offset=v_page_offset)  # fmt: skip
    if batch_invariant:
        if backend != "xla":
            raise ValueError(f"batch-invariant attention runs on the xla backend; {backend!r} "
                             "has no invariant form yet")  # fmt: skip
        return ragged_paged_attention_invariant(
            q, k_pages, v_pages, page_table, seq_lens, query_start_loc,
            k_scales=k_scales, v_scales=v_scales, **common,
        )  # fmt: skip
    if backend == "xla":
        return ragged_paged_attention(
            q, k_pages, v_pages, page_table, seq_lens, query_start_loc,
            k_scales=k_scales, v_scales=v_scales, **common,
        )  # fmt: skip
    if backend == "pallas":
        from pallas_kernels.paged_attention.mosaic_gpu import ragged_paged_attention_mgpu

        return ragged_paged_attention_mgpu(
            q, k_pages, v_pages, page_table, seq_lens, query_start_loc,
            k_scales=k_scales, v_scales=v_scales, new_kv=new_kv, device=device, **common,
            **kernel_options,
        )  # fmt: skip
    from pallas_kernels.paged_attention.cudnn import cudnn_paged_attention

    return cudnn_paged_attention(
        q, k_pages, v_pages, page_table, seq_lens, query_start_loc,
        k_scales=k_scales, v_scales=v_scales, **common,
    )  # fmt: skip
