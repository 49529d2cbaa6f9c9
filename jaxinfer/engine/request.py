"""Requests as sequences with an explicit state machine, sampling parameters and timestamps.

    WAITING ──schedule──> RUNNING ──stop/max_tokens──> FINISHED
       ^                    │  └──bad input / error──> FAILED
       └────preempt─────────┘  (PREEMPTED: pages freed, K/V recomputed when rescheduled)

A sequence's tokens are `prompt_token_ids + output_token_ids`; `num_computed_tokens` of them have
their K/V in the cache (in the pages `page_ids`, in order). Preemption by recompute resets
`num_computed_tokens` to 0 and keeps the outputs: on resume prompt + outputs are prefilled again.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    FAILED = "failed"


MAX_SEED = 2**64  # seeds are 64-bit, as in vLLM: 0 <= seed < 2**64


def is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def is_real(x: object) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 is greedy; top_k 0 or -1, top_p 1, min_p 0
    are off. `stop` is one stop string or a sequence of them (vLLM's convention). Penalties
    (repetition 1, presence and frequency 0 and no `logit_bias`: off) need an engine built with
    `engine.penalties`; `logit_bias` maps token ids to values added to their logits
    (`engine.sampler` has the semantics). Checked when built, naming the field and the value,
    and again when submitted (against the vocabulary and the engine's options)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] | str = ()  # stop strings (need a tokenizer to detokenize)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: sampled token's; k: also the top k
    # Benchmark knob: finish (reason "stop") after this many tokens, as if the model had emitted
    # EOS there. The server cannot know it in advance: allocation still plans for max_tokens.
    eos_after: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] | dict[int, float] = ()
    # Parallel sampling: n samples of the prompt (its pages shared, block_manager.fork), each
    # with its own seed stream (`sample_seed`); best_of >= n draws that many and returns the n
    # with the highest cumulative logprob.
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        # vLLM's spellings: one stop string; lists for tuples; a dict of logit biases.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            items = tuple((int(k) if isinstance(k, str) and k.isdigit() else k, v)
                          for k, v in self.logit_bias.items())  # fmt: skip
            object.__setattr__(self, "logit_bias", items)
        self.validate()

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))  # fmt: skip

    @property
    def num_samples(self) -> int:
        """Samples drawn: best_of, or n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def top_k_or_off(self) -> int:
        """top_k with 'off' as 0."""
        return 0 if self.top_k == -1 else self.top_k

    def validate(self, vocab_size: int | None = None, max_num_seqs: int | None = None) -> None:
        """Raise ValueError naming the first bad field and its value; `vocab_size` and
        `max_num_seqs` (an engine's) add the checks against that engine."""

        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(
                f"SamplingParams.{name}={getattr(self, name)!r} is invalid: must be {allowed}"
            )

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not is_real(self.temperature) or not (
            math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise bad("temperature", "a finite number >= 0")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an int >= 0, or -1 or 0 for off")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not is_real(self.min_p) or not 0 <= self.min_p < 1:
            raise bad("min_p", "a number in [0, 1)")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise bad("seed", "None or an int in [0, 2**64)")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an int >= 1")
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            raise bad("best_of", f"None or an int >= n ({self.n})")
        if self.eos_after is not None and (not is_int(self.eos_after) or self.eos_after < 1):
            raise bad("eos_after", "None or an int >= 1")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "None or an int >= 0")
        if not isinstance(self.ignore_eos, bool | np.bool_):
            raise bad("ignore_eos", "True or False")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            is_int(t) for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "a list of int token ids")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s
                                                   for s in self.stop):  # fmt: skip
            raise bad("stop", "a non-empty string or a list of them")
        if not is_real(self.repetition_penalty) or not (
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0
        ):
            raise bad("repetition_penalty", "a finite number > 0 (1: off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -2 <= value <= 2:
                raise bad(name, "a number in [-2, 2] (0: off)")
        if not isinstance(self.logit_bias, tuple) or not all(
            isinstance(kv, tuple) and len(kv) == 2 and is_int(kv[0]) and is_real(kv[1])
            and -100 <= kv[1] <= 100 for kv in self.logit_bias
        ):  # fmt: skip
            raise bad("logit_bias", "a map of int token ids to numbers in [-100, 100]")
        if vocab_size is not None:
            if any(not 0 <= t < vocab_size for t in self.stop_token_ids):
                raise bad("stop_token_ids", f"token ids in [0, {vocab_size})")
            if self.top_k > vocab_size:
                raise bad("top_k", f"<= the vocabulary size {vocab_size}")
            if self.logprobs is not None and self.logprobs > vocab_size:
                raise bad("logprobs", f"<= the vocabulary size {vocab_size}")
            if any(not 0 <= t < vocab_size for t, _ in self.logit_bias):
                raise bad("logit_bias", f"token ids in [0, {vocab_size})")
        if max_num_seqs is not None and self.num_samples > max_num_seqs:
            # each sample is a sequence: more than the engine runs at once is refused, not queued
            # (n = 10**5 kept an engine busy for minutes; 2**40 exhausted host memory)
            raise bad("n" if self.best_of is None else "best_of",
                      f"<= engine.max_num_seqs={max_num_seqs} (one sequence per sample)")  # fmt: skip


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (SamplingParams.n): sample 0 keeps
    it (n = 1 is unchanged), the others step by an odd 64-bit constant (distinct for any n)."""
    return (seed + index * 0x9E3779B97F4A7C15) % MAX_SEED


def prompt_token_ids(prompt: object) -> list[int]:
    """A token-id prompt as a list of ints: a list or tuple of ints, or a 1-D integer numpy
    array. Anything else (floats, bools, strings of digits, bytes, nesting) is a ValueError
    naming the first bad item; vLLM accepts the same."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompt: a numpy array of token ids must be 1-D of integers, got "
                             f"shape {prompt.shape} dtype {prompt.dtype}")  # fmt: skip
        return [int(t) for t in prompt]
    if isinstance(prompt, bytes | bytearray):
        raise ValueError("prompt is bytes: pass text (str) or a list of token ids")
    if not isinstance(prompt, list | tuple):
        raise ValueError(f"prompt must be a str or a list of int token ids, got "
                         f"{type(prompt).__name__} {prompt!r:.40}")  # fmt: skip
    for i, t in enumerate(prompt):
        if not is_int(t):
            raise ValueError(f"prompt token ids must be ints: item {i} is "
                             f"{type(t).__name__} {t!r:.40}")  # fmt: skip
    return [int(t) for t in prompt]


