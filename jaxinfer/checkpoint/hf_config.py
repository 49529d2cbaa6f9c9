"""Hugging Face `config.json` -> ModelConfig.

A config.json means whatever transformers reads it to mean, so a key that is absent takes the
default of the transformers config class named by `architectures` (e.g. Mistral's 4096-token
sliding window, Qwen3's head_dim of 128), not ModelConfig's own defaults. The keys that fix the
model's size have no sensible default and are required. Anything we would silently compute
differently from transformers (other RoPE variants, partial rotary, non-SiLU activations) is
refused with UnsupportedModelError instead of loading a subtly wrong model. Two RoPE variants
that transformers recomputes per forward (dynamic NTK, LongRoPE) are loaded in a static form
that matches it only at some lengths: see `DynamicRopeScaling` and `LongRopeScaling`. A
`quantization_config` we can load exactly sets `weight_format` (`hf_quantized`); any other is
refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxinfer.checkpoint.errors import CheckpointError, UnsupportedModelError
from jaxinfer.checkpoint.hf_quantized import checkpoint_weight_format
from jaxinfer.models.config import ROPE_SCALINGS, ModelConfig, MoeConfig

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
# Architectures refused with the reason (instead of "not supported").
_REFUSED_ARCHITECTURES = {
    arch: "its attention is MLA (multi-head latent attention), which jaxinfer does not implement "
    "yet; its MoE block is `jaxinfer.models.moe` (MoeConfig scoring='sigmoid', score_bias, "
    "num_groups)"
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
}
# Used when `architectures` is absent (older or hand-written configs still carry model_type).
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_MISSING = object()


@dataclass(frozen=True)
class _ClassDefaults:
    """Defaults of the transformers config class (v5) for keys a config.json may omit."""

    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None
    # Absent num_key_value_heads: _MISSING means "same as num_attention_heads" (Llama's None).
    num_key_value_heads: Any
    # Absent head_dim: _MISSING means hidden_size // num_attention_heads.
    head_dim: Any
    sliding_window: int | None = None


_DEFAULTS = {
    "LlamaForCausalLM": _ClassDefaults(2048, 1, 2, _MISSING, _MISSING),
    "MistralForCausalLM": _ClassDefaults(131072, 1, 2, 8, _MISSING, sliding_window=4096),
    "Qwen2ForCausalLM": _ClassDefaults(32768, None, None, 32, _MISSING, sliding_window=4096),
    "Qwen3ForCausalLM": _ClassDefaults(32768, None, None, 32, 128, sliding_window=4096),
    "MixtralForCausalLM": _ClassDefaults(131072, 1, 2, 8, _MISSING),
    "Qwen2MoeForCausalLM": _ClassDefaults(32768, None, None, 16, _MISSING, sliding_window=4096),
    "Qwen3MoeForCausalLM": _ClassDefaults(32768, None, None, 4, _MISSING, sliding_window=4096),
}
# transformers' MoE defaults: (num_experts, num_experts_per_tok, moe_intermediate_size,
# norm_topk_prob); Mixtral's experts are `intermediate_size` wide and always renormalised.
_MOE_DEFAULTS = {
    "MixtralForCausalLM": (8, 2, None, True),
    "Qwen2MoeForCausalLM": (60, 4, 1408, False),
    "Qwen3MoeForCausalLM": (128, 8, 768, False),
}
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6
_QWEN_MAX_WINDOW_LAYERS = 28


def _architecture(hf: Mapping[str, Any], source: str) -> str:
    archs = hf.get("architectures")
    if archs is None:
        model_type = hf.get("model_type")
        if model_type is None:
            raise CheckpointError(
                f"{source}: missing required key 'architectures' (and no 'model_type' either)"
            )
        if _MODEL_TYPE_TO_ARCH.get(model_type) in _REFUSED_ARCHITECTURES:
            arch = _MODEL_TYPE_TO_ARCH[model_type]
            raise UnsupportedModelError(f"{source}: {arch} is not supported: "
                                        f"{_REFUSED_ARCHITECTURES[arch]}")  # fmt: skip
        if model_type not in _MODEL_TYPE_TO_ARCH:
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} is not supported; supported architectures: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        return _MODEL_TYPE_TO_ARCH[model_type]
    if isinstance(archs, str):
        archs = [archs]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
        if arch in _REFUSED_ARCHITECTURES:
            raise UnsupportedModelError(f"{source}: {arch} is not supported: "
                                        f"{_REFUSED_ARCHITECTURES[arch]}")  # fmt: skip
    raise UnsupportedModelError(
        f"{source}: architectures {list(archs)!r} is not supported; supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _get(hf: Mapping[str, Any], key: str, default: Any) -> Any:
    """hf[key], with `default` when absent *or* null (HF writes nulls for unset optionals)."""
    value = hf.get(key)
    return default if value is None else value


def _rope(hf: Mapping[str, Any], max_pos: int, head_dim: int, source: str):
    """(rope_theta, rope_scaling) from v5 `rope_parameters` or v4 `rope_theta` + `rope_scaling`.

    Mirrors transformers' precedence: a v4 `rope_scaling` dict wins over `rope_parameters`, and
    rope_theta inside the dict wins over a top-level one.
    """
    if hf.get("rope_scaling") is not None:
        key, params = "rope_scaling", hf["rope_scaling"]
    else:
        key, params = "rope_parameters", hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise CheckpointError(f"{source}: {key} must be a JSON object, got {params!r}")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError(
            f"{source}: per-layer-type RoPE parameters in {key} are not supported: {dict(params)!r}"
        )
    theta = float(_get(params, "rope_theta", _get(hf, "rope_theta", _DEFAULT_ROPE_THETA)))
    partial = _get(params, "partial_rotary_factor", _get(hf, "partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise UnsupportedModelError(
            f"{source}: partial_rotary_factor={partial!r} is not supported (only full rotary)"
        )
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in ROPE_SCALINGS:
        raise UnsupportedModelError(
            f"{source}: {key}.rope_type={rope_type!r} is not supported; supported: 'default', "
            + ", ".join(repr(t) for t in ROPE_SCALINGS)
        )
    fields = _rope_scaling_fields(rope_type, params, hf, max_pos, head_dim, f"{source}: {key}")
    try:
        return theta, ROPE_SCALINGS[rope_type](**fields)
    except ValueError as e:
        raise CheckpointError(f"{source}: {key} (rope_type {rope_type!r}): {e}") from e


def _rope_scaling_fields(
    rope_type: str,
    params: Mapping[str, Any],
    hf: Mapping[str, Any],
    max_pos: int,
    head_dim: int,
    where: str,
) -> dict[str, Any]:
    """The fields of `ROPE_SCALINGS[rope_type]`, read as transformers' modeling_rope_utils does."""

    def required(name: str) -> Any:
        if params.get(name) is None:
            raise CheckpointError(f"{where} has rope_type {rope_type!r} but no {name!r}")
        return params[name]

    if rope_type in ("linear", "dynamic"):
        # (dynamic stretches max_position_embeddings: transformers reads no original max for it)
        return {"factor": required("factor")}
    # transformers lets a top-level original_max_position_embeddings win (its model re-runs
    # `standardize_rope_params`), then the dict's, then falls back to max_position_embeddings.
    orig = _get(hf, "original_max_position_embeddings", None)
    if orig is None:
        orig = _get(params, "original_max_position_embeddings", max_pos)
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise CheckpointError(
            f"{where}: original_max_position_embeddings must be a positive int, got {orig!r}"
        )
    if rope_type == "llama3":
        return {
            "factor": required("factor"),
            "low_freq_factor": required("low_freq_factor"),
            "high_freq_factor": required("high_freq_factor"),
            "original_max_position_embeddings": orig,
        }
    # yarn and longrope: a null factor is max_position_embeddings / original (DeepSeek-V3, Phi-3)
    factor = _get(params, "factor", max_pos / orig)
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):  # (a factor per frequency)
            value = required(name)
            if isinstance(value, list) and len(value) != head_dim // 2:
                raise CheckpointError(f"{where}.{name} has {len(value)} entries, head_dim "
                                      f"{head_dim} needs {head_dim // 2}")  # fmt: skip
        return {
            "short_factor": params["short_factor"],
            "long_factor": params["long_factor"],
            "original_max_position_embeddings": orig,
            "factor": factor,
            "attention_factor": params.get("attention_factor"),
        }
    if "factor" not in params:  # yarn: transformers requires the key (even if null)
        raise CheckpointError(f"{where} has rope_type 'yarn' but no 'factor'")
    truncate = params.get("truncate", True)
    return {
        "factor": factor,
        "original_max_position_embeddings": orig,
        "beta_fast": params.get("beta_fast") or 32.0,  # transformers' `or`: 0 and null are 32
        "beta_slow": params.get("beta_slow") or 1.0,
        "mscale": params.get("mscale"),
        "mscale_all_dim": params.get("mscale_all_dim"),
        "attention_factor": params.get("attention_factor"),
        "truncate": False if truncate is None else truncate,  # a null is falsy to transformers
    }


