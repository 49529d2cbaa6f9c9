"""The engine loop: schedule (host) -> build a fixed-shape batch -> jitted step (device) -> append
tokens, check stops, record metrics (host).

A decode-only step that no waiting request could join (none waits, or the policy admits none
while a batch runs) runs `decode_steps` rounds in one jitted scan; its tokens reach the host
together, and their timestamps say so (that is what a streaming client would see). Everything
else runs as a mixed step. Steps are dispatched before the previous one is read, so host work
overlaps device work (`async_decode`, `async_schedule`); `inflight.py` holds that state and its
invariants. With a proposer, decodes carry draft tokens that the step verifies
(`proposer.py`); with adaptive speculation, only while that has been the faster path at the
batch's size (`adaptive.py`). Bad requests fail on their own with an error naming the field;
they never reach the device.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from jaxinfer.engine.adaptive import MIN_LIVE, AdaptiveSpeculation
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.compile_counter import compile_count
from jaxinfer.engine.config import EngineConfig, resolve_dtype
from jaxinfer.engine.draft_model import DraftModelProposer, early_exit_draft
from jaxinfer.engine.eagle import EagleProposer, init_head, load_head
from jaxinfer.engine.inflight import InFlight, UnreadScan
from jaxinfer.engine.loading import load_model, quantize_for_engine
from jaxinfer.engine.model_runner import ModelRunner, pick_bucket
from jaxinfer.engine.ngram import NgramProposer
from jaxinfer.engine.proposer import Proposer
from jaxinfer.engine.request import (
    SamplingParams,
    SeqStatus,
    Sequence,
    is_int,
    prompt_token_ids,
    sample_seed,
)
from jaxinfer.engine.sampler import SamplingBatch
from jaxinfer.engine.scheduler import ScheduledSeq, Scheduler
from jaxinfer.kv.cache import kv_page_bytes
from jaxinfer.metrics import StepRecord
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.spec import param_bytes, param_shardings
from jaxinfer.parallel.multihost import Leader
from jaxinfer.parallel.sharding import EngineShardings
from jaxinfer.parallel.tensor import fit_kv_heads_to_mesh


def _message(e: Exception) -> str:
    """A request's error: the message, with the exception's type when it is not a ValueError."""
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


@dataclass
class StepOutput:
    """Tokens each sequence gained in one engine step (for streaming); `finished`: in this step."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


def pages_in_budget(config: EngineConfig, cfg: ModelConfig, budget_bytes: int | None = None) -> int:
    """KV pages (the scratch page included) of `engine.num_pages: auto`: what is left of the
    memory budget (`budget_bytes`, else `engine.memory_budget_gb`, else 0.9 x the device's
    `bytes_limit`) per device, times the devices of the mesh's "model" axis (which shards both
    params and pages), after the stored params (`param_bytes`: a quantized model's are fewer)
    and `workspace_bytes`, in pages of `kv_page_bytes`."""
    if budget_bytes is None and config.memory_budget_gb is not None:
        budget_bytes = int(config.memory_budget_gb * 1e9)
    device = jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if budget_bytes is None:
        if limit is None:
            raise ValueError(f"engine.num_pages=auto needs engine.memory_budget_gb (GB): the "
                             f"{device.platform} device reports no memory size")  # fmt: skip
        budget_bytes = int(0.9 * limit)
    elif limit is not None and budget_bytes > limit:
        # (an H200 run with 120 GB ran out of memory at its first decode: JAX's allocator
        # holds 75% of a GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise)
        raise ValueError(
            f"engine.memory_budget_gb={budget_bytes / 1e9:.4g} is more than the {device.platform} "
            f"device's allocator holds ({limit / 1e9:.4g} GB, its bytes_limit): lower it, or "
            f"raise XLA_PYTHON_CLIENT_MEM_FRACTION before JAX starts"
        )
    total = budget_bytes * config.mesh.get("model", 1)
    params, workspace = param_bytes(cfg), workspace_bytes(config, cfg)
    page = kv_page_bytes(cfg, config.page_size, config.kv_dtype)
    pages = (total - params - workspace) // page
    if pages < 2:
        raise ValueError(
            f"engine.num_pages=auto: a budget of {total / 1e9:.3g} GB leaves "
            f"{(total - params - workspace) / 1e9:.3g} GB after the params ({params / 1e9:.3g} GB)"
            f" and the workspace ({workspace / 1e9:.3g} GB), fewer than 2 KV pages of "
            f"{page} bytes: raise engine.memory_budget_gb"
        )
    config.check_pages(int(pages), f"engine.num_pages=auto ({int(pages)} pages in a budget of "
                                   f"{total / 1e9:.3g} GB, engine.memory_budget_gb)")  # fmt: skip
    return int(pages)