@dataclass(eq=False)
class Sequence:
    """One request's state; mutated only by the scheduler/block manager (host side) and engine."""

    seq_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower value = more important (vLLM's convention)
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    num_computed_tokens: int = 0
    page_ids: list[int] = field(default_factory=list)
    # prefix caching: content hashes of its leading full pages (block_manager), and the prompt
    # tokens its admissions found cached (their prefill skipped)
    page_hashes: list[bytes] = field(default_factory=list)
    num_registered_pages: int = 0
    num_cached_tokens: int = 0
    # Timestamps (engine clock, seconds).
    scheduled_time: float | None = None  # first time it was scheduled
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None  # "stop", "length", or "error"
    error: str | None = None
    num_preemptions: int = 0
    prompt: str | None = None
    output_text: str = ""
    # Async dispatch (engine/inflight.py, the only writer): trailing placeholders of steps in
    # flight among the outputs, and the most tokens beyond one each that the newest may stand for.
    num_placeholders: int = 0
    pending_extra_tokens: int = 0
    # Tokens a proposer suggests after the last one, to verify in the next step (not outputs).
    draft_token_ids: list[int] = field(default_factory=list)
    # Parallel sampling (SamplingParams.n / best_of): sample 0 is the request's own sequence,
    # holding the others in `siblings`; each other one has `parent` and shares its prompt pages.
    sample_index: int = 0
    parent: Sequence | None = None
    siblings: list[Sequence] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # sum of its sampled tokens' logprobs (best_of ranks by it)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to be fed to the model before this sequence can sample its next token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens it may generate: what `reserve_max` allocates up front."""
        return len(self.prompt_token_ids) + self.sampling.max_tokens

    @property
    def output_budget(self) -> int:
        """Tokens it will generate at most: max_tokens, or eos_after when that comes first."""
        limit = self.sampling.max_tokens
        if self.sampling.eos_after is not None:
            limit = min(limit, self.sampling.eos_after)
        return limit

    @property
    def final_pending(self) -> bool:
        """Unfinished with all its output tokens: the last is a placeholder of the step in flight
        (async scheduling) that will end it, so it is not scheduled again."""
        return len(self.output_token_ids) >= self.output_budget and not self.is_finished

    @property
    def is_finished(self) -> bool:
        return self.status in (SeqStatus.FINISHED, SeqStatus.FAILED)
