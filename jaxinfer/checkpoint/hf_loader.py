"""Load Hugging Face safetensors checkpoints (Llama, Mistral, Qwen2, Qwen3) into our param tree.

The load is driven by `param_specs(cfg)`: every leaf names the HF tensor it comes from, so a tensor
the model needs but the files lack is an error, and tensors the model does not use (e.g. old
`rotary_emb.inv_freq` buffers, a tied `lm_head.weight`) are ignored, except those of layers beyond
`cfg.num_layers` (a `num_hidden_layers` smaller than the checkpoint's would silently load a
truncated model): they are refused unless `allow_unused_layers=True`.

Every loaded param is checked for NaN/inf on the device (one scalar to the host per param); a
non-finite weight is refused with the HF tensor's name.

What a load checks, and what it cannot: each tensor's presence, shape, dtype and finiteness, and
the config's keys. A tensor with the right shape but wrong contents loads silently: a square
projection stored transposed (`q_proj` of an E x E model), rows permuted (q/k for another RoPE
convention), another layer's tensor under this one's name. Nothing in a safetensors file says how
its values were laid out, so only a forward pass against outputs the checkpoint's authors made can
catch these; `tests/test_checkpoint_loading.py`, `test_hf_parity.py` and `test_smollm2.py` do that against `transformers`
for the architectures we load, and a new architecture needs the same test before it is trusted.

Memory: tensors are read one at a time from memory-mapped files, sent to the device(s) in their HF
layout and dtype, and transposed/reshaped/cast there by a small jitted program, so the host holds
at most one tensor (and no transposed copy of it) at any moment. We wait for each tensor's device
copy before reading the next; otherwise async dispatch would let host buffers pile up.

On a mesh each tensor goes straight onto its shards: `jax.device_put(host, sharding)` with the
sharding of the param's logical axes in HF layout (`_hf_layout`) slices the host array and sends
each device only its slice (a replicated tensor: all of it), and the conversion to our layout is
local to each device (its compiled program holds no collective on a `model` or `data` x `model`
mesh: the HF dim a param is split on is the leading dim of ours that shards it). Peak host memory
is the largest tensor (e.g. the embedding, V x E); peak memory of a device is its share of the
params loaded so far (a sharded param's bytes / T on a model axis of T, a replicated one's
whole) plus the current tensor's slice twice (HF layout and ours). `tests/test_tensor_parallel.py`
checks the per-device bytes of a load on 8 CPU devices. Exceptions: KV heads the model axis does
not divide are loaded replicated (`parallel/tensor.py` then replicates them per device), and per-
expert tensors are stacked on the mesh after each was placed by its own axes.

Dtypes: F32, F16 and BF16 tensors are accepted and cast to the spec's dtype. Everything else is
refused: integer and FP8 tensors come from quantized checkpoints whose scales we would not apply
(casting them would load wrong weights silently), and F64 never occurs in LLM checkpoints. The
exception: a pre-quantized checkpoint (FP8 block-scaled, ModelOpt NVFP4) whose config names its
format loads its decoder linears as they are stored, into that weight format (`hf_quantized`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.checkpoint.hf_config import config_from_hf
from jaxinfer.checkpoint.hf_quantized import prequantized_linears
from jaxinfer.checkpoint.integrity import count_nonfinite
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.spec import Params, ParamSpec, param_specs
from jaxinfer.parallel.sharding import named_sharding, put_global
from jaxinfer.quant import QuantizedWeight
from jaxinfer.quant.transform import quantize_params

PathLike = str | os.PathLike[str]

SUPPORTED_DTYPES = ("F32", "F16", "BF16")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
QUANT_CONFIG_FILE = "hf_quant_config.json"  # NVIDIA ModelOpt's, beside config.json
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class _Rule:
    """Where a param comes from and how HF's layout maps onto ours.

    kind "same": identical shape. "vector": HF 1-D, ours may split heads ([Hq*D] -> [Hq, D]).
    "linear": HF nn.Linear weight [out, in]; ours is [in..., out...] with the first `n_in` dims
    being the input, so ours = W.T.reshape(shape).
    """

    hf_name: str
    kind: str
    n_in: int = 1


@dataclass(frozen=True)
class _Fused:
    """A param that joins several HF tensors along `axis` of our layout (e.g. `w_qkv` from
    q_proj, k_proj and v_proj). The first part takes all of that axis but one slot per later part
    (q: the G query heads of each KV group; k, v, gate, up: one slot each)."""

    parts: tuple[_Rule, ...]
    axis: int

    def part_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        rest = shape[self.axis] - (len(self.parts) - 1)
        sizes = [rest] + [1] * (len(self.parts) - 1)
        return [(*shape[: self.axis], n, *shape[self.axis + 1 :]) for n in sizes]


_TOP_RULES = {
    "embed": _Rule("model.embed_tokens.weight", "same"),
    "final_norm": _Rule("model.norm.weight", "same"),
    "lm_head": _Rule("lm_head.weight", "linear"),
}
_LAYER_RULES = {
    "attn_norm": _Rule("input_layernorm.weight", "vector"),
    "mlp_norm": _Rule("post_attention_layernorm.weight", "vector"),
    "w_qkv": _Fused(
        (
            _Rule("self_attn.q_proj.weight", "linear"),
            _Rule("self_attn.k_proj.weight", "linear"),
            _Rule("self_attn.v_proj.weight", "linear"),
        ),
        axis=2,
    ),
    "wo": _Rule("self_attn.o_proj.weight", "linear", n_in=2),
    "b_qkv": _Fused(
        (
            _Rule("self_attn.q_proj.bias", "vector"),
            _Rule("self_attn.k_proj.bias", "vector"),
            _Rule("self_attn.v_proj.bias", "vector"),
        ),
        axis=1,
    ),
    "bo": _Rule("self_attn.o_proj.bias", "vector"),
    "q_norm": _Rule("self_attn.q_norm.weight", "vector"),
    "k_norm": _Rule("self_attn.k_norm.weight", "vector"),
    "w_gate_up": _Fused(
        (_Rule("mlp.gate_proj.weight", "linear"), _Rule("mlp.up_proj.weight", "linear")), axis=1
    ),
    "w_down": _Rule("mlp.down_proj.weight", "linear"),
    "b_gate_up": _Fused(
        (_Rule("mlp.gate_proj.bias", "vector"), _Rule("mlp.up_proj.bias", "vector")), axis=0
    ),
    "b_down": _Rule("mlp.down_proj.bias", "vector"),
    # Qwen2-MoE's shared expert and its gate
    "w_shared_gate_up": _Fused(
        (
            _Rule("mlp.shared_expert.gate_proj.weight", "linear"),
            _Rule("mlp.shared_expert.up_proj.weight", "linear"),
        ),
        axis=1,
    ),
    "w_shared_down": _Rule("mlp.shared_expert.down_proj.weight", "linear"),
    "w_shared_gate": _Rule("mlp.shared_expert_gate.weight", "linear"),
}
# An MoE block's params: read by `_Loader.load_moe` (names depend on the family).
_MOE_KEYS = ("router", "router_bias", "w_expert_gate_up", "w_expert_down")


def layer_parts(key: str, spec: ParamSpec) -> tuple[list[tuple[_Rule, ParamSpec]], int | None]:
    """([(HF rule, spec of the piece of our param it fills)], fused axis) for the HF tensor(s)
    behind layer param `key`, in order along that axis; one pair and None for an unfused param."""
    rule = _layer_rule(key)
    if isinstance(rule, _Rule):
        return [(rule, spec)], None
    parts = [
        (part, ParamSpec(shape, spec.dtype, spec.axes, spec.init, spec.scale))
        for part, shape in zip(rule.parts, rule.part_shapes(spec.shape), strict=True)
    ]
    return parts, rule.axis


def _hf_layout(rule: _Rule, shape: tuple[int, ...], axes: tuple[str | None, ...]):
    """(shape, logical axes) of the tensor as stored in the HF file, for checks and placement."""
    if rule.kind == "same":
        return shape, axes
    if rule.kind == "vector":
        return (int(np.prod(shape)),), axes[:1]
    n = rule.n_in
    # HF's out dim flattens ours shape[n:]; it shards like the first of those that is not 1 wide
    out_axis = next((a for a, size in zip(axes[n:], shape[n:], strict=True) if size != 1), axes[n])
    return (int(np.prod(shape[n:])), int(np.prod(shape[:n]))), (out_axis, axes[0])


def _to_ours(rule: _Rule, shape: tuple[int, ...], dtype: Any, raw: jax.Array) -> jax.Array:
    x = raw.T if rule.kind == "linear" else raw
    return x.reshape(shape).astype(dtype)


@functools.lru_cache(maxsize=256)
def _converter(rule: _Rule, shape: tuple[int, ...], dtype: Any, sharding: Any):
    return jax.jit(functools.partial(_to_ours, rule, shape, dtype), out_shardings=sharding)


def _fused_to_ours(rule: _Fused, shape: tuple[int, ...], dtype: Any, raws) -> jax.Array:
    """HF tensors -> our fused param: each converted to its piece, joined along `rule.axis`."""
    shapes = rule.part_shapes(shape)
    parts = [_to_ours(r, sh, dtype, x) for r, sh, x in zip(rule.parts, shapes, raws, strict=True)]
    return jnp.concatenate(parts, axis=rule.axis)


@functools.lru_cache(maxsize=256)
def _fuser(rule: _Fused, shape: tuple[int, ...], dtype: Any, sharding: Any):
    return jax.jit(lambda *raws: _fused_to_ours(rule, shape, dtype, raws), out_shardings=sharding)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} does not exist") from e
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _checkpoint_dir(path: PathLike) -> Path:
    d = Path(path)
    if not d.exists():
        raise CheckpointError(f"checkpoint directory {d} does not exist")
    if not d.is_dir():
        raise CheckpointError(f"checkpoint path {d} is not a directory")
    return d


class _SafetensorsFiles:
    """Tensor name -> file, with each file memory-mapped once and closed at the end."""

    def __init__(self, directory: Path, stack: contextlib.ExitStack) -> None:
        self._dir = directory
        self._stack = stack
        self._handles: dict[str, Any] = {}
        self._names: dict[str, frozenset[str]] = {}  # file -> tensor names in its header
        index = directory / INDEX_FILE
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map' object")
            self._where: dict[str, str] = dict(weight_map)
            self._searched = f"{index} (weight_map)"
            return
        if (directory / SINGLE_FILE).exists():
            files = [SINGLE_FILE]
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors in {directory}")
        self._where = {}
        for file in files:
            self._open(file)
            for name in sorted(self._names[file]):
                if name in self._where:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {self._where[name]} and {file} in {directory}"
                    )
                self._where[name] = file
        self._searched = ", ".join(str(directory / f) for f in files)

    def names(self) -> list[str]:
        """Every tensor name the checkpoint lists (index weight_map, or the files' headers)."""
        return list(self._where)

    @property
    def directory(self) -> Path:
        return self._dir

    def location(self, name: str) -> Path:
        return self._dir / self._where[name]

    def _open(self, file: str):
        if file not in self._handles:
            path = self._dir / file
            if not path.exists():
                raise CheckpointError(f"{path} (listed in {INDEX_FILE}) does not exist")
            try:
                handle = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"cannot open {path}: {e}") from e
            self._handles[file] = self._stack.enter_context(handle)
            self._names[file] = frozenset(self._handles[file].keys())
        return self._handles[file]

    def read(self, name: str, expected_shape: tuple[int, ...], param: str) -> np.ndarray:
        """The tensor as a host array, after checking shape and dtype from the file header."""
        file = self._where.get(name)
        if file is None:
            raise CheckpointError(
                f"tensor {name!r} (for param {param}) not found in {self._searched}"
            )
        handle = self._open(file)
        if name not in self._names[file]:
            raise CheckpointError(
                f"tensor {name!r} (for param {param}) not found in {self._dir / file}, "
                f"where {INDEX_FILE} says it is"
            )
        header = handle.get_slice(name)
        dtype, shape = header.get_dtype(), tuple(header.get_shape())
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"tensor {name!r} in {self._dir / file} has shape {shape}, expected "
                f"{tuple(expected_shape)} (for param {param})"
            )
        if dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} in {self._dir / file} has dtype {dtype}; supported: "
                f"{', '.join(SUPPORTED_DTYPES)} (quantized checkpoints are not supported)"
            )
        return handle.get_tensor(name)


