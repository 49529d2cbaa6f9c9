"""The code prompts of the speculative benchmark and of an EAGLE head's training text
(`jaxinfer/workload/code_prompts.py`)."""

from __future__ import annotations

import re

import pytest

from jaxinfer.engine.chat import render_chat
from jaxinfer.engine.loading import model_chat_template
from jaxinfer.workload.code_prompts import CHAT_TASKS, KINDS, prompt_text, snippets


def test_snippets_are_consecutive_pieces_cycled_to_n():
    sources = ["abcdefghij", "0123456", "xy"]
    assert snippets(sources, 7, 3) == ["abc", "def", "ghi", "012", "345", "abc", "def"]
    with pytest.raises(ValueError, match="no source is longer than 20 characters"):
        snippets(sources, 2, 20)


def test_each_kind_holds_its_snippet_and_chat_renders_a_user_turn_of_smollm2s_template():
    template = model_chat_template("smollm2")
    assert template is not None

    def chat(messages):
        return render_chat(template, messages)

    code = "def add(a, b):\n    return a + b"
    assert prompt_text("open", code, 0) == code
    grounded = prompt_text("grounded", code, 0)
    assert code in grounded and grounded.endswith("```python\n")
    replies = [prompt_text("chat", code, i, chat) for i in range(len(CHAT_TASKS) + 1)]
    for i, text in enumerate(replies):
        assert CHAT_TASKS[i % len(CHAT_TASKS)] in text and code in text, text
        assert re.search(r"<\|im_start\|>user\n.*<\|im_end\|>\n<\|im_start\|>assistant\n$", text,
                         re.S), text  # fmt: skip
    assert replies[0] == replies[-1] and len(set(replies)) == len(CHAT_TASKS)
    with pytest.raises(ValueError, match="chat prompts need the model's chat template"):
        prompt_text("chat", code, 0)
    with pytest.raises(ValueError, match=re.escape(f"prompt kind must be one of {KINDS}")):
        prompt_text("essay", code, 0)
