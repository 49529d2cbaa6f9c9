"""Named model shapes for random-init benchmarks (no download needed) and tiny test models."""

from __future__ import annotations

from typing import Any

from jaxinfer.models.config import Llama3RopeScaling, ModelConfig, MoeConfig

_LLAMA31_SCALING = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)

PRESETS: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
        num_heads=32, num_kv_heads=32, head_dim=128, rope_theta=10000.0,
        max_position_embeddings=4096,
    ),
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING, max_position_embeddings=131072,
    ),
    "llama3-70b": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING, max_position_embeddings=131072,
    ),
    "mistral-7b": dict(  # v0.3 shapes (no sliding window, 32768 vocab)
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
        max_position_embeddings=32768,
    ),
    "qwen2-7b": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        qkv_bias=True, max_position_embeddings=32768,
    ),
    "qwen3-8b": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        qk_norm=True, max_position_embeddings=40960,
    ),
    "smollm2-135m": dict(  # SmolLM2-135M-Instruct's shape (the `smollm2` model, random weights)
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=8192,
    ),
    "qwen3-30b-a3b": dict(  # Qwen3-30B-A3B: every layer MoE, 128 experts of 768, top-8
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        qk_norm=True, max_position_embeddings=40960,
        moe=MoeConfig(num_experts=128, experts_per_token=8, expert_size=768),
    ),
    "qwen3-a3b-dense": dict(  # qwen3-30b-a3b's active parameters as a dense model: an FFN of
        # 8 x 768 = 6144, the width of the 8 experts each token runs (seed 000's comparison)
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        qk_norm=True, max_position_embeddings=40960,
    ),
    # Tiny shapes for CPU tests and the quickstart.
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
        param_dtype="float32", dtype="float32",
    ),
    "tiny-qwen3": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=1, head_dim=32, qk_norm=True, rms_norm_eps=1e-6,
        max_position_embeddings=2048, param_dtype="float32", dtype="float32",
    ),
    "tiny-moe": dict(  # a tiny Qwen3-MoE
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=2048,
        moe=MoeConfig(num_experts=8, experts_per_token=2, expert_size=32),
        param_dtype="float32", dtype="float32",
    ),
}  # fmt: skip


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A ModelConfig by preset name, with field overrides (e.g. `layer_loop="scan"`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return ModelConfig(**{**PRESETS[name], **overrides})