class _Loader:
    def __init__(self, files: Any, mesh: Any) -> None:
        self.files = files
        self.mesh = mesh

    def _shardings(self, rule: _Rule, shape, axes):
        """(HF-layout input sharding, our-layout output sharding); (None, None) without a mesh."""
        if self.mesh is None:
            return None, None
        hf_shape, hf_axes = _hf_layout(rule, shape, axes)
        return (
            named_sharding(self.mesh, hf_axes, hf_shape),
            named_sharding(self.mesh, axes, shape),
        )

    def _raw(self, rule: _Rule, name: str, shape, axes, param: str, sharding) -> jax.Array:
        hf_shape, _ = _hf_layout(rule, shape, axes)
        host = self.files.read(name, hf_shape, param)
        raw = jax.device_put(host) if sharding is None else put_global(host, sharding)
        del host
        return raw

    def load(self, rule: _Rule, name: str, spec: ParamSpec, param: str) -> jax.Array:
        in_sh, out_sh = self._shardings(rule, spec.shape, spec.axes)
        raw = self._raw(rule, name, spec.shape, spec.axes, param, in_sh)
        out = _converter(rule, spec.shape, spec.dtype, out_sh)(raw)
        self._check_finite(out, [(name, raw)], param)
        return out

    def _check_finite(self, out: jax.Array, raws: list[tuple[str, jax.Array]], param: str) -> None:
        """Refuse NaN/inf in `out` (also syncs with its conversion, so host copies don't pile up);
        only then are its HF tensors counted, to name the one(s) at fault."""
        if not int(count_nonfinite(out)):
            return
        for name, raw in raws:
            count = int(count_nonfinite(raw))
            if count:
                raise CheckpointError(
                    f"tensor {name!r} (for param {param}) in {self.files.location(name)} holds "
                    f"{count} NaN/inf values"
                )
        names = ", ".join(repr(name) for name, _ in raws)
        raise CheckpointError(
            f"param {param} (from {names}) holds {int(count_nonfinite(out))} NaN/inf "
            f"values after the cast to {out.dtype}: the checkpoint's values exceed its range"
        )

    def load_stacked(self, name: str, spec: ParamSpec, param: str) -> jax.Array:
        """A stacked expert tensor [X, out, in] (transformers v5's layout) as ours [X, *in, *out]."""
        x, inner = spec.shape[0], spec.shape[1:]
        rule = _Rule(name, "linear")
        hf_shape, hf_axes = _hf_layout(rule, inner, spec.axes[1:])
        host = self.files.read(name, (x, *hf_shape), param)
        if self.mesh is None:
            raw = jax.device_put(host)
        else:  # each device gets its experts' slice in HF layout, as `_raw` places a tensor
            raw = put_global(host, named_sharding(self.mesh, (spec.axes[0], *hf_axes),
                                                  (x, *hf_shape)))  # fmt: skip
        del host
        sharding = named_sharding(self.mesh, spec.axes, spec.shape) if self.mesh else None
        out = jax.jit(lambda r: jnp.swapaxes(r, 1, 2).reshape(spec.shape).astype(spec.dtype),
                      out_shardings=sharding)(raw)  # fmt: skip
        self._check_finite(out, [(name, raw)], param)
        return out

    def _raws(self, rule: _Rule | _Fused, prefix: str, shape, axes, param: str) -> list[jax.Array]:
        """The HF tensor(s) behind one layer's param, on device in HF layout."""
        if isinstance(rule, _Rule):
            in_sh, _ = self._shardings(rule, shape, axes)
            return [self._raw(rule, prefix + rule.hf_name, shape, axes, param, in_sh)]
        raws = []
        for part, part_shape in zip(rule.parts, rule.part_shapes(shape), strict=True):
            in_sh, _ = self._shardings(part, part_shape, axes)
            raws.append(self._raw(part, prefix + part.hf_name, part_shape, axes, param, in_sh))
        return raws

    def load_layer(self, rule: _Rule | _Fused, prefix: str, spec: ParamSpec, param: str):
        """One layer's param from the tensors named `prefix + hf_name` (fused ones joined)."""
        if isinstance(rule, _Rule):
            return self.load(rule, prefix + rule.hf_name, spec, param)
        out_sh = named_sharding(self.mesh, spec.axes, spec.shape) if self.mesh is not None else None
        raws = self._raws(rule, prefix, spec.shape, spec.axes, param)
        out = _fuser(rule, spec.shape, spec.dtype, out_sh)(*raws)
        names = [prefix + part.hf_name for part in rule.parts]
        self._check_finite(out, list(zip(names, raws, strict=True)), param)
        return out


