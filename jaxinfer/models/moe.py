"""The MoE FFN block: a router, routed SwiGLU experts, an optional shared expert.

Weights (`moe_ffn_specs`), experts stacked on a leading axis with logical axis "expert":
- `router` [E, X] (plain, read in fp32), and `router_bias` [X] fp32 with `score_bias`;
- `w_expert_gate_up` [X, E, 2, F] (each expert's gate then up) and `w_expert_down` [X, F, E];
- with a shared expert: `w_shared_gate_up` [E, 2, S], `w_shared_down` [S, E] and, gated,
  `w_shared_gate` [E, 1].

Dispatch on one device (`experts.routed_experts`) is dropless with static shapes: the T * k (token,
choice) rows are sorted by expert, the experts run as two grouped matmuls over those rows
(`experts.grouped_matmul`, whose group sizes are data: no capacity, no bucket, no token dropped), and the
rows are unsorted and summed with their weights. The grouped matmul has two backends
(`MOE_BACKENDS`): `xla` (`lax.ragged_dot`, runs anywhere) and `pallas` (the Mosaic GPU kernel of
`pallas_kernels.moe`, Hopper only, several times ragged_dot's speed: docs/decisions.md);
`resolve_moe_backend` picks. Padding tokens
(past the batch's real tokens) route to no expert: their rows sort last and fall outside every
group, so they cost no expert compute and do not count in the load. With an expert-parallel mesh the same rows travel to the
devices holding their experts and back (`jaxinfer.parallel.expert`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.models.config import ModelConfig, MoeConfig
from jaxinfer.models.experts import invariant_routed_experts, routed_experts
from jaxinfer.models.layers import linear, scale_rows
from jaxinfer.models.numerics import DEFAULT_NUMERICS, Numerics, row_sum, softmax
from jaxinfer.models.param_spec import ParamSpec, linear_spec
from jaxinfer.parallel.expert import expert_parallel_experts
from pallas_kernels.moe.grouped_mgpu import DTYPES as KERNEL_DTYPES

MOE_BACKENDS = ("auto", "xla", "pallas")


def moe_ffn_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    m, e, w = cfg.moe, cfg.hidden_size, cfg.jnp_param_dtype
    x, f = m.num_experts, m.expert_size
    std = 1.0 / math.sqrt(e)
    specs = {
        "router": ParamSpec((e, x), w, ("embed", None), "normal", std),
        # Expert stacks are not `linear` weights (in_dims 0): the grouped matmul reads them.
        "w_expert_gate_up": ParamSpec(
            (x, e, 2, f), w, ("expert", "embed", None, "mlp"), "normal", std
        ),
        "w_expert_down": ParamSpec(
            (x, f, e), w, ("expert", "mlp", "embed"), "normal", 1.0 / math.sqrt(f)
        ),
    }
    if m.score_bias:
        # fp32 whatever param_dtype is: it reorders nearly equal scores (HF keeps it fp32 too).
        # Random init draws it like a trained one (nonzero), so tests see it change selection.
        specs["router_bias"] = ParamSpec((x,), jnp.dtype(jnp.float32), (None,), "normal", 0.1)
    s = m.shared_expert_size
    if s:
        specs["w_shared_gate_up"] = linear_spec((e, 2, s), w, ("embed", None, "mlp"), 1)
        specs["w_shared_down"] = linear_spec((s, e), w, ("mlp", "embed"), 1)
    if m.shared_expert_gate:
        specs["w_shared_gate"] = ParamSpec((e, 1), w, ("embed", None), "normal", std)
    return specs


def route(m: MoeConfig, p: dict, h: jax.Array,
          numerics: Numerics = DEFAULT_NUMERICS) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Each token's experts and their weights: (weights [T, k] fp32, experts [T, k] int32) of h
    [T, E] (already normed), as transformers' routers compute them (see `MoeConfig`)."""
    if numerics.batch_invariant:
        logits = linear(h.astype(jnp.float32), p["router"].astype(jnp.float32), numerics=numerics)
    else:
        logits = jnp.dot(h.astype(jnp.float32), p["router"].astype(jnp.float32))
    scores = softmax(logits, numerics) if m.scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores + p["router_bias"] if m.score_bias else scores
    if m.num_groups > 1:
        t, per_group = h.shape[0], m.num_experts // m.num_groups
        grouped = choice.reshape(t, m.num_groups, per_group)
        group_score = lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]: its two best experts
        _, top_groups = lax.top_k(group_score, m.topk_groups)
        keep = jnp.zeros((t, m.num_groups), bool).at[jnp.arange(t)[:, None], top_groups].set(True)
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, m.num_experts)
    _, experts = lax.top_k(choice, m.experts_per_token)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if m.norm_topk_prob:
        weights = weights / (row_sum(weights, numerics, keepdims=True) + 1e-20)
    return weights * m.routed_scaling_factor, experts.astype(jnp.int32)


