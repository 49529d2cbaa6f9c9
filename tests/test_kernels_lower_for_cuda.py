"""The Mosaic GPU kernels lowered for CUDA on a machine without a GPU.

The GPU interpreter (the other kernel tests) runs a kernel's semantics but none of Mosaic's layout
inference, register layouts, shared-memory planning or lowering: a kernel can pass under it and
still fail to compile. Lowering for CUDA (`lower(lowering_platforms=("cuda",))`) runs all of that
in Python on any machine, so CI catches those failures for every pipeline the kernels have (this
jax's Mosaic; the GPU machine's newer jax compiles them in the `-m gpu` tests). Shapes only, no data.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.paged_attention import PagedAttentionInputs
from pallas_kernels.paged_attention.mosaic_gpu import KernelOptions, ragged_paged_attention_mgpu

BF16, FP8 = jnp.bfloat16, jnp.float8_e4m3fn


def lower_attention(*, num_tokens, num_seqs, max_q_len, num_kv_heads=8, group=4, head_dim=128,
                    page_size=64, kv_dtype=BF16, shared_pool=False, new_kv=False, soft_cap=None,
                    sliding_window=None, **options):  # fmt: skip
    """Lowered HLO text of one call of the kernel (compiled, not interpreted) for CUDA, with
    `KernelOptions(**options)`."""
    num_pages = 64
    sds = jax.ShapeDtypeStruct
    q = sds((num_tokens, num_kv_heads * group, head_dim), BF16)
    pages = sds((num_pages, page_size, num_kv_heads, head_dim), kv_dtype)
    table, lens = sds((num_seqs, 8), jnp.int32), sds((num_seqs,), jnp.int32)
    qsl = sds((num_seqs + 1,), jnp.int32)
    scales = sds((num_pages, num_kv_heads), jnp.float32) if kv_dtype == FP8 else None
    x = PagedAttentionInputs(q, pages, pages, table, lens, qsl, max_q_len=max_q_len,
                             k_scales=scales, v_scales=scales, soft_cap=soft_cap,
                             sliding_window=sliding_window,
                             v_page_offset=int(shared_pool))  # fmt: skip
    k_new = sds((num_tokens, num_kv_heads, head_dim), BF16) if new_kv else None

    def call(x, k_new):
        if shared_pool:  # one pool array for K and V
            x = dataclasses.replace(x, v_pages=x.k_pages)
        kv = None if k_new is None else (k_new, k_new)
        return ragged_paged_attention_mgpu(x, KernelOptions(**options), interpret=False, new_kv=kv)

    return jax.jit(call).trace(x, k_new).lower(lowering_platforms=("cuda",)).as_text()


DECODE = dict(num_tokens=64, num_seqs=64, max_q_len=1)  # one split: token-major outputs
SMALL_DECODE = dict(num_tokens=4, num_seqs=4, max_q_len=1)  # context splits and their combine
PREFILL = dict(num_tokens=256, num_seqs=4, max_q_len=128)  # prefill blocks (and decode rows)
# speculative verification: decode blocks of 5 tokens (context splits and their combine)
VERIFY = dict(num_tokens=20, num_seqs=4, max_q_len=5)


@pytest.mark.parametrize(
    "case,kw",
    [
        (DECODE, {}),
        (SMALL_DECODE, {}),
        (DECODE, dict(new_kv=True)),  # the kernel writes the new K/V (pages as refs)
        (SMALL_DECODE, dict(new_kv=True, shared_pool=True, group=3)),
        (DECODE, dict(warp_specialized=True, num_stages=4)),
        (DECODE, dict(kv_dtype=FP8)),  # producer converts fp8 tiles to f16
        (SMALL_DECODE, dict(kv_dtype=FP8, warp_specialized=False)),
        (DECODE, dict(head_dim=64, page_size=16, group=8)),  # several copies per tile
        (SMALL_DECODE, dict(head_dim=256, page_size=128)),  # a tile is a slice of a page
        (VERIFY, {}),
        (VERIFY, dict(new_kv=True)),  # the kernel writes 5 tokens' K/V a sequence
        (VERIFY, dict(new_kv=True, shared_pool=True, group=3)),
        (PREFILL, {}),  # two consumer warpgroups; decode rows in a second launch
        (PREFILL, dict(split_decode_rows=False, soft_cap=30.0, sliding_window=100)),
        (PREFILL, dict(kv_dtype=FP8)),
    ],
)
def test_attention_kernel_lowers_for_cuda(case, kw):
    text = lower_attention(**case, **kw)
    assert "mosaic_gpu" in text


def test_shared_memory_overflow_is_caught_when_lowering():
    # 3 stages of 128-key tiles for two consumer warpgroups do not fit the H100/H200's 227 KB: the
    # engine then fails at warm-up, and so does this lowering, with the same message
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lower_attention(**PREFILL, num_stages=3)
