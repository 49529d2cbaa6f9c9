"""Device side of the engine: the KV cache, bucketed jitted steps, warm-up.

Three jitted functions, each compiled for a finite set of shapes at warm-up:
- `mixed_step`: one ragged batch (prefill chunks, decode tokens, verifications of draft tokens),
  bucketed on the token count; returns logits at `num_rows` rows per sequence (its last row, or
  its last 1 + drafts rows), which `sample_step` turns into tokens;
- `sample_step`: sampling (greedy-only or filtered by `SamplingBatch.filtered`) and the
  acceptance of drafts: 1 to `num_rows` tokens per sequence;
- `decode_loop`: `num_steps` decode rounds in one `lax.scan` (the decode-only fast path), bucketed
  on the sequence count; sampling and stop masks on the device, so the host is consulted once per
  scan. A round feeds each sequence's last token (and, with an on-device proposer, its drafts;
  adaptive speculation compiles each bucket both with and without them). A sequence that hits a
  stop token or its token limit stops advancing (it re-writes its last slot), so it never writes
  past the pages the host reserved (and slots past them are the scratch page).
The cache is donated and updated in place.

Warm-up lowers every bucket first, then compiles them all at once on a thread pool (XLA releases
the GIL while it compiles, so the buckets' compiles overlap on a many-core host) and keeps the
executables; the step calls use them directly, so serving never goes back to jit's tracing.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.config import GRAPHS_OFF_FROM_HIDDEN, EngineConfig, compiler_options_key
from jaxinfer.engine.proposer import Proposer, Round
from jaxinfer.engine.sampler import (
    SamplingBatch,
    accept_drafts,
    filtered_probs,
    rejection_verify,
    rows_of,
    sample_rows,
)
from jaxinfer.kv.cache import SCRATCH_PAGE, KVCache, PageTable, init_kv_cache
from jaxinfer.models.attention import AttentionConfig
from jaxinfer.models.batch import RaggedBatch, build_ragged_batch
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import compute_logits, forward_paged
from jaxinfer.models.moe import resolve_moe_backend
from jaxinfer.models.numerics import DEFAULT_NUMERICS, Numerics, log_softmax
from jaxinfer.parallel import vocab
from jaxinfer.parallel.multihost import mirrored
from jaxinfer.parallel.sharding import EngineShardings
from jaxinfer.parallel.tensor import attention_mesh

MAX_STOP_IDS = 8  # stop/eos ids checked on the device per sequence in the decode loop


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return (*out, hi)


def resolve_numerics(config: EngineConfig, device: jax.Device | None = None) -> Numerics:
    """The numerics of an engine's steps: batch-invariant with engine.batch_invariant, on the CPU
    (XLA forms, tensor parallelism included) or one GPU (plus the invariant GEMM kernel:
    docs/batch_invariance.md); on another platform, or several GPUs of a model axis, it raises,
    naming the key."""
    if not config.batch_invariant:
        return DEFAULT_NUMERICS
    platform = (device or jax.devices()[0]).platform
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"engine.batch_invariant runs on a CPU or a GPU, not {platform}")
    if platform == "gpu" and config.mesh.get("model", 1) > 1:
        # (the invariant GEMM and attention kernels are Mosaic calls, which XLA's partitioner
        # cannot split, and NCCL's all-reduce order depends on the message size)
        raise ValueError(f"engine.batch_invariant on GPUs runs on one device: engine.mesh="
                         f"{config.mesh} splits the model, and the invariant kernels do not run "
                         "under tensor parallelism yet")  # fmt: skip
    return Numerics(batch_invariant=True, gpu=platform == "gpu")


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def logit_rows(query_start_loc: jax.Array, num_drafts: jax.Array, num_rows: int) -> jax.Array:
    """Rows [S, num_rows] whose logits a step returns: sequence s's last 1 + num_drafts[s] rows
    (the last repeated past them). With one row, each sequence's last row."""
    if num_rows == 1:
        return jnp.maximum(query_start_loc[1:, None] - 1, 0)
    ends = query_start_loc[1:, None]
    n = 1 + num_drafts[:, None]
    j = jnp.arange(num_rows, dtype=jnp.int32)[None, :]
    return jnp.maximum(ends - n + jnp.minimum(j, n - 1), 0)


