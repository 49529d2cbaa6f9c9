"""The paged KV cache and the page table, both pytrees threaded through jitted steps.

Invariants a caller must keep (the host block manager does):
- Page `SCRATCH_PAGE` (0) is never owned by a sequence. Padding batch slots and page-table entries
  past a sequence's length point at it, and padding tokens write their K/V there.
- A page is owned by (or, with prefix sharing, refcounted among) the sequences whose rows list it;
  attention reads a sequence's keys only below its `seq_len`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxinfer.models.config import ModelConfig
from jaxinfer.parallel.sharding import DEFAULT_RULES, named_sharding
from pallas_kernels.paged_attention.fp8 import FP8_DTYPE, quantize_pages_write
from pallas_kernels.paged_attention.reference import token_sequences

SCRATCH_PAGE = 0
KV_AXES = ("layers", "pages", None, None, "kv_heads", "head_dim")
SCALE_AXES = ("layers", "pages", None, "kv_heads")
# "auto": the model's activation dtype. "float8_e4m3fn" adds per-(page, kv head) float32 scales.
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "float8_e4m3fn")
_KV_DTYPE_ALIASES = {"fp8": "float8_e4m3fn"}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """All layers' K/V pages in one array: `pages` [num_layers, num_pages, 2, page_size, Hkv, D],
    K at index 0 and V at 1 of the third axis.

    - Stacking layers costs nothing at read time (attention gathers pages of layer `l` directly)
      and the cache is updated in place when donated.
    - A page's K and V side by side make a step's K/V write one scatter per layer, not two (on the
      H200 each scatter is its own kernel). Attention
      views the array as one pool of `num_layers * num_pages * 2` half-pages: K of (layer l, page
      p) is pool page `2 * (l * num_pages + p)`, V the next one (`v_page_offset=1` for the
      kernels).
    - FP8 pages carry float32 scales [num_layers, num_pages, 2, Hkv] (format:
      `paged_attention.fp8`); other caches have None there.

    `k_pages`/`v_pages`/`k_scales`/`v_scales` are views for inspection and tests (slices: a copy
    inside a jitted function).
    """

    pages: jax.Array
    scales: jax.Array | None = None

    @property
    def is_quantized(self) -> bool:
        return self.scales is not None

    @property
    def num_layers(self) -> int:
        return self.pages.shape[0]

    @property
    def num_pages(self) -> int:
        return self.pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.pages.shape[3]

    @property
    def dtype(self) -> jnp.dtype:
        return self.pages.dtype

    @property
    def k_pages(self) -> jax.Array:
        """[num_layers, num_pages, page_size, Hkv, D]."""
        return self.pages[:, :, 0]

    @property
    def v_pages(self) -> jax.Array:
        return self.pages[:, :, 1]

    @property
    def k_scales(self) -> jax.Array | None:
        """[num_layers, num_pages, Hkv] (FP8 caches), else None."""
        return None if self.scales is None else self.scales[:, :, 0]

    @property
    def v_scales(self) -> jax.Array | None:
        return None if self.scales is None else self.scales[:, :, 1]

    def pool(self) -> tuple[jax.Array, jax.Array | None]:
        """The pages as one pool [num_layers * num_pages * 2, page_size, Hkv, D] (a free reshape)
        and the scales as [num_layers * num_pages * 2, Hkv] (or None); see the class docstring."""
        num_layers, num_pages, _, page_size, hkv, d = self.pages.shape
        pool = self.pages.reshape(num_layers * num_pages * 2, page_size, hkv, d)
        scales = None if self.scales is None else self.scales.reshape(-1, hkv)
        return pool, scales

    def pool_page_ids(self, page_ids: jax.Array, layer: int | jax.Array) -> jax.Array:
        """K's pool page of each (layer `layer`, page) in `page_ids`; V's is the next one."""
        return 2 * (page_ids + layer * self.num_pages)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PageTable:
    """Which pages hold each batch slot's context, and how long that context is.

    `page_ids`: [S, pages_per_seq] int32; `seq_lens`: [S] int32, the context length after this
    step's new tokens are written. Padding slots have length 0 and only SCRATCH_PAGE entries.
    """

    page_ids: jax.Array
    seq_lens: jax.Array


def kv_dtype(cfg: ModelConfig, dtype: str | jnp.dtype | None = None) -> jnp.dtype:
    """The pool dtype for a `KV_DTYPES` name (or alias "fp8", or a dtype); None/"auto": cfg.dtype."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return jnp.dtype(cfg.dtype)
    if isinstance(dtype, str):
        dtype = _KV_DTYPE_ALIASES.get(dtype, dtype)
        if dtype not in KV_DTYPES:
            raise ValueError(
                f"kv dtype {dtype!r} is invalid: must be one of {', '.join(KV_DTYPES)}"
            )
    return jnp.dtype(dtype)


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype: str | jnp.dtype | None = None) -> int:
    """Device bytes one page index costs across all layers, K and V, scales included."""
    dtype = kv_dtype(cfg, dtype)
    per_pool = cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    scales = cfg.num_layers * cfg.num_kv_heads * 4 if dtype == FP8_DTYPE else 0
    return 2 * (per_pool + scales)