@dataclass(frozen=True)
class _MoeLayout:
    """Where a layer's MoE block lives in a HF checkpoint: its module ("mlp." for Qwen and
    DeepSeek, "block_sparse_moe." for Mixtral) and each expert's (gate, up, down) weights, per
    expert (`experts.{j}.gate_proj.weight`, as the hub's files and transformers' save_pretrained
    store them) or stacked (`experts.gate_up_proj` [X, 2F, E], `experts.down_proj` [X, E, F]:
    transformers v5's in-memory layout)."""

    block: str
    gate_up_down: tuple[str, str, str]
    stacked: bool

    @staticmethod
    def of(names: set[str], prefix: str) -> _MoeLayout:
        mixtral = f"{prefix}block_sparse_moe.gate.weight" in names
        block = prefix + ("block_sparse_moe." if mixtral else "mlp.")
        parts = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        return _MoeLayout(block, parts, f"{block}experts.gate_up_proj" in names)


def _stack_experts(arrays, sharding):
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*arrays)


def _load_moe(loader: _Loader, layout: _MoeLayout, key: str, spec: ParamSpec, param: str):
    """One MoE param of a layer; per-expert tensors are stacked on the device(s)."""
    block = layout.block
    if key == "router":  # HF [X, E]
        return loader.load(_Rule(f"{block}gate.weight", "linear"), f"{block}gate.weight", spec,
                           param)  # fmt: skip
    if key == "router_bias":
        name = f"{block}gate.e_score_correction_bias"
        return loader.load(_Rule(name, "same"), name, spec, param)
    x, rest = spec.shape[0], spec.shape[1:]
    one = ParamSpec(rest, spec.dtype, spec.axes[1:], spec.init, spec.scale)
    gate, up, down = layout.gate_up_down
    if layout.stacked:  # [X, 2F, E] / [X, E, F]: each expert is the same linear layout
        name = f"{block}experts.{'gate_up_proj' if key == 'w_expert_gate_up' else 'down_proj'}"
        flat = ParamSpec((x, *rest), spec.dtype, spec.axes, spec.init, spec.scale)
        return loader.load_stacked(name, flat, param)
    if key == "w_expert_gate_up":
        rule = _Fused((_Rule(f"{gate}.weight", "linear"), _Rule(f"{up}.weight", "linear")), axis=1)
    else:
        rule = _Rule(f"{down}.weight", "linear")
    parts = [loader.load_layer(rule, f"{block}experts.{j}.", one, f"{param}[{j}]")
             for j in range(x)]  # fmt: skip
    sharding = named_sharding(loader.mesh, spec.axes, spec.shape) if loader.mesh else None
    return _stack_experts(parts, sharding)


