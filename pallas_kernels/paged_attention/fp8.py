"""FP8 (float8_e4m3fn) page format: per-(page, kv head) float32 scales, and the write path.

Format: `value = float32(q) * scale[page, head]`, with `q` e4m3fn in a page pool
[..., num_pages, page_size, Hkv, D] and `scale` float32 [..., num_pages, Hkv]. One scalar per page
and head is what a kernel reads alongside each page. A scale of 0 marks a page with no content
(fresh, or all zeros); every division below guards it so no NaN/inf is ever produced from it.

A page's scale only grows while the page is being filled: `scale = max(old, amax(new) / E4M3_MAX)`.
When it grows, the page's existing entries are requantized to the new scale (at most one extra
rounding each time the scale grows; it grows at most page_size times per page).

A write at offset 0 starts the page afresh: the page's previous content (a freed page's former
owner, or positions past this sequence's new length) is dead, so its old scale is dropped. This
relies on the cache invariant that a step's new tokens are the last positions of their sequence.

A growing scale makes a page's stored values depend on how its tokens were grouped into writes
(a chunk's amax sets the scale its tokens round to). Batch-invariant numerics instead write with
one fixed scale (`fixed_scale`, `INVARIANT_SCALE`): each value is rounded alone, once, whatever
the grouping. 1.0 is vLLM's scale for FP8 KV caches without calibration (docs.vllm.ai,
"Quantized KV Cache"): values beyond +-448 clip, and below 2^-6 lose precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FP8_DTYPE = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448: largest finite e4m3fn value
_MIN_SCALE = float(jnp.finfo(jnp.float32).tiny)  # keeps nonzero scales normal (no x/denormal)
INVARIANT_SCALE = 1.0  # every page's scale under batch-invariant numerics (module docstring)


def _to_e4m3(x: jax.Array) -> jax.Array:
    """Round to nearest e4m3fn; clipping first because e4m3fn has no inf (overflow gives NaN)."""
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(FP8_DTYPE)


def _safe(scale: jax.Array) -> jax.Array:
    return jnp.where(scale > 0, scale, 1.0)


def _scale_for(amax: jax.Array) -> jax.Array:
    """Smallest scale that represents amax; exact zero stays 0 ("no content")."""
    return jnp.where(amax > 0, jnp.maximum(amax / E4M3_MAX, _MIN_SCALE), 0.0)


def quantize_pages(pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantize whole pages [..., P, ps, Hkv, D] -> (e4m3fn pages, float32 scales [..., P, Hkv])."""
    x = pages.astype(jnp.float32)
    scales = _scale_for(jnp.max(jnp.abs(x), axis=(-3, -1)))
    return _to_e4m3(x / _safe(scales)[..., None, :, None]), scales


def dequantize_pages(pages: jax.Array, scales: jax.Array) -> jax.Array:
    """float32 values of e4m3fn pages [..., P, ps, Hkv, D] with scales [..., P, Hkv]."""
    return pages.astype(jnp.float32) * scales[..., None, :, None]


def quantize_pages_write(
    pages: jax.Array,
    scales: jax.Array,
    new: jax.Array,
    page: jax.Array,
    offset: jax.Array,
    *,
    layer: int | jax.Array | None = None,
    fixed_scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Write new tokens [T, Hkv, D] at (page[t], offset[t]); returns the updated (pages, scales).
    With `fixed_scale` every value is written at that scale (and every touched page's scale is
    it): no page is requantized, so the stored bits do not depend on the grouping of writes.

    Without `layer`, `pages` is one pool [P, ps, Hkv, D] with `scales` [P, Hkv]; with it (may be
    traced), stacked pools [L, P, ps, Hkv, D] with scales [L, P, Hkv] and only layer `layer` is
    touched. Pages are only updated by scatters (`.at[...].set`), so a donated pool stays in place.
    Several tokens may hit the same page (a prefill chunk): every per-page quantity is computed
    once per page and gathered per token, so duplicate scatters write identical values.
    """
    lead = () if layer is None else (layer,)
    if fixed_scale is not None:
        s = jnp.float32(fixed_scale)
        pages = pages.at[(*lead, page, offset)].set(_to_e4m3(new.astype(jnp.float32) / s))
        return pages, scales.at[(*lead, page)].set(s)
    num_pages = pages.shape[len(lead)]
    old_scales = scales[lead] if lead else scales  # [P, Hkv]: small, sliced freely
    new = new.astype(jnp.float32)

    fresh = jnp.zeros(num_pages, bool).at[page].max(offset == 0)  # [P]
    base = jnp.where(fresh[:, None], 0.0, old_scales)
    page_scales = base.at[page].max(_scale_for(jnp.max(jnp.abs(new), axis=-1)))  # [P, Hkv]

    s_new = page_scales[page]  # [T, Hkv]
    ratio = jnp.where(s_new > 0, base[page] / _safe(s_new), 0.0)  # 0 on a fresh page: zero it
    # The touched pages' old values, gathered apart from the scatters below: fused into the
    # scatter, the gather would read the buffer the scatter writes, and XLA:GPU then copies the
    # whole pool (twice per layer: measured on the H200) to keep the scatter in place.
    old = lax.optimization_barrier(pages[(*lead, page)]).astype(jnp.float32)  # [T, ps, Hkv, D]
    pages = pages.at[(*lead, page)].set(_to_e4m3(old * ratio[:, None, :, None]))
    pages = pages.at[(*lead, page, offset)].set(_to_e4m3(new / _safe(s_new)[..., None]))
    scales = scales.at[lead].set(page_scales) if lead else page_scales
    return pages, scales
