"""Greedy generation through the paged KV cache: one ragged prefill, then batched decode steps.

A minimal driver of `forward_paged` for the quickstart and parity tests. The engine (continuous
batching, scheduling, sampling) replaces it for serving workloads.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv.cache import KVCache, init_kv_cache
from jaxinfer.models.batch import RaggedBatch, build_ragged_batch
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import compute_logits, forward_paged, last_token_rows
from jaxinfer.models.spec import Params


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("kv",))
def greedy_step(
    params: Params, kv: KVCache, batch: RaggedBatch, *, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One ragged step: (argmax next token [S], its fp32 logits [S, V], updated cache)."""
    hidden, kv = forward_paged(params, cfg, batch, kv)
    logits = compute_logits(params, cfg, hidden[last_token_rows(batch)])
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, kv


def _bucket(n: int, multiple: int) -> int:
    return max(multiple, math.ceil(n / multiple) * multiple)


def greedy_generate(
    params: Params,
    cfg: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    page_size: int = 16,
    eos_token_ids: tuple[int, ...] = (),
    shuffle_pages_seed: int | None = None,
) -> list[list[int]]:
    """Greedy continuations of `prompts` (token ids), at most `max_new_tokens` each.

    Each sequence owns ceil((longest prompt + max_new_tokens) / page_size) pages, in ascending
    order, or shuffled across sequences with `shuffle_pages_seed` (to exercise the page table).
    A sequence stops at an EOS token (included in its output).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > cfg.max_context:
        raise ValueError(
            f"prompt + max_new_tokens = {longest} exceeds the model's context "
            f"({cfg.describe_context()})"
        )
    num_seqs = len(prompts)
    pages_per_seq = math.ceil(longest / page_size)
    num_pages = num_seqs * pages_per_seq + 1
    order = np.arange(1, num_pages)
    if shuffle_pages_seed is not None:
        order = np.random.default_rng(shuffle_pages_seed).permutation(order)
    page_ids = order.reshape(num_seqs, pages_per_seq).tolist()
    kv = init_kv_cache(cfg, num_pages, page_size)

    lens = [len(p) for p in prompts]
    batch = build_ragged_batch(
        prompts,
        [0] * num_seqs,
        page_ids,
        num_tokens=_bucket(sum(lens), 64),
        num_seqs=num_seqs,
        pages_per_seq=pages_per_seq,
        max_q_len=max(lens),
    )
    next_tokens, _, kv = greedy_step(params, kv, batch, cfg=cfg)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(num_seqs, bool)
    for step in range(max_new_tokens):
        tokens = np.asarray(next_tokens)
        for s in np.flatnonzero(~done):
            outputs[s].append(int(tokens[s]))
            if int(tokens[s]) in eos_token_ids:
                done[s] = True
        if done.all() or step == max_new_tokens - 1:
            break
        # Finished sequences keep decoding into their own reserved pages; their outputs are
        # ignored. This keeps the decode shape fixed (one compile) at the cost of wasted rows.
        batch = build_ragged_batch(
            [[int(t)] for t in tokens],
            [lens[s] + step for s in range(num_seqs)],
            page_ids,
            num_tokens=num_seqs,
            num_seqs=num_seqs,
            pages_per_seq=pages_per_seq,
            max_q_len=1,
        )
        next_tokens, _, kv = greedy_step(params, kv, batch, cfg=cfg)
    return outputs
