"""The decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3) as pure functions over param pytrees.

Two entry points share one layer function:
- `forward(params, cfg, tokens)`: whole sequences [B, L] with dense causal attention and no cache
  (training, parity checks).
- `forward_paged(params, cfg, batch, kv)`: a ragged batch of prefill chunks and decode tokens
  through the paged KV cache (the engine's step). Each sequence may score several new tokens, so
  speculative verification is the same call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.kv.cache import KVCache, token_slots
from jaxinfer.models.attention import (
    XLA_ATTENTION,
    AttentionConfig,
    causal_attention,
    write_kv_and_attend,
)
from jaxinfer.models.batch import RaggedBatch
from jaxinfer.models.config import LayerKind, ModelConfig
from jaxinfer.models.ffn import FFN_BLOCKS, FfnContext
from jaxinfer.models.layers import (
    apply_rope,
    deferred_rms_norm,
    linear,
    rms_norm,
    rms_scale,
    rope_attention_factor,
    rope_inv_freq,
    scale_rows,
)
from jaxinfer.models.numerics import DEFAULT_NUMERICS, Numerics
from jaxinfer.models.spec import Params
from jaxinfer.quant import QuantizedWeight

# attend(q, k, v, carry, layer, kind) -> (out, carry): how a layer's attention sees the sequence.
Attend = Callable[[jax.Array, jax.Array, jax.Array, Any, Any, LayerKind], tuple[jax.Array, Any]]
# layer_fn(layer params, x, carry, layer index, *, kind) -> (x, carry)
LayerFn = Callable[..., tuple[jax.Array, Any]]


def apply_layers(cfg: ModelConfig, layers: tuple[dict, ...], x: jax.Array, carry: Any,
                 layer_fn: LayerFn, taps: tuple[int, ...] = ()):  # fmt: skip
    """Run every decoder layer; `carry` (e.g. the KV cache) is threaded through and updated in
    place when donated. With `taps` (layer indices), also returns the residual stream after each
    of those layers, `tap_features` of them: (x, carry, feats [..., len(taps) * E]).

    The loop is unrolled over per-layer weight buffers, which the matmuls read directly: each
    weight is read once per step. A `lax.scan` over layer-stacked weights made XLA copy each
    layer's slice first (about 2x the weight traffic; docs/decisions.md) and was removed. Each layer runs as a nested jit
    with its index as data and its `LayerKind` static, so layers of one kind (and param structure)
    are traced and lowered once, not once per layer; XLA inlines the calls.
    """
    # Inside a trace only: called eagerly, a fresh jit of this closure would compile per call.
    traced = isinstance(x, jax.core.Tracer)
    step = jax.jit(layer_fn, static_argnames="kind") if traced else layer_fn
    tapped = {}
    for i, p in enumerate(layers):
        x, carry = step(p, x, carry, np.int32(i), kind=cfg.layer(i))
        if i in taps:
            tapped[i] = x
    if not taps:
        return x, carry
    return x, carry, tap_features([tapped[i] for i in taps], cfg.rms_norm_eps)


def tap_features(xs: list[jax.Array], eps: float) -> jax.Array:
    """Residual streams [..., E] of some layers as one feature [..., n E]: each RMS-normalised
    without a weight (the residual stream's scale grows with depth and has outlier channels;
    normalised, each layer weighs alike in the projection that reads them), concatenated."""
    return jnp.concatenate(
        [(x.astype(jnp.float32) * rms_scale(x, eps)[..., None]).astype(x.dtype) for x in xs], -1
    )


def decoder_layer(
    cfg: ModelConfig,
    p: dict,
    x: jax.Array,
    positions: jax.Array,
    attend: Attend,
    carry: Any,
    layer: Any,
    kind: LayerKind,
    ffn_ctx: FfnContext | None = None,
    numerics: Numerics = DEFAULT_NUMERICS,
) -> tuple[jax.Array, Any, jax.Array | None]:
    """Pre-norm attention + FFN block of kind `kind` on x [..., E] with positions [...]: (x,
    carry, the FFN's rows per expert [X] or None). `numerics`: of the norms and projections
    here (the FFN's are `ffn_ctx`'s, the attention's `attend`'s).

    Both norms are deferred (`deferred_rms_norm`): the row scale is applied to the outputs of the
    projections that follow them.
    """
    h, r = deferred_rms_norm(x, p["attn_norm"], cfg.rms_norm_eps, numerics)
    q, k, v = qkv_projection(cfg, p, h, r, numerics)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, numerics)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, numerics)
    inv_freq, attention_factor = rope_inv_freq(cfg), rope_attention_factor(cfg)
    q = apply_rope(q, positions, inv_freq, attention_factor)
    k = apply_rope(k, positions, inv_freq, attention_factor)
    o, carry = attend(q, k, v, carry, layer, kind)
    o = linear(o, p["wo"], in_dims=2, numerics=numerics)
    if cfg.o_bias:
        o = o + p["bo"]
    x = x + o
    h, r = deferred_rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps, numerics)
    out, load = FFN_BLOCKS[kind.ffn].apply(cfg, p, h, r, ffn_ctx)
    return x + out, carry, load


def qkv_projection(cfg: ModelConfig, p: dict, h: jax.Array, row_scale: jax.Array | None = None,
                   numerics: Numerics = DEFAULT_NUMERICS):  # fmt: skip
    """h [..., E] (times row_scale [...], when given) -> q [..., Hq, D], k and v [..., Hkv, D]: one
    matmul with the fused `w_qkv` [E, Hkv, G + 2, D] (per KV head: its G query heads, its key, its
    value; see `layer_specs`)."""
    g = cfg.q_per_kv
    qkv = scale_rows(linear(h, p["w_qkv"], numerics=numerics), row_scale, 3)
    if cfg.qkv_bias:
        qkv = qkv + p["b_qkv"]
    q = qkv[..., :g, :].reshape(*qkv.shape[:-3], cfg.num_heads, cfg.head_dim)
    return q, qkv[..., g, :], qkv[..., g + 1, :]


def embed(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    return params["embed"][tokens].astype(cfg.jnp_dtype)


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array,
                   numerics: Numerics = DEFAULT_NUMERICS) -> jax.Array:  # fmt: skip
    """Final-normed hidden states [..., E] -> fp32 logits [..., V] (tied or untied head)."""
    if cfg.tie_word_embeddings:
        head = params["embed"].T.astype(hidden.dtype)
        return linear(hidden, head, numerics=numerics).astype(jnp.float32)
    head = params["lm_head"]
    if not isinstance(head, QuantizedWeight):
        head = head.astype(hidden.dtype)
    return linear(hidden, head, numerics=numerics).astype(jnp.float32)


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Logits [B, L, V] of whole sequences tokens [B, L] (positions 0..L-1), no cache."""
    return compute_logits(params, cfg, forward_hidden(params, cfg, tokens))


def forward_hidden(params: Params, cfg: ModelConfig, tokens: jax.Array,
                   taps: tuple[int, ...] = ()):  # fmt: skip
    """Final-normed hidden states [B, L, E] (the LM head's input) of whole sequences [B, L];
    with `taps`, (those, the tapped layers' `tap_features` [B, L, len(taps) E])."""
    x = embed(params, cfg, tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

    def attend(q, k, v, carry, layer, kind):
        return causal_attention(q, k, v, sliding_window=kind.sliding_window), carry

    def layer_fn(p, x, carry, layer, *, kind):
        return decoder_layer(cfg, p, x, positions, attend, carry, layer, kind)[:2]

    x, _, *feats = apply_layers(cfg, params["layers"], x, None, layer_fn, taps)
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return (hidden, feats[0]) if taps else hidden


def forward_paged(
    params: Params,
    cfg: ModelConfig,
    batch: RaggedBatch,
    kv: KVCache,
    *,
    attention: AttentionConfig = XLA_ATTENTION,
    expert_mesh: Any = None,
    moe_backend: str = "xla",
    return_expert_load: bool = False,
    numerics: Numerics = DEFAULT_NUMERICS,
    taps: tuple[int, ...] = (),
):
    """One step over a ragged batch: writes the new tokens' K/V, returns (final hidden [T, E],
    kv), and with `return_expert_load` the rows each expert of each layer took, [L, X] int32
    (zeros in dense layers; padding tokens are routed nowhere); with `taps` (layer indices), last,
    the tapped layers' `tap_features` [T, len(taps) E] (an EAGLE head's input). `expert_mesh`: a
    mesh with an "expert" axis over which the MoE layers' experts are sharded
    (`jaxinfer.parallel.expert`);
    `moe_backend`: their grouped matmuls' ("xla" or "pallas", `moe.resolve_moe_backend`).
    `numerics` (static): batch-invariant numerics make each token's hidden state a function of
    its own sequence alone (`models/numerics.py`).

    Take logits only at the rows you sample from (`compute_logits(params, cfg, hidden[rows])`):
    the vocabulary projection of every prefill row would cost more than the rest of the step.
    """
    page, offset = token_slots(
        batch.page_table, batch.query_start_loc, batch.positions, kv.page_size
    )
    x = embed(params, cfg, batch.tokens)

    def attend(q, k, v, kv, layer, kind):
        return write_kv_and_attend(
            q,
            k,
            v,
            kv,
            layer,
            batch,
            page,
            offset,
            sliding_window=kind.sliding_window,
            attention=attention,
            numerics=numerics,
        )

    num_tokens = batch.tokens.shape[0]
    valid = jnp.arange(num_tokens) < batch.query_start_loc[-1] if cfg.moe else None
    ctx = FfnContext(valid, expert_mesh, moe_backend, numerics)
    num_experts = cfg.moe.num_experts if cfg.moe else 1

    def layer_fn(p, x, carry, layer, *, kind):
        kv, loads = carry
        x, kv, load = decoder_layer(cfg, p, x, batch.positions, attend, kv, layer, kind, ctx,
                                    numerics)  # fmt: skip
        if load is not None:
            loads = lax.dynamic_update_index_in_dim(loads, load, layer, 0)
        return x, (kv, loads)

    loads = jnp.zeros((cfg.num_layers, num_experts), jnp.int32)
    x, (kv, loads), *feats = apply_layers(cfg, params["layers"], x, (kv, loads), layer_fn, taps)
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, numerics)
    return (hidden, kv, *([loads] if return_expert_load else []), *feats)


def last_token_rows(batch: RaggedBatch) -> jax.Array:
    """Row of each sequence's last new token (where its next token is sampled); [S] int32."""
    return jnp.maximum(batch.query_start_loc[1:] - 1, 0)
