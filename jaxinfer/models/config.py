"""Model configuration: one frozen dataclass covers the whole dense decoder family.

Llama 2/3/3.1, Mistral, Qwen2 and Qwen3 differ only in fields here (RoPE scaling, QKV bias,
QK-norm, tied embeddings, sliding window), never in code paths that are copies of each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import jax.numpy as jnp

LayerLoop = Literal["unrolled", "scan"]
FfnKind = Literal["dense"]


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (`rope_type: llama3` in HF configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias=True
    o_bias: bool = False  # Llama with attention_bias=True
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # Mistral v0.1: attend to the last `sliding_window` keys
    ffn: FfnKind = "dense"  # the swap point for MoE blocks
    # Numerics: weights stored in `param_dtype`, activations computed in `dtype`; softmax, norms
    # and accumulations always in fp32.
    param_dtype: str = "bfloat16"
    dtype: str = "bfloat16"
    # How the decoder layers are stored and iterated (see `jaxinfer.models.dense.apply_layers`).
    layer_loop: LayerLoop = "unrolled"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("param_dtype", "dtype"):
            value = getattr(self, name)
            if value not in ("float32", "bfloat16", "float16"):
                raise ValueError(
                    f"ModelConfig.{name} must be one of float32, bfloat16, float16; got {value!r}"
                )
        if self.layer_loop not in ("unrolled", "scan"):
            raise ValueError(
                f"ModelConfig.layer_loop must be 'unrolled' or 'scan', got {self.layer_loop!r}"
            )
        if self.ffn != "dense":
            raise ValueError(f"ModelConfig.ffn must be 'dense' (MoE comes later), got {self.ffn!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"ModelConfig.sliding_window must be positive or None, got {self.sliding_window}"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)