def _layer_rule(key: str) -> _Rule | _Fused:
    if key not in _LAYER_RULES:
        raise NotImplementedError(f"no Hugging Face tensor mapping for layer param {key!r}")
    return _LAYER_RULES[key]


def _refuse_unused_layers(files: Any, num_layers: int) -> None:
    unused = [
        name
        for name in files.names()
        if (m := _LAYER_TENSOR.match(name)) is not None and int(m.group(1)) >= num_layers
    ]
    if unused:
        layers = sorted({int(_LAYER_TENSOR.match(name).group(1)) for name in unused})
        which = ", ".join(map(str, layers)) if len(layers) <= 4 else f"{layers[0]}..{layers[-1]}"
        shown = ", ".join(repr(name) for name in sorted(unused)[:3])
        raise CheckpointError(
            f"{files.directory} holds {len(unused)} tensors of layer(s) {which}, beyond the "
            f"config's num_hidden_layers={num_layers} (e.g. {shown}); pass "
            f"allow_unused_layers=True to load only the first {num_layers} layers"
        )


def load_hf_params(
    path: PathLike, cfg: ModelConfig, mesh: Any = None, *, allow_unused_layers: bool = False
) -> Params:
    """Params for `cfg` from the safetensors files in `path`, placed on `mesh` when given.

    `cfg` must describe the checkpoint (normally from `config_from_hf`); its dtypes decide the
    result's. With weight formats (`cfg.has_formats`) the plain weights are loaded, then quantized on the device,
    unless the checkpoint stores them in that format already (`hf_quantized`).
    Tensors of layers `cfg` does not have are an error unless `allow_unused_layers`.
    """
    directory = _checkpoint_dir(path)
    with contextlib.ExitStack() as stack:
        files = _SafetensorsFiles(directory, stack)
        return load_params_from(files, cfg, mesh, allow_unused_layers=allow_unused_layers)


