"""Token streams and batches. A batch is a pure function of (seed, step), so a resumed run sees
exactly the batches an uninterrupted one would."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from jaxinfer.train.tokenizer import EOS


def encode_stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """All texts as one int32 stream, each followed by EOS (so a window may span two files)."""
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise ValueError(f"tokenizer has no {EOS} token")
    parts = []
    for enc in tokenizer.encode_batch(texts):
        parts.append(np.asarray(enc.ids, np.int32))
        parts.append(np.asarray([eos], np.int32))
    return np.concatenate(parts)


def train_batch(stream: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int):
    """[batch_size, seq_len + 1] windows at random offsets drawn from (seed, step)."""
    if len(stream) <= seq_len + 1:
        raise ValueError(f"token stream of {len(stream)} is too short for seq_len {seq_len}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, batch_size)
    return np.stack([stream[s : s + seq_len + 1] for s in starts])


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping [n, seq_len + 1] windows covering the stream from its start."""
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"token stream of {len(stream)} is too short for seq_len {seq_len}")
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
