"""Expert parallelism: an MoE layer's experts sharded over the mesh's "expert" axis.

With n devices on the axis, device d holds experts [d X/n, (d + 1) X/n) (the "expert" logical
axis of the stacked weights, `DEFAULT_RULES`). `expert_parallel_experts` runs in a `shard_map`
over that axis:

1. Tokens split: device d takes tokens [d T/n, (d + 1) T/n) (padded to a multiple of n) of the
   routed batch, i.e. its r = T/n * k (token, choice) rows, sorted by expert and so by owner.
2. Counts first: each device's rows per peer go to every device (`all_gather`, n x n ints), so
   all agree on the most rows any device sends any other.
3. Dispatch: rows are packed into a static buffer [n, C, E] per device, C the smallest capacity
   bucket (`capacity_buckets`: 2r/n, 4r/n, ..., r) that holds that maximum, and exchanged with
   one `all_to_all`. The last bucket, r, holds every row a device has, so no token is ever
   dropped: a skewed step takes a bigger bucket (each bucket is one branch of a `lax.switch`,
   compiled once; the branch is picked on the device from the exchanged counts).
4. The receiver sorts what it got by its local expert and runs the grouped matmuls.
5. Combine: the outputs go back by the inverse `all_to_all`, each row to its place, and each
   token sums its k rows with their weights. The result is all-gathered to every device.

Attention stays replicated over the axis here (every device computes every token's attention):
the all-gather of step 5 is where an attention data-parallel over the group would shard instead.

Why `all_to_all` of padded buckets and not `lax.ragged_all_to_all` (which moves only the rows):
on 8xB200, ragged_all_to_all was measured at about 2% of NVLink bandwidth
(openxla/xla#33386), and a bucketed all_to_all is a plain NCCL all-to-all. We have not yet
measured either on several H200s.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxinfer.models.experts import combine, expert_ffn, sort_rows, unsort

AXIS = "expert"


def expert_axis_size(mesh) -> int:
    """Devices on `mesh`'s "expert" axis (1 without one)."""
    return int(mesh.shape.get(AXIS, 1)) if mesh is not None else 1


def capacity_buckets(rows: int, n: int) -> tuple[int, ...]:
    """Static per-peer buffer sizes for a device with `rows` rows and n peers: 2r/n, 4r/n, ...
    up to r (rounded up to multiples of 8), so a balanced step sends about twice what it must
    and the largest bucket holds every row."""
    caps, c = [], 2 * rows / n
    while c < rows:
        caps.append(min(rows, 8 * math.ceil(c / 8)))
        c *= 2
    return tuple(sorted({*caps, rows}))


def expert_parallel_experts(h, weights, experts, w_gate_up, w_down, mesh, backend="xla"):
    """`experts.routed_experts` with the experts sharded over `mesh`'s "expert" axis: (outputs
    [T, E] fp32, rows per expert [X] int32), replicated. experts [T, k] may hold X (no expert)."""
    n = expert_axis_size(mesh)
    num_experts = w_gate_up.shape[0]
    if num_experts % n:
        raise ValueError(f"{num_experts} experts do not split over the mesh's {n} expert devices")
    t = h.shape[0]
    pad = -t % n
    if pad:  # padding tokens route nowhere
        h = jnp.pad(h, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=num_experts)
    local = partial(_local, n=n, num_experts=num_experts, backend=backend)
    out, sizes = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS), P(AXIS)),
        out_specs=(P(AXIS), P()),
        check_vma=False,
    )(h, weights, experts, w_gate_up, w_down)
    return out[:t], sizes


def _local(h, weights, experts, w_gate_up, w_down, *, n: int, num_experts: int, backend: str):
    """One device's part: its tokens h [t, E] and their routing, its experts' weights."""
    t, k = experts.shape
    rows = t * k
    per_device = num_experts // n
    order, sorted_experts, _ = sort_rows(experts, num_experts)
    peer = sorted_experts // per_device  # n: no expert (padding)
    counts = jnp.bincount(peer, length=n).astype(jnp.int32)  # rows to each peer
    first = jnp.cumsum(counts) - counts
    slot = jnp.arange(rows, dtype=jnp.int32) - first[jnp.minimum(peer, n - 1)]
    local_id = jnp.where(peer < n, sorted_experts % per_device, per_device)
    send_rows = h[order // k]
    all_counts = lax.all_gather(counts, AXIS)  # [n, n]: rows device i sends device j
    need = jnp.max(all_counts)
    caps = capacity_buckets(rows, n)

    def exchange(cap: int):
        # Pack: row i goes to peer[i] at slot[i]; padding rows (peer n) are dropped by the
        # scatter, and empty slots carry local id `per_device` (no expert).
        buf = jnp.zeros((n, cap, h.shape[1]), h.dtype).at[peer, slot].set(send_rows, mode="drop")
        ids = jnp.full((n, cap), per_device, jnp.int32).at[peer, slot].set(local_id, mode="drop")
        recv = lax.all_to_all(buf, AXIS, 0, 0).reshape(n * cap, -1)
        recv_ids = lax.all_to_all(ids, AXIS, 0, 0).reshape(-1)
        r_order = jnp.argsort(recv_ids, stable=True)
        sizes = jnp.bincount(recv_ids, length=per_device).astype(jnp.int32)
        y = expert_ffn(recv[r_order], sizes, w_gate_up, w_down, backend)
        y = unsort(y, r_order).reshape(n, cap, -1)
        back = lax.all_to_all(y, AXIS, 0, 0)  # back[p]: my rows' outputs from peer p
        got = back.at[peer, slot].get(mode="fill", fill_value=0)
        return jnp.where((peer < n)[:, None], got, 0)

    branch = jnp.searchsorted(jnp.asarray(caps), need)  # the smallest bucket that holds `need`
    y_sorted = lax.switch(branch, [partial(exchange, c) for c in caps])
    out = combine(y_sorted, order, weights)
    sizes = lax.psum(jnp.bincount(experts.reshape(-1), length=num_experts), AXIS)
    return out, sizes.astype(jnp.int32)
