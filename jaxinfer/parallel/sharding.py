"""Logical axis names -> mesh axes.

Every weight and cache array declares logical axes (`"embed"`, `"heads"`, ...); a rules table maps
them to mesh axes. Changing the parallelism is changing the table, not the model code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Tensor parallelism over a "model" mesh axis; "data" shards the batch. Unlisted axes replicate.
DEFAULT_RULES: Mapping[str, str | None] = {
    "vocab": "model",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
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
    """A mesh over `devices` (default: all), e.g. `{"data": 1, "model": 8}`; default all on model."""
    devices = list(devices if devices is not None else jax.devices())
    shape = dict(shape or {"data": 1, "model": len(devices)})
    if int(np.prod(list(shape.values()))) != len(devices):
        raise ValueError(f"mesh shape {shape} does not cover {len(devices)} devices")
    return Mesh(np.array(devices).reshape(tuple(shape.values())), tuple(shape.keys()))


def named_sharding(
    mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int], rules=DEFAULT_RULES
) -> NamedSharding:
    """Sharding for one array; an axis whose size the mesh axis does not divide is replicated."""
    spec = list(logical_to_pspec(axes, rules))
    for i, mesh_axis in enumerate(spec):
        if mesh_axis is not None and shape[i] % mesh.shape[mesh_axis]:
            spec[i] = None
    return NamedSharding(mesh, PartitionSpec(*spec))
