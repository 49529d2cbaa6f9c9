"""Attention for the model: dense causal (whole sequences, no cache) and paged (ragged batches).

The paged path is the one interface with several backends (`pallas_kernels.paged_attention`'s
dispatcher): `xla`, the pure-JAX reference (runs anywhere, the oracle in tests); `pallas`, the Mosaic
GPU kernel (interpreted on CPU); `cudnn`, cuDNN's paged decode (an ablation baseline); `auto`,
`pallas` on a GPU and `xla` elsewhere. `AttentionConfig` carries the choice into the jitted steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxinfer.kv.cache import KVCache, write_kv
from jaxinfer.models.batch import RaggedBatch
from jaxinfer.models.numerics import DEFAULT_NUMERICS, Numerics
from pallas_kernels.paged_attention import (
    BACKENDS,
    PagedAttentionInputs,
    paged_attention,
    resolve_backend,
)
from pallas_kernels.paged_attention.fp8 import INVARIANT_SCALE
from pallas_kernels.paged_attention.mosaic_gpu import KernelOptions, fused_kv_write_reason

ATTENTION_BACKENDS = BACKENDS
# Options this module acts on, not the kernel: `fused_kv_write` (true, false or a token limit)
# lets a decode step's kernel write the new K/V itself (`new_kv`) instead of an XLA scatter
# before it (`write_kv_and_attend`).
CALLER_OPTIONS = ("fused_kv_write",)
ATTENTION_OPTIONS = (*(f.name for f in dataclasses.fields(KernelOptions)), *CALLER_OPTIONS)
# Decode steps of at most this many tokens write their K/V in the attention kernel (option
# `fused_kv_write`: true = this limit, an int = another, false = never): measured faster up to
# batch 64, not beyond (docs/decisions.md).
FUSED_KV_WRITE_MAX_TOKENS = 64


@dataclass(frozen=True)
class AttentionConfig:
    """Static: which paged-attention backend a step uses, the Pallas kernel's options ((name,
    value) pairs of `ATTENTION_OPTIONS`: `KernelOptions`' fields and `fused_kv_write`; other
    backends ignore them), the device the kernels are built for (its SM count, whether to
    interpret; None: the default device), and the mesh whose "model" axis splits the heads
    (None: attention runs as one program; `parallel.tensor.attention_mesh`)."""

    backend: str = "xla"
    options: tuple[tuple[str, object], ...] = ()
    device: jax.Device | None = None
    mesh: Mesh | None = None

    def __post_init__(self) -> None:
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention backend must be one of {ATTENTION_BACKENDS}, got {self.backend!r}"
            )
        object.__setattr__(self, "options", tuple(sorted(dict(self.options).items())))

    @property
    def kernel_options(self) -> KernelOptions:
        """The kernel's tuning (raises ValueError naming a bad option)."""
        return KernelOptions(**{k: v for k, v in self.options if k not in CALLER_OPTIONS})