def load_params_from(
    files: Any, cfg: ModelConfig, mesh: Any = None, *, allow_unused_layers: bool = False
) -> Params:
    """Params for `cfg` from a source of HF-named tensors in HF layout: `_SafetensorsFiles`, or
    anything with its `names()`, `directory`, `location(name)` and `read(name, shape, param)`
    (GGUF files: `jaxinfer.checkpoint.gguf_io`). A checkpoint of pre-quantized linears loads
    them as stored (its format must be `cfg.weight_format`)."""
    prequantized = prequantized_linears(files, cfg, mesh)
    if cfg.has_formats and prequantized is None:
        plain_cfg = cfg.plain()
        plain = load_params_from(files, plain_cfg, mesh, allow_unused_layers=allow_unused_layers)
        return quantize_params(cfg, plain, mesh)
    specs = param_specs(cfg)
    if not allow_unused_layers:
        _refuse_unused_layers(files, cfg.num_layers)
    loader = _Loader(files, mesh)
    params: Params = {}
    for key, spec in specs.items():
        if key == "layers":
            continue
        if key not in _TOP_RULES:
            raise NotImplementedError(f"no Hugging Face tensor mapping for param {key!r}")
        rule = _TOP_RULES[key]
        params[key] = loader.load(rule, rule.hf_name, spec, key)
    logical = param_specs(cfg.plain())["layers"] if prequantized else None
    names = set(files.names()) if cfg.moe else set()

    def load_layer(i: int, key: str, spec: Any):
        prefix, param = f"model.layers.{i}.", f"layers[{i}].{key}"
        if key in _MOE_KEYS:
            return _load_moe(loader, _MoeLayout.of(names, prefix), key, spec, param)
        if isinstance(spec, QuantizedWeight):  # stored quantized: `prequantized` reads it
            parts, axis = layer_parts(key, logical[i][key])
            named = [(prefix + rule.hf_name, part.shape) for rule, part in parts]
            return prequantized.load(named, axis, spec, param)
        return loader.load_layer(_layer_rule(key), prefix, spec, param)

    params["layers"] = tuple(
        {key: load_layer(i, key, spec) for key, spec in layer.items()}
        for i, layer in enumerate(specs["layers"])
    )
    return params


