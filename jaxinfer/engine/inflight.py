"""One engine's steps in flight: dispatched to the device, their tokens not yet read by the host.

Async dispatch (`engine.async_schedule`, `engine.async_decode`) builds and dispatches step N+1
before the host reads step N, so host scheduling and post-processing overlap device work.
`InFlight` holds those steps; its methods are what the engine does with them, and it alone
writes a sequence's placeholder state. What makes that safe, and the invariants a change must
keep (their methods assert what the host can check; picture: docs/engine.md):

1. Between `Engine.step` calls at most one step is unread: a mixed step (`UnreadMixed`) or a
   decode scan (`UnreadScan`). Inside a call a second of the same kind may be dispatched before
   the first is read (`dispatch_mixed`, `dispatch_scan`); steps are read in dispatch order
   (`take`).
2. Placeholders. Each sequence that samples in a mixed step gets one placeholder appended to its
   `output_token_ids` when the step is dispatched: -(row + 1), its row in that step's outputs.
   `seq.num_placeholders` counts them; they are its last entries, oldest first (at most two,
   only inside a call). Reading a step replaces its sequences' oldest placeholder by the 1 to K
   tokens the device kept for that row (`fill`; K = 1 + drafts: a verification keeps a
   data-dependent number, `sampler.accept_drafts`).
3. A placeholder reaches the device only in the very next mixed step, as its sequence's only
   token (sampling leaves exactly one uncomputed token, and the placeholder is it). That step
   reads the real token from the previous step's outputs (`feed`) and shifts the sequence's
   positions by the extra tokens the host has not counted yet (`model_runner.mixed_step`). Later
   steps never see a placeholder: it is read first.
4. Host counts assume one token per placeholder: `num_computed_tokens` gains the extra ones at the
   read, and the pages for them were reserved at dispatch (`seq.pending_extra_tokens`).
5. A sequence that finishes at a read, or is aborted, drops its later placeholders (`drop`):
   their tokens are void. Their K/V writes land in its own pages or the scratch page, which the
   device's stream orders before any reuse of those pages.
6. A decode scan starts from tokens on the host: the unread mixed step is read before a scan is
   dispatched, and a scan writes no placeholders (its tokens are appended when it is read).
7. Proposers draft only for sequences without placeholders: they need the real last token. So
   with a proposer that drafts on the host (`Proposer.host_drafts`) the engine reads a plain
   mixed step (`plain`) before it builds the next, and lets a verification overlap only the
   plain step after it (the one that feeds its placeholders). One that drafts in the scans
   alone (EAGLE, a draft model) leaves mixed steps overlapped as without a proposer.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer.engine.request import Sequence
from jaxinfer.engine.sampler import SamplingBatch


@dataclass
class UnreadMixed:
    """A dispatched mixed step: `samplers` are its sampling sequences, each with its row and its
    draft count; `outs` the device arrays (tokens [S, K], counts [S], logprobs [S, K], top
    logprobs, top ids, expert load)."""

    samplers: list[tuple[Sequence, int, int]]
    outs: tuple

    @property
    def verifies(self) -> bool:
        """Whether any sequence carried drafts."""
        return any(d for _, _, d in self.samplers)


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


class InFlight:
    """The engine's unread steps, oldest first (1): none or one between `Engine.step` calls."""

    def __init__(self) -> None:
        self._steps: list[UnreadMixed | UnreadScan] = []

    @property
    def unread(self) -> bool:
        """Whether a dispatched step's tokens are still on the device."""
        return bool(self._steps)

    @property
    def scan(self) -> UnreadScan | None:
        """The newest unread step, if it is a decode scan (a chained scan starts from it)."""
        step = self._steps[-1] if self._steps else None
        return step if isinstance(step, UnreadScan) else None

    @property
    def plain(self) -> bool:
        """Whether the newest unread step is a mixed step that verifies no drafts (7)."""
        step = self._steps[-1] if self._steps else None
        return isinstance(step, UnreadMixed) and not step.verifies

    @property
    def feed(self) -> tuple | None:
        """The newest unread mixed step's device outputs (None: none), which the next mixed step
        reads its placeholders' tokens from (3)."""
        step = self._steps[-1] if self._steps else None
        return step.outs if isinstance(step, UnreadMixed) else None

    def _push(self, step: UnreadMixed | UnreadScan) -> None:
        """At most one step is unread before a dispatch, and of the new one's kind (1, 6)."""
        assert not self._steps or (len(self._steps) == 1 and type(self._steps[0]) is type(step)), (
            f"dispatching a {type(step).__name__} with {[type(s).__name__ for s in self._steps]}"
            " unread"
        )
        self._steps.append(step)

    def dispatch_mixed(self, samplers: list[tuple[Sequence, int, int]], outs: tuple) -> None:
        """A mixed step whose outputs are `outs` was dispatched; each of `samplers` (seq, row,
        drafts) gets its placeholder (2): the host counts one token until the step is read, and
        the pages for `drafts` more were reserved (4). A sequence with drafts has none yet (7)."""
        self._push(UnreadMixed(samplers, outs))
        for seq, row, drafts in samplers:
            assert seq.num_placeholders < (1 if drafts else 2), (seq.seq_id, seq.num_placeholders)
            seq.output_token_ids.append(-(row + 1))
            seq.num_placeholders += 1
            seq.pending_extra_tokens = drafts

    def dispatch_scan(self, scan: UnreadScan) -> None:
        """A decode scan was dispatched: from tokens on the host, or chained from the unread
        scan's final state; its sequences hold no placeholders (6)."""
        assert not any(s.num_placeholders for s in scan.seqs), "a scan over placeholders"
        self._push(scan)

    def take(self, keep: int = 0) -> UnreadMixed | UnreadScan | None:
        """The oldest unread step if more than `keep` are unread (None: not so), to read now (1).
        A mixed step's placeholders stay until the read `fill`s (or `drop`s) them."""
        return self._steps.pop(0) if len(self._steps) > keep else None

    def fill(self, seq: Sequence, row: int, tokens: list[int]) -> int:
        """Read: `seq`'s oldest placeholder, at `row` of the step just taken, becomes `tokens`
        (2), none of them pending any more (4); returns the index of the first."""
        ids = seq.output_token_ids
        index = len(ids) - seq.num_placeholders
        assert ids[index : index + 1] == [-(row + 1)], (seq.seq_id, row, ids[index:])
        ids[index : index + 1] = tokens
        seq.num_placeholders -= 1
        seq.pending_extra_tokens = 0
        return index

    def drop(self, seq: Sequence) -> None:
        """`seq` finished or was aborted: its placeholders go, their tokens void (5)."""
        if seq.num_placeholders:
            del seq.output_token_ids[-seq.num_placeholders :]
        seq.num_placeholders = seq.pending_extra_tokens = 0