XLA_ATTENTION = AttentionConfig()  # the reference backend, the default of the model functions


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, sliding_window: int | None = None
) -> jax.Array:
    """q [B, L, Hq, D], k/v [B, L, Hkv, D] -> [B, L, Hq, D]; GQA, causal, softmax in fp32."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, n, hkv, hq // hkv, d).astype(jnp.float32)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32)) * d**-0.5
    i = jnp.arange(n)
    mask = i[None, :] <= i[:, None]
    if sliding_window is not None:
        mask &= i[None, :] > i[:, None] - sliding_window
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v.astype(jnp.float32))
    return out.reshape(b, n, hq, d).astype(q.dtype)


def write_kv_and_attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv: KVCache,
    layer: int | jax.Array,
    batch: RaggedBatch,
    page: jax.Array,
    offset: jax.Array,
    *,
    sliding_window: int | None = None,
    attention: AttentionConfig = XLA_ATTENTION,
    numerics: Numerics = DEFAULT_NUMERICS,
) -> tuple[jax.Array, KVCache]:
    """Write this step's K/V [T, Hkv, D] (rope applied) of layer `layer` at (`page`, `offset`),
    then attend q [T, Hq, D] over the cache: returns (out [T, Hq, D], updated cache).

    The cache is viewed as one pool of K and V half-pages (`KVCache.pool`, a free reshape) and the
    page ids offset by layer: no per-layer slice of the cache is ever materialised. Decode steps
    of up to `FUSED_KV_WRITE_MAX_TOKENS` tokens on the Pallas kernel write the K/V in the kernel
    (option `fused_kv_write`): each sequence's K/V rows arrive with its queries and the kernel
    stores them in place, so no XLA scatter kernel runs per layer. Other steps and backends
    scatter first (`write_kv`).

    On a mesh with a "model" axis (`attention.mesh`) each device runs this on its own heads
    (`shard_map`): its query heads, its KV heads' K/V and pages; the batch is every device's.
    Batch-invariant `numerics` take the backend's invariant form (`dispatch.paged_attention`).
    """
    args = (q, k, v, kv, layer, batch, page, offset, sliding_window, attention, numerics)
    if attention.mesh is not None:
        return _per_device(*args)
    return _attend(*args)


def _per_device(q, k, v, kv, layer, batch, page, offset, sliding_window, attention, numerics):
    heads = PartitionSpec(None, "model", None)  # q, k, v [T, H, D]
    pages = PartitionSpec(None, None, None, None, "model", None)  # KV_AXES' kv_heads
    scales = None if kv.scales is None else PartitionSpec(None, None, None, "model")
    kv_spec = KVCache(pages, scales)
    rep = PartitionSpec()
    local = dataclasses.replace(attention, mesh=None)
    static_layer = isinstance(layer, int)  # (an unrolled layer loop's index stays static)

    def body(q, k, v, kv, traced_layer, batch, page, offset):
        at = layer if static_layer else traced_layer
        return _attend(q, k, v, kv, at, batch, page, offset, sliding_window, local, numerics)

    return jax.shard_map(body, mesh=attention.mesh,
                         in_specs=(heads, heads, heads, kv_spec, rep, rep, rep, rep),
                         out_specs=(heads, kv_spec), check_vma=False)(
        q, k, v, kv, jnp.asarray(layer, jnp.int32), batch, page, offset)  # fmt: skip


def _attend(q, k, v, kv, layer, batch, page, offset, sliding_window, attention, numerics):
    opts = dict(attention.options)
    if attention.backend == "pallas" and kv.dtype == jnp.float32:
        raise ValueError("attention backend 'pallas' reads bf16 or fp8 pages; this cache is "
                         "float32 (set engine.kv_dtype or the model dtype to bfloat16)")  # fmt: skip
    pool, _ = kv.pool()
    backend = resolve_backend(attention.backend, q, pool, device=attention.device)
    limit = opts.get("fused_kv_write", True)
    limit = FUSED_KV_WRITE_MAX_TOKENS if limit is True else int(limit)
    fused = (
        q.shape[0] <= limit
        and not kv.is_quantized
        and not numerics.batch_invariant
        and backend == "pallas"
        and fused_kv_write_reason(
            batch.max_q_len,
            kv.dtype,
            opts.get("warp_specialized"),
            q.shape[1] // k.shape[1],
        )
        is None
    )
    if not fused:
        fixed = INVARIANT_SCALE if numerics.batch_invariant else None  # (FP8 pages: fp8.py)
        kv = write_kv(kv, layer, k, v, page, offset, fixed_scale=fixed)
    pool, pool_scales = kv.pool()
    inputs = PagedAttentionInputs(
        q,
        pool,
        pool,
        kv.pool_page_ids(batch.page_table.page_ids, layer),
        batch.page_table.seq_lens,
        batch.query_start_loc,
        max_q_len=batch.max_q_len,
        sliding_window=sliding_window,
        k_scales=pool_scales,
        v_scales=pool_scales,
        v_page_offset=1,
    )
    out = paged_attention(
        inputs,
        backend=backend,
        options=attention.kernel_options,
        new_kv=(k, v) if fused else None,
        device=attention.device,
        batch_invariant=numerics.batch_invariant,
    )
    if not fused:
        return out, kv
    out, pool, _ = out
    return out, KVCache(pool.reshape(kv.pages.shape), None)
