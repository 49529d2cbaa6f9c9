"""Model configuration: one frozen dataclass covers the whole decoder family.

Llama 2/3/3.1, Mistral, Qwen2 and Qwen3 differ only in fields here (RoPE scaling, QKV bias,
QK-norm, tied embeddings, sliding window), never in code paths that are copies of each other.
Layers may differ from each other: each has an FFN kind (`ffn_kinds`: dense today, MoE next;
DeepSeek's first-k-dense layers) and an attention type (`layer_types`: Qwen's mixed sliding and
full attention), read through `layer(i)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax.numpy as jnp

ATTENTION_TYPES = ("full_attention", "sliding_attention")  # transformers' `layer_types` names


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (`rope_type: llama3` in HF configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LayerKind:
    """A layer's static shape beyond the model's: layers of one kind share their traced code."""

    ffn: str = "dense"
    sliding_window: int | None = None


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
    # Mistral v0.1, Qwen: attend to the last `sliding_window` keys, in the layers that
    # `layer_types` makes "sliding_attention" (all of them when it is empty)
    sliding_window: int | None = None
    # Per layer (empty: the default for every layer): its attention type (ATTENTION_TYPES), and
    # its FFN kind, a key of `jaxinfer.models.ffn.FFN_BLOCKS` (default "dense").
    layer_types: tuple[str, ...] = ()
    ffn_kinds: tuple[str, ...] = ()
    # The format of the linear weights of the decoder layers (a key of
    # `jaxinfer.quant.WEIGHT_FORMATS`); None: plain `param_dtype` arrays. Embedding, LM head and
    # norms stay plain.
    weight_format: str | None = None
    # Numerics: weights stored in `param_dtype`, activations computed in `dtype`; softmax, norms
    # and accumulations always in fp32.
    param_dtype: str = "bfloat16"
    dtype: str = "bfloat16"
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
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"ModelConfig.sliding_window must be positive or None, got {self.sliding_window}"
            )
        from jaxinfer.models.ffn import FFN_BLOCKS  # (registries import this module)
        from jaxinfer.quant import WEIGHT_FORMATS

        for name, allowed in (("layer_types", ATTENTION_TYPES), ("ffn_kinds", tuple(FFN_BLOCKS))):
            value = getattr(self, name)
            object.__setattr__(self, name, tuple(value))  # (JSON gives lists)
            if value and len(value) != self.num_layers:
                raise ValueError(f"ModelConfig.{name} has {len(value)} entries for "
                                 f"{self.num_layers} layers (or leave it empty)")  # fmt: skip
            bad = sorted(set(value) - set(allowed))
            if bad:
                raise ValueError(f"ModelConfig.{name}: {bad} unknown; allowed: {list(allowed)}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("ModelConfig.layer_types has sliding_attention layers but "
                             "sliding_window is None")  # fmt: skip
        if self.weight_format is not None and self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"ModelConfig.weight_format={self.weight_format!r} is unknown; "
                             f"known: {sorted(WEIGHT_FORMATS)} or None")  # fmt: skip

    def layer(self, i: int) -> LayerKind:
        """What makes layer `i` differ from the others: its FFN kind and attention window."""
        ffn = self.ffn_kinds[i] if self.ffn_kinds else "dense"
        sliding = self.layer_types[i] == "sliding_attention" if self.layer_types else True
        return LayerKind(ffn, self.sliding_window if sliding else None)

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
