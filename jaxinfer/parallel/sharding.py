"""Logical axis names -> mesh axes, and where an engine's arrays live on its mesh.

Every weight and cache array declares logical axes (`"embed"`, `"heads"`, ...); a rules table maps
them to mesh axes. Changing the parallelism is changing the table (and the mesh), not the model
code. A rule naming a mesh axis the mesh lacks, or that does not divide the array, replicates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The mesh axes an engine may have: "data" (batch), "model" (tensor parallel: heads, FFN, vocab),
# "expert" (expert parallel: stacked experts).
MESH_AXES = ("data", "model", "expert")
# Unlisted logical axes replicate.
DEFAULT_RULES: Mapping[str, str | None] = {
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "expert": "expert",
    "embed": None,
    "head_dim": None,
    "layers": None,
    "pages": None,
    "batch": "data",
}


def logical_to_pspec(
    axes: Sequence[str | None], rules: Mapping[str, str | None] = DEFAULT_RULES
) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes; a mesh axis is used at most once."""
    used: set[str] = set()
    out: list[str | None] = []
    for name in axes:
        mesh_axis = rules.get(name) if name is not None else None
        if mesh_axis is not None and mesh_axis in used:
            mesh_axis = None
        if mesh_axis is not None:
            used.add(mesh_axis)
        out.append(mesh_axis)
    return PartitionSpec(*out)


def make_mesh(shape: Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A mesh of `shape` ({axis: size}, e.g. `{"data": 1, "model": 8}`) over the first
    prod(shape) of `devices` (default: all); no shape: all devices on "model"."""
    devices = list(devices if devices is not None else jax.devices())
    shape = dict(shape or {"data": 1, "model": len(devices)})
    n = math.prod(shape.values())
    if n > len(devices):
        raise ValueError(f"mesh {shape} needs {n} devices; {len(devices)} are visible")
    return Mesh(np.array(devices[:n]).reshape(tuple(shape.values())), tuple(shape.keys()))


def named_sharding(
    mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int], rules=DEFAULT_RULES
) -> NamedSharding:
    """Sharding for one array; an axis the mesh lacks or does not divide is replicated."""
    spec = list(logical_to_pspec(axes, rules))
    for i, mesh_axis in enumerate(spec):
        if mesh_axis is not None and (
            mesh_axis not in mesh.shape or shape[i] % mesh.shape[mesh_axis]
        ):
            spec[i] = None
    return NamedSharding(mesh, PartitionSpec(*spec))


def put_global(host: Any, sharding: NamedSharding) -> jax.Array:
    """A host array on `sharding`. On a mesh spanning several processes each process puts the
    slices its own devices hold (every process passes the same value): `jax.device_put` would
    first all-gather the value to check that, a collective per array (and a deadlock if the
    other processes are not putting it too)."""
    if not sharding.mesh.is_multi_process:
        return jax.device_put(host, sharding)
    host = np.asarray(host)
    host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@dataclass(frozen=True, eq=False)
class EngineShardings:
    """Where one engine's arrays live on its mesh, declared once.

    - params: by their logical axes (`param_specs`, `rules`);
    - KV pages: by KV head (`jaxinfer.kv.cache.KV_AXES`), so a device holds its heads' pages;
    - a mixed step's logits [S, K, V]: by vocab, as the LM head (`logits`), so sampling reduces
      them per shard (`parallel/vocab.py`);
    - batches (the ragged token batch, page tables, sampling parameters) and step outputs
      (sampled tokens, log-probs): replicated. Every device sees every token: a "data" axis
      replicates the step (data-parallel serving is `engine.data_parallel`'s replicas).
    """

    mesh: Mesh
    rules: Mapping[str, str | None] = field(default_factory=lambda: DEFAULT_RULES)

    @staticmethod
    def for_config(mesh_shape: Mapping[str, int], devices: Sequence | None = None):
        """The shardings of an engine whose config says `mesh: mesh_shape` (empty: one device)."""
        return EngineShardings(make_mesh(dict(mesh_shape) or {"data": 1, "model": 1}, devices))

    @property
    def device(self) -> jax.Device:
        """The mesh's first device (the kernels are built for its kind)."""
        return self.mesh.devices.flat[0]

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def put(self, x: Any) -> Any:
        """Host array(s) -> device, replicated over the mesh (batches, sampling parameters)."""
        if not self.mesh.is_multi_process:
            return jax.device_put(x, self.replicated)
        return jax.tree.map(lambda a: put_global(a, self.replicated), x)

    def of(self, axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        return named_sharding(self.mesh, axes, shape, self.rules)

    def logits(self, vocab_size: int) -> NamedSharding:
        """Logits [S, K, V]: by vocab (replicated where the LM head is: a vocabulary the model
        axis does not divide, or no model axis)."""
        return self.of((None, None, "vocab"), (1, 1, vocab_size))
