"""Request schemas of the OpenAI API (the fields this server implements), as pydantic models.

Strict types (a string is not a number) and unknown fields refused: a field this server would
otherwise ignore (`response_format`, `tools`, `echo` ...) answers 400 naming it, rather than a
reply that silently did something else. Beyond OpenAI's fields, vLLM's sampling extensions:
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`, and `return_token_ids`
(each choice / chunk also carries its token ids).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxinfer.engine.request import MAX_SEED, SamplingParams

NonNegInt = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0, lt=1)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=0, lt=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None  # accepted, unused

    def sampling(self, max_tokens: int, logprobs: int | None, best_of: int | None = None
                 ) -> SamplingParams:  # fmt: skip
        """SamplingParams of these fields; a ValueError names the bad field (its API name)."""
        stop = self.stop if self.stop is not None else ()
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop: stop strings must be non-empty")
        bias = {}
        for k, v in (self.logit_bias or {}).items():
            if not k.lstrip("-").isdigit():
                raise ValueError(f"logit_bias: keys must be token ids, got {k!r}")
            bias[int(k)] = v
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=stop,
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                logprobs=logprobs, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, logit_bias=bias, n=self.n,
                best_of=best_of,
            )  # fmt: skip
        except ValueError as e:  # "SamplingParams.top_k=... is invalid: ..." -> "top_k=..."
            raise ValueError(api_message(str(e))) from None


def api_message(message: str) -> str:
    """An engine message in the API's names (SamplingParams.logprobs -> logprobs)."""
    return message.replace("SamplingParams.", "")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # (OpenAI's default for completions)
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = Field(default=None, ge=1)
    echo: Literal[False] = False
    suffix: None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role  # (OpenAI's newer name)
        return {"role": role, "content": content}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # (the newer name)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self.max_completion_tokens or self.max_tokens