def init_kv_cache(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: str | jnp.dtype | None = None,
    mesh=None,
    rules=DEFAULT_RULES,
) -> KVCache:
    """Zeroed pools allocated on the device; page 0 is the scratch page (so usable pages = n-1).

    `dtype`: see `kv_dtype`; float8_e4m3fn (or "fp8") also allocates zero scales (0 = empty page).
    """
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    shape = (cfg.num_layers, num_pages, 2, page_size, cfg.num_kv_heads, cfg.head_dim)
    scale_shape = (cfg.num_layers, num_pages, 2, cfg.num_kv_heads)
    dtype = kv_dtype(cfg, dtype)
    quantized = dtype == FP8_DTYPE

    def zeros():
        return KVCache(jnp.zeros(shape, dtype),
                       jnp.zeros(scale_shape, jnp.float32) if quantized else None)  # fmt: skip

    out = None
    if mesh is not None:
        scales = named_sharding(mesh, SCALE_AXES, scale_shape, rules) if quantized else None
        out = KVCache(named_sharding(mesh, KV_AXES, shape, rules), scales)
    return jax.jit(zeros, out_shardings=out)()


def token_slots(
    page_table: PageTable, query_start_loc: jax.Array, positions: jax.Array, page_size: int
) -> tuple[jax.Array, jax.Array]:
    """(page id, offset in page) where each token's K/V is written; padding tokens -> scratch."""
    num_tokens = positions.shape[0]
    t = jnp.arange(num_tokens)
    seq, valid = token_sequences(query_start_loc, num_tokens)
    block = jnp.clip(positions // page_size, 0, page_table.page_ids.shape[1] - 1)
    page = jnp.where(valid, page_table.page_ids[seq, block], SCRATCH_PAGE)
    offset = jnp.where(valid, positions % page_size, t % page_size)
    return page.astype(jnp.int32), offset.astype(jnp.int32)


def write_kv(
    kv: KVCache,
    layer: int | jax.Array,
    k: jax.Array,
    v: jax.Array,
    page: jax.Array,
    offset: jax.Array,
    *,
    fixed_scale: float | None = None,
) -> KVCache:
    """Scatter new K/V [T, Hkv, D] of layer `layer` into their slots (in place when donated): one
    scatter of [T, 2, Hkv, D].

    FP8 pages are quantized on write (and touched pages requantized when their scale grows, or
    with `fixed_scale` every value at that one scale: batch-invariant numerics); that path
    writes K and V as separate half-pages (two scatters).
    """
    if kv.is_quantized:
        num_layers, num_pages, _, page_size, hkv, d = kv.pages.shape
        halves = kv.pages.reshape(num_layers, num_pages * 2, page_size, hkv, d)
        scales = kv.scales.reshape(num_layers, num_pages * 2, hkv)
        write = functools.partial(quantize_pages_write, layer=layer, fixed_scale=fixed_scale)
        halves, scales = write(halves, scales, k, 2 * page, offset)
        halves, scales = write(halves, scales, v, 2 * page + 1, offset)
        return KVCache(halves.reshape(kv.pages.shape), scales.reshape(kv.scales.shape))
    new = jnp.stack([k, v], axis=1).astype(kv.pages.dtype)  # [T, 2, Hkv, D]
    return KVCache(kv.pages.at[layer, page, :, offset].set(new), None)
