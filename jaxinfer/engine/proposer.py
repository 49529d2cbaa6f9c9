"""Draft tokens to verify: the interface a speculative proposer implements.

A proposer suggests up to `num_draft_tokens` (gamma) tokens to follow a sequence. The engine feeds
them after the sequence's last token in one step, scores all 1 + gamma rows (a verification pass
of the ragged step) and keeps the drafts the target's own samples agree with, plus the next
sample (`sampler.accept_drafts`), so a step makes 1 to 1 + gamma tokens per sequence. Drafts
count in the step's token budget and their pages are reserved before the step.

A proposer subclasses `Proposer` and overrides what it needs; the defaults are those of a
proposer with no device pool. The runner and its jitted steps call only these methods, so a new
proposer is its own module, plus its method name (`config.SPECULATIVE_METHODS`) and its
construction (`engine.make_proposer`).

- `propose(seq)`: host drafts, for mixed steps (overriding it makes `host_drafts` true).
  It sees the sequence's real tokens: the engine reads a step in flight before it asks (so a
  mixed step then waits for the one before it, `inflight.py`), and does not ask while the
  sequence's last token is a placeholder.
- `init_pool(target_params, num_pages, page_size, kv_dtype, shardings)`: (draft params, pool),
  the proposer's own device arrays, made once by the runner (default: none). The pool uses the
  target's pages and page table, so the block manager's pages serve both. Both travel as
  arguments of the jitted steps (`draft_params`, `draft_kv`), never as constants.
- `fill(draft_params, pool, batch, hidden, attention)`: a mixed step's part, given its batch and
  the target's final-normed hidden states [T, E] (a prefill fills the pool as it fills the
  target's pages). Called only for a proposer with a pool.
- `device_state(seqs, rows)`: the host-built state (a pytree, `rows` padded) a decode scan starts
  from. A proposer with `on_device` False leaves the scans at one token per round.
- `draft(state, rnd, draft_params, pool)`: a decode-scan round's drafts after each row's last
  token, on the device: (drafts [S, gamma], state, pool, q). q [S, gamma, V]: the distributions
  sampled drafts were drawn from, for rejection sampling (`sampler.rejection_verify`); None for
  deterministic drafts, which `accept_drafts` keeps while they equal the target's samples. A
  round whose rows are all greedy (`rnd.sampling.filtered` False, static) drafts argmaxes with
  q None: with one-hot p and q the rejection rule keeps a draft exactly when it is the target's
  argmax, and its residual draw is that argmax, which greedy verification gives without the
  [S, gamma + 1, V] distributions and their random draws.
- `follow(state, rnd, draft_params, pool)`: (state, pool) after a plain round that fed the last
  tokens and drafted nothing (adaptive speculation, `adaptive.py`), so the next round may draft
  from a state as complete as after a drafting round (default: unchanged, for a state the fed
  tokens do not change). `catch_up` (same arguments and result) runs once before a plain scan's
  first round, given that round: what the scan before it left to redo (default: nothing), so
  `follow` need only take each round's own fed token.
- `observe(pool, batch, hidden)`: the pool after a round's verification pass, which saw `batch`
  with final-normed hidden states `hidden` (default: unchanged).
- `static_key()`: what shapes its traced steps. The proposer is a static argument of the jitted
  steps, compared by this key, so engines whose proposers share a key share compiled steps
  (default: the proposer itself).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import jax

from jaxinfer.engine.request import Sequence
from jaxinfer.engine.sampler import SamplingBatch
from jaxinfer.models.attention import AttentionConfig
from jaxinfer.models.batch import RaggedBatch


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Round:
    """What a decode-scan round gives its proposer: each row's last token [S] and its position
    [S], the real rows [S], the scan's page table [S, pages], the round's sampling (its positions:
    the token after the last) and the attention backend."""

    tokens: jax.Array
    positions: jax.Array
    active: jax.Array | None = None
    page_ids: jax.Array | None = None
    sampling: SamplingBatch | None = None
    attention: AttentionConfig | None = field(default=None, metadata=dict(static=True))


class Proposer:
    """A speculative proposer (see the module docstring); the defaults have no device pool."""

    num_draft_tokens: int
    on_device: bool = False
    # the target's layers whose residual streams `fill` and `observe` get (`tap_features`), in
    # place of its final-normed hidden states (an EAGLE-3-style head's input)
    feature_layers: tuple[int, ...] = ()

    @property
    def host_drafts(self) -> bool:
        """Whether it drafts on the host (overrides `propose`): mixed steps wait for the step in
        flight and carry drafts only then; one drafting in the scans alone keeps them overlapped
        with the host's work and at one logits row per sequence."""
        return type(self).propose is not Proposer.propose

    def propose(self, seq: Sequence) -> list[int]:
        return []

    def init_pool(self, target_params, num_pages: int, page_size: int, kv_dtype: str,
                  shardings) -> tuple[Any, Any]:  # fmt: skip
        return None, None

    def fill(self, draft_params, pool, batch: RaggedBatch, hidden: jax.Array, attention):
        return pool

    def device_state(self, seqs: list[Sequence], rows: int) -> Any:
        return None

    def draft(self, state, rnd: Round, draft_params, pool):
        raise NotImplementedError(f"{type(self).__name__} has no device drafts (on_device)")

    def follow(self, state, rnd: Round, draft_params, pool):
        return state, pool

    def catch_up(self, state, rnd: Round, draft_params, pool):
        return state, pool

    def observe(self, pool, batch: RaggedBatch, hidden: jax.Array):
        return pool

    def static_key(self) -> Hashable:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.static_key() == self.static_key()

    def __hash__(self) -> int:
        return hash(self.static_key())