def workspace_bytes(config: EngineConfig, cfg: ModelConfig) -> int:
    """A rough upper bound on one step's transient device memory, all in fp32: a mixed step's
    activations over its tokens (hidden, q/k/v, gate/up, one row of attention scores over
    max_model_len keys per query head) and the sampled rows' logits, four copies (softmax,
    sort, filtered). A formula, not a measurement: it keeps the pool from claiming it."""
    t = config.max_step_tokens
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    activations = t * (2 * cfg.hidden_size + qkv + 3 * cfg.intermediate_size)
    scores = t * cfg.num_heads * config.max_model_len
    logits = 4 * config.max_num_seqs * cfg.vocab_size
    return 4 * (activations + scores + logits)


def make_proposer(config: EngineConfig, model_config: ModelConfig, params=None,
                  mesh=None) -> Proposer | None:  # fmt: skip
    """The proposer `config.speculative` names (None: no speculation); a draft model is loaded
    (in the engine's dtype, onto `mesh`) and must share the target's vocabulary; a
    self-speculative draft is the first layers of `params`."""
    spec = config.speculative
    rejection = spec.draft_sampling == "rejection"
    if spec.method in ("draft", "self", "eagle") and rejection and config.penalties:
        raise ValueError("engine.speculative.draft_sampling=rejection does not apply penalties "
                         "to the draft's distribution: with engine.penalties use "
                         "draft_sampling: greedy")  # fmt: skip
    if spec.method == "draft":
        try:
            cfg, params, _ = load_model(spec.draft_model, config.dtype, config.seed, mesh)
        except (OSError, ValueError) as e:  # (a CheckpointError is a ValueError)
            raise ValueError(f"engine.speculative.draft_model={spec.draft_model!r}: {e}") from e
        if cfg.vocab_size != model_config.vocab_size:
            raise ValueError(f"engine.speculative.draft_model={spec.draft_model!r} has a "
                             f"vocabulary of {cfg.vocab_size} tokens, the model "
                             f"{model_config.vocab_size}: a draft must share the target's")  # fmt: skip
        if config.max_model_len > cfg.max_context:
            raise ValueError(f"engine.max_model_len={config.max_model_len} exceeds the draft "
                             f"model's {cfg.describe_context()}")  # fmt: skip
        return DraftModelProposer(cfg, params, spec.num_draft_tokens, rejection)
    if spec.method == "self":
        if spec.draft_layers >= model_config.num_layers:
            raise ValueError(f"engine.speculative.draft_layers={spec.draft_layers} must be fewer "
                             f"than the model's {model_config.num_layers} layers")  # fmt: skip
        cfg, params = early_exit_draft(model_config, params, spec.draft_layers)
        return DraftModelProposer(cfg, params, spec.num_draft_tokens, rejection)
    if spec.method == "eagle":
        info = {}
        if spec.eagle_head == "random":
            head = init_head(model_config, jax.random.key(config.seed))
        else:
            head, info = load_head(spec.eagle_head, model_config)
        return EagleProposer(model_config, head, spec.num_draft_tokens, rejection,
                             tuple(info.get("feature_layers", ())))  # fmt: skip
    if spec.method == "ngram":
        return NgramProposer(spec.num_draft_tokens, spec.ngram_max, spec.ngram_min,
                             config.max_model_len)  # fmt: skip
    return None