def _generation_eos(directory: Path) -> tuple[int, ...]:
    path = directory / "generation_config.json"
    if not path.exists():
        return ()
    value = _read_json(path).get("eos_token_id")
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) for v in values):
        raise CheckpointError(f"{path}: eos_token_id must be an int or a list of ints")
    return tuple(values)


def load_hf_config(
    path: PathLike,
    *,
    dtype: str = "bfloat16",
    param_dtype: str | None = None,
) -> ModelConfig:
    """ModelConfig of a HF checkpoint dir; eos ids are config.json's then generation_config.json's.

    Chat models often list their end-of-turn token only in generation_config.json, and stopping
    must honour both.
    """
    directory = _checkpoint_dir(path)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{config_path} does not exist")
    hf = _read_json(config_path)
    if hf.get("quantization_config") is None and (directory / QUANT_CONFIG_FILE).exists():
        hf = {**hf, "quantization_config": _read_json(directory / QUANT_CONFIG_FILE)}
    cfg = config_from_hf(
        hf,
        dtype=dtype,
        param_dtype=param_dtype,
        source=str(config_path),
    )
    eos = list(cfg.eos_token_ids)
    eos += [t for t in _generation_eos(directory) if t not in eos]
    return cfg.replace(eos_token_ids=tuple(eos))


def load_hf_model(
    path: PathLike,
    *,
    dtype: str = "bfloat16",
    param_dtype: str | None = None,
    mesh: Any = None,
    allow_unused_layers: bool = False,
) -> tuple[ModelConfig, Params]:
    """(config, params) of a HF checkpoint directory; see `load_hf_config`, `load_hf_params`."""
    cfg = load_hf_config(path, dtype=dtype, param_dtype=param_dtype)
    return cfg, load_hf_params(path, cfg, mesh, allow_unused_layers=allow_unused_layers)


def load_tokenizer(path: PathLike) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a checkpoint dir (or a tokenizer.json path itself)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() or not p.suffix else p
    if not file.exists():
        raise CheckpointError(f"{file} does not exist")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"cannot read tokenizer {file}: {e}") from e
