"""Model configuration: one frozen dataclass covers the whole decoder family.

Llama 2/3/3.1, Mistral, Qwen2 and Qwen3 differ only in fields here (RoPE scaling, QKV bias,
QK-norm, tied embeddings, sliding window), never in code paths that are copies of each other.
Layers may differ from each other: each has an FFN kind (`ffn_kinds`: dense today, MoE next;
DeepSeek's first-k-dense layers) and an attention type (`layer_types`: Qwen's mixed sliding and
full attention), read through `layer(i)`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import ClassVar

import jax.numpy as jnp

from jaxinfer.quant import WEIGHT_FORMATS

ATTENTION_TYPES = ("full_attention", "sliding_attention")  # transformers' `layer_types` names


def _number(obj: object, name: str, *, at_least: float | None = None, optional: bool = False):
    """obj.name as a float (left None when `optional`); ValueError naming the field otherwise."""
    value = getattr(obj, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if at_least is not None and not value >= at_least:
        raise ValueError(f"{name} must be >= {at_least}, got {value!r}")
    object.__setattr__(obj, name, float(value))


def _positive_int(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# RoPE scalings, one frozen dataclass per transformers `rope_type`. Field names are transformers'
# `rope_parameters` keys, so the HF and orbax configs write them as they are. `factor` >= 1
# everywhere: transformers warns below 1 (it would shrink the context, not stretch it).


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595): positions divided by
    `factor`, i.e. every inverse frequency divided by it."""

    rope_type: ClassVar[str] = "linear"
    factor: float

    def __post_init__(self) -> None:
        _number(self, "factor", at_least=1.0)