def _qwen_layer_types(hf: Mapping[str, Any], d: _ClassDefaults, n_layers: int, source: str):
    """Qwen2/3: (sliding window or None, per-layer attention types, () when all are alike).

    transformers turns `use_sliding_window` + `max_window_layers` into per-layer `layer_types`
    (sliding from layer max_window_layers on) unless the config lists them itself.
    """
    window = _get(hf, "sliding_window", d.sliding_window) if hf.get("use_sliding_window") else None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first_sliding = _get(hf, "max_window_layers", _QWEN_MAX_WINDOW_LAYERS)
        layer_types = [
            "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
            for i in range(n_layers)
        ]
    if len(layer_types) != n_layers:
        raise CheckpointError(
            f"{source}: layer_types has {len(layer_types)} entries for {n_layers} layers"
        )
    kinds = set(layer_types)
    unknown = sorted(kinds - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModelError(f"{source}: layer_types {unknown} are not supported")
    if kinds == {"full_attention"}:
        return None, ()
    if window is None:
        raise UnsupportedModelError(
            f"{source}: layer_types lists sliding_attention layers but use_sliding_window="
            f"{hf.get('use_sliding_window')!r} (no window applies in transformers)"
        )
    return int(window), (() if kinds == {"sliding_attention"} else tuple(layer_types))


def _moe(hf: Mapping[str, Any], arch: str, num_layers: int, source: str):
    """(MoeConfig or None, per-layer FFN kinds, () when all are alike) of an MoE architecture,
    with transformers' rule for its dense layers (Qwen: `mlp_only_layers`, and a sparse layer
    every `decoder_sparse_step`)."""
    if arch not in _MOE_DEFAULTS:
        return None, ()
    n_default, k_default, size_default, norm_default = _MOE_DEFAULTS[arch]
    # config.json files say num_experts (Qwen) or num_local_experts (Mixtral); either is read
    num_experts = _get(hf, "num_experts", _get(hf, "num_local_experts", n_default))
    if arch == "MixtralForCausalLM":
        size, norm, step, dense_layers = hf["intermediate_size"], True, 1, []
    else:
        size = _get(hf, "moe_intermediate_size", size_default)
        norm = _get(hf, "norm_topk_prob", norm_default)
        step = _get(hf, "decoder_sparse_step", 1)
        dense_layers = _get(hf, "mlp_only_layers", [])
        if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
            raise CheckpointError(f"{source}: decoder_sparse_step must be a positive int, "
                                  f"got {step!r}")  # fmt: skip
        if not isinstance(dense_layers, list) or not all(isinstance(i, int) for i in dense_layers):
            raise CheckpointError(f"{source}: mlp_only_layers must be a list of layer indices, "
                                  f"got {dense_layers!r}")  # fmt: skip
    if num_experts == 0:  # transformers builds dense layers only
        return None, ()
    shared = (
        _get(hf, "shared_expert_intermediate_size", 5632) if arch == "Qwen2MoeForCausalLM" else 0
    )
    try:
        moe = MoeConfig(
            num_experts=num_experts,
            experts_per_token=_get(hf, "num_experts_per_tok", k_default),
            expert_size=size,
            norm_topk_prob=bool(norm),
            shared_expert_size=shared,
            shared_expert_gate=bool(shared),
        )
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from e
    kinds = tuple(
        "moe" if i not in dense_layers and (i + 1) % step == 0 else "dense"
        for i in range(num_layers)
    )
    return moe, (() if set(kinds) == {"moe"} else kinds)


def _token_ids(value: Any, key: str, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise CheckpointError(f"{source}: {key} must be an int or a list of ints, got {value!r}")


def config_from_hf(
    hf: Mapping[str, Any],
    *,
    dtype: str = "bfloat16",
    param_dtype: str | None = None,
    source: str = "config.json",
) -> ModelConfig:
    """ModelConfig for a Hugging Face config.json dict.

    `param_dtype=None` stores weights in `dtype`; the checkpoint's own `torch_dtype`/`dtype` is
    deliberately ignored so the caller, not the file, decides memory use. `source` names the file
    in error messages.
    """
    for name, value in (
        ("dtype", dtype),
        ("param_dtype", param_dtype),
    ):  # the caller's, not the file's
        if value is not None and value not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"{name}={value!r} is invalid: must be one of float32, bfloat16, "
                             "float16")  # fmt: skip
    arch = _architecture(hf, source)
    for key in _REQUIRED_KEYS:
        if hf.get(key) is None:
            raise CheckpointError(f"{source}: missing required key {key!r} (architecture {arch})")
    d = _DEFAULTS[arch]
    act = _get(hf, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")

    num_layers = hf["num_hidden_layers"]
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    kv_heads = hf.get("num_key_value_heads", d.num_key_value_heads)
    if kv_heads is None or kv_heads is _MISSING:
        kv_heads = num_heads
    head_dim = hf.get("head_dim", d.head_dim)
    if head_dim is None or head_dim is _MISSING:
        head_dim = hidden // num_heads
    max_pos = _get(hf, "max_position_embeddings", d.max_position_embeddings)
    rope_theta, rope_scaling = _rope(hf, max_pos, head_dim, source)

    attention_bias = bool(_get(hf, "attention_bias", False))
    qkv_bias = o_bias = mlp_bias = qk_norm = False
    sliding_window, layer_types = None, ()
    if arch == "LlamaForCausalLM":
        qkv_bias = o_bias = attention_bias
        mlp_bias = bool(_get(hf, "mlp_bias", False))
    elif arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        # Mistral's and Mixtral's layers hard-code bias=False, whatever the config says.
        sliding_window = hf.get("sliding_window", d.sliding_window)
    elif arch == "Qwen2MoeForCausalLM":
        qkv_bias = bool(_get(hf, "qkv_bias", True))  # q/k/v only (o_proj has none)
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"{source}: use_sliding_window=true is not supported for Qwen2MoeForCausalLM "
                "(its sliding layers follow their own pattern)"
            )
    elif arch == "Qwen3MoeForCausalLM":
        qkv_bias = o_bias = attention_bias
        qk_norm = True
        if hf.get("use_sliding_window"):  # every layer (transformers' Qwen3MoeAttention)
            sliding_window = _get(hf, "sliding_window", d.sliding_window)
    elif arch == "Qwen2ForCausalLM":
        qkv_bias = True  # Qwen2Attention: bias on q/k/v, never on o.
        sliding_window, layer_types = _qwen_layer_types(hf, d, num_layers, source)
    else:  # Qwen3ForCausalLM
        qkv_bias = o_bias = attention_bias
        qk_norm = True
        sliding_window, layer_types = _qwen_layer_types(hf, d, num_layers, source)

    moe, ffn_kinds = _moe(hf, arch, num_layers, source)
    eos = _token_ids(hf.get("eos_token_id", d.eos_token_id), "eos_token_id", source)
    bos = hf.get("bos_token_id", d.bos_token_id)
    if isinstance(bos, list):  # a few configs list it like eos; the first is the one prepended
        bos = bos[0] if bos else None
    if bos is not None and not isinstance(bos, int):
        raise CheckpointError(f"{source}: bos_token_id must be an int, got {bos!r}")
    try:
        cfg = ModelConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(_get(hf, "rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(max_pos),
            tie_word_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            sliding_window=None if sliding_window is None else int(sliding_window),
            layer_types=layer_types,
            ffn_kinds=ffn_kinds,
            moe=moe,
            param_dtype=param_dtype if param_dtype is not None else dtype,
            dtype=dtype,
            bos_token_id=bos,
            eos_token_ids=eos,
        )
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from e
    # a pre-quantized checkpoint's linears load in the format it stores (`hf_quantized`)
    quant = checkpoint_weight_format(hf.get("quantization_config"), cfg.num_layers, source)
    return cfg if quant is None else cfg.replace(weight_format=quant)
