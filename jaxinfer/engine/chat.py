"""Chat templates: a conversation rendered to the model's prompt text, as transformers'
`apply_chat_template(..., tokenize=False)` renders it (a sandboxed Jinja environment with
`trim_blocks` and `lstrip_blocks`, `raise_exception` and the tokenizer's special tokens)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]
ROLES = ("system", "user", "assistant", "tool")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    import json
    from datetime import datetime

    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks assistant turns with it
        for its masks): renders the body as it is."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' (Jinja's own escapes HTML and sorts keys)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ValueError(f"the model's chat template does not compile: {e}") from None


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """A conversation as a list of {"role", "content"} dicts; a ValueError names what is wrong."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} objects, "
                         f"got {type(messages).__name__}")  # fmt: skip
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got "
                             f"{type(m).__name__}")  # fmt: skip
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r} is not one of {list(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string, got {type(content).__name__}"
            )
        out.append(dict(m))
    return out


def render_chat(
    template: str | None,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
) -> str:
    """The prompt text of `messages` under `template`; `special_tokens` (bos_token, eos_token,
    ...) are the names templates may use."""
    from jinja2 import TemplateError

    if template is None:
        raise ValueError("this model has no chat template: give plain prompts instead")
    messages = check_messages(messages)
    try:
        return _compiled(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **(special_tokens or {})
        )
    except TemplateError as e:
        raise ValueError(f"the model's chat template refused these messages: {e}") from None
