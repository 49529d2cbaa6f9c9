"""Typed training config: YAML file + dotted `key=value` overrides, merged and checked by
`jaxinfer.config_file`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING

from jaxinfer.config_file import load_config, to_yaml

BUILTIN_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "tokenizer.json"


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


@dataclass
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
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    compute_dtype: str = "bfloat16"  # master weights and optimizer state are always fp32
    eval_every: int = 200
    eval_windows: int = 64
    checkpoint_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("seq_len", "batch_size", "steps", "eval_every", "checkpoint_every")
        for key in positive:
            if getattr(self, key) <= 0:
                raise ValueError(f"train config: {key} must be > 0, got {getattr(self, key)}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"train config: warmup_steps must be in [0, steps={self.steps}), "
                f"got {self.warmup_steps}"
            )
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"train config: compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}"
            )
        if self.lr <= 0:
            raise ValueError(f"train config: lr must be > 0, got {self.lr}")

    @property
    def tokenizer_path(self) -> Path:
        return BUILTIN_TOKENIZER if self.tokenizer == "builtin" else Path(self.tokenizer)


def load_train_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Schema <- YAML file <- `key=value` overrides; errors name the offending key."""
    return load_config(TrainConfig, path, overrides, what="train")


def config_yaml(tc: TrainConfig) -> str:
    return to_yaml(tc)
