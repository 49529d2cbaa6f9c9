"""Cheap integrity checks of weight arrays, reduced on the device: checksums and finiteness.

Hashing a 16 GB checkpoint on the host would cost more than loading it. Instead each array's bits
are viewed as unsigned words (one per element, or two per 64-bit element) and reduced on the
device(s) to a few scalars, so checking an array moves only those scalars to the host:

- `sum`: the words' sum mod 2**32. Any one changed word changes it.
- `weighted_sum`: the sum of word * (2*i + 1) mod 2**32 over the words' linear index i. Odd
  weights are invertible mod 2**32, so this too sees any one changed word, and it also sees words
  that moved (swapped blocks, a transposed write), which `sum` cannot.
- `nonfinite`: how many NaN/inf values a floating array holds (0 for integer arrays).

Integer addition mod 2**32 does not depend on the order of the terms, so the checksums are the
same bit for bit on any mesh: a checkpoint saved on one device verifies when restored onto eight.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_UNSIGNED = {2: jnp.uint2, 4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}


class ArrayStats(NamedTuple):
    sum: int
    weighted_sum: int
    nonfinite: int

    def checksums(self) -> dict[str, int]:
        return {"sum": self.sum, "weighted_sum": self.weighted_sum}


def param_path(keypath: tuple[Any, ...]) -> str:
    """`layers[3].w_qkv` for a key path of `tree_flatten_with_path` (the names the HF loader's
    errors use); a quantized weight's arrays read `layers[3].w_qkv.arrays.scales`."""
    out = ""
    for key in keypath:
        if isinstance(key, jax.tree_util.DictKey):
            out += f".{key.key}"
        elif isinstance(key, jax.tree_util.GetAttrKey):
            out += f".{key.name}"
        elif isinstance(key, jax.tree_util.SequenceKey):
            out += f"[{key.idx}]"
        else:
            out += jax.tree_util.keystr((key,))
    return out.removeprefix(".")


def _words(x: jax.Array) -> jax.Array:
    """x's bits as uint32 words: one per element (narrower types zero-extended), two per 64-bit
    element (a trailing axis of 2)."""
    bits = jax.dtypes.itemsize_bits(x.dtype)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if bits == 64:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if bits not in _UNSIGNED:
        raise TypeError(f"no checksum for dtype {x.dtype} ({bits} bits)")
    return lax.bitcast_convert_type(x, _UNSIGNED[bits]).astype(jnp.uint32)


def _linear_index(shape: tuple[int, ...]) -> jax.Array:
    """Row-major linear index of every element, mod 2**32, built from iotas (so a sharded array is
    never reshaped, which could move its shards)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index += lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _nonfinite(x: jax.Array) -> jax.Array:
    # float32 counts never wrap to 0 (an int32 count of 2**32 NaNs would).
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.float32(0)
    return jnp.sum(~jnp.isfinite(x), dtype=jnp.float32)


@jax.jit
def _stats(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    words = _words(x)
    weights = _linear_index(words.shape) * jnp.uint32(2) + jnp.uint32(1)
    return (
        jnp.sum(words, dtype=jnp.uint32),
        jnp.sum(words * weights, dtype=jnp.uint32),
        _nonfinite(x),
    )


count_nonfinite = jax.jit(_nonfinite)
"""Device scalar: the number of NaN/inf values of `x` (0 for integer dtypes)."""


def array_stats(arrays: list[jax.Array]) -> list[ArrayStats]:
    """`ArrayStats` of each array: the reductions are dispatched for all, then their scalars come
    to the host in one transfer."""
    host = jax.device_get([_stats(x) for x in arrays])
    return [ArrayStats(int(s), int(w), int(n)) for s, w, n in host]
