"""On-device sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Reproducibility: the key for a token is `fold_in(key(seed), position)`, a function of the request's
seed and the token's position only, so a seeded request samples the same tokens whatever batch it
shares, whichever slot it sits in, and after preemption and recompute.

Filters are applied in one descending sort of the (temperature-scaled) logits: keep rank < top_k,
then the smallest prefix whose renormalised probability mass reaches top_p (nucleus; Holtzman et
al. 2020), and tokens with p >= min_p * p_max (min-p sampling; Nguyen et al. 2024). Log-probs are of
the raw model distribution (before penalties, temperature and filters).

Penalties (engines with `engine.penalties`, vLLM's semantics), applied to the logits before
greedy or sampled choice, in this order: `logit_bias` added; `repetition_penalty` r on every token
of the prompt or the output so far (a logit l > 0 becomes l / r, else l * r; Keskar et al. 2019);
`frequency_penalty` times the token's count in the output, and `presence_penalty` once if it occurs
there, subtracted (OpenAI's definitions). A row's context is its `history` before the position it
samples, so a verification's row j counts the drafts before it.

Vocab-parallel sampling (`sample(..., mesh=)`: logits sharded by vocab on the mesh's "model"
axis, `parallel/vocab.py`): greedy tokens, the token's log-prob and the top log-probs are
reduced per shard and combined across shards, so no device holds a whole [S, V] row; penalties
land on the shard holding their token. Only a batch where some row samples (`filtered`) gathers
its rows: the filters sort the whole vocabulary. Without a mesh (or a model axis of 1) none of
this runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.request import SamplingParams
from jaxinfer.models.numerics import DEFAULT_NUMERICS, Numerics, cumsum, log_softmax, softmax
from jaxinfer.parallel import vocab


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters, [S] each; padding rows are greedy."""

    temperature: jax.Array  # f32; 0 = greedy
    top_k: jax.Array  # i32; 0 = off
    top_p: jax.Array  # f32; 1 = off
    min_p: jax.Array  # f32; 0 = off
    seed: jax.Array  # u32: the seed's low 32 bits
    position: jax.Array  # i32: position of the token being sampled
    # Static (part of the compiled shape): whether any row samples. False compiles greedy only.
    # A host-side flag rather than `lax.cond` on the device: on a GPU a conditional copies its
    # predicate to the host, which blocked every step's dispatch until the step had run.
    filtered: bool = field(default=True, metadata=dict(static=True))
    seed_hi: jax.Array | None = None  # u32: the seed's high 32 bits (seeds are 64-bit)
    penalties: Penalties | None = None  # engines with `engine.penalties` only

    @staticmethod
    def build(
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
        num_rows: int,
        put=jax.device_put,
        max_logit_bias: int | None = None,
    ) -> SamplingBatch:
        """Host-side packing (padding rows greedy); `put` moves the arrays to the device(s).
        `max_logit_bias` (an engine with penalties): pack the penalties, that many bias entries
        per row."""
        n = len(params)
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        min_p = np.zeros(num_rows, np.float32)
        position = np.zeros(num_rows, np.int32)
        for i, p in enumerate(params):
            temperature[i], top_k[i] = p.temperature, p.top_k_or_off
            top_p[i], min_p[i] = p.top_p, p.min_p
        seeds64 = np.zeros(num_rows, np.uint64)
        seeds64[:n] = seeds
        seed, seed_hi = (seeds64 & 0xFFFFFFFF).astype(np.uint32), (seeds64 >> 32).astype(np.uint32)
        position[:n] = positions
        pen = None if max_logit_bias is None else Penalties.pack(params, num_rows, max_logit_bias)
        arrays = put((temperature, top_k, top_p, min_p, seed, position, seed_hi, pen))
        filtered = bool((temperature > 0).any())
        return SamplingBatch(*arrays[:6], filtered, arrays[6], arrays[7])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Penalties:
    """Per-row penalty settings ([S] each; off: repetition 1, presence and frequency 0) and
    logit biases (`bias_ids`/`bias_values` [S, B], padded with bias 0)."""

    repetition: jax.Array
    presence: jax.Array
    frequency: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array

    @staticmethod
    def pack(params: list[SamplingParams], num_rows: int, max_bias: int) -> Penalties:
        rep = np.ones(num_rows, np.float32)
        pres = np.zeros(num_rows, np.float32)
        freq = np.zeros(num_rows, np.float32)
        ids = np.zeros((num_rows, max_bias), np.int32)
        vals = np.zeros((num_rows, max_bias), np.float32)
        for i, p in enumerate(params):
            rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
            for j, (t, b) in enumerate(p.logit_bias):
                ids[i, j], vals[i, j] = t, b
        return Penalties(rep, pres, freq, ids, vals)

    def rows(self, k: int) -> Penalties:
        """Each row repeated k times (a verification's rows)."""
        return jax.tree.map(lambda x: jnp.repeat(x, k, axis=0), self)


