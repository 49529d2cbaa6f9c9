"""The engine's unread work: steps dispatched to the device whose tokens the host has not read.

Async dispatch (`engine.async_schedule`, `engine.async_decode`) builds and dispatches step N+1
before the host reads step N, so host scheduling and post-processing overlap device work. What
makes that safe, and the invariants a change must keep (picture: docs/engine.md):

1. Between `Engine.step` calls at most one step is unread: a mixed step (`UnreadMixed`) or a
   decode scan (`UnreadScan`). Inside a call a second may be dispatched before the first is read;
   steps are read in dispatch order.
2. Placeholders. Each sequence that samples in a mixed step gets one placeholder appended to its
   `output_token_ids` when the step is dispatched: -(row + 1), its row in that step's outputs.
   `seq.num_placeholders` counts them; they are its last entries, oldest first (at most two,
   only inside a call). Reading a step replaces its sequences' oldest placeholder by the 1 to K
   tokens the device kept for that row (K = 1 + drafts: a verification keeps a data-dependent
   number, `sampler.accept_drafts`).
3. A placeholder reaches the device only in the very next mixed step, as its sequence's only
   token (sampling leaves exactly one uncomputed token, and the placeholder is it). That step
   reads the real token from the previous step's outputs and shifts the sequence's positions by
   the extra tokens the host has not counted yet (`model_runner.mixed_step`). Later steps never
   see a placeholder: it is read first.
4. Host counts assume one token per placeholder: `num_computed_tokens` gains the extra ones at the
   read, and the pages for them were reserved at dispatch (`seq.pending_extra_tokens`).
5. A sequence that finishes at a read drops its later placeholders: their tokens are void. Their
   K/V writes land in its own pages or the scratch page, which the device's stream orders before
   any reuse of those pages.
6. A decode scan starts from tokens on the host: the unread mixed step is read before a scan is
   dispatched, and a scan writes no placeholders (its tokens are appended when it is read).
7. Proposers draft only for sequences without placeholders: they need the real last token. So
   with a proposer the engine reads a plain mixed step before it builds the next, and lets a
   verification overlap only the plain step after it (the one that feeds its placeholders).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer.engine.request import Sequence
from jaxinfer.engine.sampler import SamplingBatch


@dataclass
class UnreadMixed:
    """A dispatched mixed step: `samplers` are its sampling sequences and their rows; `outs` the
    device arrays (tokens [S, K], counts [S], logprobs [S, K], top logprobs, top ids);
    `verifies`: whether any sequence carried drafts; `drafts`: each sampler's draft count."""

    samplers: list[tuple[Sequence, int]]
    outs: tuple
    verifies: bool = False
    drafts: list[int] | None = None


@dataclass
class UnreadScan:
    """A dispatched decode scan of `rounds` rounds over `seqs` (rows in order); `outs` its device
    arrays (tokens [R, rows, K], counts [R, rows], ...), `final` its final DecodeState (device),
    from which the next scan can start (async decode). `speculative` False: adaptive
    speculation's plain path; `dispatched_at`: the engine clock when the host began it."""

    seqs: list[Sequence]
    outs: tuple
    final: object
    sb: SamplingBatch
    rows: int
    rounds: int
    speculative: bool = True
    dispatched_at: float = 0.0


def add_placeholder(seq: Sequence, row: int, extra: int) -> None:
    """Dispatch: `seq` samples at `row` of a mixed step that may keep `extra` tokens more than
    one (its drafts); the host counts one until the step is read."""
    seq.output_token_ids.append(-(row + 1))
    seq.num_placeholders += 1
    seq.pending_extra_tokens = extra


def fill_placeholder(seq: Sequence, tokens: list[int]) -> int:
    """Read: the oldest placeholder of `seq` becomes `tokens`; returns the index of the first."""
    ids = seq.output_token_ids
    index = len(ids) - seq.num_placeholders
    assert ids[index] < 0, (seq.seq_id, index, ids[index:])
    ids[index : index + 1] = tokens
    seq.num_placeholders -= 1
    seq.pending_extra_tokens = 0
    return index
