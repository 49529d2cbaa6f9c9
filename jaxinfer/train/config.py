"""Typed training config: YAML file + dotted `key=value` overrides, merged and checked by
`jaxinfer.config_file`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from omegaconf import MISSING
from pydantic import Field, model_validator

from jaxinfer.config_file import Count, load_config, one_of, schema

BUILTIN_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "tokenizer.json"


def warmup_in_range(tc):
    """A train config's warmup_steps, checked against its steps."""
    if not 0 <= tc.warmup_steps < tc.steps:
        raise ValueError(f"warmup_steps={tc.warmup_steps} is invalid: must be in [0, steps="
                         f"{tc.steps})")  # fmt: skip
    return tc


@dataclass
class ModelShape:
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    head_dim: int = MISSING
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048


@schema("")
class TrainConfig:
    name: str = MISSING
    model: ModelShape = field(default_factory=ModelShape)
    out_dir: str = "runs/train/${name}"
    # "builtin": the committed stdlib BPE (jaxinfer/assets/tokenizer.json). Any other path is used
    # if it exists, else a tokenizer with `vocab_size` is trained on the train split and saved there.
    tokenizer: str = "builtin"
    vocab_size: int = 4096
    heldout_fraction: float = 0.05
    corpus_include_tests: bool = False  # add the stdlib test suites to the train split
    seq_len: Count = 256
    batch_size: Count = 16
    steps: Count = 1000
    lr: Annotated[float, Field(gt=0)] = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    # master weights and optimizer state are always fp32
    compute_dtype: Annotated[str, one_of("float32", "bfloat16")] = "bfloat16"
    eval_every: Count = 200
    eval_windows: int = 64
    checkpoint_every: Count = 200
    seed: int = 0

    _warmup = model_validator(mode="after")(warmup_in_range)

    @property
    def tokenizer_path(self) -> Path:
        return BUILTIN_TOKENIZER if self.tokenizer == "builtin" else Path(self.tokenizer)


def load_train_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Schema <- YAML file <- `key=value` overrides; errors name the offending key."""
    return load_config(TrainConfig, path, overrides, what="train")
