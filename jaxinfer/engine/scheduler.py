"""Continuous-batching scheduler: which sequences run this step, with how many new tokens each.

One `schedule(now)` call builds one step, in this order:

1. Decodes: running sequences with one uncomputed token (the last sampled one), in policy order,
   1 token each. Each needs pages for `num_tokens` tokens.
2. Running prefills (chunked prefill in progress), in policy order.
3. Admissions from the waiting queue: preempted sequences first, then the rest, each group in
   policy order. Admission stops at the first sequence that does not fit (no overtaking), and is
   skipped entirely in a step that preempted something (a victim is not re-admitted at once).

`static` (the naive baseline) admits only whole batches: when nothing runs, the batch is the first
`max_num_seqs` waiting sequences; admitting it may take several steps of the token budget (its
prompts are prefilled chunk by chunk), and nobody else is admitted until it has finished. The
batch closes early when a member does not fit in the KV cache or a step preempts.

Limits: at most `max_num_seqs` running, at most `max_num_batched_tokens` new tokens per step. With
`chunked_prefill` a prefill gets `min(uncomputed, budget left)` tokens; without it a prefill is
scheduled whole or not at all, and one longer than the budget is allowed only as the first (so
the only) thing scheduled in its step, which happens once the running sequences have drained.

Preemption by recompute: when a running sequence cannot get the pages it needs, the running
sequence LAST in policy order (maybe itself, maybe one already scheduled this step, which is then
unscheduled) loses its pages and goes back to the front of the waiting queue with
`num_computed_tokens = 0`; it keeps its outputs and re-prefills prompt + outputs on resume. The
first running sequence in policy order therefore advances every step, so the loop cannot
deadlock: `add` rejects up front any sequence that could not fit in the cache alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.policies import POLICIES
from jaxinfer.engine.request import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """This step feeds `seq.all_token_ids[c:][:num_new_tokens - num_draft_tokens]` (c =
    seq.num_computed_tokens), then `seq.draft_token_ids[:num_draft_tokens]` to verify."""

    seq: Sequence
    num_new_tokens: int
    num_draft_tokens: int = 0

    @property
    def new_token_ids(self) -> list[int]:
        seq, n = self.seq, self.num_new_tokens - self.num_draft_tokens
        fed = seq.all_token_ids[seq.num_computed_tokens :][:n]
        return fed + seq.draft_token_ids[: self.num_draft_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # failed during this call (see _reserve)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_decode_only(self) -> bool:
        """Non-empty and every sequence feeds exactly its last token (read before the step runs)."""
        return bool(self.scheduled) and all(
            s.num_new_tokens == 1 and s.seq.num_computed_tokens == s.seq.num_tokens - 1
            for s in self.scheduled
        )


class Scheduler:
    """Reads the engine's config: `scheduler` (the policy), `max_num_seqs`,
    `max_num_batched_tokens`, `chunked_prefill`, `max_model_len`."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config, self.block_manager = config, block_manager
        self.policy = POLICIES[config.scheduler]
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # every preemption, wherever it happens
        self._batch: list[Sequence] = []  # static: members of the current batch not yet admitted

    # -- queue -------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> bool:
        """Queue a WAITING sequence; one that can never run is FAILED at once (returns False)."""
        if seq.status is not SeqStatus.WAITING:
            raise ValueError(f"sequence {seq.seq_id} has status {seq.status.value}, not waiting")
        error = self._admission_error(seq)
        if error is not None:
            self._set_done(seq, SeqStatus.FAILED, "error", seq.arrival_time, error)
            return False
        self.waiting.append(seq)
        return True

    def _admission_error(self, seq: Sequence) -> str | None:
        bm, total, limit = self.block_manager, seq.max_total_tokens, self.config.max_model_len
        if seq.num_prompt_tokens == 0:
            return f"request {seq.seq_id}: the prompt is empty"
        if total > limit:
            return (
                f"request {seq.seq_id}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                f"({seq.sampling.max_tokens}) = {total} exceeds max_model_len={limit}"
            )
        if bm.pages_for(total) > bm.capacity:
            return (
                f"request {seq.seq_id}: {total} tokens need {bm.pages_for(total)} KV pages of "
                f"{bm.page_size} but the cache has only {bm.capacity}"
            )
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def can_admit_waiting(self) -> bool:
        """Whether the next step may admit a waiting sequence (the engine keeps steps short then).

        Not while every batch slot is taken: a full batch runs decode scans even with a queue (a
        slot freed inside a scan is filled at the scan's end, at most decode_steps - 1 steps late).
        """
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        return self.policy.admits_while_running or not self.running or bool(self._batch)

    def running_seqs(self) -> list[Sequence]:
        return sorted(self.running, key=self.policy.key)

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled = _Scheduled()  # insertion-ordered: decodes, running prefills, new
        was_running = bool(self.running)
        order = [s for s in self.running_seqs() if not s.final_pending]
        for seq in order:
            if seq.num_uncomputed_tokens < 1:
                raise RuntimeError(f"running sequence {seq.seq_id} has no token to feed")
        decodes = [s for s in order if s.num_uncomputed_tokens == 1]
        prefills = [s for s in order if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if seq.status is not SeqStatus.RUNNING:  # preempted as a victim earlier in this loop
                continue
            n = self._num_new_tokens(seq, scheduled)
            # (a placeholder's extra tokens, not counted yet, need their slots too)
            need = seq.num_computed_tokens + n + seq.pending_extra_tokens
            if n and self._reserve(seq, need, scheduled, out, now):
                scheduled[seq] = n

        if out.preempted:
            self._batch = []
        elif len(self.running) < self.config.max_num_seqs:  # (sorting the queue costs: skip it)
            for seq in self._admission_order(was_running):
                if len(self.running) >= self.config.max_num_seqs:
                    break
                parent = seq.parent  # a further sample (SamplingParams.n) shares its prompt
                if (
                    parent is not None
                    and not parent.is_finished
                    and (parent.num_computed_tokens < parent.num_prompt_tokens)
                ):
                    continue  # it waits for its parent's prompt; later ones may go first
                if parent is not None and parent.status is SeqStatus.RUNNING:
                    cached = self.block_manager.fork(parent, seq)
                else:
                    cached = self.block_manager.match_prefix(seq)  # (prefix caching)
                seq.num_computed_tokens += cached
                n = self._num_new_tokens(seq, scheduled)
                if not n or not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                    if cached:  # (undone: it stays waiting, holding nothing)
                        self.block_manager.free(seq)
                        seq.num_computed_tokens = 0
                    if n:
                        self._batch = []  # a static batch is what fits
                    break  # no overtaking: later sequences wait too
                seq.num_cached_tokens += cached
                self.waiting.remove(seq)
                if seq in self._batch:
                    self._batch.remove(seq)
                self.running.append(seq)
                seq.status = SeqStatus.RUNNING
                if seq.scheduled_time is None:
                    seq.scheduled_time = now
                scheduled[seq] = n

        out.scheduled = [ScheduledSeq(s, n, max(0, n - s.num_uncomputed_tokens))
                         for s, n in scheduled.items()]  # fmt: skip
        return out

    def _admission_order(self, was_running: bool) -> list[Sequence]:
        """Waiting sequences this step may admit, in order (see `static` in the module doc)."""
        waiting = sorted(self.waiting, key=self._waiting_key)
        if self.policy.admits_while_running:
            return waiting
        if not was_running:
            self._batch = waiting[: self.config.max_num_seqs]
        return list(self._batch)

    def _waiting_key(self, seq: Sequence) -> tuple:
        if self.policy.prefix_first:
            cached = self.block_manager.cached_prefix_tokens(seq)
            return (seq.status is not SeqStatus.PREEMPTED, -cached, *self.policy.key(seq))
        return (seq.status is not SeqStatus.PREEMPTED, *self.policy.key(seq))

    def _num_new_tokens(self, seq: Sequence, scheduled: _Scheduled) -> int:
        """Tokens to feed `seq` this step under the budget left (0: not this step); a decode's
        draft tokens count, as many as fit."""
        left = self.config.max_num_batched_tokens - scheduled.total
        need = seq.num_uncomputed_tokens
        if need == 1 and seq.draft_token_ids:
            return min(1 + len(seq.draft_token_ids), max(left, 0))
        if need <= left:
            return need
        if self.config.chunked_prefill:
            return max(left, 0)
        return need if not scheduled else 0  # an over-budget whole prefill runs alone

    def _reserve(
        self,
        seq: Sequence,
        num_tokens: int,
        scheduled: dict[Sequence, int],
        out: SchedulerOutput,
        now: float,
    ) -> bool:
        """Pages for a running `seq` to hold `num_tokens`, preempting the last in policy order."""
        while not self.block_manager.allocate(seq, num_tokens):
            victim = max(self.running, key=self.policy.key)
            if victim is seq and len(self.running) == 1:  # unreachable after add's check
                self.fail(seq, f"request {seq.seq_id}: {num_tokens} tokens do not fit", now)
                out.failed.append(seq)
                return False
            self._preempt(victim)
            scheduled.pop(victim, None)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    # -- completion --------------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str, now: float) -> None:
        """FINISHED with `reason` ("stop", "length", "abort"); its pages are freed."""
        self._set_done(seq, SeqStatus.FINISHED, reason, now, None)

    def abort(self, seq: Sequence, now: float) -> None:
        self.finish(seq, "abort", now)

    def fail(self, seq: Sequence, error: str, now: float) -> None:
        """FAILED with finish_reason "error" and the message in `seq.error`; pages freed."""
        self._set_done(seq, SeqStatus.FAILED, "error", now, error)

    def _set_done(
        self, seq: Sequence, status: SeqStatus, reason: str, now: float, error: str | None
    ) -> None:
        self.block_manager.free(seq)
        for queue in (self.running, self.waiting, self._batch):
            if seq in queue:
                queue.remove(seq)
        seq.status, seq.finish_reason, seq.finish_time, seq.error = status, reason, now, error


class _Scheduled(dict):
    """Sequence -> tokens scheduled this step, with a running total (summing it per sequence was
    quadratic in the batch: ~65k additions per step at 256 sequences)."""

    total = 0

    def __setitem__(self, seq, n: int) -> None:
        self.total += n - self.get(seq, 0)
        super().__setitem__(seq, n)

    def pop(self, seq, default=None):
        n = super().pop(seq, default)
        if n:
            self.total -= n
        return n
