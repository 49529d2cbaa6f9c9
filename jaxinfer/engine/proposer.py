"""Draft tokens to verify: the interface a speculative proposer implements.

A proposer suggests up to `num_draft_tokens` (gamma) tokens to follow a sequence. The engine feeds
them after the sequence's last token in one step, scores all 1 + gamma rows (a verification pass
of the ragged step) and keeps the drafts the target's own samples agree with, plus the next
sample (`sampler.accept_drafts`), so a step makes 1 to 1 + gamma tokens per sequence. Drafts
count in the step's token budget and their pages are reserved before the step.

- `propose(seq)`: host side, for mixed steps. It sees the sequence's real tokens: it is not asked
  while the sequence's last token is a placeholder of a step in flight (`inflight.py`).
- `device_state(seqs, rows)` and `propose_device(state, tokens, positions)`: the device form, for
  the decode scans: each round drafts after the previous round's last token, with no host round
  trip. `device_state` builds the state (a pytree, `rows` padded) from the host before a scan;
  `propose_device(state, tokens [S], positions [S])` returns (drafts [S, gamma], new state). A
  proposer without one (`on_device` False) leaves the scans at one token per round.
- `follow_device(state, tokens, positions)`: the new state after a plain round that fed
  `tokens` at `positions` and drafted nothing (adaptive speculation, `adaptive.py`), so the next
  round may draft again from a state as complete as after a drafting round. Proposers with a
  pool (draft model, EAGLE) have `draft_device` and `follow_draft` in these two's place.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jaxinfer.engine.request import Sequence


class Proposer(Protocol):
    num_draft_tokens: int
    on_device: bool

    def propose(self, seq: Sequence) -> list[int]: ...

    def device_state(self, seqs: list[Sequence], rows: int) -> Any: ...

    def propose_device(
        self, state: Any, tokens: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, Any]: ...

    def follow_device(self, state: Any, tokens: jax.Array, positions: jax.Array) -> Any: ...
