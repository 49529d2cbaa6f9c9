"""Streamed text of one sample: the deltas of its detokenized tokens, held back where they could
still change.

Two things can change text already decoded: an incomplete UTF-8 character (a byte-level token
decodes to U+FFFD until the rest arrives) and a stop string (the engine cuts the text where one
starts, `Engine._hit_stop_string`). So a delta stops before a trailing U+FFFD and, with stop
strings, `len(longest) - 1` characters before the end: a stop string found later starts after
everything sent (it was not in the text decoded so far, so it ends beyond it). The last delta is
the rest of the engine's final text.
"""

from __future__ import annotations


class StreamedText:
    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""

    def add(self, token_ids: list[int]) -> str:
        """The new text that is safe to send after these tokens."""
        self.token_ids += token_ids
        if self.tokenizer is None or not token_ids:
            return ""
        text = self.tokenizer.decode(self.token_ids)
        end = len(text) - self.holdback
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) : end], text[:end]
        return delta

    def finish(self, token_ids: list[int], final_text: str | None) -> str:
        """The rest of `final_text` (the engine's, stop strings cut) after the last tokens (not
        decoded: they may hold the stop string)."""
        self.token_ids += token_ids
        if final_text is None:
            return ""
        delta = final_text[len(self.sent) :] if final_text.startswith(self.sent) else ""
        self.sent += delta
        return delta
