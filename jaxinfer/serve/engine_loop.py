"""The engine in a thread of its own, fed through one command queue; the asyncio side never blocks it.

    HTTP handlers (event loop)                       engine thread
      submit(ids, sampling) ──("add", sub)──>  queue ──> engine.add_request
      abort(sub)            ──("abort", sub)─>  queue ──> engine.abort (pages freed now)
      sub.accepted / sub.final  <──── call_soon_threadsafe, one per step ──── engine.step()
      sub.events (streaming)    <────┘

Only the engine thread touches the Engine. It drains the queue between steps and blocks on it
only when nothing is left to run. Backpressure is on the asyncio side: `submit` refuses
(`QueueFull`) once the sequences accepted and not yet finished would exceed `max_num_seqs +
max_queue`, so a burst never grows memory without bound. A finished request leaves the engine
(`Engine.release`) and its step records are drained into the metrics, so a long-lived server
keeps no history. An exception inside `engine.step` (a bug, not a bad request: those fail alone
at `add_request`) fails every live request and stops the loop; `/health` then reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import traceback
from dataclasses import dataclass, field

from jaxinfer.engine.engine import Engine
from jaxinfer.engine.outputs import RequestOutput, sequence_text
from jaxinfer.engine.request import SamplingParams, Sequence
from jaxinfer.serve.metrics import ServerMetrics

log = logging.getLogger("jaxinfer.serve")


class QueueFull(Exception):
    """The server holds as many requests as it may: answer 429."""


class EngineDead(Exception):
    """The engine thread stopped (an error in a step, or shutdown): answer 503."""


@dataclass
class TokenEvent:
    """New tokens of one sample of a submission, in one engine step."""

    sub: Submission
    index: int  # the sample (SamplingParams.n)
    token_ids: list[int]
    logprobs: list[dict]  # the new tokens' entries (empty unless the request asked for them)
    finished: bool
    finish_reason: str | None = None
    text: str | None = None  # when finished: the sample's whole text (stop strings cut)


@dataclass(eq=False)
class Submission:
    """One prompt of an HTTP request on its way through the engine. `accepted` resolves to None
    or the error that refused it; `final` to its RequestOutput; `events` (streaming only) gets
    its TokenEvents and then the submission itself once `final` is set."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    accepted: asyncio.Future
    final: asyncio.Future
    events: asyncio.Queue | None = None
    tag: int = 0  # the handler's (which prompt of the request)
    seq: Sequence | None = field(default=None, repr=False)  # engine thread only

    @property
    def num_seqs(self) -> int:
        return self.sampling.num_samples


