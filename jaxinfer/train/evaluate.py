"""Perplexity of a model on text it was not trained on: the stdlib corpus's held-out files
(code), or English prose (the Python documentation's topics and held-out module docstrings)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from tokenizers import Tokenizer

from jaxinfer.engine.loading import load_model
from jaxinfer.train.corpus import english_texts, stdlib_corpus
from jaxinfer.train.data import encode_stream, eval_windows
from jaxinfer.train.trainer import heldout_loss

TEXTS = ("code", "english")


def heldout_windows(
    tokenizer: Tokenizer,
    text: str = "code",
    seq_len: int = 256,
    batch_size: int = 16,
    max_windows: int | None = None,
    heldout_fraction: float = 0.05,
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """(windows [n, seq_len + 1], the texts, their token stream): the held-out windows
    `heldout_perplexity` scores, for callers that score several params of one model. n is at
    most `max_windows`, and a multiple of `batch_size` when there are that many."""
    if text not in TEXTS:
        raise ValueError(f"text={text!r} is not one of {list(TEXTS)}")
    corpus = stdlib_corpus(heldout_fraction=heldout_fraction)
    texts = corpus.texts("heldout") if text == "code" else english_texts(corpus)
    stream = encode_stream(tokenizer, texts)
    windows = eval_windows(stream, seq_len, max_windows)
    return windows[: max(batch_size, len(windows) // batch_size * batch_size)], texts, stream


def heldout_perplexity(
    model_dir: str | Path,
    *,
    text: str = "code",
    seq_len: int = 256,
    batch_size: int = 16,
    max_windows: int | None = None,
    heldout_fraction: float = 0.05,
    dtype: str = "float32",
    show_progress: bool = True,
) -> dict:
    """Perplexity per token (and bits per byte, comparable across tokenizers) over
    non-overlapping windows of `text` ("code" or "english", see the module docstring).
    `model_dir` is anything `EngineConfig.model` takes (a HF directory, tiny, smollm2, a .gguf).

    Every held-out token but the first of each window is scored once, with at most `seq_len`
    tokens of context. The uniform baseline's perplexity is the vocabulary size. Progress (the
    load, then windows scored of N) goes to stderr: stdout carries the results.
    """
    if text not in TEXTS:
        raise ValueError(f"text={text!r} is not one of {list(TEXTS)}")
    # `jaxinfer train` exports to <out_dir>/hf: name the run, not "hf".
    name = Path(model_dir).name if Path(model_dir).name != "hf" else Path(model_dir).parent.name
    name = name.removesuffix(".gguf")
    columns = (TextColumn(f"[bold]{escape(name)}[/] {{task.description}}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())  # fmt: skip
    console = Console(stderr=True)
    with Progress(*columns, console=console, disable=not show_progress) as progress:
        task = progress.add_task("loading the model", total=None)
        cfg, params, tokenizer = load_model(str(model_dir), dtype=dtype)
        if tokenizer is None:
            raise ValueError(f"model {str(model_dir)!r} has no tokenizer to score text with")
        progress.update(task, description=f"tokenizing the {text}")
        windows, texts, stream = heldout_windows(
            tokenizer, text, seq_len, batch_size, max_windows, heldout_fraction
        )
        progress.update(task, description=f"held-out windows of {seq_len} tokens scored",
                        total=len(windows))  # fmt: skip
        nats = heldout_loss(params, cfg, windows, batch_size,
                            on_batch=lambda n: progress.advance(task, n))  # fmt: skip
    tokens_per_byte = len(stream) / sum(len(t.encode()) + 1 for t in texts)
    return {
        "model": name,
        "num_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
        "vocab_size": cfg.vocab_size,
        "heldout_tokens": int(windows.shape[0] * seq_len),
        "text": text,
        "heldout_files": len(texts),
        "seq_len": seq_len,
        "nats_per_token": round(nats, 4),
        "perplexity": round(math.exp(nats), 3),
        "bits_per_byte": round(nats * tokens_per_byte / math.log(2), 4),
        "uniform_perplexity": cfg.vocab_size,
        "corpus_python": sys.version.split()[0],
        "eval_dtype": dtype,
    }
