"""One request of a workload: what to send and when."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkloadRequest:
    """A prompt (token ids, text, or both), how many tokens to generate, and when it arrives.

    At least one of `prompt_token_ids` and `prompt` is set. `output_len` is the number of tokens
    to generate (send with `ignore_eos` to make it exact); `arrival_time` is in seconds from the
    start of the run.
    """

    prompt_token_ids: list[int] | None
    prompt: str | None
    output_len: int
    arrival_time: float

    @property
    def prompt_len(self) -> int | None:
        """Prompt length in tokens, None when only the text is known."""
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)
