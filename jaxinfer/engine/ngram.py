"""N-gram prompt lookup (Saxena 2023, "prompt lookup decoding"; vLLM's `ngram` method): draft the
tokens that followed the latest earlier occurrence of the sequence's last n tokens.

For n from `max_n` down to `min_n`, the sequence's context (prompt and output) is searched for the
latest earlier occurrence of its last n tokens; the γ tokens after that occurrence are the drafts.
When the occurrence ends within γ tokens of the end, the continuation runs into the suffix
itself and is read periodically (the distance between the two occurrences is the period), so a
repeating pattern drafts γ tokens of its repetition. No model, no training: it pays off on
input-grounded outputs (code edits, summaries that quote, extraction) where outputs repeat the
prompt.

Both forms draft the same tokens:
- host (`propose`), for mixed steps: numpy over the sequence's tokens; no match drafts nothing;
- device (`draft`), for the decode scans: each row's context lives in the state
  ([S, max_len] tokens, -1 past its end). A round first writes what the previous round accepted
  (its drafts up to the new last position, then the last token), then searches. A row without a
  match drafts its last token repeated (a verification row computed anyway: a fixed shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.proposer import Proposer, Round
from jaxinfer.engine.request import Sequence


def ngram_drafts(tokens: np.ndarray, gamma: int, max_n: int, min_n: int) -> list[int]:
    """The drafts of one context `tokens` [L] (host): [] when no n-gram recurs."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1])  # latest occurrence (it ends before the last token)
            period = length - n - start
            k = np.arange(gamma)
            src = length + k - period * ((k // period) + 1)
            return tokens[src].tolist()
    return []


@dataclass(frozen=True)
class NgramState:
    """Device state: each row's context [S, L] (-1 past it), its last position [S], and the
    drafts the previous round proposed after it [S, γ]."""

    history: jax.Array
    last: jax.Array
    drafts: jax.Array


jax.tree_util.register_dataclass(NgramState, data_fields=["history", "last", "drafts"],
                                 meta_fields=[])  # fmt: skip


class NgramProposer(Proposer):
    """Prompt-lookup drafts of `num_draft_tokens` tokens (see the module docstring); `max_len`
    bounds the context the device form keeps (the engine's max_model_len). No pool: its state
    is all it keeps."""

    on_device = True

    def __init__(self, num_draft_tokens: int, max_n: int = 3, min_n: int = 1,
                 max_len: int = 1024) -> None:  # fmt: skip
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, "
                             f"max_n={max_n}")  # fmt: skip
        self.num_draft_tokens, self.max_n, self.min_n, self.max_len = (
            num_draft_tokens, max_n, min_n, max_len
        )  # fmt: skip

    def static_key(self) -> tuple:
        return (self.num_draft_tokens, self.max_n, self.min_n, self.max_len)

    def propose(self, seq: Sequence) -> list[int]:
        tokens = np.asarray(seq.all_token_ids, np.int32)
        return ngram_drafts(tokens, self.num_draft_tokens, self.max_n, self.min_n)

    def device_state(self, seqs: list[Sequence], rows: int) -> NgramState:
        history = np.full((rows, self.max_len), -1, np.int32)
        last = np.zeros(rows, np.int32)
        for i, seq in enumerate(seqs):
            toks = seq.all_token_ids  # (at most max_model_len = max_len tokens)
            history[i, : len(toks)] = toks
            last[i] = len(seq.all_token_ids) - 1
        drafts = np.zeros((rows, self.num_draft_tokens), np.int32)
        return NgramState(history, last, drafts)

    def _context(self, state: NgramState, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """Each row's context [S, L] with what the previous round kept: its drafts before the
        new last position, then the last token `tokens` at `positions`."""
        gamma, length = self.num_draft_tokens, state.history.shape[1]
        rows = jnp.arange(tokens.shape[0])[:, None]
        cols = state.last[:, None] + 1 + jnp.arange(gamma)
        accepted = cols < positions[:, None]
        hist = state.history.at[rows, jnp.where(accepted, cols, length)].set(
            state.drafts, mode="drop"
        )
        return hist.at[rows[:, 0], positions].set(tokens, mode="drop")

    def follow(self, state: NgramState, rnd: Round, draft_params, pool):
        """(state, pool) after a plain round (adaptive speculation) fed the last tokens: the
        context written, no search (the next round's position is one on: no draft kept)."""
        return NgramState(self._context(state, rnd.tokens, rnd.positions), rnd.positions,
                          state.drafts), pool  # fmt: skip

    def draft(self, state: NgramState, rnd: Round, draft_params, pool):
        """(drafts [S, γ], state, pool, None) after each row's last token."""
        tokens, positions = rnd.tokens, rnd.positions
        gamma, length = self.num_draft_tokens, state.history.shape[1]
        hist = self._context(state, tokens, positions)
        drafts = jnp.broadcast_to(tokens[:, None], (tokens.shape[0], gamma))
        found = jnp.zeros(tokens.shape[0], bool)
        idx = jnp.arange(length)
        for n in range(self.max_n, self.min_n - 1, -1):
            # starts i of earlier occurrences: hist[i + j] == hist[pos - n + 1 + j] for j < n,
            # with i + n - 1 < pos (ending before the last token)
            match = idx[None, :] + n - 1 < positions[:, None]
            for j in range(n):
                tail = jnp.take_along_axis(hist, (positions - n + 1 + j)[:, None], axis=1)
                shifted = jnp.roll(hist, -j, axis=1)
                match = match & (shifted == tail)
            match = match & (positions[:, None] >= n)
            start = jnp.max(jnp.where(match, idx[None, :], -1), axis=1)
            hit = (start >= 0) & ~found
            period = jnp.maximum(positions + 1 - n - start, 1)[:, None]
            k = jnp.arange(gamma)[None, :]
            src = positions[:, None] + 1 + k - period * (k // period + 1)
            cand = jnp.take_along_axis(hist, jnp.clip(src, 0, length - 1), axis=1)
            drafts = jnp.where(hit[:, None], cand, drafts)
            found = found | hit
        return drafts, NgramState(hist, positions, drafts), pool, None
