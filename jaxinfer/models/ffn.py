"""FFN blocks, one per kind a layer may have (`ModelConfig.ffn_kinds`): the swap point for MoE.

An `FfnBlock` is its weights' specs and its function. The function's input is the normed hidden
`x * row_scale[..., None]` passed in two parts (see `layers.deferred_rms_norm`): a block whose
first op is a row-wise matmul applies the scale to that matmul's output; one whose first op is
not (a router's softmax over experts is one) multiplies it in first. Stacked expert weights
[num_experts, ...] take the logical axis "expert" (sharded on the mesh's "expert" axis). It
returns (output, rows per expert [X] int32 or None): the MoE block's load, which the engine's
step metrics report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.layers import linear, scale_rows
from jaxinfer.models.moe import moe_ffn, moe_ffn_specs
from jaxinfer.models.numerics import DEFAULT_NUMERICS, Numerics
from jaxinfer.models.param_spec import ParamSpec, linear_spec


@dataclass(frozen=True)
class FfnContext:
    """What an FFN block may need beyond its input: which rows are real tokens (`valid` [T]
    bool; None: all; padding rows route to no expert) and the mesh whose "expert" axis holds
    the experts (None: all of them on every device), the grouped matmul's backend
    ("xla" or "pallas": `moe.resolve_moe_backend`), and the block's `numerics`."""

    valid: jax.Array | None = None
    expert_mesh: Any = None
    moe_backend: str = "xla"
    numerics: Numerics = DEFAULT_NUMERICS


@dataclass(frozen=True)
class FfnBlock:
    specs: Callable[[ModelConfig], dict[str, ParamSpec]]
    # (cfg, layer params, x, row_scale or None, FfnContext or None) -> (output [..., E],
    # rows per expert [X] int32 or None)
    apply: Callable[..., tuple[jax.Array, jax.Array | None]]


def dense_ffn_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """`w_gate_up` [E, 2, F] (gate then up: one matmul of N = 2F; sharding "mlp" splits both
    alike) and `w_down` [F, E]."""
    e, f, w = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_param_dtype
    specs = {
        "w_gate_up": linear_spec((e, 2, f), w, ("embed", None, "mlp"), 1),
        "w_down": linear_spec((f, e), w, ("mlp", "embed"), 1),
    }
    if cfg.mlp_bias:
        specs["b_gate_up"] = ParamSpec((2, f), w, (None, "mlp"), "zeros")
        specs["b_down"] = ParamSpec((e,), w, ("embed",), "zeros")
    return specs


def dense_ffn(
    cfg: ModelConfig,
    p: dict,
    x: jax.Array,
    row_scale: jax.Array | None = None,
    numerics: Numerics = DEFAULT_NUMERICS,
) -> jax.Array:
    """SwiGLU: down(silu(h @ gate) * (h @ up)) of h = x * row_scale, gate and up as one matmul with
    the fused `w_gate_up`; the row scale is applied to that matmul's output."""
    gate_up = scale_rows(linear(x, p["w_gate_up"], numerics=numerics), row_scale, 2)
    if cfg.mlp_bias:
        gate_up = gate_up + p["b_gate_up"]
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    out = linear(jax.nn.silu(gate) * up, p["w_down"], numerics=numerics)
    if cfg.mlp_bias:
        out = out + p["b_down"]
    return out


def _dense_block(cfg, p, x, row_scale=None, ctx=None):
    return dense_ffn(cfg, p, x, row_scale, DEFAULT_NUMERICS if ctx is None else ctx.numerics), None


FFN_BLOCKS: dict[str, FfnBlock] = {
    "dense": FfnBlock(dense_ffn_specs, _dense_block),
    "moe": FfnBlock(moe_ffn_specs, moe_ffn),
}