class Engine:
    """One engine: `config` (EngineConfig) drives it, `model_config` (ModelConfig) describes
    the model whose `params` it serves on the mesh `config.mesh` (params are placed there).

    A plain model is quantized here when `config.quant` asks for formats (`quantize_for_engine`);
    `num_pages: auto` is resolved here (`pages_in_budget`), so `self.config.num_pages` is a
    number."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        params,
        tokenizer=None,
        clock: Callable[[], float] = time.perf_counter,
        proposer: Proposer | None = None,
    ) -> None:
        if config.dtype == "auto":  # as load_model resolved it (a draft model is loaded in it)
            config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype))
        self.config, self.model_config, self.tokenizer, self.clock = (
            config, model_config, tokenizer, clock
        )  # fmt: skip
        if config.max_model_len > model_config.max_context:
            raise ValueError(
                f"engine.max_model_len={config.max_model_len} exceeds the model's "
                f"{model_config.describe_context()}"
            )
        self.shardings = EngineShardings.for_config(config.mesh)
        # fewer KV heads than the mesh's model axis: each replicated (parallel/tensor.py)
        model_config, params = fit_kv_heads_to_mesh(model_config, params, self.shardings.mesh)
        self.model_config = model_config

        if config.quant.active and not model_config.has_formats:
            model_config, params = quantize_for_engine(config, model_config, params, tokenizer,
                                                       self.shardings.mesh)  # fmt: skip
            self.model_config = model_config
        if config.num_pages == "auto":
            config = dataclasses.replace(config, num_pages=pages_in_budget(config, model_config))
            self.config = config
        params = jax.device_put(params, param_shardings(model_config, self.shardings.mesh))
        # prefix caching: a page's contents also depend on the model, its dtypes and the KV dtype
        salt = f"{config.model}|{model_config!r}|{config.kv_dtype}".encode()
        self.block_manager = BlockManager(config.num_pages, config.page_size, config.allocation,
                                          config.prefix_caching, salt)  # fmt: skip
        self.scheduler = Scheduler(config, self.block_manager)
        if proposer is None:
            proposer = make_proposer(config, model_config, params, self.shardings.mesh)
        self.runner = ModelRunner(model_config, params, config, self.shardings, proposer)
        if jax.process_count() > 1 and jax.process_index() == 0:
            # a multi-host engine: this process schedules; the others follow its device calls
            # (parallel/multihost.py; they built this engine too, `engine/follower.py`)
            self.runner.driver = Leader()
        self.proposer = proposer
        # adaptive speculation: the policy, and when the host was last done with a scan's tokens
        # (a chained scan's time starts there: `_measure`)
        self.adaptive = AdaptiveSpeculation() if self.runner.adaptive else None
        self._scan_done_at = -float("inf")
        self.eos_ids = tuple(model_config.eos_token_ids)
        self.sequences: list[Sequence] = []
        self.step_records: list[StepRecord] = []
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self._seeds: dict[int, int] = {}
        self.inflight = InFlight()  # steps dispatched, not read yet
        self._preemptions_recorded = 0  # of scheduler.num_preemptions, in step records
        self._evictions_recorded = 0  # of block_manager.num_evictions
        self._expert_load = None  # MoE rows per expert read since the last step record
        # speculative verifications read since the last record: drafts, and how many kept j
        self._drafted, self._verifications = 0, []
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
        """Queue a request. Invalid input gives a FAILED sequence with `error` set (naming the
        field and its value); it never raises, and never touches the engine's other requests."""
        sampling = SamplingParams() if sampling is None else sampling
        now = self.clock() if arrival_time is None else arrival_time
        text = prompt if isinstance(prompt, str) else None
        seq = Sequence(next(self._ids), [], sampling, arrival_time=now, priority=priority)
        seq.prompt = text
        self.sequences.append(seq)
        try:
            if not isinstance(sampling, SamplingParams):
                raise ValueError(f"sampling must be a SamplingParams, got "
                                 f"{type(sampling).__name__} {sampling!r:.60}")  # fmt: skip
            if not is_int(priority):
                raise ValueError(f"priority must be an int, got {priority!r:.40}")
            seq.prompt_token_ids = self._encode(prompt)
            self._validate(seq)
        except Exception as e:  # bad input of any shape fails this request alone
            seq.status, seq.error, seq.finish_reason = SeqStatus.FAILED, _message(e), "error"
            seq.finish_time = now
            return seq
        seed = sampling.seed if sampling.seed is not None else int(self._rng.integers(2**31))
        self._seeds[seq.seq_id] = seed
        if not self.scheduler.add(seq):  # (fails it if it can never fit: length, cache size)
            return seq
        for i in range(1, sampling.num_samples):  # parallel sampling: the further samples
            sib = Sequence(next(self._ids), list(seq.prompt_token_ids), sampling, arrival_time=now,
                           priority=priority, sample_index=i, parent=seq)  # fmt: skip
            sib.prompt = text
            self.sequences.append(sib)
            self._seeds[sib.seq_id] = sample_seed(seed, i)
            seq.siblings.append(sib)
            self.scheduler.add(sib)
        return seq

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt is a string but model {self.config.model!r} was loaded without a "
                    "tokenizer (a preset has none; a checkpoint directory needs a "
                    "tokenizer.json); pass token ids instead"
                )
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt is not valid Unicode text: {e.reason} at index "
                                 f"{e.start} ({prompt[e.start:e.end]!r})") from None  # fmt: skip
            return list(self.tokenizer.encode(prompt).ids)
        return prompt_token_ids(prompt)

    def _validate(self, seq: Sequence) -> None:
        """What only the engine can check (the vocabulary, its options); the scheduler checks
        the prompt's and the cache's sizes when the request is queued."""
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in seq.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seq.sampling.validate(vocab, self.config.max_num_seqs)
        if (seq.sampling.logprobs or 0) > self.config.num_logprobs:
            raise ValueError(
                f"SamplingParams.logprobs={seq.sampling.logprobs} exceeds "
                f"engine.num_logprobs={self.config.num_logprobs} (top logprobs computed per token)"
            )
        if seq.sampling.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop (stop strings) needs a tokenizer")
        if seq.sampling.uses_penalties and not self.config.penalties:
            raise ValueError("SamplingParams penalties / logit_bias need an engine built with "
                             "engine.penalties=true")  # fmt: skip
        if len(seq.sampling.logit_bias) > self.config.max_logit_bias:
            raise ValueError(f"SamplingParams.logit_bias has {len(seq.sampling.logit_bias)} "
                             f"entries > engine.max_logit_bias={self.config.max_logit_bias}")  # fmt: skip

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.inflight.unread

    def release(self, seqs) -> None:
        """Forget finished (or failed) sequences whose results the caller has taken, so a long
        run's host memory stays bounded: they leave `sequences` and the engine's seed table."""
        seqs = [x for s in seqs for x in (s, *s.siblings)]
        done = {id(s) for s in seqs if s.is_finished}
        if not done:
            return
        self.sequences = [s for s in self.sequences if id(s) not in done]
        for s in seqs:
            if id(s) in done:
                self._seeds.pop(s.seq_id, None)

    def abort(self, seq: Sequence) -> None:
        """Stop a request and all its samples: FINISHED with reason "abort", pages freed now,
        tokens kept so far (placeholders of a step in flight dropped). The step in flight, if
        any, then finds them finished and voids their tokens, as for a stop (inflight.py, 5)."""
        now = self.clock()
        for s in (seq, *seq.siblings):
            if s.is_finished:
                continue
            self.inflight.drop(s)
            s.draft_token_ids = []
            self.scheduler.abort(s, now)

    def close(self) -> None:
        """End the other processes of a multi-host engine (they return from `follow`); the
        engine makes no device call after it. Nothing to do on one process."""
        if self.runner.driver is not None:
            self.runner.driver.close()

    # -- warm-up and compile accounting ------------------------------------------------------
    def warmup(self, progress=None) -> float:
        """Compile every executable the engine can use; `progress(done, total)` is called as
        they finish. Returns the seconds taken."""
        t0 = time.perf_counter()
        compile_count()  # install the listener before compiling
        self.runner.warmup(max_workers=self.config.compile_workers or None, progress=progress)
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
        """Advance the engine by one scheduled batch (or one unread decode scan)."""
        t_start = self.clock()
        if self.inflight.scan is not None:
            return self._step_scan(t_start, [])
        early, waited = [], 0.0
        if self.config.penalties:
            # Penalties count the real tokens of every context: read the step in flight first.
            early, waited = self._read_mixed()
        if self.proposer is not None and self.proposer.host_drafts:
            # A proposer extends real tokens (inflight.py, 7): a plain step in flight is read
            # first. A verification in flight is read after the next step, which is then a
            # plain one, is dispatched: verifications alternate with overlapped plain steps.
            # Adaptive speculation drafts in mixed steps only where its batch size's decode scans
            # measured speculation faster (mixed steps are not measured: prefill chunks would
            # blur the rate; nor probes).
            n = max(len(self.scheduler.running), 1)
            bucket = pick_bucket(self.runner.seq_buckets, n)
            speculate = self.adaptive is None or self.adaptive.measured_faster(bucket)
            if speculate and self.inflight.plain:
                early, waited = self._read_mixed()
            self._propose(speculate)
        out = self.scheduler.schedule(t_start)
        early += [StepOutput(seq, [], True) for seq in out.failed]
        if not out.scheduled:  # nothing to run: the step in flight (if any) ends this one
            outputs, _ = self._read_mixed()
            return early + outputs
        seqs = [s.seq for s in out.scheduled]
        decode_only = out.is_decode_only  # (read before the dispatch moves the counts)
        k = self._lookahead(seqs) if decode_only else 1
        if k > 1:
            # A decode scan starts from tokens on the host: read the step in flight first.
            outputs, _ = self._read_mixed()
            seqs = [q for q in seqs if q.status is SeqStatus.RUNNING]
            if not seqs:
                return early + outputs
            try:
                self._dispatch_decode(seqs, k)
            except Exception as e:  # a request the host cannot pack fails alone
                return early + outputs + self._fail_unbuildable(seqs, e)
            return self._step_scan(t_start, early + outputs)
        # Dispatch this step before reading the previous one's tokens (async schedule): the
        # device runs it while the host post-processes the previous step.
        try:
            self._dispatch_mixed(out.scheduled)
        except Exception as e:  # a request the host cannot pack fails alone
            outputs, _ = self._read_mixed()
            return early + outputs + self._fail_unbuildable(seqs, e)
        # the previous step's tokens (without async scheduling, this one's too)
        outputs, device_s = self._read_mixed(keep=1 if self.config.async_schedule else 0)
        self._record(t_start, len(seqs), out.num_batched_tokens, decode_only, 1,
                     device_s + waited)  # fmt: skip
        return early + outputs

    def _fail_unbuildable(self, seqs: list[Sequence], err: Exception) -> list[StepOutput]:
        """A step could not be built or dispatched: fail the sequences whose own inputs cannot be
        packed (each tried alone); if none can be singled out, every sequence of the step."""
        bad = [s for s in seqs if self._unpackable(s)] or seqs
        now = self.clock()
        for seq in bad:
            self.scheduler.fail(seq, f"request {seq.seq_id} could not be run: {_message(err)}",
                                now)  # fmt: skip
        return [StepOutput(seq, [], True) for seq in bad]

    def _unpackable(self, seq: Sequence) -> bool:
        try:
            SamplingBatch.build([seq.sampling], [self._seeds[seq.seq_id]], [seq.num_tokens], 1,
                                put=lambda x: x)  # fmt: skip
            np.asarray(seq.all_token_ids + seq.draft_token_ids, np.int32)
        except Exception:
            return True
        return False

    def _step_scan(self, t_start: float, early: list[StepOutput]) -> list[StepOutput]:
        """Read the unread decode scan, after dispatching the next from its final state."""
        if self.config.async_decode:
            self._chain(self.inflight.scan)
        scan = self.inflight.take()
        results, counts, device_s = self._collect(scan)
        outputs = self._append_all(results)
        fed = sum(len(new) for _, new in results)
        self._record(t_start, len(scan.seqs), fed, True, scan.rounds, device_s,
                     self._drafts(scan))  # fmt: skip
        if self.adaptive is not None:
            self._measure(scan, counts, results)
        return early + outputs

    def _append_all(self, results) -> list[StepOutput]:
        now = self.clock()
        return [self._append(seq, new_tokens, now) for seq, new_tokens in results]

    def _add_verification(self, drafts: int, accepted: int) -> None:
        """One sequence's verification of `drafts` drafts kept `accepted` of them (a stop or
        the token limit may cut a run short: those count as not accepted)."""
        hist = self._verifications
        hist += [0] * (drafts + 1 - len(hist))
        hist[accepted] += 1
        self._drafted += drafts

    def _add_expert_load(self, load) -> None:
        """(rows per expert [X], experts with rows per MoE layer [..., L_moe]) of device results
        just read (a mixed step, or a scan's rounds): the next step record reports them."""
        if load is None:
            return
        rows, active = load[0], np.reshape(load[1], (-1, load[1].shape[-1]))
        if self._expert_load is not None:
            rows = rows + self._expert_load[0]
            active = np.concatenate([self._expert_load[1], active])
        self._expert_load = (rows, active)

    def _record(self, t_start, num_seqs, num_batched, decode_only, k, device_s,
                speculative=False):  # fmt: skip
        """A StepRecord; its preemptions are every one since the last record (a schedule that
        preempts and then runs nothing writes no record of its own). `speculative`: a decode
        scan's path (a mixed step's is whether it read verifications)."""
        running = self.scheduler.running_seqs()
        for seq in running:  # prefix caching: full pages computed by now (or dispatched)
            self.block_manager.register(seq, seq.num_computed_tokens)
        load, self._expert_load = self._expert_load, None
        hist, drafted = self._verifications, self._drafted
        self._verifications, self._drafted = [], 0
        preempted = self.scheduler.num_preemptions - self._preemptions_recorded
        self._preemptions_recorded = self.scheduler.num_preemptions
        evictions = self.block_manager.num_evictions - self._evictions_recorded
        self._evictions_recorded = self.block_manager.num_evictions
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
                kv_pages_cached=self.block_manager.num_cached_pages,
                evictions=evictions,
                expert_tokens=None if load is None else [int(n) for n in load[0]],
                expert_device_tokens=None
                if load is None
                else [int(n) for n in load[0].reshape(self.runner.expert_devices, -1).sum(1)],
                experts_active=None if load is None else float(np.mean(load[1])),
                draft_tokens=drafted,
                accepted_draft_tokens=sum(j * c for j, c in enumerate(hist)),
                accepted_hist=hist or None,
                speculative=speculative or drafted > 0,
            )
        )

    def _propose(self, speculate: bool = True) -> None:
        """Draft tokens for the running decodes whose last token is on the host (invariant 7 of
        inflight.py), no more than their output budget leaves room for (none: `speculate`
        False)."""
        gamma = self.proposer.num_draft_tokens
        for seq in self.scheduler.running:
            room = seq.output_budget - len(seq.output_token_ids) - 1
            if not speculate or seq.num_uncomputed_tokens != 1 or seq.num_placeholders or room < 1:
                seq.draft_token_ids = []
                continue
            seq.draft_token_ids = list(self.proposer.propose(seq))[: min(gamma, room)]

    def _lookahead(self, seqs: list[Sequence]) -> int:
        """Decode rounds to run on device: reserve their pages now, or fall back to one step."""
        k = self.config.decode_steps
        if k <= 1 or self.scheduler.can_admit_waiting:
            return 1
        # (a plain scan of adaptive speculation reserves as much: its path is chosen at dispatch)
        per_round = self.runner.num_rows if self.runner.scan_proposer else 1
        for seq in seqs:  # (an unread placeholder may stand for pending_extra_tokens more)
            need = seq.num_tokens + seq.pending_extra_tokens + k * per_round - 1
            need = min(need, seq.max_total_tokens)
            if not self.block_manager.allocate(seq, need):
                return 1
        return k

    def _sampling(self, seqs: list[Sequence], positions: list[int], rows: int) -> SamplingBatch:
        """`positions`: where each sequence's first sampled token will sit (keys its draw)."""
        return SamplingBatch.build([s.sampling for s in seqs], [self._seeds[s.seq_id] for s in seqs],
                                   positions, rows, put=self.runner.put,
                                   max_logit_bias=self.runner.max_logit_bias())  # fmt: skip

    def _dispatch_mixed(self, scheduled: list[ScheduledSeq]) -> None:
        """Build and dispatch one mixed step; the host does not wait for it.

        Fed tokens may be placeholders of the unread step (its sampled tokens, still on the
        device). Each sequence that samples this step gets a placeholder of its own, so the next
        schedule already sees the token it will feed; one that thereby reaches its token limit is
        `final_pending` (derived) and is not scheduled again.
        """
        seqs = [s.seq for s in scheduled]
        batch = self.runner.build_mixed(
            [s.new_token_ids for s in scheduled],
            [s.seq.num_computed_tokens for s in scheduled],
            [s.seq.page_ids for s in scheduled],
        )
        num_drafts = None  # (no drafts: the runner's zeros, already on the device)
        if any(s.num_draft_tokens for s in scheduled):
            num_drafts = np.zeros(self.config.max_num_seqs, np.int32)
            num_drafts[: len(scheduled)] = [s.num_draft_tokens for s in scheduled]
        # the first sampled row (the sequence's last real token) samples the token after it
        positions = [s.seq.num_computed_tokens + s.num_new_tokens - s.num_draft_tokens
                     for s in scheduled]  # fmt: skip
        sb = self._sampling(seqs, positions, self.config.max_num_seqs)
        prev_outs = self.inflight.feed
        history = self.runner.history_arrays(
            [s.seq.all_token_ids + s.seq.draft_token_ids[: s.num_draft_tokens] for s in scheduled],
            [s.seq.num_prompt_tokens for s in scheduled], self.config.max_num_seqs,
        )  # fmt: skip
        outs = self.runner.run_mixed(batch, num_drafts, sb, prev_outs, history)
        self.overlapped_steps += prev_outs is not None
        samplers = []
        for i, s in enumerate(scheduled):
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens - s.num_draft_tokens
            if seq.num_computed_tokens == seq.num_tokens:  # prefill done, or a decode: samples
                samplers.append((seq, i, s.num_draft_tokens))
        self.inflight.dispatch_mixed(samplers, outs)

    def _read_mixed(self, keep: int = 0) -> tuple[list[StepOutput], float]:
        """Read the unread mixed steps, oldest first, until `keep` are left: fill their
        placeholders, stamp times, check stops. Returns (outputs, seconds the host waited for
        the device)."""
        outputs, device_s = [], 0.0
        while (unread := self.inflight.take(keep)) is not None:
            t0 = self.clock()
            tok, counts, lp, top_lp, top_ids, load = jax.device_get(unread.outs)
            device_s += self.clock() - t0
            self._add_expert_load(load)
            now = self.clock()
            for seq, i, d in unread.samplers:
                if seq.is_finished:  # ended meanwhile: the tokens are void
                    outputs.append(StepOutput(seq, [], False))
                    continue
                n = int(counts[i])
                if d:
                    self._add_verification(d, n - 1)
                new = [int(t) for t in tok[i, :n]]
                index = self.inflight.fill(seq, i, new)
                if seq.status is SeqStatus.RUNNING:  # (a preempted one recomputes everything)
                    seq.num_computed_tokens += n - 1  # the accepted drafts' K/V is in place
                kept = []
                for j, token in enumerate(new):
                    kept.append(token)
                    self._accept(seq, index + j, token, float(lp[i, j]), top_lp[i, j],
                                 top_ids[i, j], now)  # fmt: skip
                    if seq.is_finished:
                        break
                outputs.append(StepOutput(seq, kept, seq.is_finished))
        return outputs, device_s

    def _speculate(self, rows: int) -> bool:
        """Whether a decode scan (or mixed step) of `rows` rows takes the speculative path:
        always, unless adaptive speculation (`adaptive.py`) has found plain faster there."""
        return self.adaptive is None or self.adaptive.speculate(rows)

    def _dispatch_decode(self, seqs: list[Sequence], k: int) -> None:
        t0 = self.clock()
        speculate = self._speculate(pick_bucket(self.runner.seq_buckets, len(seqs)))
        table, state, rows = self.runner.build_decode(
            [s.all_token_ids[-1] for s in seqs],
            [s.num_tokens - 1 for s in seqs],
            [s.output_budget - len(s.output_token_ids) for s in seqs],
            [self._stop_ids(s) for s in seqs],
            [s.page_ids for s in seqs],
            seqs,
        )
        sb = self._sampling(seqs, [s.num_tokens for s in seqs], rows)  # loop re-keys per step
        if self.adaptive is not None:
            self.adaptive.dispatched(rows, speculate)
        outs, final = self.runner.run_decode(table, state, sb, k, speculate)
        self.inflight.dispatch_scan(UnreadScan(seqs, outs, final, sb, rows, k, speculate, t0))

    def _chain(self, prev: UnreadScan) -> None:
        """Dispatch the next scan from `prev`'s device state, before reading `prev`'s tokens."""
        if self.scheduler.can_admit_waiting:
            return
        if any(s.status is not SeqStatus.RUNNING for s in prev.seqs):
            return
        k = prev.rounds
        if all(self._left(s) <= k * (self.runner.num_rows if self._drafts(prev) else 1)
               for s in prev.seqs):  # fmt: skip
            # prev may end every sequence (it makes k to k x rows tokens each): a scan chained
            # now would run void, and the next request's prefill would wait behind it
            return
        t0 = self.clock()
        per_round = self.runner.num_rows if self.runner.scan_proposer else 1
        for seq in prev.seqs:  # prev may add up to k rounds of tokens before this scan's k
            need = min(seq.num_tokens + 2 * k * per_round - 1, seq.max_total_tokens)
            if not self.block_manager.allocate(seq, need):
                return
        table = self.runner.decode_table([s.page_ids for s in prev.seqs], prev.rows)
        speculate = self._speculate(prev.rows)  # (either path starts from either's final state)
        if self.adaptive is not None:
            self.adaptive.dispatched(prev.rows, speculate)
        outs, final = self.runner.run_decode(table, prev.final, prev.sb, k, speculate)
        self.chained_scans += 1
        self.inflight.dispatch_scan(UnreadScan(prev.seqs, outs, final, prev.sb, prev.rows, k,
                                               speculate, t0))  # fmt: skip

    @staticmethod
    def _left(seq: Sequence) -> int:
        """Tokens `seq` may still generate, as far as the host has read them."""
        return min(seq.output_budget - len(seq.output_token_ids),
                   seq.max_total_tokens - seq.num_tokens)  # fmt: skip

    def _collect(self, scan: UnreadScan):
        """Read a scan's tokens; returns ([(seq, tokens)], tokens per [round, row], seconds the
        host waited for them)."""
        t0 = self.clock()
        tok, counts, lp, top_lp, top_ids, load = jax.device_get(scan.outs)
        read_at = self.clock()
        device_s = read_at - t0
        self._add_expert_load(None if load is None else (load[0].sum(0), load[1]))
        results = []
        gamma = self.runner.num_rows - 1 if self._drafts(scan) else 0
        for i, seq in enumerate(scan.seqs):
            if seq.is_finished:  # finished while this scan was in flight: its tokens are void
                results.append((seq, []))
                continue
            for r in range(scan.rounds) if gamma else ():
                if counts[r, i]:
                    self._add_verification(gamma, int(counts[r, i]) - 1)
            new = [(int(tok[r, i, j]), float(lp[r, i, j]), top_lp[r, i, j], top_ids[r, i, j])
                   for r in range(scan.rounds) for j in range(int(counts[r, i]))]  # fmt: skip
            seq.num_computed_tokens += len(new)
            results.append((seq, new))
        return results, counts, device_s

    def _measure(self, scan: UnreadScan, counts, results) -> None:
        """Report a scan whose tokens the host is done with to adaptive speculation: its tokens
        per round a row was live, times the bucket's rows and the rounds (a batch thinning out as
        sequences end makes fewer tokens whichever path runs: that says nothing of the path),
        over the seconds from its dispatch, or from when the host was done with the previous
        scan if that came later (a chained scan ran on the device from its dispatch, beside that
        scan's host work), to now. So a scan pays for the host work on its own tokens, not on
        its predecessor's: timed from read to read, a plain scan after a speculative probe paid
        for the probe's extra tokens, and the probe for the plain scan's fewer. A scan whose
        sequences were live in less than `MIN_LIVE` of its row-rounds (void ones counted as
        dead) is not reported."""
        done = self.clock()
        start, self._scan_done_at = max(scan.dispatched_at, self._scan_done_at), done
        rows = [i for i, (_, new) in enumerate(results) if new]  # (not the void ones)
        live = int((counts[:, rows] > 0).sum())
        if live and live >= MIN_LIVE * len(results) * scan.rounds:
            made = sum(len(new) for _, new in results)
            self.adaptive.record(scan.rows, scan.speculative, made * scan.rows * scan.rounds / live,
                                 done - start)  # fmt: skip

    def _drafts(self, scan: UnreadScan) -> bool:
        """Whether `scan`'s rounds verified drafts."""
        return scan.speculative and self.runner.scan_proposer is not None

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
        EOS / a stop id / a stop string / max_tokens, dropping anything after it (placeholders
        of later steps included)."""
        seq.cumulative_logprob += float(logprob)
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
            self.inflight.drop(seq)
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
