"""Device side of the engine: the KV cache, bucketed jitted steps, warm-up.

Two jitted functions, each compiled for a finite set of shapes at warm-up:
- `mixed_step`: one ragged batch (prefill chunks and decode tokens together), bucketed on the token
  count; returns logits at each sequence's last row, which `sample_rows` (a small executable,
  greedy-only or filtered by `SamplingBatch.filtered`) turns into tokens.
- `decode_loop`: `num_steps` decode steps in one `lax.scan` (the decode-only fast path), bucketed on
  the sequence count; sampling and stop masks on the device, so the host is consulted once per
  `num_steps` tokens. A sequence that hits a stop token or its token limit stops advancing (it
  re-writes its last slot), so it never writes past the pages the host reserved.
The cache is donated to both and updated in place.

Warm-up lowers every bucket first, then compiles them all at once on a thread pool (XLA releases
the GIL while it compiles, so the buckets' compiles overlap on a many-core host) and keeps the
executables; the step calls use them directly, so serving never goes back to jit's tracing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.config import compiler_options_key
from jaxinfer.engine.sampler import SamplingBatch, sample
from jaxinfer.kv.cache import SCRATCH_PAGE, KVCache, PageTable, init_kv_cache
from jaxinfer.models.batch import RaggedBatch
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import compute_logits, forward_paged, last_token_rows

MAX_STOP_IDS = 8  # stop/eos ids checked on the device per sequence in the decode loop


@dataclass(frozen=True)
class RunnerShapes:
    num_pages: int
    page_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    decode_steps: int = 1
    num_logprobs: int = 0  # top-k logprobs computed per row (static)
    # Without chunked prefill one whole prompt (up to max_model_len) may exceed the token budget.
    chunked_prefill: bool = True
    # Row buckets of the decode scans (ascending; max_num_seqs is added): () = powers of two
    # from 8 (or max_num_seqs, if smaller).
    decode_buckets: tuple[int, ...] = ()

    @property
    def max_step_tokens(self) -> int:
        if self.chunked_prefill:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, self.max_model_len)

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return (*out, hi)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@partial(jax.jit, static_argnames=("cfg", "backend", "options"), donate_argnames=("kv",))
def mixed_step(params, kv: KVCache, batch: RaggedBatch, prev_tokens: jax.Array, *,
               cfg: ModelConfig, backend: str, options: tuple = ()):  # fmt: skip
    """fp32 logits [max_num_seqs, V] at each sequence's last row, and the cache.

    `prev_tokens` [max_num_seqs]: the previous step's sampled tokens, still on the device. A
    negative token -(i + 1) in the batch stands for prev_tokens[i] (async scheduling: the host
    builds this step before it has read the previous one's tokens). Sampling is a separate small
    executable (`sample_rows`), so the greedy/sampling choice costs no second compile of the model.
    """
    src = jnp.clip(-batch.tokens - 1, 0, prev_tokens.shape[0] - 1)
    tokens = jnp.where(batch.tokens < 0, prev_tokens[src], batch.tokens)
    batch = dataclasses.replace(batch, tokens=tokens)
    hidden, kv = forward_paged(params, cfg, batch, kv, attention_backend=backend,
                               attention_options=options)  # fmt: skip
    return compute_logits(params, cfg, hidden[last_token_rows(batch)]), kv


@partial(jax.jit, static_argnames=("num_logprobs",))
def sample_rows(logits: jax.Array, sb: SamplingBatch, *, num_logprobs: int):
    return sample(logits, sb, num_logprobs)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeState:
    tokens: jax.Array  # [S] last token of each row (to be fed)
    positions: jax.Array  # [S] its position
    remaining: jax.Array  # [S] tokens each row may still generate
    stop_ids: jax.Array  # [S, MAX_STOP_IDS], -1 padded
    active: jax.Array  # [S] bool; padding rows False


@partial(
    jax.jit,
    static_argnames=("cfg", "num_steps", "num_logprobs", "backend", "options"),
    donate_argnames=("kv",),
)
def decode_loop(params, kv: KVCache, page_ids, state: DecodeState, sb: SamplingBatch, *,
                cfg: ModelConfig, num_steps: int, num_logprobs: int, backend: str,
                options: tuple = ()):  # fmt: skip
    """((tokens [K, S], logprobs [K, S], top_lp [K, S, k], top_ids [K, S, k], live [K, S]),
    final DecodeState, kv). The final state can seed the next call directly (async decode)."""

    def body(carry, _):
        kv, st = carry
        # Active rows come first (the host packs them so): row i is sequence i.
        batch = RaggedBatch(
            tokens=st.tokens,
            positions=st.positions,
            query_start_loc=jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(st.active)]),
            page_table=PageTable(page_ids, jnp.where(st.active, st.positions + 1, 0)),
            max_q_len=1,
        )
        hidden, kv = forward_paged(params, cfg, batch, kv, attention_backend=backend,
                                   attention_options=options)  # fmt: skip
        logits = compute_logits(params, cfg, hidden)
        step_sb = SamplingBatch(sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.seed,
                                st.positions + 1, sb.filtered)  # fmt: skip
        tok, lp, top_lp, top_ids = sample(logits, step_sb, num_logprobs)
        live = st.active & (st.remaining > 0)
        hit_stop = jnp.any(tok[:, None] == st.stop_ids, axis=-1)
        remaining = jnp.where(live, st.remaining - 1, st.remaining)
        still = live & ~hit_stop & (remaining > 0)
        new = DecodeState(
            tokens=jnp.where(still, tok, st.tokens),
            positions=jnp.where(still, st.positions + 1, st.positions),
            remaining=jnp.where(still, remaining, 0),
            stop_ids=st.stop_ids,
            active=st.active,
        )
        return (kv, new), (tok, lp, top_lp, top_ids, live)

    (kv, final), outs = jax.lax.scan(body, (kv, state), None, length=num_steps)
    return outs, final, kv


class ModelRunner:
    """Owns the KV cache; turns host-built batches into sampled tokens."""

    def __init__(self, cfg: ModelConfig, params, shapes: RunnerShapes, backend: str = "xla",
                 kv_dtype: str = "auto", attention_options: dict | None = None,
                 compiler_options: dict[str, dict] | None = None):  # fmt: skip
        self.cfg, self.params, self.shapes, self.backend = cfg, params, shapes, backend
        # XLA options of warm-up's executables by kind ("all", "mixed", "decode", "sample")
        self.compiler_options = compiler_options or {}
        # static (hashable) kernel tuning keywords, in a fixed order
        self.attention_options = tuple(sorted((attention_options or {}).items()))
        self.kv = init_kv_cache(cfg, shapes.num_pages, shapes.page_size, kv_dtype)
        self._executables: dict[tuple, object] = {}  # warm-up's compiled steps, by bucket
        self.warmup_stats: dict = {}
        self._no_prev: jax.Array | None = None
        self.token_buckets = _pow2_buckets(min(16, shapes.max_step_tokens), shapes.max_step_tokens)
        self.seq_buckets = _pow2_buckets(min(8, shapes.max_num_seqs), shapes.max_num_seqs)
        if shapes.decode_buckets:
            self.seq_buckets = tuple(sorted({*shapes.decode_buckets, shapes.max_num_seqs}))

    # -- batch building (host) ---------------------------------------------------------------
    def build_mixed(self, tokens: list[list[int]], contexts: list[int], pages: list[list[int]]):
        """Pack a ragged batch into the smallest token bucket; q bucket = token bucket."""
        s = self.shapes
        n_tok = sum(len(t) for t in tokens)
        t_bucket = pick_bucket(self.token_buckets, max(n_tok, len(tokens)))
        tok = np.zeros(t_bucket, np.int32)
        pos = np.zeros(t_bucket, np.int32)
        qsl = np.zeros(s.max_num_seqs + 1, np.int32)
        table = np.full((s.max_num_seqs, s.pages_per_seq), SCRATCH_PAGE, np.int32)
        lens = np.zeros(s.max_num_seqs, np.int32)
        start = 0
        for i, (t, c, p) in enumerate(zip(tokens, contexts, pages, strict=True)):
            tok[start : start + len(t)] = t
            pos[start : start + len(t)] = np.arange(c, c + len(t))
            table[i, : len(p)] = p
            lens[i] = c + len(t)
            start += len(t)
            qsl[i + 1] = start
        qsl[len(tokens) + 1 :] = start
        max_q = 1 if all(len(t) == 1 for t in tokens) else t_bucket
        return RaggedBatch(
            jax.device_put(tok), jax.device_put(pos), jax.device_put(qsl),
            PageTable(jax.device_put(table), jax.device_put(lens)), max_q,
        )  # fmt: skip

    # -- device calls --------------------------------------------------------------------------
    def _mixed_static(self):
        return dict(cfg=self.cfg, backend=self.backend, options=self.attention_options)

    def _decode_static(self, num_steps: int):
        return dict(cfg=self.cfg, num_steps=num_steps, num_logprobs=self.shapes.num_logprobs,
                    backend=self.backend, options=self.attention_options)  # fmt: skip

    def no_prev_tokens(self) -> jax.Array:
        """The `prev_tokens` of a step that refers to no earlier step's tokens."""
        if self._no_prev is None:
            self._no_prev = jax.device_put(np.zeros(self.shapes.max_num_seqs, np.int32))
        return self._no_prev

    def run_mixed(self, batch: RaggedBatch, sb: SamplingBatch, prev_tokens=None):
        """Dispatch one mixed step; returns its device arrays (tokens, logprobs, top logprobs,
        top ids), each [max_num_seqs, ...] by the batch's sequence order."""
        prev = self.no_prev_tokens() if prev_tokens is None else prev_tokens
        exe = self._executables.get(("mixed", batch.tokens.shape[0], batch.max_q_len))
        if exe is not None:
            logits, self.kv = exe(self.params, self.kv, batch, prev)
        else:  # a shape warm-up did not compile: jit compiles it (and the engine counts it)
            logits, self.kv = mixed_step(self.params, self.kv, batch, prev, **self._mixed_static())
        exe = self._executables.get(("sample", sb.filtered))
        if exe is not None:
            return exe(logits, sb)
        return sample_rows(logits, sb, num_logprobs=self.shapes.num_logprobs)

    def decode_table(self, pages: list[list[int]], rows: int) -> jax.Array:
        table = np.full((rows, self.shapes.pages_per_seq), SCRATCH_PAGE, np.int32)
        for i, p in enumerate(pages):
            table[i, : len(p)] = p
        return jax.device_put(table)

    def build_decode(self, last_tokens, positions, remaining, stop_ids, pages):
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

        state = DecodeState(
            jax.device_put(pad(last_tokens)),
            jax.device_put(pad(positions)),
            jax.device_put(pad(remaining)),
            jax.device_put(stops),
            jax.device_put(np.arange(rows) < n),
        )
        return self.decode_table(pages, rows), state, rows

    def run_decode(self, table, state: DecodeState, sb: SamplingBatch, num_steps: int):
        exe = self._executables.get(("decode", table.shape[0], num_steps, sb.filtered))
        if exe is not None:
            outs, final, self.kv = exe(self.params, self.kv, table, state, sb)
        else:
            outs, final, self.kv = decode_loop(
                self.params, self.kv, table, state, sb, **self._decode_static(num_steps)
            )
        return outs, final

    # -- warm-up -------------------------------------------------------------------------------
    def warmup(self, max_workers: int | None = None) -> None:
        """Compile every bucket (in parallel), then run each once on an all-padding batch.

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
        with ThreadPoolExecutor(max_workers=workers) as pool:
            key = None
            try:
                for key, fn, args, static in calls:
                    t = time.perf_counter()
                    low = fn.lower(*args, **static)
                    lower_s += time.perf_counter() - t
                    compiled[key] = pool.submit(low.compile, self._options_of(key) or None)
                key = None
                for key, future in compiled.items():
                    self._executables[key] = future.result()
            except Exception as e:  # name what failed; compiles not yet started are dropped
                pool.shutdown(wait=False, cancel_futures=True)
                if key is None:
                    raise
                raise self._warmup_error(key, "compile" if key in compiled else "lower", e) from e
        self.warmup_stats = {"executables": len(calls), "lower_s": round(lower_s, 2),
                             "lower_and_compile_s": round(time.perf_counter() - t0, 2),
                             "compile_threads": workers}  # fmt: skip
        for key, _, args, _ in calls:  # run each once: first-call work stays out of serving
            if key[0] == "mixed":
                batch, prev = args[2:]
                sb = SamplingBatch.build([], [], [], self.shapes.max_num_seqs)
                jax.block_until_ready(self.run_mixed(batch, sb, prev))
            elif key[0] == "decode":
                jax.block_until_ready(self.run_decode(*args[2:], key[2]))
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
            what = f"decode scan of {key[1]} rows ({key[2]} steps)"
        elif kind == "mixed":
            what = f"mixed step of {key[1]} tokens"
        else:
            what = "sampler"
        msg = (f"warm-up could not {stage} the {what}: {type(err).__name__}: {err}\n"
               f"  engine.attention_backend={self.backend!r}, engine.attention_options="
               f"{dict(self.attention_options)}, XLA options of this executable "
               f"(engine.compiler_options)={self._options_of(key)}")  # fmt: skip
        if "shared memory" in str(err):
            msg += ("\n  the attention kernel's buffers exceed an SM's shared memory: lower "
                    "engine.attention_options num_stages or block_kv, or leave them out (the "
                    "kernel's defaults fit)")  # fmt: skip
        return RuntimeError(msg)

    def _compiler_options(
        self, kind: str, size: int | None = None
    ) -> dict[str, str | bool | int | float]:
        """XLA options of one executable of `kind` (bucket `size`: rows of a decode scan, tokens
        of a mixed step): "all"'s, overridden by the kind's own, then by each "KIND>=N" entry with
        N <= size, smallest N first; a None value drops the option (XLA's default). Values keep
        their type: XLA rejects a bool option given as the string 'true'."""
        merged = {**self.compiler_options.get("all", {}), **self.compiler_options.get(kind, {})}
        bounded = []
        for key, options in self.compiler_options.items():
            k, least = compiler_options_key(key)
            if k == kind and least is not None and size is not None and size >= least:
                bounded.append((least, options))
        for _, options in sorted(bounded, key=lambda b: b[0]):
            merged.update(options)
        return {k: v for k, v in merged.items() if v is not None}

    def _warmup_calls(self):
        """(key, jitted fn, example args, static args) for every bucket the engine can use."""
        s = self.shapes
        calls = []

        def zeros(shape, dtype=np.int32, fill=0):  # device_put of host zeros: no tiny compiles
            return jax.device_put(np.full(shape, fill, dtype))

        # A decode-only mixed batch (max_q 1) has one token per sequence, so its token bucket is at
        # most the one holding max_num_seqs; larger buckets only ever see prefill chunks.
        decode_cap = pick_bucket(self.token_buckets, min(s.max_num_seqs, s.max_step_tokens))
        for t in self.token_buckets:
            for max_q in sorted({1, t} if t <= decode_cap else {t}):
                table = zeros((s.max_num_seqs, s.pages_per_seq))
                batch = RaggedBatch(
                    zeros(t), zeros(t), zeros(s.max_num_seqs + 1),
                    PageTable(table, zeros(s.max_num_seqs)), max_q,
                )  # fmt: skip
                prev = zeros(s.max_num_seqs)
                calls.append((("mixed", t, max_q), mixed_step,
                              (self.params, self.kv, batch, prev), self._mixed_static()))  # fmt: skip
        logits = zeros((s.max_num_seqs, self.cfg.vocab_size), np.float32)
        for filtered in (False, True):  # all-greedy batches, and batches where some row samples
            sb = dataclasses.replace(SamplingBatch.build([], [], [], s.max_num_seqs),
                                     filtered=filtered)  # fmt: skip
            calls.append((("sample", filtered), sample_rows, (logits, sb),
                          dict(num_logprobs=s.num_logprobs)))  # fmt: skip
        if s.decode_steps > 1:
            for rows in self.seq_buckets:
                z = zeros(rows)
                state = DecodeState(z, z, z, zeros((rows, MAX_STOP_IDS), fill=-1),
                                    zeros(rows, bool))  # fmt: skip
                table = zeros((rows, s.pages_per_seq))
                for filtered in (False, True):
                    sb = dataclasses.replace(SamplingBatch.build([], [], [], rows),
                                             filtered=filtered)  # fmt: skip
                    calls.append((("decode", rows, s.decode_steps, filtered), decode_loop,
                                  (self.params, self.kv, table, state, sb),
                                  self._decode_static(s.decode_steps)))  # fmt: skip
        return calls
