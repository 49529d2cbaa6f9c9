"""Export our params as a Hugging Face model directory (the inverse of `hf_loader`).

The directory holds `config.json`, `generation_config.json`, one `model.safetensors` and,
optionally, `tokenizer.json`; both `load_hf_model` and `transformers.AutoModelForCausalLM` load it.
Tensor names and layouts come from the loader's own rule tables, so the two cannot drift apart.

Memory: tensors are moved to the host one at a time, but `safetensors.numpy.save_file` needs all of
them in one dict, so the whole model in the export dtype is held in host memory at once. This
exporter is meant for models that fit in host memory (tests, small fine-tunes, toy models); it does
not shard its output.

Atomicity: everything is written into a hidden temporary directory next to `path` and renamed into
place at the end, so an interrupted save leaves no half-written `path` (at most a hidden
`.<name>.tmp-*` directory when the process is killed outright).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxinfer.checkpoint.hf_config import config_from_hf
from jaxinfer.checkpoint.hf_loader import _MOE_KEYS, _TOP_RULES, _hf_layout, _Rule, layer_parts
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.spec import ParamSpec, param_specs

PathLike = str | os.PathLike[str]

_NP_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
# Fields of ModelConfig that are load options rather than properties of the checkpoint.
_LOAD_OPTIONS = ("param_dtype", "dtype")


def _architecture(cfg: ModelConfig) -> str:
    """The HF architecture that represents `cfg` exactly; ValueError naming the field otherwise."""

    def refuse(field: str, why: str) -> ValueError:
        value = getattr(cfg, field)
        return ValueError(
            f"ModelConfig.{field}={value!r} cannot be exported: {why} (no Hugging Face "
            "architecture among Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE "
            "represents this config)"
        )

    if cfg.moe is not None:
        return _moe_architecture(cfg, refuse)
    if set(cfg.ffn_kinds) - {"dense"}:
        raise refuse("ffn_kinds", "only dense MLP blocks are supported")
    if cfg.has_formats:
        raise refuse("weight_format", "quantized weights are not exported")
    if cfg.qk_norm:
        # Qwen3: `attention_bias` puts a bias on all of q, k, v and o; the MLP has none.
        if cfg.qkv_bias != cfg.o_bias:
            raise refuse("o_bias", f"Qwen3 (qk_norm) needs o_bias == qkv_bias={cfg.qkv_bias}")
        if cfg.mlp_bias:
            raise refuse("mlp_bias", "Qwen3 (qk_norm) has no MLP bias")
        return "Qwen3ForCausalLM"
    if cfg.qkv_bias and not cfg.o_bias:
        # Qwen2: bias on q, k, v only, never on o or the MLP.
        if cfg.mlp_bias:
            raise refuse("mlp_bias", "Qwen2 (qkv_bias without o_bias) has no MLP bias")
        return "Qwen2ForCausalLM"
    if cfg.layer_types:
        raise refuse("layer_types", "per-layer attention types need Qwen2 (qkv_bias) or Qwen3")
    if cfg.sliding_window is not None:
        # Mistral: no biases anywhere (its modules hard-code bias=False).
        for field in ("qkv_bias", "o_bias", "mlp_bias"):
            if getattr(cfg, field):
                raise refuse(field, "Mistral (sliding_window without qk_norm) has no biases")
        return "MistralForCausalLM"
    if cfg.o_bias != cfg.qkv_bias:
        # Llama's `attention_bias` covers q, k, v and o together.
        raise refuse("o_bias", f"Llama needs o_bias == qkv_bias={cfg.qkv_bias}")
    return "LlamaForCausalLM"


def _moe_architecture(cfg: ModelConfig, refuse) -> str:
    """Mixtral, Qwen2-MoE or Qwen3-MoE, whichever represents the MoE `cfg` exactly."""
    m = cfg.moe
    if m.scoring != "softmax" or m.score_bias or m.num_groups > 1 or m.routed_scaling_factor != 1:
        raise refuse("moe", "DeepSeek-style routing (sigmoid scores, a selection bias, groups, "
                     "a scaling factor) has no exported architecture")  # fmt: skip
    if cfg.mlp_bias:
        raise refuse("mlp_bias", "MoE architectures have no MLP bias")
    if cfg.qk_norm:  # Qwen3-MoE: attention_bias on q, k, v and o; no shared expert
        if m.shared_expert_size:
            raise refuse("moe", "Qwen3-MoE (qk_norm) has no shared expert")
        if cfg.qkv_bias != cfg.o_bias:
            raise refuse("o_bias", f"Qwen3-MoE needs o_bias == qkv_bias={cfg.qkv_bias}")
        return "Qwen3MoeForCausalLM"
    if cfg.o_bias or cfg.layer_types:
        raise refuse("o_bias" if cfg.o_bias else "layer_types",
                     "Mixtral and Qwen2-MoE have no o bias or per-layer attention types")  # fmt: skip
    if m.shared_expert_size or m.shared_expert_gate or cfg.qkv_bias or not m.norm_topk_prob:
        if not m.shared_expert_gate:
            raise refuse("moe", "Qwen2-MoE (qkv_bias, unnormalised top-k or a shared expert) "
                         "has a gated shared expert")  # fmt: skip
        if cfg.sliding_window is not None:
            raise refuse("sliding_window", "Qwen2-MoE's sliding windows are not exported")
        return "Qwen2MoeForCausalLM"
    if cfg.ffn_kinds and set(cfg.ffn_kinds) != {"moe"}:
        raise refuse("ffn_kinds", "Mixtral has no dense layers")
    return "MixtralForCausalLM"


def _moe_fields(cfg: ModelConfig, arch: str) -> dict[str, Any]:
    m = cfg.moe
    if arch == "MixtralForCausalLM":
        return {"num_local_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
                "sliding_window": cfg.sliding_window}  # fmt: skip
    hf = {
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.experts_per_token,
        "moe_intermediate_size": m.expert_size,
        "norm_topk_prob": m.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.num_layers) if cfg.layer(i).ffn == "dense"],
    }
    if arch == "Qwen2MoeForCausalLM":
        hf.update(shared_expert_intermediate_size=m.shared_expert_size,
                  qkv_bias=bool(cfg.qkv_bias), use_sliding_window=False)  # fmt: skip
    else:
        hf.update(attention_bias=bool(cfg.qkv_bias),
                  use_sliding_window=cfg.sliding_window is not None,
                  sliding_window=cfg.sliding_window)  # fmt: skip
    return hf


def _rope_fields(cfg: ModelConfig) -> dict[str, Any]:
    """RoPE both as transformers v5 `rope_parameters` and as v4 `rope_theta` + `rope_scaling`.

    A scaling's fields are transformers' keys; unset optional ones (None) are left out.
    """
    theta = float(cfg.rope_theta)
    s = cfg.rope_scaling
    if s is None:
        return {
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "rope_theta": theta,
            "rope_scaling": None,
        }
    scaling = {"rope_type": s.rope_type}
    for name, value in dataclasses.asdict(s).items():
        if value is not None:
            scaling[name] = list(value) if isinstance(value, tuple) else value
    return {
        "rope_parameters": {**scaling, "rope_theta": theta},
        "rope_theta": theta,
        "rope_scaling": scaling,
    }


def _eos_value(cfg: ModelConfig) -> int | list[int] | None:
    eos = [int(t) for t in cfg.eos_token_ids]
    if not eos:
        return None
    return eos[0] if len(eos) == 1 else eos


def _qwen_window_fields(cfg: ModelConfig) -> dict[str, Any]:
    """Per-layer attention types, spelled so v4 and v5 Qwen2/3 configs agree where v4 can (it
    has only `max_window_layers`: sliding from that layer on)."""
    n = cfg.num_layers
    if cfg.layer_types:
        return {
            "use_sliding_window": True,
            "sliding_window": int(cfg.sliding_window),
            "max_window_layers": cfg.layer_types.index("sliding_attention"),
            "layer_types": list(cfg.layer_types),
        }
    if cfg.sliding_window is None:
        return {
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": n,
            "layer_types": ["full_attention"] * n,
        }
    return {
        "use_sliding_window": True,
        "sliding_window": int(cfg.sliding_window),
        "max_window_layers": 0,  # sliding from layer 0 on
        "layer_types": ["sliding_attention"] * n,
    }


def _without_load_options(cfg: ModelConfig) -> ModelConfig:
    return cfg.replace(
        param_dtype="float32",
        dtype="float32",
        eos_token_ids=tuple(int(t) for t in cfg.eos_token_ids),
    )


def config_to_hf(cfg: ModelConfig, *, dtype: str = "bfloat16") -> dict[str, Any]:
    """The HF `config.json` dict for `cfg`, with `torch_dtype`/`dtype` set to `dtype`.

    Raises ValueError (naming the field) for configs no supported HF architecture represents, and
    checks that `config_from_hf` reads the result back to `cfg` (up to the load options
    param_dtype and dtype).
    """
    if dtype not in _NP_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_NP_DTYPES)}; got {dtype!r}")
    arch = _architecture(cfg)
    hf: dict[str, Any] = {
        "architectures": [arch],
        "model_type": {
            "LlamaForCausalLM": "llama",
            "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3",
            "MixtralForCausalLM": "mixtral",
            "Qwen2MoeForCausalLM": "qwen2_moe",
            "Qwen3MoeForCausalLM": "qwen3_moe",
        }[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(cfg.rms_norm_eps),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": _eos_value(cfg),
        **_rope_fields(cfg),
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if arch == "LlamaForCausalLM":
        hf["attention_bias"] = bool(cfg.qkv_bias)
        hf["mlp_bias"] = bool(cfg.mlp_bias)
    elif arch == "MistralForCausalLM":
        hf["sliding_window"] = int(cfg.sliding_window)
    elif arch == "Qwen2ForCausalLM":
        hf.update(_qwen_window_fields(cfg))
    elif arch == "Qwen3ForCausalLM":
        hf["attention_bias"] = bool(cfg.qkv_bias)
        hf.update(_qwen_window_fields(cfg))
    else:
        hf.update(_moe_fields(cfg, arch))

    # Backstop for the rules above: what we write must read back as what we were given.
    try:
        back = config_from_hf(json.loads(json.dumps(hf)), dtype="float32")
    except ValueError as e:
        raise ValueError(f"cannot export ModelConfig as {arch}: {e}") from e
    if _without_load_options(back) != _without_load_options(cfg):
        diff = [
            f"{k}: {getattr(cfg, k)!r} -> {getattr(back, k)!r}"
            for k in cfg.__dataclass_fields__
            if k not in _LOAD_OPTIONS and getattr(cfg, k) != getattr(back, k)
        ]
        raise ValueError(f"ModelConfig does not survive export as {arch}: {'; '.join(diff)}")
    return hf


def _generation_config(cfg: ModelConfig) -> dict[str, Any]:
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": _eos_value(cfg)}


def _to_hf_layout(rule: _Rule, spec: ParamSpec, x: np.ndarray, name: str) -> np.ndarray:
    """Our layout -> HF's (the inverse of the loader's `_to_ours`)."""
    hf_shape, _ = _hf_layout(rule, spec.shape, spec.axes)
    if rule.kind == "linear":
        n = rule.n_in
        x = x.reshape(int(np.prod(spec.shape[:n])), int(np.prod(spec.shape[n:]))).T
    else:
        x = x.reshape(hf_shape)
    assert x.shape == tuple(hf_shape), (name, x.shape, hf_shape)
    return np.ascontiguousarray(x)


def _host(leaf: Any, spec: ParamSpec, param: str, dtype: np.dtype) -> np.ndarray:
    """One param on the host, shape-checked and cast to the export dtype."""
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        raise ValueError(
            f"param {param} is a {type(leaf).__name__}, not an array (quantized params cannot be "
            "exported)"
        )
    if tuple(leaf.shape) != tuple(spec.shape):
        raise ValueError(f"param {param} has shape {tuple(leaf.shape)}, expected {spec.shape}")
    host = np.asarray(leaf)
    if not (np.issubdtype(host.dtype, np.floating) or host.dtype == _NP_DTYPES["bfloat16"]):
        raise ValueError(
            f"param {param} has dtype {host.dtype}; only floating-point params can be exported"
        )
    return host.astype(dtype, copy=False)


def _check_keys(got: Mapping[str, Any], want: Mapping[str, Any], where: str) -> None:
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(
            f"params{where} do not match the config: missing {missing}, unexpected {extra}"
        )


def hf_state_dict(cfg: ModelConfig, params: Mapping[str, Any], dtype: str = "bfloat16"):
    """{HF tensor name: host array in HF layout and `dtype`}, built one tensor at a time."""
    if dtype not in _NP_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_NP_DTYPES)}; got {dtype!r}")
    np_dtype = _NP_DTYPES[dtype]
    if not isinstance(params, Mapping) or "layers" not in params:
        raise ValueError("params must be a dict with a 'layers' entry")
    layers = params["layers"]
    specs = param_specs(cfg)
    _check_keys(params, specs, "")
    if isinstance(layers, Mapping) or len(layers) != cfg.num_layers:
        raise ValueError(f"params['layers'] must be a tuple of {cfg.num_layers} per-layer dicts")

    out: dict[str, np.ndarray] = {}
    for key, spec in specs.items():
        if key == "layers":
            continue
        rule = _TOP_RULES[key]
        out[rule.hf_name] = _to_hf_layout(rule, spec, _host(params[key], spec, key, np_dtype), key)
    for i, (layer, layer_spec) in enumerate(zip(layers, specs["layers"], strict=True)):
        _check_keys(layer, layer_spec, f"['layers'][{i}]")
        for key, spec in layer_spec.items():
            param, leaf = f"layers[{i}].{key}", layer[key]
            host = _host(leaf, spec, param, np_dtype)
            if key in _MOE_KEYS:
                out.update(_moe_tensors(cfg, i, key, host))
                continue
            parts, axis = layer_parts(key, spec)
            pieces = [host]
            if axis is not None:  # a fused param (w_qkv, w_gate_up, ...): split into HF's tensors
                ends = np.cumsum([part.shape[axis] for _, part in parts])[:-1]
                pieces = np.split(host, ends, axis=axis)
            for (rule, part_spec), piece in zip(parts, pieces, strict=True):
                out[f"model.layers.{i}.{rule.hf_name}"] = _to_hf_layout(
                    rule, part_spec, piece, param
                )
    return out


def _moe_tensors(cfg: ModelConfig, i: int, key: str, host: np.ndarray) -> dict[str, np.ndarray]:
    """An MoE param as HF's tensors: the router, and each expert's gate, up and down weights
    (Mixtral's w1, w3, w2), per expert as the hub's checkpoints store them."""
    mixtral = _architecture(cfg) == "MixtralForCausalLM"
    block = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}."
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    if key == "router":
        return {f"{block}gate.weight": np.ascontiguousarray(host.T)}
    out = {}
    for j, w in enumerate(host):
        name = f"{block}experts.{j}."
        if key == "w_expert_gate_up":  # ours [E, 2, F] -> [F, E] each
            out[f"{name}{gate}.weight"] = np.ascontiguousarray(w[:, 0].T)
            out[f"{name}{up}.weight"] = np.ascontiguousarray(w[:, 1].T)
        else:  # w_expert_down: ours [F, E] -> [E, F]
            out[f"{name}{down}.weight"] = np.ascontiguousarray(w.T)
    return out


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`, replacing an existing `target` directory."""
    if not target.exists():
        os.replace(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    try:
        os.replace(target, old / "dir")
        try:
            os.replace(tmp, target)
        except BaseException:
            os.replace(old / "dir", target)  # put the original back
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def save_hf_model(
    path: PathLike,
    cfg: ModelConfig,
    params: Mapping[str, Any],
    *,
    tokenizer_file: PathLike | None = None,
    dtype: str = "bfloat16",
    force: bool = False,
) -> Path:
    """Write `params` (for `cfg`) as a Hugging Face model directory at `path`; returns the path.

    `dtype` ("bfloat16", "float16" or "float32") is the dtype of the saved tensors and of the
    config's `torch_dtype`. A `path` that exists and is not an empty directory is an error unless
    `force=True`, which replaces it entirely. `tokenizer_file` is copied to `tokenizer.json`.
    The whole model is held in host memory during the save (see the module docstring).
    """
    target = Path(path)
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise FileExistsError(f"{target} exists and is not a directory")
        if any(target.iterdir()) and not force:
            raise FileExistsError(f"{target} exists and is not empty (pass force=True to replace)")
    tokenizer = None if tokenizer_file is None else Path(tokenizer_file)
    if tokenizer is not None and not tokenizer.is_file():
        raise FileNotFoundError(f"tokenizer file {tokenizer} does not exist")
    hf_config = config_to_hf(cfg, dtype=dtype)  # validates before anything is written
    tensors = hf_state_dict(cfg, params, dtype)

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_json(tmp / "config.json", hf_config)
        _write_json(tmp / "generation_config.json", _generation_config(cfg))
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        del tensors
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        for file in tmp.iterdir():
            _fsync(file)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0o700
        _move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
