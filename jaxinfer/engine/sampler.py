"""On-device sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Reproducibility: the key for a token is `fold_in(key(seed), position)`, a function of the request's
seed and the token's position only, so a seeded request samples the same tokens whatever batch it
shares, whichever slot it sits in, and after preemption and recompute.

Filters are applied in one descending sort of the (temperature-scaled) logits: keep rank < top_k,
then the smallest prefix whose renormalised probability mass reaches top_p (nucleus; Holtzman et
al. 2020), and tokens with p >= min_p * p_max (min-p sampling; Nguyen et al. 2024). Log-probs are of
the raw model distribution (before temperature and filters).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.request import SamplingParams


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters, [S] each; padding rows are greedy."""

    temperature: jax.Array  # f32; 0 = greedy
    top_k: jax.Array  # i32; 0 = off
    top_p: jax.Array  # f32; 1 = off
    min_p: jax.Array  # f32; 0 = off
    seed: jax.Array  # u32
    position: jax.Array  # i32: position of the token being sampled
    # Static (part of the compiled shape): whether any row samples. False compiles greedy only.
    # A host-side flag rather than `lax.cond` on the device: on a GPU a conditional copies its
    # predicate to the host, which blocked every step's dispatch until the step had run.
    filtered: bool = field(default=True, metadata=dict(static=True))

    @staticmethod
    def build(
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
        num_rows: int,
        put=jax.device_put,
    ) -> SamplingBatch:
        """Host-side packing (padding rows greedy); `put` moves the arrays to the device(s)."""
        n = len(params)
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        min_p = np.zeros(num_rows, np.float32)
        seed = np.zeros(num_rows, np.uint32)
        position = np.zeros(num_rows, np.int32)
        for i, p in enumerate(params):
            temperature[i], top_k[i] = p.temperature, p.top_k_or_off
            top_p[i], min_p[i] = p.top_p, p.min_p
        seed[:n] = np.asarray(seeds, np.uint64) & 0xFFFFFFFF
        position[:n] = positions
        arrays = put((temperature, top_k, top_p, min_p, seed, position))
        return SamplingBatch(*arrays, bool((temperature > 0).any()))


def sample(
    logits: jax.Array, sb: SamplingBatch, num_logprobs: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits [S, V] fp32 -> (tokens [S], token logprob [S], top logprobs [S, k], top ids [S, k])."""
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1)

    # The sort over the vocabulary dominates a decode step's sampling cost: a batch whose rows
    # are all greedy (sb.filtered False) skips it.
    if sb.filtered:
        greedy = jnp.where(sb.temperature > 0, _sample_filtered(logits, sb), greedy)
    tokens = greedy.astype(jnp.int32)
    token_logprob = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs == 0:
        rows = logits.shape[0]
        return tokens, token_logprob, jnp.zeros((rows, 0)), jnp.zeros((rows, 0), jnp.int32)
    top_lp, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return tokens, token_logprob, top_lp, top_ids


def _sample_filtered(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """Temperature, top-k, top-p, min-p filtering and a draw per row with its own key."""
    scaled = logits / jnp.maximum(sb.temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    keep = (sb.top_k[:, None] == 0) | (rank < sb.top_k[:, None])
    # Applied in HF/vLLM order: top-p on the distribution renormalised after top-k; min-p is a
    # ratio to the top probability, which renormalising does not change.
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < sb.top_p[:, None]
    keep &= probs >= sb.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(seed, position, row):
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.categorical(key, row)

    choice = jax.vmap(draw)(sb.seed, sb.position, filtered)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def sample_rows(logits, sb: SamplingBatch, shift, num_logprobs: int = 0):
    """Sample K rows per sequence: logits [S, K, V] fp32, `sb` per sequence, where row j of
    sequence s samples the token at position `sb.position[s] + shift[s] + j` (its key, so a seeded
    request samples the same token at a position whether it is drafted or not). Returns tokens
    [S, K], their logprobs [S, K], top logprobs [S, K, k] and ids."""
    s, k, v = logits.shape
    if k == 1:
        sb = dataclasses.replace(sb, position=sb.position + shift)
        return tuple(x[:, None] for x in sample(logits[:, 0], sb, num_logprobs))
    rows = SamplingBatch(
        *(jnp.repeat(x, k) for x in (sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.seed)),
        ((sb.position + shift)[:, None] + jnp.arange(k, dtype=jnp.int32)).reshape(-1),
        sb.filtered,
    )
    out = sample(logits.reshape(s * k, v), rows, num_logprobs)
    return tuple(x.reshape(s, k, *x.shape[1:]) for x in out)


def accept_drafts(tokens: jax.Array, drafts: jax.Array, num_drafts: jax.Array) -> jax.Array:
    """How many tokens a verification keeps per sequence: the leading drafts that equal the
    target's own samples at the rows before them, plus the sample after the last of those
    (the correction, or the bonus when all pass). tokens [S, K], drafts [S, K - 1], num_drafts
    [S] -> counts [S] in [1, 1 + num_drafts].

    Exact for a deterministic proposer: each kept token is the target's sample given the kept
    tokens before it, with the key of its position, so the output is the one plain decoding
    gives. (That is rejection sampling with a one-hot draft distribution: the draft survives
    with probability p(draft). A proposer with a draft distribution q needs the min(1, p/q) rule
    of Leviathan et al. 2023 instead.)
    """
    k = tokens.shape[1]
    if k == 1:
        return jnp.ones(tokens.shape[:1], jnp.int32)
    ok = (tokens[:, :-1] == drafts) & (jnp.arange(k - 1) < num_drafts[:, None])
    return 1 + jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