@dataclass(frozen=True)
class DynamicRopeScaling:
    """NTK-aware scaling of the base (bloc97/emozilla, "dynamic NTK"), in vLLM's static form.

    The context it stretches is `ModelConfig.max_position_embeddings` (transformers reads no
    original_max_position_embeddings for this type). transformers recomputes the base in every
    forward from that forward's longest position (unscaled up to max_position_embeddings), and
    keeps the larger base until a forward fits the original context again; its cache then holds
    keys rotated with different bases. A paged engine with mixed batches cannot follow a
    per-batch rule, so the base is scaled once, as transformers does for a sequence of
    `factor * max_position_embeddings` tokens: equal to transformers at that length, other
    rotations (for every shorter sequence) than transformers'.
    """

    rope_type: ClassVar[str] = "dynamic"
    factor: float

    def __post_init__(self) -> None:
        _number(self, "factor", at_least=1.0)


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (Peng et al. 2023, arXiv:2309.00071): NTK-by-parts interpolation of the frequencies
    between `beta_slow` and `beta_fast` rotations over the original context, and cos/sin scaled
    by an attention factor (by default 0.1 ln(factor) + 1, or the mscale ratio of DeepSeek)."""

    rope_type: ClassVar[str] = "yarn"
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: derived from factor (and mscale, mscale_all_dim)
    truncate: bool = True  # round the ramp's ends to whole dimensions

    def __post_init__(self) -> None:
        _number(self, "factor", at_least=1.0)
        _positive_int(self, "original_max_position_embeddings")
        for name in ("beta_fast", "beta_slow"):
            _number(self, name)
        for name in ("mscale", "mscale_all_dim"):
            _number(self, name, optional=True)
        _number(self, "attention_factor", at_least=0.0, optional=True)
        if not isinstance(self.truncate, bool):
            raise ValueError(f"truncate must be true or false, got {self.truncate!r}")


@dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE (Ding et al. 2024, arXiv:2402.13753; Phi-3): a rescale factor per frequency,
    `short_factor` within the original context and `long_factor` beyond it, and cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) unless `attention_factor` is set.

    transformers picks the factors per forward (long once a position passes the original
    context). Here the choice is static: long factors when `ModelConfig.max_position_embeddings`
    exceeds the original context, as transformers does for the longest sequences the config
    admits; for sequences within the original context transformers would use the short ones.
    """

    rope_type: ClassVar[str] = "longrope"
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    factor: float
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if not isinstance(value, list | tuple) or any(
                isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 for v in value
            ):
                raise ValueError(f"{name} must be a list of positive numbers, got {value!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))  # (JSON gives lists)
        _positive_int(self, "original_max_position_embeddings")
        _number(self, "factor", at_least=1.0)
        _number(self, "attention_factor", at_least=0.0, optional=True)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (`rope_type: llama3` in HF configs)."""

    rope_type: ClassVar[str] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        _number(self, "factor", at_least=1.0)
        for name in ("low_freq_factor", "high_freq_factor"):
            _number(self, name)
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"high_freq_factor ({self.high_freq_factor}) must exceed "
                             f"low_freq_factor ({self.low_freq_factor})")  # fmt: skip
        _positive_int(self, "original_max_position_embeddings")


RopeScaling = (
    LinearRopeScaling | DynamicRopeScaling | YarnRopeScaling | LongRopeScaling | Llama3RopeScaling
)
ROPE_SCALINGS: dict[str, type[RopeScaling]] = {
    cls.rope_type: cls
    for cls in (
        LinearRopeScaling,
        DynamicRopeScaling,
        YarnRopeScaling,
        LongRopeScaling,
        Llama3RopeScaling,
    )
}


SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoeConfig:
    """The routed FFN of the layers whose kind is "moe" (`ModelConfig.ffn_kinds`).

    Each token's router scores (fp32) pick `experts_per_token` of `num_experts` SwiGLU experts of
    width `expert_size`; their outputs are summed with the selected scores as weights.
    - `scoring`: "softmax" over all experts (Mixtral, Qwen2/3-MoE) or a per-expert "sigmoid"
      (DeepSeek-V3). `norm_topk_prob` renormalises the k selected weights to sum to 1 (Mixtral
      always does; Qwen's `norm_topk_prob`); `routed_scaling_factor` then multiplies them.
    - DeepSeek-V3's aux-loss-free balancing: `score_bias` adds a learned per-expert bias
      (`e_score_correction_bias`) to the scores for selection only, never to the weights; with
      `num_groups` > 1, selection is limited to the `topk_groups` groups (of consecutive experts)
      whose two best biased scores sum highest.
    - A shared expert: a dense SwiGLU of width `shared_expert_size` (0: none) every token goes
      through, added to the routed output; `shared_expert_gate` (Qwen2-MoE) scales it by
      sigmoid(x @ w_shared_gate) per token. DeepSeek's `n_shared_experts` of width w are one
      shared expert of width n * w.
    """

    num_experts: int
    experts_per_token: int
    expert_size: int
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    score_bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    shared_expert_size: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "experts_per_token", "expert_size", "num_groups",
                     "topk_groups"):  # fmt: skip
            _positive_int(self, name)
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) exceeds num_experts "
                             f"({self.num_experts})")  # fmt: skip
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        _number(self, "routed_scaling_factor")
        for name in ("norm_topk_prob", "score_bias", "shared_expert_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        size = self.shared_expert_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"shared_expert_size must be an int >= 0, got {size!r}")
        if self.shared_expert_gate and not size:
            raise ValueError("shared_expert_gate needs a shared expert (shared_expert_size > 0)")
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_groups ({self.num_groups}) must divide num_experts "
                             f"({self.num_experts})")  # fmt: skip
        if self.topk_groups > self.num_groups:
            raise ValueError(f"topk_groups ({self.topk_groups}) exceeds num_groups "
                             f"({self.num_groups})")  # fmt: skip
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and per_group < 2:
            raise ValueError(f"group-limited routing ranks groups by their two best experts: "
                             f"num_groups={self.num_groups} leaves {per_group} per group")  # fmt: skip
        if self.num_groups > 1 and self.topk_groups * per_group < self.experts_per_token:
            raise ValueError(f"topk_groups={self.topk_groups} groups of {per_group} experts "
                             f"hold fewer than experts_per_token={self.experts_per_token}")  # fmt: skip


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
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
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
    # its FFN kind, a key of `jaxinfer.models.ffn.FFN_BLOCKS` (default "moe" when `moe` is set,
    # else "dense"; dense layers of an MoE model have width `intermediate_size`).
    layer_types: tuple[str, ...] = ()
    ffn_kinds: tuple[str, ...] = ()
    moe: MoeConfig | None = None  # the routed experts of "moe" layers
    # The format of the linear weights of the decoder layers (a key of
    # `jaxinfer.quant.WEIGHT_FORMATS`); None: plain `param_dtype` arrays. Embedding, LM head,
    # norms and biases always stay plain.
    weight_format: str | None = None
    # A quantization recipe: (pattern, format or None = plain) pairs, fnmatch patterns over a
    # layer weight's path "layers.{i}.{name}" (e.g. "layers.*.w_qkv", "layers.0.*"); the first
    # pattern that matches a weight gives its format, `weight_format` the format of the rest
    # (`weight_format_of`). Every pattern must match a linear weight of the model
    # (`spec.param_specs` refuses one that does not).
    weight_formats: tuple[tuple[str, str | None], ...] = ()
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
        rs = self.rope_scaling
        if rs is not None and type(rs) not in ROPE_SCALINGS.values():
            kinds = [c.__name__ for c in ROPE_SCALINGS.values()]
            raise ValueError(f"ModelConfig.rope_scaling must be one of {kinds} or None, got {rs!r}")
        for name in ("short_factor", "long_factor") if isinstance(rs, LongRopeScaling) else ():
            n = len(getattr(rs, name))  # a factor per frequency
            if n != self.head_dim // 2:
                raise ValueError(f"ModelConfig.rope_scaling.{name} has {n} entries, head_dim "
                                 f"{self.head_dim} needs {self.head_dim // 2}")  # fmt: skip
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"ModelConfig.sliding_window must be positive or None, got {self.sliding_window}"
            )
        if isinstance(self.moe, dict):  # (JSON and YAML give a mapping)
            try:
                object.__setattr__(self, "moe", MoeConfig(**self.moe))
            except (TypeError, ValueError) as e:
                raise ValueError(f"ModelConfig.moe: {e}") from e
        if self.moe is not None and not isinstance(self.moe, MoeConfig):
            raise ValueError(f"ModelConfig.moe must be a MoeConfig, a mapping or None, "
                             f"got {self.moe!r}")  # fmt: skip

        for name in ("layer_types", "ffn_kinds"):  # (the FFN kinds: `spec.layer_specs` checks)
            value = getattr(self, name)
            object.__setattr__(self, name, tuple(value))  # (JSON gives lists)
            if value and len(value) != self.num_layers:
                raise ValueError(f"ModelConfig.{name} has {len(value)} entries for "
                                 f"{self.num_layers} layers (or leave it empty)")  # fmt: skip
        bad = sorted(set(self.layer_types) - set(ATTENTION_TYPES))
        if bad:
            raise ValueError(f"ModelConfig.layer_types: {bad} unknown; allowed: "
                             f"{list(ATTENTION_TYPES)}")  # fmt: skip
        if self.moe is None and "moe" in self.ffn_kinds:
            raise ValueError("ModelConfig.ffn_kinds has moe layers but moe is None")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("ModelConfig.layer_types has sliding_attention layers but "
                             "sliding_window is None")  # fmt: skip
        if self.weight_format is not None and self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"ModelConfig.weight_format={self.weight_format!r} is unknown; "
                             f"known: {sorted(WEIGHT_FORMATS)} or None")  # fmt: skip
        self._check_weight_formats()

    def _check_weight_formats(self) -> None:
        """Each recipe entry is (pattern, known format or None); that each pattern matches a
        linear weight of the layers is `spec.param_specs`'s check (the layers' weights are its)."""
        entries = []
        for i, entry in enumerate(self.weight_formats):  # (JSON gives lists of lists)
            if (not isinstance(entry, list | tuple) or len(entry) != 2
                    or not isinstance(entry[0], str)):  # fmt: skip
                raise ValueError(f"ModelConfig.weight_formats[{i}]={entry!r} must be a "
                                 "(pattern, format or None) pair")  # fmt: skip
            pattern, fmt = entry
            if fmt is not None and fmt not in WEIGHT_FORMATS:
                raise ValueError(f"ModelConfig.weight_formats[{i}]: pattern {pattern!r} names "
                                 f"format {fmt!r}, unknown; known: {sorted(WEIGHT_FORMATS)} "
                                 "or None")  # fmt: skip
            entries.append((pattern, fmt))
        object.__setattr__(self, "weight_formats", tuple(entries))

    def weight_format_of(self, layer: int, name: str) -> str | None:
        """The format of linear weight `name` of layer `layer`: the first `weight_formats`
        pattern matching "layers.{layer}.{name}", else `weight_format` (None: plain)."""
        path = f"layers.{layer}.{name}"
        for pattern, fmt in self.weight_formats:
            if fnmatch.fnmatchcase(path, pattern):
                return fmt
        return self.weight_format

    @property
    def has_formats(self) -> bool:
        """Whether any weight is stored in a format (else every weight is a plain array)."""
        return self.weight_format is not None or any(f is not None for _, f in self.weight_formats)

    def plain(self) -> ModelConfig:
        """This model with every weight a plain `param_dtype` array (no formats, no recipe)."""
        return self.replace(weight_format=None, weight_formats=())

    @property
    def max_context(self) -> int:
        """The longest sequence the model's RoPE is meant for (vLLM's rule): linear and dynamic
        scaling stretch `max_position_embeddings` by `factor`, YaRN the original context; Llama 3
        and LongRoPE configs already give the stretched length."""
        rs = self.rope_scaling
        if isinstance(rs, LinearRopeScaling | DynamicRopeScaling):
            return int(self.max_position_embeddings * rs.factor)
        if isinstance(rs, YarnRopeScaling):
            return max(self.max_position_embeddings,
                       int(rs.original_max_position_embeddings * rs.factor))  # fmt: skip
        return self.max_position_embeddings

    def describe_context(self) -> str:
        """`max_context` as error messages name it."""
        if self.max_context == self.max_position_embeddings:
            return f"max_position_embeddings={self.max_position_embeddings}"
        return (f"context of {self.max_context} (max_position_embeddings="
                f"{self.max_position_embeddings} stretched by its {self.rope_scaling.rope_type} "
                "RoPE scaling)")  # fmt: skip

    def layer(self, i: int) -> LayerKind:
        """What makes layer `i` differ from the others: its FFN kind and attention window."""
        ffn = self.ffn_kinds[i] if self.ffn_kinds else ("moe" if self.moe else "dense")
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