def kernel_unfit(cfg: ModelConfig) -> str | None:
    """Why the Pallas grouped matmul cannot run this model's experts (None: it can): it takes
    bf16/f16 activations and K, N multiples of 64 (hidden_size, and 2 x / 1 x expert_size)."""
    if jnp.dtype(cfg.dtype) not in KERNEL_DTYPES:
        return f"the kernel takes bfloat16 or float16 activations, not {cfg.dtype}"
    for name, size in (("hidden_size", cfg.hidden_size), ("moe.expert_size", cfg.moe.expert_size)):
        if size % 64:
            return f"the kernel needs {name} a multiple of 64, got {size}"
    return None


def resolve_moe_backend(name: str, cfg: ModelConfig, device: jax.Device | None = None) -> str:
    """`xla` or `pallas` for engine.moe_backend `name` (MOE_BACKENDS): `auto` is the kernel on a
    GPU when it fits the model (`kernel_unfit`), else XLA; `pallas` that does not fit raises,
    naming the key. A dense model resolves to `xla` (unused)."""
    if name not in MOE_BACKENDS:
        raise ValueError(f"engine.moe_backend={name!r} is invalid: must be one of "
                         f"{', '.join(MOE_BACKENDS)}")  # fmt: skip
    if cfg.moe is None:
        return "xla"
    why = kernel_unfit(cfg)
    if name == "auto":
        platform = (device or jax.devices()[0]).platform
        return "pallas" if platform == "gpu" and why is None else "xla"
    if name == "pallas" and why is not None:
        raise ValueError(f"engine.moe_backend='pallas' cannot serve this model: {why}")
    return name


def moe_ffn(cfg: ModelConfig, p: dict, x: jax.Array, row_scale: jax.Array | None = None,
            ctx=None) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """(output [..., E], rows per expert [X] int32) of the MoE FFN on x [..., E] (times
    row_scale). `ctx` (`ffn.FfnContext`): which tokens are real, the expert-parallel mesh, the
    grouped matmul's backend and the numerics (batch-invariant: `invariant_routed_experts`, on
    one device)."""
    m = cfg.moe
    shape = x.shape
    numerics = DEFAULT_NUMERICS if ctx is None else ctx.numerics
    h = scale_rows(x, row_scale, 1).reshape(-1, shape[-1])
    weights, experts = route(m, p, h, numerics)
    valid = None if ctx is None else ctx.valid
    if valid is not None:
        experts = jnp.where(valid.reshape(-1, 1), experts, m.num_experts)
    mesh = None if ctx is None else ctx.expert_mesh
    backend = "xla" if ctx is None else ctx.moe_backend
    if numerics.batch_invariant:
        if mesh is not None or backend != "xla":
            raise ValueError("batch-invariant experts run on one device with the xla backend")
        out, sizes = invariant_routed_experts(h, weights, experts, p["w_expert_gate_up"],
                                              p["w_expert_down"])  # fmt: skip
    elif mesh is not None:
        out, sizes = expert_parallel_experts(h, weights, experts, p["w_expert_gate_up"],
                                             p["w_expert_down"], mesh, backend)  # fmt: skip
    else:
        out, sizes = routed_experts(h, weights, experts, p["w_expert_gate_up"],
                                    p["w_expert_down"], backend)  # fmt: skip
    if m.shared_expert_size:
        gate_up = linear(h, p["w_shared_gate_up"], numerics=numerics)
        act = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
        shared = linear(act, p["w_shared_down"], numerics=numerics)
        if m.shared_expert_gate:
            shared = jax.nn.sigmoid(linear(h, p["w_shared_gate"], numerics=numerics)) * shared
        out = out + shared.astype(jnp.float32)
    return out.astype(x.dtype).reshape(shape), sizes
