"""Test-only parts that plug into the spine's seams: a weight format, an FFN kind, a proposer.

Each is the smallest real user of its seam, so the tests that use it fail if the seam does:
- `ChannelScaled`: values [*in, *out] times one fp32 scale per output channel (a weight format,
  `jaxinfer.quant`), named "test_channel_scaled". Importing this module does not register it:
  `registered_format` does for a `with` block (conftest's `channel_scaled_format` fixture, for
  the modules that use it), so `WEIGHT_FORMATS` holds it only while such tests run, and tests
  that parametrize over the formats take `jaxinfer_formats()`;
- "test_split_dense" (`FFN_BLOCKS`): the dense SwiGLU with separate gate and up weights, so a
  layer of this kind computes what a dense layer with the fused weight does;
- `KnownTokens`: a proposer that drafts known continuations, some of them deliberately wrong
  (`wrong_every`), on the host and on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.proposer import Proposer
from jaxinfer.models.ffn import FFN_BLOCKS, FfnBlock
from jaxinfer.models.layers import linear, scale_rows
from jaxinfer.models.spec import ParamSpec, linear_spec
from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight, WeightFormat, register_format

# -- a weight format -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelScaled(WeightFormat):
    """w = values * scales, scales [*out] fp32 (one per output channel), values in w's dtype."""

    def part_specs(self, spec: ParamSpec) -> dict[str, ParamSpec]:
        out_shape, out_axes = spec.shape[spec.in_dims :], spec.axes[spec.in_dims :]
        return {
            "values": dataclasses.replace(spec, scale=1.0),  # (random init: scales 1/sqrt(fan_in))
            "scales": ParamSpec(out_shape, jnp.float32, out_axes, "normal", spec.scale),
        }

    def quantize(self, w: jax.Array, in_dims: int) -> dict[str, jax.Array]:
        amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=tuple(range(in_dims)))
        scales = jnp.where(amax > 0, amax, 1.0)
        return {"values": (w / scales).astype(w.dtype), "scales": scales}

    def dequantize(self, qw: QuantizedWeight) -> jax.Array:
        values = qw.arrays["values"]
        return (values.astype(jnp.float32) * qw.arrays["scales"]).astype(values.dtype)

    def matmul(self, x: jax.Array, qw: QuantizedWeight) -> jax.Array:
        y = linear(x, qw.arrays["values"], qw.in_dims)
        return (y.astype(jnp.float32) * qw.arrays["scales"]).astype(y.dtype)


CHANNEL_SCALED = ChannelScaled("test_channel_scaled")


@contextlib.contextmanager
def registered_format(fmt: WeightFormat) -> Iterator[WeightFormat]:
    """`fmt` in `WEIGHT_FORMATS` (so configs can name it) for the `with` block only. A name
    registered already is refused: a test format must not shadow another, nor outlive its block."""
    if fmt.name in WEIGHT_FORMATS:
        raise ValueError(f"weight format {fmt.name!r} is registered already")
    register_format(fmt)
    try:
        yield fmt
    finally:
        del WEIGHT_FORMATS[fmt.name]


def defined_by_jaxinfer(fmt: WeightFormat) -> bool:
    """Whether the format's class is one of the jaxinfer package's (not a test's)."""
    module = type(fmt).__module__
    return module == "jaxinfer" or module.startswith("jaxinfer.")


def jaxinfer_formats() -> list[str]:
    """The names of the registered formats jaxinfer defines, sorted: what tests parametrize over,
    so that a format registered by a test (or leaked by one) cannot add cases."""
    return sorted(name for name, fmt in WEIGHT_FORMATS.items() if defined_by_jaxinfer(fmt))


# -- an FFN kind -----------------------------------------------------------------------------------

SPLIT_DENSE_TRACES = []  # one entry per trace of the block's function (a Python side effect)


def _split_specs(cfg) -> dict[str, ParamSpec]:
    e, f, w = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_param_dtype
    return {
        "w_gate": linear_spec((e, f), w, ("embed", "mlp")),
        "w_up": linear_spec((e, f), w, ("embed", "mlp")),
        "w_down": linear_spec((f, e), w, ("mlp", "embed")),
    }


def _split_apply(cfg, p, x, row_scale=None, ctx=None):
    SPLIT_DENSE_TRACES.append(x.shape)
    gate = scale_rows(linear(x, p["w_gate"]), row_scale, 1)
    up = scale_rows(linear(x, p["w_up"]), row_scale, 1)
    return linear(jax.nn.silu(gate) * up, p["w_down"]), None


FFN_BLOCKS["test_split_dense"] = FfnBlock(_split_specs, _split_apply)


def split_layer(layer: dict) -> dict:
    """A dense layer's params as a test_split_dense layer's (same function)."""
    out = {k: v for k, v in layer.items() if k != "w_gate_up"}
    out["w_gate"], out["w_up"] = layer["w_gate_up"][:, 0], layer["w_gate_up"][:, 1]
    return out


def expert_specs(cfg, num_experts: int = 4) -> dict[str, ParamSpec]:
    """Stacked expert weights [X, ...] on the logical axis "expert" (for sharding tests)."""
    e, f, w = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_param_dtype
    scale = 1 / math.sqrt(e)
    return {
        "router": linear_spec((e, num_experts), w, ("embed", None)),
        "w_experts": ParamSpec((num_experts, e, f), w, ("expert", "embed", "mlp"), "normal", scale),
    }


FFN_BLOCKS["test_experts"] = FfnBlock(
    expert_specs, lambda cfg, p, x, r=None, ctx=None: (jnp.zeros_like(x), None)
)

# -- a proposer ------------------------------------------------------------------------------------


class KnownTokens(Proposer):
    """Drafts the known continuation of a prompt: for a sequence of n tokens, tokens n .. n +
    gamma - 1 of prompt + continuation, where every token at a position p with
    `p % wrong_every == 1` is replaced by a wrong one, so verifications accept some drafts and
    reject others. The device form holds each row's (altered) tokens in a table (the fed tokens
    do not change it: `follow` is the default). No pool."""

    def __init__(self, references: list[tuple[list[int], list[int]]], gamma: int,
                 vocab_size: int, wrong_every: int = 3, on_device: bool = True,
                 max_len: int = 512):  # fmt: skip
        self.num_draft_tokens, self.on_device, self.max_len = gamma, on_device, max_len
        self._table = {}
        for prompt, continuation in references:
            drafts = list(prompt) + list(continuation)
            for p in range(len(prompt), len(drafts)):
                if wrong_every and p % wrong_every == 1:
                    drafts[p] = (drafts[p] + 1) % vocab_size
            self._table[tuple(prompt)] = drafts
        self.proposed = 0

    def _drafts(self, seq) -> list[int]:
        return self._table.get(tuple(seq.prompt_token_ids), [])

    def propose(self, seq) -> list[int]:
        out = self._drafts(seq)[seq.num_tokens : seq.num_tokens + self.num_draft_tokens]
        self.proposed += len(out)
        return out

    def device_state(self, seqs, rows: int) -> np.ndarray:
        table = np.zeros((rows, self.max_len), np.int32)
        for i, seq in enumerate(seqs):
            ref = self._drafts(seq)[: self.max_len]
            table[i, : len(ref)] = ref
        return table

    def draft(self, state, rnd, draft_params, pool):
        cols = rnd.positions[:, None] + 1 + jnp.arange(self.num_draft_tokens)
        cols = jnp.clip(cols, 0, state.shape[1] - 1)
        return jnp.take_along_axis(state, cols, axis=1), state, pool, None
