"""The engine loop: schedule (host) -> build a fixed-shape batch -> jitted step (device) -> append
tokens, check stops, record metrics (host).

A decode-only step that no waiting request could join (none waits, or the policy admits none
while a batch runs) runs `decode_steps` tokens in one jitted scan; its tokens reach the host
together, and their timestamps say so (that is what a streaming client would see).
With `async_decode`, while no waiting request could join, the next scan is dispatched from the previous scan's
final device state *before* the host reads and post-processes the previous scan's tokens, so host
work overlaps device work. Pages for both scans are reserved up front; a sequence that finishes in
scan N idles through scan N+1 (its row is masked on device or its tokens dropped on the host), and
pages it frees are only rewritten by later device work, which the stream orders after N+1.
With `async_schedule`, a mixed step is likewise dispatched before the previous mixed step's
tokens are read: tokens it feeds that the host has not seen yet are placeholders -(row + 1) that
the step reads from the previous step's device output (see docs/architecture.md).
Bad requests fail on their own with an error naming the field; they never reach the device.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.compile_counter import compile_count
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.model_runner import ModelRunner, RunnerShapes
from jaxinfer.engine.request import SamplingParams, SeqStatus, Sequence
from jaxinfer.engine.sampler import SamplingBatch
from jaxinfer.engine.scheduler import Scheduler, SchedulerConfig
from jaxinfer.metrics import StepRecord
from jaxinfer.models.config import ModelConfig


@dataclass
class _Inflight:
    """A dispatched decode scan whose results the host has not read yet."""

    seqs: list[Sequence]
    outs: tuple  # device arrays: tokens, logprobs, top logprobs, top ids, live  ([K, rows, ...])
    final: object  # DecodeState after the scan (device)
    sb: SamplingBatch
    rows: int
    k: int


@dataclass
class _PendingMixed:
    """A dispatched mixed step whose sampled tokens the host has not read yet (async scheduling).

    Each sampling sequence already holds a placeholder -(row + 1) at `output_token_ids[index]`;
    reading the step replaces it with the token (or voids it if the sequence ended meanwhile)."""

    samplers: list[tuple[Sequence, int, int]]  # (seq, row in outs, index in output_token_ids)
    outs: tuple  # device arrays: tokens, logprobs, top logprobs, top ids ([max_num_seqs, ...])


@dataclass
class StepOutput:
    """Tokens each sequence gained in one engine step (for streaming); `finished`: in this step."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        cfg: ModelConfig,
        params,
        tokenizer=None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config, self.cfg, self.tokenizer, self.clock = config, cfg, tokenizer, clock
        self.block_manager = BlockManager(config.num_pages, config.page_size, config.allocation)
        self.scheduler = Scheduler(
            SchedulerConfig(
                policy=config.scheduler,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                chunked_prefill=config.chunked_prefill,
                max_model_len=config.max_model_len,
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(
            cfg,
            params,
            RunnerShapes(
                num_pages=config.num_pages,
                page_size=config.page_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                decode_steps=config.decode_steps,
                num_logprobs=config.num_logprobs,
                chunked_prefill=config.chunked_prefill,
                decode_buckets=tuple(config.decode_buckets),
            ),
            backend=config.attention_backend,
            kv_dtype=config.kv_dtype,
            attention_options=dict(config.attention_options),
            compiler_options={k: dict(v) for k, v in config.compiler_options.items()},
        )
        self.eos_ids = tuple(cfg.eos_token_ids)
        self.sequences: list[Sequence] = []
        self.step_records: list[StepRecord] = []
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self._seeds: dict[int, int] = {}
        self._inflight: _Inflight | None = None
        self._pending: _PendingMixed | None = None
        self.chained_scans = 0  # decode scans dispatched before the previous one was read
        self.overlapped_steps = 0  # mixed steps dispatched before the previous one was read
        self.warmup_s: float | None = None
        self._compiles_at_warmup: int | None = None

    # -- requests --------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Sequence:
        """Queue a request. Invalid input gives a FAILED sequence with `error` set; no exception."""
        sampling = sampling or SamplingParams()
        now = self.clock() if arrival_time is None else arrival_time
        text = prompt if isinstance(prompt, str) else None
        seq = Sequence(next(self._ids), [], sampling, arrival_time=now, priority=priority)
        seq.prompt = text
        self.sequences.append(seq)
        try:
            seq.prompt_token_ids = self._encode(prompt)
            self._validate(seq)
        except ValueError as e:
            seq.status, seq.error, seq.finish_reason = SeqStatus.FAILED, str(e), "error"
            seq.finish_time = now
            return seq
        self._seeds[seq.seq_id] = (
            sampling.seed if sampling.seed is not None else int(self._rng.integers(2**31))
        )
        self.scheduler.add(seq)
        return seq

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the engine has no tokenizer")
            return list(self.tokenizer.encode(prompt).ids)
        return [int(t) for t in prompt]

    def _validate(self, seq: Sequence) -> None:
        ids, limit = seq.prompt_token_ids, self.config.max_model_len
        if not ids:
            raise ValueError("prompt is empty")
        if any(not 0 <= t < self.cfg.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        seq.sampling.validate(self.cfg.vocab_size)
        if seq.max_total_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({seq.sampling.max_tokens}) exceeds "
                f"max_model_len={limit}"
            )
        if (seq.sampling.logprobs or 0) > self.config.num_logprobs:
            raise ValueError(
                f"SamplingParams.logprobs={seq.sampling.logprobs} exceeds "
                f"engine.num_logprobs={self.config.num_logprobs} (top logprobs computed per token)"
            )
        if seq.sampling.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop (stop strings) needs a tokenizer")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    # -- warm-up and compile accounting ------------------------------------------------------
    def warmup(self) -> float:
        t0 = time.perf_counter()
        compile_count()  # install the listener before compiling
        self.runner.warmup(max_workers=self.config.compile_workers or None)
        self.warmup_s = time.perf_counter() - t0
        self._compiles_at_warmup = compile_count()
        return self.warmup_s

    @property
    def compiles_after_warmup(self) -> int | None:
        if self._compiles_at_warmup is None:
            return None
        return compile_count() - self._compiles_at_warmup

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Advance the engine by one scheduled batch (or one in-flight decode scan)."""
        t_start = self.clock()
        if self._inflight is None:
            out = self.scheduler.schedule(t_start)
            failed = [StepOutput(seq, [], True) for seq in out.failed]
            if not out.scheduled:  # nothing to run: the step in flight (if any) ends this one
                outputs, _ = self._read_pending()
                return outputs + failed
            seqs = [s.seq for s in out.scheduled]
            decode_only = out.is_decode_only
            k = self._lookahead(seqs) if decode_only else 1
            if k == 1:
                # Dispatch this step before reading the previous one's tokens (async schedule):
                # the device runs it while the host post-processes the previous step.
                pending = self._dispatch_mixed(out.scheduled, self._pending)
                outputs, device_s = self._read_pending()
                self._pending = pending
                if not self.config.async_schedule:
                    more, waited = self._read_pending()
                    outputs, device_s = outputs + more, device_s + waited
                num_batched, preempted = out.num_batched_tokens, len(out.preempted)
                self._record(t_start, len(seqs), num_batched, decode_only, 1, preempted,
                             device_s)  # fmt: skip
                return outputs + failed
            # A decode scan starts from tokens on the host: read the step in flight first.
            outputs, _ = self._read_pending()
            seqs = [q for q in seqs if q.status is SeqStatus.RUNNING]
            if not seqs:
                return outputs + failed
            self._inflight = self._dispatch_decode(seqs, k)
            early = outputs + failed
        else:
            early = []
        prev = self._inflight
        self._inflight = self._chain(prev) if self.config.async_decode else None
        results, device_s = self._collect(prev)
        outputs = self._append_all(results)
        fed = sum(len(new) for _, new in results)
        self._record(t_start, len(prev.seqs), fed, True, prev.k, 0, device_s)
        return early + outputs

    def _append_all(self, results) -> list[StepOutput]:
        now = self.clock()
        return [self._append(seq, new_tokens, now) for seq, new_tokens in results]

    def _record(self, t_start, num_seqs, num_batched, decode_only, k, preempted, device_s):
        running = self.scheduler.running_seqs()
        self.step_records.append(
            StepRecord(
                time=t_start,
                num_seqs=num_seqs,
                num_batched_tokens=num_batched,
                kv_pages_used=self.block_manager.num_used_pages,
                kv_pages_total=self.config.num_pages - 1,
                wasted_slots=self.block_manager.wasted_slots(running),
                kv_slots_allocated=self.config.page_size * sum(len(q.page_ids) for q in running),
                is_decode_only=decode_only,
                preemptions=preempted,
                host_ms=1e3 * ((self.clock() - t_start) - device_s),
                device_ms=1e3 * device_s,
                decode_steps=k,
            )
        )

    def _lookahead(self, seqs: list[Sequence]) -> int:
        """Decode steps to run on device: reserve their pages now, or fall back to one step."""
        k = self.config.decode_steps
        if k <= 1 or self.scheduler.can_admit_waiting:
            return 1
        for seq in seqs:
            need = min(seq.num_tokens + k - 1, seq.max_total_tokens)
            if not self.block_manager.allocate(seq, need):
                return 1
        return k

    def _sampling(self, seqs: list[Sequence], positions: list[int], rows: int) -> SamplingBatch:
        """`positions`: where each sampled token will sit (keys its random draw)."""
        return SamplingBatch.build(
            [s.sampling for s in seqs], [self._seeds[s.seq_id] for s in seqs], positions, rows
        )

    def _dispatch_mixed(self, scheduled, prev: _PendingMixed | None) -> _PendingMixed:
        """Build and dispatch one mixed step; the host does not wait for it.

        Fed tokens may be placeholders of `prev` (its sampled tokens, still on the device). Each
        sequence that samples this step gets a placeholder of its own, so the next schedule
        already sees the token it will feed; one that thereby reaches its token limit is marked
        `final_pending` (derived) and is not scheduled again.
        """
        seqs = [s.seq for s in scheduled]
        batch = self.runner.build_mixed(
            [
                s.seq.all_token_ids[s.seq.num_computed_tokens :][: s.num_new_tokens]
                for s in scheduled
            ],
            [s.seq.num_computed_tokens for s in scheduled],
            [s.seq.page_ids for s in scheduled],
        )
        positions = [s.seq.num_computed_tokens + s.num_new_tokens for s in scheduled]
        sb = self._sampling(seqs, positions, self.config.max_num_seqs)
        outs = self.runner.run_mixed(batch, sb, None if prev is None else prev.outs[0])
        self.overlapped_steps += prev is not None
        samplers = []
        for i, s in enumerate(scheduled):
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            if seq.num_computed_tokens == seq.num_tokens:  # prefill done, or a decode: samples
                seq.output_token_ids.append(-(i + 1))
                samplers.append((seq, i, len(seq.output_token_ids) - 1))
        return _PendingMixed(samplers, outs)

    def _read_pending(self) -> tuple[list[StepOutput], float]:
        """Read the mixed step in flight (if any): fill its placeholders, stamp times, check
        stops. Returns (outputs, seconds the host waited for the device)."""
        p, self._pending = self._pending, None
        if p is None:
            return [], 0.0
        t0 = self.clock()
        tok, lp, top_lp, top_ids = jax.device_get(p.outs)
        device_s = self.clock() - t0
        now = self.clock()
        outputs = []
        for seq, i, index in p.samplers:
            ids = seq.output_token_ids
            if seq.is_finished or index >= len(ids) or ids[index] != -(i + 1):
                outputs.append(StepOutput(seq, [], False))  # ended meanwhile: the token is void
                continue
            token = int(tok[i])
            ids[index] = token
            self._accept(seq, index, token, float(lp[i]), top_lp[i], top_ids[i], now)
            outputs.append(StepOutput(seq, [token], seq.is_finished))
        return outputs, device_s

    def _dispatch_decode(self, seqs: list[Sequence], k: int) -> _Inflight:
        table, state, rows = self.runner.build_decode(
            [s.all_token_ids[-1] for s in seqs],
            [s.num_tokens - 1 for s in seqs],
            [s.output_budget - len(s.output_token_ids) for s in seqs],
            [self._stop_ids(s) for s in seqs],
            [s.page_ids for s in seqs],
        )
        sb = self._sampling(seqs, [s.num_tokens for s in seqs], rows)  # loop re-keys per step
        outs, final = self.runner.run_decode(table, state, sb, k)
        return _Inflight(seqs, outs, final, sb, rows, k)

    def _chain(self, prev: _Inflight) -> _Inflight | None:
        """Dispatch the next scan from `prev`'s device state, before reading `prev`'s tokens."""
        if self.scheduler.can_admit_waiting:
            return None
        if any(s.status is not SeqStatus.RUNNING for s in prev.seqs):
            return None
        k = prev.k
        for seq in prev.seqs:  # prev may add up to k tokens before this scan's k
            if not self.block_manager.allocate(
                seq, min(seq.num_tokens + 2 * k - 1, seq.max_total_tokens)
            ):
                return None
        table = self.runner.decode_table([s.page_ids for s in prev.seqs], prev.rows)
        outs, final = self.runner.run_decode(table, prev.final, prev.sb, k)
        self.chained_scans += 1
        return _Inflight(prev.seqs, outs, final, prev.sb, prev.rows, k)

    def _collect(self, inflight: _Inflight):
        """Read a scan's tokens; returns ([(seq, tokens)], seconds the host waited for them)."""
        t0 = self.clock()
        tok, lp, top_lp, top_ids, live = jax.device_get(inflight.outs)
        device_s = self.clock() - t0
        results = []
        for i, seq in enumerate(inflight.seqs):
            if seq.is_finished:  # finished while this scan was in flight: its tokens are void
                results.append((seq, []))
                continue
            new = [(int(tok[j, i]), float(lp[j, i]), top_lp[j, i], top_ids[j, i])
                   for j in range(inflight.k) if live[j, i]]  # fmt: skip
            seq.num_computed_tokens += len(new)
            results.append((seq, new))
        return results, device_s

    def _stop_ids(self, seq: Sequence) -> list[int]:
        ids = list(seq.sampling.stop_token_ids)
        if not seq.sampling.ignore_eos:
            ids += list(self.eos_ids)
        return ids

    def _append(self, seq: Sequence, new, now: float) -> StepOutput:
        """Append a decode scan's sampled tokens, stamping times, until one ends the sequence."""
        if seq.is_finished:  # finished while a decode scan was in flight: nothing new
            return StepOutput(seq, [], False)
        appended, stop_ids = [], set(self._stop_ids(seq))
        for token, logprob, top_lp, top_ids in new:
            seq.output_token_ids.append(token)
            appended.append(token)
            self._accept(seq, len(seq.output_token_ids) - 1, token, logprob, top_lp, top_ids, now,
                         stop_ids)  # fmt: skip
            if seq.is_finished:
                break
        return StepOutput(seq, appended, seq.is_finished)

    def _accept(self, seq: Sequence, index: int, token: int, logprob, top_lp, top_ids, now,
                stop_ids=None):  # fmt: skip
        """Output token `index` (already in place) is `token`: record it; finish the sequence at
        EOS / a stop id / a stop string / max_tokens, dropping any placeholder after it."""
        if seq.sampling.logprobs is not None:
            top = {int(t): float(v) for t, v in zip(top_ids, top_lp, strict=True)}
            seq.output_logprobs.append({"token": token, "logprob": logprob, "top": top})
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_times.append(now)
        n = index + 1
        reason = None
        stop_ids = self._stop_ids(seq) if stop_ids is None else stop_ids
        if token in stop_ids or self._hit_stop_string(seq, n):
            reason = "stop"
        elif n >= seq.sampling.max_tokens:
            reason = "length"
        elif n >= seq.output_budget:
            reason = "stop"  # eos_after: the simulated EOS
        if reason is not None:
            del seq.output_token_ids[n:]
            if self.tokenizer is not None and not seq.sampling.stop:
                seq.output_text = self.tokenizer.decode(seq.output_token_ids)
            self.scheduler.finish(seq, reason, now)

    def _hit_stop_string(self, seq: Sequence, n: int) -> bool:
        """Whether the first `n` output tokens' text holds a stop string (sets output_text)."""
        if not seq.sampling.stop:
            return False
        text = self.tokenizer.decode(seq.output_token_ids[:n])
        hits = [text.find(s) for s in seq.sampling.stop if s in text]
        if hits:
            seq.output_text = text[: min(hits)]
            return True
        seq.output_text = text
        return False

    def run(self) -> list[Sequence]:
        """Step until every queued request has finished or failed."""
        while self.has_unfinished():
            self.step()
        return self.sequences
