"""What a request gives back: its samples' tokens and text (`RequestOutput`, one `Completion`
per sample) and, streamed, each step's new tokens (`StreamEvent`)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer.engine.request import Sequence


def sequence_text(seq: Sequence, tokenizer) -> str:
    """A sequence's output text: cut before its first stop string when one ended it (possibly
    empty: a stop at the very start), else its tokens decoded."""
    if seq.sampling.stop and seq.finish_reason == "stop":
        return seq.output_text
    return seq.output_text or tokenizer.decode(seq.output_token_ids)


@dataclass
class Completion:
    """One sample of a request (SamplingParams.n / best_of)."""

    index: int  # the sample's number among the request's samples (its seed stream)
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    error: str | None
    logprobs: list[dict]
    cumulative_logprob: float  # sum of its sampled tokens' logprobs

    @staticmethod
    def of(seq: Sequence, tokenizer) -> Completion:
        text = None
        if tokenizer is not None and seq.error is None:
            text = sequence_text(seq, tokenizer)
        return Completion(seq.sample_index, list(seq.output_token_ids), text, seq.finish_reason,
                          seq.error, list(seq.output_logprobs), seq.cumulative_logprob)  # fmt: skip


@dataclass
class RequestOutput:
    """A request's result: `outputs` holds its n samples (best_of: the n of highest cumulative
    logprob, best first; else in sample order); the fields token_ids .. logprobs are the first
    one's, so an n = 1 caller reads them directly."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    error: str | None
    logprobs: list[dict]
    num_preemptions: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (prefill skipped)
    outputs: list[Completion] | None = None

    @staticmethod
    def of(seq: Sequence, tokenizer) -> RequestOutput:
        family = [seq, *seq.siblings]
        outputs = [Completion.of(s, tokenizer) for s in family]
        if seq.error is None and seq.sampling.best_of is not None:
            outputs.sort(key=lambda c: (c.error is not None, -c.cumulative_logprob, c.index))
        if seq.siblings:  # (one failed at submission has none, and its n may be what failed it)
            outputs = outputs[: seq.sampling.n]
        first = outputs[0]
        return RequestOutput(
            seq.seq_id, seq.prompt, seq.prompt_token_ids, first.token_ids, first.text,
            first.finish_reason, seq.error or first.error, first.logprobs,
            sum(s.num_preemptions for s in family), seq.num_cached_tokens, outputs,
        )  # fmt: skip


@dataclass
class StreamEvent:
    request_id: int
    token_ids: list[int]  # new this step
    finished: bool  # (this sample)
    finish_reason: str | None
    error: str | None
    index: int = 0  # the sample (SamplingParams.n); best_of's ranking is not streamed
