"""Byte-level BPE trained with the `tokenizers` library: any byte sequence encodes, nothing is UNK."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"  # separates files in the token stream; also BOS and the stop token


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out: str | Path) -> Tokenizer:
    """Train on `texts`, save as `tokenizer.json` at `out`, return it. EOS gets id 0."""
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return tok