def apply_penalties(logits, pen: Penalties, history, num_prompt, position, vocab_start=None):
    """logits [R, V] after the penalties of the module docstring. `history` [R, L]: the token at
    each position of the row's sequence (-1: none); the row's context is positions < `position`
    [R] (the one it samples), of which the first `num_prompt` [R] are the prompt.
    `vocab_start` (vocab-parallel sampling): `logits` are the slice of the vocabulary from that
    global id; a bias or count lands there only for the tokens of the slice."""
    r, v = logits.shape
    bias_ids, bias_values = pen.bias_ids, pen.bias_values
    if vocab_start is not None:
        bias_ids = bias_ids - vocab_start
        inside = (bias_ids >= 0) & (bias_ids < v)
        bias_ids, bias_values = jnp.clip(bias_ids, 0, v - 1), jnp.where(inside, bias_values, 0.0)
        history = jnp.where(history >= 0, history - vocab_start, -1)
        history = jnp.where(history < v, history, -1)  # another slice's token: none here
    logits = logits.at[jnp.arange(r)[:, None], bias_ids].add(bias_values)
    p = jnp.arange(history.shape[1], dtype=jnp.int32)[None, :]
    seen = (history >= 0) & (p < position[:, None])
    output = seen & (p >= num_prompt[:, None])
    rows = jnp.broadcast_to(jnp.arange(r)[:, None], history.shape)
    ids = jnp.clip(history, 0, v - 1)
    counts = jnp.zeros((r, v), jnp.float32).at[rows, ids].add(output.astype(jnp.float32))
    appears = jnp.zeros((r, v), bool).at[rows, ids].max(seen)
    rep = pen.repetition[:, None]
    logits = jnp.where(appears, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - pen.frequency[:, None] * counts - pen.presence[:, None] * (counts > 0)


def sample(
    logits: jax.Array,
    sb: SamplingBatch,
    num_logprobs: int = 0,
    history=None,
    mesh=None,
    numerics: Numerics = DEFAULT_NUMERICS,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """logits [S, V] fp32 -> (tokens [S], token logprob [S], top logprobs [S, k], top ids [S, k]).
    `history` = (tokens [S, L], num_prompt [S]) when `sb.penalties` is set. `mesh`: logits
    sharded by vocab on its "model" axis (`vocab.vocab_mesh`), sampled per shard (module
    docstring); the outputs are replicated. Batch-invariant `numerics`: the log-softmax and the
    filters' softmax and prefix sums in a fixed order, so a row's outputs are its own."""
    if mesh is not None:
        return _sample_vocab_parallel(logits, sb, num_logprobs, history, mesh)
    logits = logits.astype(jnp.float32)
    logprobs = log_softmax(logits, numerics)
    if sb.penalties is not None:
        logits = apply_penalties(logits, sb.penalties, *history, sb.position)
    greedy = jnp.argmax(logits, axis=-1)

    # The sort over the vocabulary dominates a decode step's sampling cost: a batch whose rows
    # are all greedy (sb.filtered False) skips it.
    if sb.filtered:
        greedy = jnp.where(sb.temperature > 0, _sample_filtered(logits, sb, numerics), greedy)
    tokens = greedy.astype(jnp.int32)
    token_logprob = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs == 0:
        rows = logits.shape[0]
        return tokens, token_logprob, jnp.zeros((rows, 0)), jnp.zeros((rows, 0), jnp.int32)
    top_lp, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return tokens, token_logprob, top_lp, top_ids


def _sample_vocab_parallel(logits, sb: SamplingBatch, num_logprobs: int, history, mesh):
    """`sample` of logits [S, V] sharded by vocab over `mesh`'s "model" axis, per shard: only
    [S]- and [S, T * k]-sized values cross devices, except in a batch where some row samples."""
    rows = logits.shape[0]

    def body(logits, sb, history):
        logits = logits.astype(jnp.float32)
        start = vocab.shard_start(logits.shape[-1])
        m, log_z = vocab.log_normalizer(logits)  # of the raw model distribution
        chosen = logits
        if sb.penalties is not None:
            chosen = apply_penalties(logits, sb.penalties, *history, sb.position, start)
        tokens = vocab.argmax(chosen, start)
        if sb.filtered:  # the filters sort whole rows: here (only) the vocabulary is gathered
            whole = jax.lax.all_gather(chosen, vocab.AXIS, axis=1, tiled=True)
            tokens = jnp.where(sb.temperature > 0, _sample_filtered(whole, sb), tokens)
        tokens = tokens.astype(jnp.int32)
        token_logprob = (vocab.pick(logits, tokens, start) - m) - log_z
        if num_logprobs == 0:
            return tokens, token_logprob, jnp.zeros((rows, 0)), jnp.zeros((rows, 0), jnp.int32)
        top, top_ids = vocab.top_k(logits, num_logprobs, start)
        return tokens, token_logprob, (top - m[:, None]) - log_z[:, None], top_ids

    spec, rep = jax.sharding.PartitionSpec(None, vocab.AXIS), jax.sharding.PartitionSpec()
    # Every device computes the same replicated outputs (the same keys draw the same tokens).
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, rep, rep), out_specs=rep,
                         check_vma=False)(logits, sb, history)  # fmt: skip