class EngineLoop:
    """Runs `engine` in a daemon thread; `submit` / `abort` from the event loop `loop`."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, metrics: ServerMetrics,
                 max_queue: int) -> None:  # fmt: skip
        self.engine, self.loop, self.metrics = engine, loop, metrics
        self.capacity = engine.config.max_num_seqs + max_queue  # sequences accepted at once
        self.num_outstanding = 0  # sequences submitted and not yet final (event loop only)
        self.error: str | None = None  # why the engine thread stopped, if it did
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, Submission] = {}  # seq_id of each sample -> its submission
        self._preemptions_seen = 0
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- event loop side ---------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], sampling: SamplingParams, *, stream: bool
               ) -> list[Submission]:  # fmt: skip
        """Queue every prompt of one request, or none (QueueFull, EngineDead)."""
        if not self.alive:
            raise EngineDead(self.error or "the engine is not running")
        need = len(prompts) * sampling.num_samples
        if self.num_outstanding and self.num_outstanding + need > self.capacity:
            self.metrics.rejected.inc()
            raise QueueFull(f"the server holds {self.num_outstanding} sequences (capacity "
                            f"{self.capacity}: engine.max_num_seqs + max_queue)")  # fmt: skip
        now = self.engine.clock()
        events = asyncio.Queue() if stream else None
        new = self.loop.create_future
        subs = [Submission(ids, sampling, now, new(), new(), events, tag=i)
                for i, ids in enumerate(prompts)]  # fmt: skip
        self.num_outstanding += need
        for sub in subs:
            self._commands.put(("add", sub))
        return subs

    def abort(self, subs: list[Submission]) -> None:
        """Cancel what of `subs` is unfinished (a client left); safe to call more than once."""
        for sub in subs:
            if not sub.final.done():
                self._commands.put(("abort", sub))

    def _deliver(self, items: list) -> None:
        """On the event loop: hand one step's results to their handlers."""
        for kind, sub, value in items:
            if kind == "event":
                if sub.events is not None:
                    sub.events.put_nowait(value)
            elif kind == "accepted":
                if not sub.accepted.done():
                    sub.accepted.set_result(value)
                if value is not None:  # refused: it is final too (no output)
                    self.num_outstanding -= sub.num_seqs
                    if not sub.final.done():
                        sub.final.set_result(None)
                    if sub.events is not None:
                        sub.events.put_nowait(sub)
            elif kind == "final":
                self.num_outstanding -= sub.num_seqs
                if not sub.final.done():
                    sub.final.set_result(value)
                if sub.events is not None:
                    sub.events.put_nowait(sub)

    def _post(self, items: list) -> None:
        if items:  # (a closed event loop raises: the server is shutting down)
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._deliver, items)

    # -- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                items: list = []
                block = not self.engine.has_unfinished()
                while True:
                    try:
                        command = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    if command is None:
                        return
                    self._command(command, items)
                    block = False
                if self.engine.has_unfinished():
                    self._step(items)
                self._observe_engine()
                self._post(items)
        except Exception:
            self.error = traceback.format_exc()
            log.error("the engine thread stopped:\n%s", self.error)
            live = {id(s): s for s in self._live.values()}.values()
            items = [("final", sub, None) for sub in live]
            self._live.clear()
            while True:  # what was queued and never added: refused
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command is not None and command[0] == "add":
                    items.append(("accepted", command[1], "the engine stopped"))
            self._post(items)

    def _command(self, command: tuple, items: list) -> None:
        kind, sub = command
        if kind == "add":
            seq = self.engine.add_request(sub.prompt_token_ids, sub.sampling,
                                          arrival_time=sub.arrival_time)  # fmt: skip
            if seq.is_finished:  # refused (its own fault): nothing else is touched
                items.append(("accepted", sub, seq.error or "refused"))
                self.engine.release([seq])
                self.metrics.requests.labels("refused").inc()
                return
            sub.seq = seq
            for s in (seq, *seq.siblings):
                self._live[s.seq_id] = sub
            items.append(("accepted", sub, None))
        elif kind == "abort" and sub.seq is not None and sub.seq.seq_id in self._live:
            self.engine.abort(sub.seq)
            self._finish(sub, items)

    def _step(self, items: list) -> None:
        ended = {}
        for out in self.engine.step():
            sub = self._live.get(out.seq.seq_id)
            if sub is None:
                continue
            if sub.events is not None and (out.new_token_ids or out.finished):
                s, n = out.seq, len(out.new_token_ids)
                lps = s.output_logprobs[len(s.output_logprobs) - n :] if n else []
                if s.sampling.logprobs is None:
                    lps = []
                ev = TokenEvent(sub, s.sample_index, out.new_token_ids, lps, out.finished)
                if out.finished:
                    ev.finish_reason, ev.text = s.finish_reason, self._text(s)
                items.append(("event", sub, ev))
            if out.finished:
                ended[id(sub)] = sub
        for sub in ended.values():
            if all(s.is_finished for s in (sub.seq, *sub.seq.siblings)):
                self._finish(sub, items)

    def _text(self, seq: Sequence) -> str | None:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or seq.error is not None:
            return None
        return sequence_text(seq, tokenizer)

    def _finish(self, sub: Submission, items: list) -> None:
        seq = sub.seq
        family = (seq, *seq.siblings)
        output = RequestOutput.of(seq, self.engine.tokenizer)
        self.metrics.observe_finished(family)
        for s in family:
            self._live.pop(s.seq_id, None)
        self.engine.release([seq])
        items.append(("final", sub, output))

    def _observe_engine(self) -> None:
        e = self.engine
        records = e.step_records
        if records:
            self.metrics.steps.inc(len(records))
            del records[:]  # (a server keeps no step history)
        preemptions = e.scheduler.num_preemptions
        self.metrics.preemptions.inc(preemptions - self._preemptions_seen)
        self._preemptions_seen = preemptions
        bm = e.block_manager
        self.metrics.waiting.set(e.scheduler.num_waiting)
        self.metrics.running.set(e.scheduler.num_running)
        self.metrics.kv_use.set(bm.num_used_pages / max(1, bm.capacity))
        compiles = e.compiles_after_warmup
        if compiles is not None:
            self.metrics.compiles_after_warmup.set(compiles)