def _constrain(x, sharding):
    """Step outputs are laid out as declared (`EngineShardings.replicated`), so the executables
    that read them were compiled for what they get."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _forward(params, cfg, batch, kv, attention, expert_mesh, moe_backend, numerics, taps=()):
    """(hidden, kv, expert load, features): the load of an MoE model is (rows per expert [X]
    summed over the layers, experts given at least one row in each MoE layer [L_moe]); None for a
    dense one. The second sets a decode step's expert weight traffic. features: what a proposer
    with a pool reads (`Proposer.feature_layers`): those layers' `tap_features`, or the hidden
    states when it names none."""
    out = forward_paged(params, cfg, batch, kv, attention=attention, expert_mesh=expert_mesh,
                        moe_backend=moe_backend, return_expert_load=cfg.moe is not None,
                        numerics=numerics, taps=taps)  # fmt: skip
    feats = out[-1] if taps else out[0]
    if cfg.moe is None:
        return out[0], out[1], None, feats
    moe_layers = [i for i in range(cfg.num_layers) if cfg.layer(i).ffn == "moe"]
    load = out[2][np.asarray(moe_layers)]
    return out[0], out[1], (load.sum(0), (load > 0).sum(-1).astype(jnp.int32)), feats


@partial(jax.jit, static_argnames=("cfg", "attention", "num_rows", "out_sharding",
                                   "logits_sharding", "expert_mesh", "moe_backend", "proposer",
                                   "numerics"),
         donate_argnames=("kv", "draft_kv"))  # fmt: skip
def mixed_step(params, kv: KVCache, batch: RaggedBatch, num_drafts: jax.Array,
               prev_tokens: jax.Array, prev_counts: jax.Array, draft_params=None,
               draft_kv=None, *, cfg: ModelConfig, attention: AttentionConfig, num_rows: int = 1,
               out_sharding=None, logits_sharding=None, expert_mesh=None,
               moe_backend: str = "xla", proposer: Proposer | None = None,
               numerics: Numerics = DEFAULT_NUMERICS):  # fmt: skip
    """((logits [S, num_rows, V] fp32, drafts [S, num_rows - 1], shift [S], expert load (see
    `_forward`) or None), kv, draft_kv); the logits are laid out as `logits_sharding` (by vocab
    on a model axis: `sample_step` reduces them per shard), the rest as `out_sharding`.
    `expert_mesh`: the mesh whose "expert" axis shards the
    MoE experts (None: one device holds them all); `moe_backend`: their grouped matmuls'.
    `proposer` (a proposer with a pool: `Proposer.fill`) fills its pool `draft_kv` from the
    batch and its final-normed hidden states, with its params `draft_params`.
    `numerics`: the target's (engine.batch_invariant); a proposer's model runs default ones.

    Sequence s's last 1 + num_drafts[s] tokens are its last real token and its drafts; their rows'
    logits verify the drafts. `prev_tokens` [S, num_rows] / `prev_counts` [S]: the previous step's
    sampled tokens, still on the device. A negative token -(i + 1) in the batch stands for the
    last token row i of that step produced (async scheduling: the host builds this step before
    it has read the previous one); it is always its sequence's only token, and when that step
    made more than one token for it the sequence's positions shift by the extra ones (`shift`,
    which the sampler adds to its positions too). Sampling is a separate small executable
    (`sample_step`), so the greedy/sampling choice costs no second compile of the model.
    """
    tokens = batch.tokens
    placeholder = tokens < 0
    src = jnp.clip(-tokens - 1, 0, prev_tokens.shape[0] - 1)
    shift = jnp.zeros_like(batch.page_table.seq_lens)
    if num_rows == 1:
        last = prev_tokens[:, 0]
    else:
        last = jnp.take_along_axis(prev_tokens, prev_counts[:, None] - 1, axis=1)[:, 0]
        token_shift = jnp.where(placeholder, prev_counts[src] - 1, 0)
        qsl = batch.query_start_loc
        first = jnp.clip(qsl[:-1], 0, tokens.shape[0] - 1)
        shift = jnp.where(qsl[1:] - qsl[:-1] == 1, token_shift[first], 0)
        table = PageTable(batch.page_table.page_ids, batch.page_table.seq_lens + shift)
        batch = dataclasses.replace(batch, positions=batch.positions + token_shift,
                                    page_table=table)  # fmt: skip
    tokens = jnp.where(placeholder, last[src], tokens)
    batch = dataclasses.replace(batch, tokens=tokens)
    taps = proposer.feature_layers if proposer is not None else ()
    hidden, kv, load, feats = _forward(params, cfg, batch, kv, attention, expert_mesh,
                                       moe_backend, numerics, taps)  # fmt: skip
    if proposer is not None:
        draft_kv = proposer.fill(draft_params, draft_kv, batch, feats, attention)
    rows = logit_rows(batch.query_start_loc, num_drafts, num_rows)
    logits = compute_logits(params, cfg, hidden[rows], numerics)
    logits = _constrain(logits, logits_sharding or out_sharding)
    out = _constrain((tokens[rows[:, 1:]], shift, load), out_sharding)
    return (logits, *out), kv, draft_kv


@partial(jax.jit, static_argnames=("num_logprobs", "out_sharding", "vocab_mesh", "numerics"))
def sample_step(logits, drafts, num_drafts, shift, sb: SamplingBatch, history=None, *,
                num_logprobs: int, out_sharding=None, vocab_mesh=None,
                numerics: Numerics = DEFAULT_NUMERICS):  # fmt: skip
    """(tokens [S, K], counts [S], logprobs [S, K], top logprobs [S, K, k], top ids [S, K, k]):
    every row sampled, and how many of them each sequence keeps (`accept_drafts`). `history`:
    (tokens [S, L], prompt lengths [S]) of the sequences, for penalties (`sampler.sample`).
    `vocab_mesh`: logits sharded by vocab over its "model" axis, sampled per shard."""
    tokens, lp, top_lp, top_ids = sample_rows(logits, sb, shift, num_logprobs, history,
                                              vocab_mesh, numerics)  # fmt: skip
    out = tokens, accept_drafts(tokens, drafts, num_drafts), lp, top_lp, top_ids
    return _constrain(out, out_sharding)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeState:
    tokens: jax.Array  # [S] last token of each row (to be fed)
    positions: jax.Array  # [S] its position
    remaining: jax.Array  # [S] tokens each row may still generate
    stop_ids: jax.Array  # [S, MAX_STOP_IDS], -1 padded
    active: jax.Array  # [S] bool; padding rows False
    proposer: Any = None  # the on-device proposer's state (None without one)
    # Penalties (engine.penalties): each row's tokens by position [S, L] (-1: none), and its
    # prompt length [S]; each round writes the tokens it feeds.
    history: jax.Array | None = None
    num_prompt: jax.Array | None = None


@partial(
    jax.jit,
    static_argnames=(
        "cfg",
        "attention",
        "num_steps",
        "num_logprobs",
        "proposer",
        "out_sharding",
        "expert_mesh",
        "moe_backend",
        "speculate",
        "vocab_mesh",
        "numerics",
    ),
    donate_argnames=("kv", "draft_kv"),
)
def decode_loop(params, kv: KVCache, page_ids, state: DecodeState, sb: SamplingBatch,
                draft_params=None, draft_kv=None, *, cfg: ModelConfig,
                attention: AttentionConfig, num_steps: int, num_logprobs: int,
                proposer: Proposer | None = None, out_sharding=None,
                expert_mesh=None, moe_backend: str = "xla", speculate: bool = True,
                vocab_mesh=None, numerics: Numerics = DEFAULT_NUMERICS):  # fmt: skip
    """((tokens [R, S, K], counts [R, S], logprobs [R, S, K], top_lp [R, S, K, k], top_ids,
    expert load per round (see `_forward`) or None), final DecodeState, kv, draft_kv) over R =
    `num_steps` rounds of K = 1 + drafts tokens per row; row s keeps tokens[r, s, :counts[r, s]]
    of round r. The final state can seed the next call directly. Each round the proposer drafts
    (`Proposer.draft`, with its params `draft_params` and pool `draft_kv`), and sees the
    verification pass (`Proposer.observe`). `speculate` False (adaptive speculation's plain
    path): K = 1, no drafts; the proposer only follows the fed tokens (`Proposer.follow`), so
    its state and pool are what a speculative round expects. `vocab_mesh`:
    the LM head's logits stay sharded by vocab over its "model" axis and are sampled per shard
    (the rejection sampling of a draft model's sampled drafts takes whole rows). `numerics`:
    the target's and its sampling's (a draft model drafts with default ones)."""
    gamma = proposer.num_draft_tokens if proposer is not None and speculate else 0
    k = 1 + gamma
    rows = state.tokens.shape[0]
    j = jnp.arange(k, dtype=jnp.int32)
    if proposer is not None and not speculate:
        # A plain scan: the proposer catches up once on what the scan before it left (a
        # speculative round's drafting), so each round's `follow` takes its fed token alone.
        rnd = Round(state.tokens, state.positions, state.active, page_ids, sb, attention)
        pstate, draft_kv = proposer.catch_up(state.proposer, rnd, draft_params, draft_kv)
        state = dataclasses.replace(state, proposer=pstate)

    def body(carry, _):
        kv, dkv, st = carry
        pstate = st.proposer
        fed = st.tokens[:, None]
        step_sb = dataclasses.replace(sb, position=st.positions + 1)
        rnd = Round(st.tokens, st.positions, st.active, page_ids, step_sb, attention)
        q = None  # the drafts' distributions (sampled drafts: rejection sampling)
        if gamma:
            drafts, pstate, dkv, q = proposer.draft(pstate, rnd, draft_params, dkv)
            fed = jnp.concatenate([fed, drafts.astype(jnp.int32)], axis=1)
        elif proposer is not None:
            pstate, dkv = proposer.follow(pstate, rnd, draft_params, dkv)
        positions = st.positions[:, None] + j
        history = st.history
        if history is not None:  # the fed tokens are the context of the rows after them
            cols = jnp.minimum(positions, history.shape[1] - 1)
            history = history.at[jnp.arange(rows)[:, None], cols].set(fed)
        # Active rows come first (the host packs them so): row i is sequence i.
        batch = RaggedBatch(
            tokens=fed.reshape(-1),
            positions=positions.reshape(-1),
            query_start_loc=jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(st.active * k)]),
            page_table=PageTable(page_ids, jnp.where(st.active, st.positions + k, 0)),
            max_q_len=k,
        )
        taps = proposer.feature_layers if proposer is not None else ()
        hidden, kv, load, feats = _forward(params, cfg, batch, kv, attention, expert_mesh,
                                           moe_backend, numerics, taps)  # fmt: skip
        if proposer is not None:
            dkv = proposer.observe(dkv, batch, feats)
        logits = compute_logits(params, cfg, hidden, numerics).reshape(rows, k, -1)
        tok, lp, top_lp, top_ids = sample_rows(
            logits, step_sb, jnp.zeros_like(st.positions), num_logprobs,
            None if history is None else (history, st.num_prompt), vocab_mesh, numerics,
        )  # fmt: skip
        live = st.active & (st.remaining > 0)
        if q is not None:  # sampled drafts: keep each with probability min(1, p / q)
            p = filtered_probs(logits.reshape(rows * k, -1),
                               rows_of(step_sb, k)).reshape(rows, k, -1)  # fmt: skip
            tok, kept = rejection_verify(p, q, fed[:, 1:], tok[:, -1], step_sb, step_sb.position)
            raw = log_softmax(logits.astype(jnp.float32), numerics)
            lp = jnp.take_along_axis(raw, tok[..., None], axis=-1)[..., 0]
            n = jnp.minimum(kept + 1, st.remaining)
        else:
            n = jnp.minimum(accept_drafts(tok, fed[:, 1:], jnp.full(rows, gamma)), st.remaining)
        stops = jnp.any(tok[:, :, None] == st.stop_ids[:, None, :], axis=-1) & (j < n[:, None])
        hit_stop = jnp.any(stops, axis=1)
        n = jnp.where(live, jnp.where(hit_stop, jnp.argmax(stops, axis=1) + 1, n), 0)
        remaining = st.remaining - n
        still = live & ~hit_stop & (remaining > 0)
        last = (
            tok[:, 0]
            if k == 1
            else jnp.take_along_axis(tok, jnp.maximum(n - 1, 0)[:, None], 1)[:, 0]
        )
        new = DecodeState(
            tokens=jnp.where(still, last, st.tokens),
            positions=jnp.where(still, st.positions + n, st.positions),
            remaining=jnp.where(still, remaining, 0),
            stop_ids=st.stop_ids,
            active=st.active,
            proposer=pstate,
            history=history,
            num_prompt=st.num_prompt,
        )
        return (kv, dkv, new), (tok, n, lp, top_lp, top_ids, load)

    (kv, draft_kv, final), outs = jax.lax.scan(body, (kv, draft_kv, state), None,
                                               length=num_steps)  # fmt: skip
    outs, final = _constrain((outs, final), out_sharding)
    return outs, final, kv, draft_kv


class ModelRunner:
    """Owns the KV cache; turns host-built batches into sampled tokens.

    `proposer` (optional) sets how many rows per sequence a mixed step scores (1 + its
    `num_draft_tokens`) and, when it has a device form, the drafts of each decode-scan round;
    its params and pool (`Proposer.init_pool`) are `draft_params` and `draft_kv`.
    """

    def __init__(self, cfg: ModelConfig, params, config: EngineConfig,
                 shardings: EngineShardings, proposer: Proposer | None = None):  # fmt: skip
        self.cfg, self.params, self.config, self.shardings = cfg, params, config, shardings
        self.numerics = resolve_numerics(config, shardings.device)
        # batch-invariant experts run their invariant XLA form (`auto` resolves to xla; the
        # config refuses the Pallas kernel by name); attention has an invariant form per backend
        invariant = self.numerics.batch_invariant
        self.attention = AttentionConfig(config.attention_backend,
                                         tuple(config.attention_options.items()),
                                         shardings.device, attention_mesh(cfg, shardings.mesh))  # fmt: skip
        # the experts' grouped matmul: "xla" or "pallas" (raises naming engine.moe_backend)
        self.moe_backend = resolve_moe_backend("xla" if invariant else config.moe_backend, cfg,
                                               shardings.device)  # fmt: skip
        self.proposer = proposer
        self.num_rows = 1 + (proposer.num_draft_tokens if proposer is not None else 0)
        # the rows a mixed step returns per sequence: 1 + gamma only where it can carry drafts
        # (a proposer drafting on the host); else 1, not gamma more rows of LM head and sampling
        # per sequence in every mixed step
        self.mixed_rows = self.num_rows if proposer is not None and proposer.host_drafts else 1
        self.scan_proposer = proposer if proposer is not None and proposer.on_device else None
        # adaptive speculation: decode scans on either path (engine/adaptive.py)
        self.adaptive = config.speculative.adaptive and self.scan_proposer is not None
        self.kv = init_kv_cache(cfg, config.num_pages, config.page_size, config.kv_dtype,
                                mesh=shardings.mesh, rules=shardings.rules)  # fmt: skip
        self.draft_params = self.draft_kv = None
        if proposer is not None:
            self.draft_params, self.draft_kv = proposer.init_pool(
                params, config.num_pages, config.page_size, config.kv_dtype, shardings
            )
        self._executables: dict[tuple, object] = {}  # warm-up's compiled steps, by bucket
        # Process 0 of a multi-host engine: its `multihost.Leader`, which announces each
        # `mirrored` call to the other processes first (None: make every call here alone).
        self.driver = None
        self.warmup_stats: dict = {}
        self._no_prev: tuple | None = None
        self.token_buckets = _pow2_buckets(min(16, config.max_step_tokens), config.max_step_tokens)
        self.seq_buckets = _pow2_buckets(min(8, config.max_num_seqs), config.max_num_seqs)
        if config.decode_buckets:
            self.seq_buckets = tuple(sorted({*config.decode_buckets, config.max_num_seqs}))

    # -- batch building (host) ---------------------------------------------------------------
    def build_mixed(self, tokens: list[list[int]], contexts: list[int], pages: list[list[int]]):
        """Pack a ragged batch into the smallest token bucket (max_num_seqs sequence slots)."""
        n_tok = sum(len(t) for t in tokens)
        t_bucket = pick_bucket(self.token_buckets, max(n_tok, len(tokens)))
        max_q = 1 if all(len(t) == 1 for t in tokens) else t_bucket
        return build_ragged_batch(tokens, contexts, pages, num_tokens=t_bucket,
                                  num_seqs=self.config.max_num_seqs,
                                  pages_per_seq=self.config.pages_per_seq, max_q_len=max_q,
                                  put=self.put)  # fmt: skip

    def put(self, x):
        """Host array(s) -> device, replicated: a mirrored call's inputs are made here (the
        driver keeps the host values, which the other processes put alike)."""
        out = self.shardings.put(x)
        if self.driver is not None:
            self.driver.record_put(x, out)
        return out

    # -- device calls --------------------------------------------------------------------------
    @property
    def expert_mesh(self):
        """The mesh when its "expert" axis shards the experts (else None: all on each device)."""
        mesh = self.shardings.mesh
        return mesh if self.cfg.moe is not None and mesh.shape.get("expert", 1) > 1 else None

    @property
    def expert_devices(self) -> int:
        """Devices the experts are split over (1 unless `expert_mesh`)."""
        return 1 if self.expert_mesh is None else self.expert_mesh.shape["expert"]

    def _mixed_static(self):
        # the proposer only to fill its pool: without one the steps are any engine's of these
        # rows (jit's caches share them)
        fill = self.proposer if self.draft_kv is not None else None
        return dict(cfg=self.cfg, attention=self.attention, num_rows=self.mixed_rows,
                    out_sharding=self.shardings.replicated,
                    logits_sharding=self.shardings.logits(self.cfg.vocab_size),
                    expert_mesh=self.expert_mesh, moe_backend=self.moe_backend,
                    proposer=fill, numerics=self.numerics)  # fmt: skip

    def _sample_static(self):
        return dict(
            num_logprobs=self.config.num_logprobs,
            out_sharding=self.shardings.replicated,
            vocab_mesh=self.vocab_mesh,
            numerics=self.numerics,
        )

    def _decode_static(self, num_steps: int, speculate: bool = True):
        return dict(cfg=self.cfg, attention=self.attention, num_steps=num_steps,
                    num_logprobs=self.config.num_logprobs, proposer=self.scan_proposer,
                    out_sharding=self.shardings.replicated, expert_mesh=self.expert_mesh,
                    moe_backend=self.moe_backend, speculate=speculate,
                    vocab_mesh=self.vocab_mesh, numerics=self.numerics)  # fmt: skip

    @property
    def vocab_mesh(self):
        """The mesh when its "model" axis shards the vocabulary (sampling per shard), else None."""
        return vocab.vocab_mesh(self.shardings.mesh, self.cfg.vocab_size, self.shardings.rules)

    def no_prev(self) -> tuple:
        """(prev_tokens, prev_counts) of a step that refers to no earlier step's tokens, and the
        num_drafts of a step without drafts (device arrays, made once)."""
        if self._no_prev is None:
            s = self.config.max_num_seqs
            self._no_prev = self.put((np.zeros((s, self.mixed_rows), np.int32),
                                      np.ones(s, np.int32), np.zeros(s, np.int32)))  # fmt: skip
        return self._no_prev

    @mirrored()
    def run_mixed(self, batch: RaggedBatch, num_drafts, sb: SamplingBatch, prev=None,
                  history=None):  # fmt: skip
        """Dispatch one mixed step; returns its device arrays (tokens [S, K], counts [S],
        logprobs, top logprobs, top ids, expert load or None: see `_forward`), by the batch's
        sequence order. `num_drafts`: a host
        array [max_num_seqs], or None for none; `prev`: the previous step's outputs (its tokens
        and counts); `history`: the sequences' tokens, for penalties (`history_arrays`)."""
        no_tokens, no_counts, no_drafts = self.no_prev()
        prev_tokens, prev_counts = (no_tokens, no_counts) if prev is None else prev[:2]
        num_drafts = no_drafts if num_drafts is None else self.put(num_drafts)
        args = (self.params, self.kv, batch, num_drafts, prev_tokens, prev_counts,
                self.draft_params, self.draft_kv)  # fmt: skip
        exe = self._executables.get(("mixed", batch.tokens.shape[0], batch.max_q_len))
        if exe is None:  # a shape warm-up did not compile: jit compiles it (the engine counts it)
            exe = partial(mixed_step, **self._mixed_static())
        (logits, drafts, shift, load), self.kv, self.draft_kv = exe(*args)
        args = (logits, drafts, args[3], shift, sb, history)
        exe = self._executables.get(("sample", sb.filtered))
        sampled = exe(*args) if exe is not None else sample_step(*args, **self._sample_static())
        return (*sampled, load)

    def history_arrays(self, token_lists: list[list[int]], prompt_lens: list[int], rows: int):
        """(tokens [rows, max_model_len] -1 padded, prompt lengths [rows]) on the device: what
        penalties count (None on an engine without `engine.penalties`)."""
        if not self.config.penalties:
            return None
        hist = np.full((rows, self.config.max_model_len), -1, np.int32)
        for i, toks in enumerate(token_lists):
            hist[i, : len(toks)] = toks[: self.config.max_model_len]
        num_prompt = np.zeros(rows, np.int32)
        num_prompt[: len(prompt_lens)] = prompt_lens
        return self.put((hist, num_prompt))

    def max_logit_bias(self) -> int | None:
        """The `max_logit_bias` of SamplingBatch.build (None: no penalties)."""
        return self.config.max_logit_bias if self.config.penalties else None

    def decode_table(self, pages: list[list[int]], rows: int) -> jax.Array:
        table = np.full((rows, self.config.pages_per_seq), SCRATCH_PAGE, np.int32)
        for i, p in enumerate(pages):
            table[i, : len(p)] = p
        return self.put(table)

    def build_decode(self, last_tokens, positions, remaining, stop_ids, pages, seqs=None):
        """(page table, DecodeState, rows) of a decode scan; `seqs` feed the proposer's state."""
        n = len(last_tokens)
        rows = pick_bucket(self.seq_buckets, n)
        stops = np.full((rows, MAX_STOP_IDS), -1, np.int32)
        for i, st in enumerate(stop_ids):
            st = list(st)[:MAX_STOP_IDS]
            stops[i, : len(st)] = st

        def pad(values, fill=0):
            out = np.full(rows, fill, np.int32)
            out[:n] = values
            return out

        p = self.scan_proposer
        seqs = seqs or []
        history = self.history_arrays([s.all_token_ids for s in seqs],
                                      [s.num_prompt_tokens for s in seqs], rows)  # fmt: skip
        state = DecodeState(
            *self.put((pad(last_tokens), pad(positions), pad(remaining), stops,
                       np.arange(rows) < n)),
            proposer=None if p is None else self.put(p.device_state(seqs, rows)),
            history=None if history is None else history[0],
            num_prompt=None if history is None else history[1],
        )  # fmt: skip
        return self.decode_table(pages, rows), state, rows

    @mirrored()
    def run_decode(self, table, state: DecodeState, sb: SamplingBatch, num_steps: int,
                   speculate: bool = True):  # fmt: skip
        """Dispatch one decode scan (`decode_loop`); `speculate` False: adaptive speculation's
        plain path (the same state: either path can follow the other)."""
        key = ("decode", table.shape[0], num_steps, sb.filtered, speculate)
        exe = self._executables.get(key)
        args = (self.params, self.kv, table, state, sb, self.draft_params, self.draft_kv)
        if exe is None:
            exe = partial(decode_loop, **self._decode_static(num_steps, speculate))
        outs, final, self.kv, self.draft_kv = exe(*args)
        return outs, final

    # -- warm-up -------------------------------------------------------------------------------
    @mirrored(leader_only=("progress",))
    def warmup(self, max_workers: int | None = None, progress=None) -> None:
        """Compile every bucket (in parallel), then run each once on an all-padding batch;
        `progress(done, total)` is called as executables finish compiling.

        Padding batches only touch the scratch page. `max_workers` bounds the compile threads
        (default: the host's cores, at most one per bucket; 1 compiles one bucket at a time).
        Lowering (Python tracing, which holds the GIL) is pipelined with compiling (XLA, which
        releases it): each bucket's compile starts as soon as it is lowered, while this thread
        lowers the next. `warmup_stats` records the lowering and total times.
        """
        t0 = time.perf_counter()
        # Largest programs first (decode scans, then mixed steps by token bucket, then sampling),
        # so the longest compiles start earliest and small ones fill in at the end.
        rank = {"decode": 0, "mixed": 1}
        calls = sorted(self._warmup_calls(), key=lambda c: (rank.get(c[0][0], 2), -int(c[0][1])))
        workers = max_workers or min(len(calls), os.cpu_count() or 1)
        lower_s, compiled = 0.0, {}
        pool = ThreadPoolExecutor(max_workers=workers)
        key = None
        try:
            for key, fn, args, static in calls:
                t = time.perf_counter()
                low = fn.lower(*args, **static)
                lower_s += time.perf_counter() - t
                compiled[key] = pool.submit(low.compile, self._options_of(key) or None)
            key = None
            for i, (key, future) in enumerate(compiled.items()):
                self._executables[key] = future.result()
                if progress is not None:
                    progress(i + 1, len(calls))
        except Exception as e:  # name what failed; compiles not yet started are dropped
            pool.shutdown(wait=False, cancel_futures=True)
            if key is None:
                raise
            raise self._warmup_error(key, "compile" if key in compiled else "lower", e) from e
        except BaseException:  # an interrupt: drop the queued compiles, do not wait for them
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        self.warmup_stats = {"executables": len(calls), "lower_s": round(lower_s, 2),
                             "lower_and_compile_s": round(time.perf_counter() - t0, 2),
                             "compile_threads": workers}  # fmt: skip
        for key, _, args, _ in calls:  # run each once: first-call work stays out of serving
            if key[0] == "mixed":
                s = self.config.max_num_seqs
                sb = SamplingBatch.build([], [], [], s, put=self.put,
                                         max_logit_bias=self.max_logit_bias())  # fmt: skip
                history = self.history_arrays([], [], s)
                jax.block_until_ready(self.run_mixed(args[2], None, sb, history=history))
            elif key[0] == "decode":
                jax.block_until_ready(self.run_decode(*args[2:5], key[2], key[4]))
            else:
                jax.block_until_ready(self._executables[key](*args))

    def _options_of(self, key: tuple) -> dict[str, str | bool | int | float]:
        """XLA options of the warm-up executable `key` (its kind, and its bucket size if any)."""
        return self._compiler_options(key[0], key[1] if key[0] != "sample" else None)

    def _warmup_error(self, key: tuple, stage: str, err: BaseException) -> RuntimeError:
        """The error of a warm-up executable that failed to lower or compile, naming it and the
        engine settings that shape it (a failing option is then found without a debugger)."""
        kind = key[0]
        if kind == "decode":
            what = f"{'' if key[4] else 'plain '}decode scan of {key[1]} rows ({key[2]} steps)"
        elif kind == "mixed":
            what = f"mixed step of {key[1]} tokens"
        else:
            what = "sampler"
        msg = (f"warm-up could not {stage} the {what}: {type(err).__name__}: {err}\n"
               f"  engine.attention_backend={self.attention.backend!r}, engine.attention_options="
               f"{dict(self.attention.options)}, XLA options of this executable "
               f"(engine.compiler_options)={self._options_of(key)}")  # fmt: skip
        if "shared memory" in str(err):
            msg += ("\n  the attention kernel's buffers exceed an SM's shared memory: lower "
                    "engine.attention_options num_stages or block_kv, or leave them out (the "
                    "kernel's defaults fit)")  # fmt: skip
        return RuntimeError(msg)

    @property
    def decode_cuda_graphs(self) -> bool:
        """Whether decode scans run as CUDA graphs (`EngineConfig.decode_cuda_graphs`)."""
        choice = self.config.decode_cuda_graphs
        if choice == "auto":  # (quantized weights add small kernels per layer: docs/decisions.md)
            quantized = self.config.quant.weights != "none"
            return quantized or self.cfg.hidden_size < GRAPHS_OFF_FROM_HIDDEN
        return bool(choice)

    def _compiler_options(
        self, kind: str, size: int | None = None
    ) -> dict[str, str | bool | int | float]:
        """XLA options of one executable of `kind` (bucket `size`: rows of a decode scan, tokens
        of a mixed step): for decode scans without CUDA graphs (`decode_cuda_graphs`) command
        buffers off, then "all"'s, overridden by the kind's own, then by each "KIND>=N" entry with
        N <= size, smallest N first; a None value drops the option (XLA's default). Values keep
        their type: XLA rejects a bool option given as the string 'true'."""
        options = self.config.compiler_options
        merged = {}
        if kind == "decode" and not self.decode_cuda_graphs:
            merged["xla_gpu_enable_command_buffer"] = ""
        merged.update({**options.get("all", {}), **options.get(kind, {})})
        bounded = []
        for key, opts in options.items():
            k, least = compiler_options_key(key)
            if k == kind and least is not None and size is not None and size >= least:
                bounded.append((least, opts))
        for _, opts in sorted(bounded, key=lambda b: b[0]):
            merged.update(opts)
        return {k: v for k, v in merged.items() if v is not None}

    def _warmup_calls(self):
        """(key, jitted fn, example args, static args) for every bucket the engine can use."""
        c, rows_k = self.config, self.mixed_rows
        calls = []

        def zeros(shape, dtype=np.int32, fill=0):  # device_put of host zeros: no tiny compiles
            return self.put(np.full(shape, fill, dtype))

        s = c.max_num_seqs
        prev = (zeros((s, rows_k)), zeros(s, fill=1))
        # A decode-only mixed batch (max_q 1) has one token per sequence, so its token bucket is at
        # most the one holding max_num_seqs; larger buckets only ever see prefill chunks.
        decode_cap = pick_bucket(self.token_buckets, min(s, c.max_step_tokens))
        for t in self.token_buckets:
            for max_q in sorted({1, t} if t <= decode_cap else {t}):
                table = zeros((s, c.pages_per_seq))
                batch = RaggedBatch(zeros(t), zeros(t), zeros(s + 1), PageTable(table, zeros(s)),
                                    max_q)  # fmt: skip
                calls.append((("mixed", t, max_q), mixed_step,
                              (self.params, self.kv, batch, zeros(s), *prev, self.draft_params,
                               self.draft_kv), self._mixed_static()))  # fmt: skip
        shape = (s, rows_k, self.cfg.vocab_size)  # laid out as mixed steps return them
        logits = jax.device_put(np.zeros(shape, np.float32),
                                self.shardings.logits(self.cfg.vocab_size))  # fmt: skip
        bias = self.max_logit_bias()
        for filtered in (False, True):  # all-greedy batches, and batches where some row samples
            sb = dataclasses.replace(SamplingBatch.build([], [], [], s, put=self.put,
                                                         max_logit_bias=bias),
                                     filtered=filtered)  # fmt: skip
            calls.append((("sample", filtered), sample_step,
                          (logits, zeros((s, rows_k - 1)), zeros(s), zeros(s), sb,
                           self.history_arrays([], [], s)),
                          self._sample_static()))  # fmt: skip
        # adaptive speculation also runs plain scans (`decode_loop(speculate=False)`)
        paths = (True, False) if self.adaptive else (True,)
        if c.decode_steps > 1:
            for rows, speculate, filtered in itertools.product(self.seq_buckets, paths,
                                                               (False, True)):  # fmt: skip
                table = zeros((rows, c.pages_per_seq))
                state = self._padding_state(rows)
                sb = dataclasses.replace(SamplingBatch.build([], [], [], rows, put=self.put,
                                                             max_logit_bias=bias),
                                         filtered=filtered)  # fmt: skip
                calls.append((("decode", rows, c.decode_steps, filtered, speculate), decode_loop,
                              (self.params, self.kv, table, state, sb, self.draft_params,
                               self.draft_kv), self._decode_static(c.decode_steps, speculate)))  # fmt: skip
        return calls

    def _padding_state(self, rows: int) -> DecodeState:
        """A DecodeState of `rows` padding rows (warm-up)."""
        z = np.zeros(rows, np.int32)
        p = self.scan_proposer
        history = self.history_arrays([], [], rows)
        return DecodeState(*self.put((z, z, z, np.full((rows, MAX_STOP_IDS), -1, np.int32),
                                      np.zeros(rows, bool))),
                           proposer=None if p is None else self.put(p.device_state([], rows)),
                           history=None if history is None else history[0],
                           num_prompt=None if history is None else history[1])  # fmt: skip