def _sample_filtered(logits: jax.Array, sb: SamplingBatch,
                     numerics: Numerics = DEFAULT_NUMERICS) -> jax.Array:  # fmt: skip
    """Temperature, top-k, top-p, min-p filtering and a draw per row with its own key."""
    order, filtered = _filtered_sorted(logits, sb, numerics)
    hi = jnp.zeros_like(sb.seed) if sb.seed_hi is None else sb.seed_hi

    def draw(seed, seed_hi, position, row):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), seed_hi), position)
        return jax.random.categorical(key, row)

    choice = jax.vmap(draw)(sb.seed, hi, sb.position, filtered)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def _filtered_sorted(logits: jax.Array, sb: SamplingBatch,
                     numerics: Numerics = DEFAULT_NUMERICS) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """(vocabulary order by descending scaled logit [R, V], those logits with the filtered-out
    ones -inf): the distribution a sampled row draws from, sorted."""
    scaled = logits / jnp.maximum(sb.temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    keep = (sb.top_k[:, None] == 0) | (rank < sb.top_k[:, None])
    # Applied in HF/vLLM order: top-p on the distribution renormalised after top-k; min-p is a
    # ratio to the top probability, which renormalising does not change.
    probs = softmax(jnp.where(keep, sorted_logits, -jnp.inf), numerics)
    keep &= (cumsum(probs, numerics) - probs) < sb.top_p[:, None]
    keep &= probs >= sb.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    return order, jnp.where(keep, sorted_logits, -jnp.inf)


def filtered_probs(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """The distribution each row's token is drawn from, [R, V] in vocabulary order: the
    filtered softmax of a sampled row (temperature > 0), the argmax's one-hot of a greedy one."""
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    if not sb.filtered:
        return greedy
    order, filtered = _filtered_sorted(logits.astype(jnp.float32), sb)
    rows = jnp.arange(logits.shape[0])[:, None]
    probs = jnp.zeros_like(filtered).at[rows, order].set(jax.nn.softmax(filtered, axis=-1))
    return jnp.where((sb.temperature > 0)[:, None], probs, greedy)


# Key streams of speculative sampling, beside the plain draw's key (seed, position): a draft's
# draw, the acceptance uniform and the residual draw of the token at a position.
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 1, 2, 3


def _keys(sb: SamplingBatch, positions: jax.Array, stream: int) -> jax.Array:
    """Keys [S, K] of (seed, position, stream) for positions [S, K]."""
    hi = jnp.zeros_like(sb.seed) if sb.seed_hi is None else sb.seed_hi

    def one(seed, seed_hi, position):
        base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), seed_hi), position)
        return jax.random.fold_in(base, stream)

    return jax.vmap(jax.vmap(one, (None, None, 0)))(sb.seed, hi, positions)


