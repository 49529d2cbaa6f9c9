"""Vocab-parallel reductions: a row's max / argmax, log-normaliser, one entry and top-k over
logits sharded by vocab on the mesh's "model" axis, without gathering the rows.

Each function below runs inside a `shard_map` over "model" on one device's slice of the
vocabulary, logits [R, V / T] whose first column is global token id `start`; only per-row
results ([R] or [R, T * k]) cross devices (pmax, pmin, psum, all_gather). Each returns what the
same function of the whole row would, on every device:

- `argmax`: ties go to the lowest global id, as `jnp.argmax` breaks them (each shard's own
  argmax is its lowest local id among its maxima; the lowest id among the shards that hold the
  global max wins);
- `top_k`: each shard's top k, gathered in shard order (T * k per row), then the top k of those;
  `lax.top_k` puts equal values in index order, and shard order is global id order, so ties
  break as `lax.top_k` on the whole row breaks them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.parallel.sharding import DEFAULT_RULES, named_sharding

AXIS = "model"


def vocab_mesh(mesh: Mesh | None, vocab_size: int, rules=DEFAULT_RULES) -> Mesh | None:
    """The mesh when the rules shard the vocabulary over its "model" axis (more than one device,
    dividing `vocab_size`), else None: the logits are then whole on every device (a vocabulary the
    axis does not divide is replicated, as `named_sharding` replicates the LM head)."""
    if mesh is None or dict(mesh.shape).get(AXIS, 1) == 1:
        return None
    spec = named_sharding(mesh, ("vocab",), (vocab_size,), rules).spec
    return mesh if tuple(spec) == (AXIS,) else None


def shard_start(width: int) -> jax.Array:
    """Global id of this device's first vocabulary column (inside the shard_map)."""
    return jax.lax.axis_index(AXIS) * width


def argmax(x: jax.Array, start: jax.Array) -> jax.Array:
    """Global argmax [R] of the rows whose slice [R, V / T] this device holds."""
    local_max = jnp.max(x, axis=-1)
    best = jax.lax.pmax(local_max, AXIS)
    ids = jnp.argmax(x, axis=-1).astype(jnp.int32) + start
    return jax.lax.pmin(jnp.where(local_max == best, ids, jnp.iinfo(jnp.int32).max), AXIS)


def log_normalizer(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(row max [R], log sum exp(x - max) [R]) of the whole rows: log_softmax(x) is
    (x - max) - that, as `jax.nn.log_softmax` computes it."""
    m = jax.lax.pmax(jnp.max(x, axis=-1), AXIS)
    return m, jnp.log(jax.lax.psum(jnp.sum(jnp.exp(x - m[:, None]), axis=-1), AXIS))


def pick(x: jax.Array, ids: jax.Array, start: jax.Array) -> jax.Array:
    """x[r, ids[r]] [R] for global ids [R]: the one device holding each adds it, the others 0."""
    local = ids - start
    inside = (local >= 0) & (local < x.shape[-1])
    got = jnp.take_along_axis(x, jnp.clip(local, 0, x.shape[-1] - 1)[:, None], axis=-1)[:, 0]
    return jax.lax.psum(jnp.where(inside, got, 0.0), AXIS)


def top_k(x: jax.Array, k: int, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(top k values [R, k], their global ids [R, k]) of the whole rows, descending."""
    values, ids = jax.lax.top_k(x, min(k, x.shape[-1]))
    values = jax.lax.all_gather(values, AXIS, axis=1, tiled=True)  # [R, T * k], shard order
    ids = jax.lax.all_gather(ids.astype(jnp.int32) + start, AXIS, axis=1, tiled=True)
    top, where = jax.lax.top_k(values, k)
    return top, jnp.take_along_axis(ids, where, axis=-1)
