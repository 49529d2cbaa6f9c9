"""Prompts built from Python source, the same way for the speculative-decoding benchmark
(`experiments/speculative/run.py`, on a few standard-library modules) and for the text an EAGLE
head is trained on (`jaxinfer/train/eagle.py`, the target's own replies to these prompts over
the other modules): offline, and in the reference models' domain.

Kinds:
- `open`: a piece of source, to be continued;
- `grounded`: the piece in a fence, then a request for it again (the reply copies the prompt:
  where n-gram lookup pays);
- `chat`: one user turn under the model's chat template asking to explain, comment or test the
  piece (an instruction-tuned model's usual work).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

KINDS = ("open", "grounded", "chat")
CHAT_TASKS = (
    "Explain what this Python code does.",
    "Rewrite this Python code with a comment on each step.",
    "Write pytest unit tests for this Python code.",
)


def snippets(sources: Sequence[str], n: int, chars: int) -> list[str]:
    """n pieces of `chars` characters, consecutive within each source, cycled if there are fewer
    (a source shorter than `chars` gives none)."""
    pieces = [s[i : i + chars] for s in sources for i in range(0, len(s) - chars, chars)]
    if not pieces:
        raise ValueError(f"no source is longer than {chars} characters")
    return [pieces[i % len(pieces)] for i in range(n)]


def prompt_text(kind: str, snippet: str, i: int,
                render_chat: Callable[[list[dict]], str] | None = None) -> str:  # fmt: skip
    """Prompt `i` of `kind` on `snippet`; `chat` renders its user turn with `render_chat` (e.g.
    `LLM.render_chat`) and cycles through `CHAT_TASKS` by i."""
    if kind == "open":
        return snippet
    if kind == "grounded":
        return f"```python\n{snippet}\n```\nThe same code again, unchanged:\n```python\n"
    if kind == "chat":
        if render_chat is None:
            raise ValueError("chat prompts need the model's chat template (render_chat)")
        task = CHAT_TASKS[i % len(CHAT_TASKS)]
        return render_chat([{"role": "user", "content": f"{task}\n```python\n{snippet}\n```"}])
    raise ValueError(f"prompt kind must be one of {KINDS}, got {kind!r}")