def draw_from(probs: jax.Array, sb: SamplingBatch, positions: jax.Array, stream: int):
    """A token per row [S] from probs [S, V] with the key of (seed, positions [S], stream)."""
    keys = _keys(sb, positions[:, None], stream)[:, 0]
    logits = jnp.log(probs)  # (zero-probability tokens: -inf, never drawn)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def rejection_verify(p: jax.Array, q: jax.Array, drafts: jax.Array, bonus: jax.Array,
                     sb: SamplingBatch, positions: jax.Array) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): drafts [S, G] drawn from
    q [S, G, V] against the target's p [S, G + 1, V] (both through the same filters,
    `filtered_probs`); draft j is the token at positions [S] + j. Draft j is kept when
    u_j q_j(d_j) < p_j(d_j), u_j uniform in [0, 1) keyed by (seed, position, accept): strictly
    less, so a draft the target gives probability 0 is never kept, even at u = 0. At the first
    rejection the token is drawn from norm(max(0, p_j - q_j)); when all G pass, `bonus` [S] (the
    target's own draw at the last row) follows. Returns (tokens [S, G + 1]: kept drafts, then the
    correction or bonus, then anything; kept drafts [S]). Every output token is distributed as
    p given the tokens before it."""
    s, g = drafts.shape
    j = jnp.arange(g, dtype=jnp.int32)
    pos = positions[:, None] + j
    u = jax.vmap(jax.vmap(jax.random.uniform))(_keys(sb, pos, ACCEPT_STREAM))
    p_d = jnp.take_along_axis(p[:, :g], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    ok = u * q_d < p_d
    kept = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [S] leading accepts
    first = jnp.minimum(kept, g - 1)  # the rejected row (when kept < g)
    rows = jnp.arange(s)
    residual = jnp.maximum(p[rows, first] - q[rows, first], 0.0)
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p[rows, first])
    fix = draw_from(residual, sb, positions + first, RESIDUAL_STREAM)
    last = jnp.where(kept == g, bonus, fix)
    tokens = jnp.concatenate([drafts, bonus[:, None]], axis=1)
    tokens = jnp.where(jnp.arange(g + 1)[None, :] == kept[:, None], last[:, None], tokens)
    return tokens, kept


def rows_of(sb: SamplingBatch, k: int, shift=0) -> SamplingBatch:
    """Each sequence's sampling repeated for its k rows: row j samples the token at position
    `sb.position + shift + j`."""
    rep = lambda x: None if x is None else jnp.repeat(x, k, axis=0)  # noqa: E731
    return SamplingBatch(
        *(rep(x) for x in (sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.seed)),
        ((sb.position + shift)[:, None] + jnp.arange(k, dtype=jnp.int32)).reshape(-1),
        sb.filtered,
        rep(sb.seed_hi),
        None if sb.penalties is None else sb.penalties.rows(k),
    )


def sample_rows(logits, sb: SamplingBatch, shift, num_logprobs: int = 0, history=None,
                mesh=None, numerics: Numerics = DEFAULT_NUMERICS):  # fmt: skip
    """Sample K rows per sequence: logits [S, K, V] fp32, `sb` per sequence, where row j of
    sequence s samples the token at position `sb.position[s] + shift[s] + j` (its key, so a seeded
    request samples the same token at a position whether it is drafted or not). `history`, `mesh`,
    `numerics`: see `sample` (per sequence). Returns tokens [S, K], their logprobs [S, K], top
    logprobs [S, K, k] and ids."""
    s, k, v = logits.shape
    if k == 1:
        sb = dataclasses.replace(sb, position=sb.position + shift)
        out = sample(logits[:, 0], sb, num_logprobs, history, mesh, numerics)
        return tuple(x[:, None] for x in out)
    rows = rows_of(sb, k, shift)
    if history is not None:
        history = tuple(jnp.repeat(x, k, axis=0) for x in history)
    out = sample(logits.reshape(s * k, v), rows, num_logprobs, history, mesh, numerics)
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
