"""Pre-quantized Hugging Face checkpoints, loaded into our weight formats without dequantizing.

Two layouts are read, each linear as HF stores it ([out, in], `in` flattened row-major):

    fp8_block   config.json `quantization_config` {"quant_method": "fp8", "fmt": "e4m3",
                "activation_scheme": "dynamic", "weight_block_size": [128, 128]} (DeepSeek-V3,
                Qwen3-FP8); `weight` e4m3 [out, in], `weight_scale_inv` fp32 [ceil(out/128),
                ceil(in/128)]: w = weight * scale_inv, blockwise
    nvfp4       {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16} in
                config.json, or ModelOpt's hf_quant_config.json {"quantization": {...}};
                `weight` uint8 [out, in/2] (input 2i in the low nibble, 2i+1 in the high one),
                `weight_scale` e4m3 [out, in/16], `weight_scale_2` fp32 []:
                w = e2m1(weight) * weight_scale * weight_scale_2

Our formats keep scales per logical output, so the stored codes and scales move over unchanged
(split, joined; nvfp4's transposed: it stores [*in, *out]; our FP8 formats store K-major
[*out, *in] as HF does, so an FP8 weight's bytes are used as they are read):

- nvfp4: blocks lie along the input, which HF and we flatten alike; each HF tensor's
  `weight_scale_2` becomes the tensor_scale of its logical outputs (w_qkv: q, k, v of each KV
  group; w_gate_up: gate, up). Always exact.
- fp8_block: the input blocks are HF's. Our output blocks lie within the last output axis (one
  head of w_qkv, one of gate/up), HF's along the flattened output (q_proj's Hq * D rows). Where
  our grid refines HF's (head_dim a multiple or divisor of 128, a q/k/v or gate/up boundary),
  each of our blocks takes the scale of the HF block holding it. A block that straddles two HF
  blocks with different scales is re-expressed on one of them if every value times the scale
  ratio is again an e4m3 value (checked exactly in float64), and refused otherwise, naming the
  tensor: we never round a value the checkpoint wrote.

Not read: ModelOpt's `input_scale` (NVFP4's static activation scale, for its W4A4 kernels; our
nvfp4 is weight-only and multiplies activations in their own dtype) and KV-cache scales
(`kv_cache_quant_algo`: the cache's dtype is the engine's option; fp8 pages take their own scales).
Layers a checkpoint keeps unquantized (`modules_to_not_convert`, `ignored_layers`,
`exclude_modules`, `ignore`) may only be lm_head and the embeddings, which load plain anyway: a
decoder linear among them would need a per-weight format, and is refused by name.

Memory: each HF tensor is read into host memory once, and a fused weight's parts are joined on
the host before it goes to the device (a few copies of one weight at a time).
"""

from __future__ import annotations

import fnmatch
import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxinfer.checkpoint.errors import CheckpointError, UnsupportedModelError
from jaxinfer.parallel.sharding import named_sharding
from jaxinfer.quant import QuantizedWeight
from jaxinfer.quant.fp4 import NVFP4
from jaxinfer.quant.fp8 import BLOCK

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
# The HF modules behind our decoder-layer linears (`hf_loader._LAYER_RULES`).
_DECODER_LINEARS = tuple(f"self_attn.{p}_proj" for p in "qkvo") + tuple(
    f"mlp.{p}_proj" for p in ("gate", "up", "down")
)
# A tensor named like this marks the checkpoint's format (and a quantized linear).
_SCALE_SUFFIX = {"fp8_block": ".weight_scale_inv", "nvfp4": ".weight_scale_2"}
_SCALE_DTYPES = ("F32", "BF16", "F16")  # fp32 scales; a 16-bit one widens exactly
_NUMPY_DTYPES = {"F8_E4M3": E4M3, "U8": np.dtype(np.uint8), "F32": np.dtype(np.float32),
                 "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}  # fmt: skip

# -- quantization_config -> weight format ---------------------------------------------------------

_FP8_KEYS = ("quant_method", "fmt", "activation_scheme", "weight_block_size",
             "modules_to_not_convert", "ignored_layers", "dequantize")  # fmt: skip
_MODELOPT_KEYS = ("quant_method", "quant_algo", "group_size", "exclude_modules", "ignore",
                  "kv_cache_quant_algo", "kv_cache_scheme", "producer", "quantization")  # fmt: skip


def checkpoint_weight_format(quant: Any, num_layers: int, source: str) -> str | None:
    """The weight format a config.json `quantization_config` (or ModelOpt's hf_quant_config.json
    dict) stores its decoder linears in; None when there is none. Anything else, or a setting we
    would not honour exactly, is refused naming the key."""
    if quant is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(quant, Mapping):
        raise CheckpointError(f"{where} must be a JSON object, got {quant!r}")
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8_format(quant, where, num_layers)
    if method == "modelopt" or (method is None and isinstance(quant.get("quantization"), Mapping)):
        return _modelopt_format(quant, where, num_layers)
    raise UnsupportedModelError(
        f"{where}.quant_method={method!r} is not supported; supported: 'fp8' (block-scaled, "
        "weight_block_size [128, 128]: fp8_block) and 'modelopt' (quant_algo 'NVFP4': nvfp4)"
    )


def _refuse_unknown_keys(quant: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key, value in quant.items():
        if key not in known and value not in (None, False, [], {}):
            raise UnsupportedModelError(
                f"{where}.{key}={value!r} is not supported (known keys: {', '.join(known)})"
            )


def _fp8_format(quant: Mapping[str, Any], where: str, num_layers: int) -> str:
    _refuse_unknown_keys(quant, _FP8_KEYS, where)
    fmt = quant.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise UnsupportedModelError(f"{where}.fmt={fmt!r} is not supported (only 'e4m3')")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedModelError(
            f"{where}.activation_scheme={scheme!r} is not supported: only 'dynamic' (our fp8_block "
            "quantizes activations per token per 128 channels; static input scales are not applied)"
        )
    block = quant.get("weight_block_size")
    if block != [BLOCK, BLOCK]:
        raise UnsupportedModelError(
            f"{where}.weight_block_size={block!r} is not supported: only [{BLOCK}, {BLOCK}] "
            "(fp8_block; per-tensor FP8 checkpoints have none)"
        )
    for key in ("modules_to_not_convert", "ignored_layers"):
        _refuse_unquantized_linears(quant.get(key), f"{where}.{key}", num_layers)
    return "fp8_block"


def _modelopt_format(quant: Mapping[str, Any], where: str, num_layers: int) -> str:
    _refuse_unknown_keys(quant, _MODELOPT_KEYS, where)
    inner = quant.get("quantization")
    if inner is not None:  # hf_quant_config.json: {"producer": ..., "quantization": {...}}
        if not isinstance(inner, Mapping):
            raise CheckpointError(f"{where}.quantization must be a JSON object, got {inner!r}")
        where = f"{where}.quantization"
        _refuse_unknown_keys(inner, _MODELOPT_KEYS, where)
        quant = inner
    algo = quant.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() != "NVFP4":
        raise UnsupportedModelError(
            f"{where}.quant_algo={algo!r} is not supported; supported: 'NVFP4' (nvfp4)"
        )
    group = quant.get("group_size", NVFP4.block)
    if group != NVFP4.block:
        raise UnsupportedModelError(
            f"{where}.group_size={group!r} is not supported: NVFP4 blocks are {NVFP4.block} wide"
        )
    for key in ("exclude_modules", "ignore"):
        _refuse_unquantized_linears(quant.get(key), f"{where}.{key}", num_layers)
    return "nvfp4"


def _matches(pattern: str, module: str) -> bool:
    """Whether a keep-unquantized entry names `module`: exactly, as a glob (ModelOpt), as a
    substring (transformers' modules_to_not_convert), or one of its tensors."""
    return (pattern in module or fnmatch.fnmatchcase(module, pattern)
            or pattern.startswith(module + "."))  # fmt: skip


def _refuse_unquantized_linears(patterns: Any, where: str, num_layers: int) -> None:
    """Modules kept unquantized must not include a decoder linear (lm_head and the embeddings
    are plain in every weight format; a decoder linear would need a format of its own)."""
    if patterns is None:
        return
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise CheckpointError(f"{where} must be a list of module names, got {patterns!r}")
    modules = [f"model.layers.{i}.{m}" for i in range(num_layers) for m in _DECODER_LINEARS]
    for pattern in patterns:
        hit = next((m for m in modules if _matches(pattern, m)), None)
        if hit is not None:
            raise UnsupportedModelError(
                f"{where} keeps {pattern!r} unquantized, which names the decoder linear {hit!r}: "
                "per-weight formats are not supported yet (only lm_head and the embeddings may "
                "stay unquantized)"
            )


# -- reading the tensors -------------------------------------------------------------------------


class _RawTensors:
    """Tensors read by their safetensors header (8-byte length, JSON, then data): safetensors'
    numpy backend cannot make float8 arrays (safetensors issue #682), so it cannot read these."""

    def __init__(self, files: Any) -> None:
        self.files = files
        self._names = frozenset(files.names())
        self._headers: dict[Any, tuple[int, dict[str, Any]]] = {}

    def _header(self, path) -> tuple[int, dict[str, Any]]:
        if path not in self._headers:
            try:
                with open(path, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    self._headers[path] = (8 + n, json.loads(f.read(n)))
            except (OSError, struct.error, ValueError) as e:
                raise CheckpointError(f"cannot read the safetensors header of {path}: {e}") from e
        return self._headers[path]

    def _entry(self, name: str, param: str) -> tuple[Any, int, dict[str, Any]]:
        """(file, offset of its data, the tensor's header entry)."""
        if name not in self._names:
            raise CheckpointError(
                f"tensor {name!r} (for param {param}) not found in {self.files.directory}"
            )
        path = self.files.location(name)
        start, header = self._header(path)
        entry = header.get(name)
        if not isinstance(entry, dict):
            raise CheckpointError(f"tensor {name!r} (for param {param}) not found in {path}")
        return path, start, entry

    def shape(self, name: str, param: str) -> tuple[int, ...]:
        return tuple(self._entry(name, param)[2].get("shape", ()))

    def read(self, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...], param: str):
        """The tensor as a host array, after checking its shape and dtype (one of `dtypes`)."""
        path, start, entry = self._entry(name, param)
        dtype, got = entry.get("dtype"), tuple(entry.get("shape", ()))
        if got != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {path} has shape {got}, expected "
                                  f"{tuple(shape)} (for param {param})")  # fmt: skip
        if dtype not in dtypes:
            raise CheckpointError(f"tensor {name!r} in {path} has dtype {dtype}, expected "
                                  f"{' or '.join(dtypes)} (for param {param})")  # fmt: skip
        begin, end = entry["data_offsets"]
        np_dtype = _NUMPY_DTYPES[dtype]
        if end - begin != math.prod(shape) * np_dtype.itemsize:
            raise CheckpointError(f"tensor {name!r} in {path}: {end - begin} bytes for shape "
                                  f"{got} of {dtype}")  # fmt: skip
        raw = np.fromfile(path, np.uint8, count=end - begin, offset=start + begin)
        return raw.view(np_dtype).reshape(shape)


def _refuse_nonfinite(x: np.ndarray, name: str, param: str) -> None:
    bad = int(np.count_nonzero(~np.isfinite(x.astype(np.float32))))
    if bad:
        raise CheckpointError(f"tensor {name!r} (for param {param}) holds {bad} NaN/inf values")


# -- HF tensors -> our arrays, one HF tensor (a piece of one of our weights) at a time ------------


def _fp8_block_piece(q: np.ndarray, s: np.ndarray, in_shape, out_shape, name: str, param: str):
    """HF `weight` e4m3 [out, in] and `weight_scale_inv` [ceil(out/B), ceil(in/B)] -> our values
    [*out, *in] (HF's own bytes: both are K-major) and scales [*out[:-1], ceil(N/B), ceil(K/B)]
    (B = 128, K = in, N = out[-1])."""
    n = out_shape[-1]
    nb = -(-n // BLOCK)
    rows = np.arange(q.shape[0]).reshape(out_shape)  # the HF row of each of our outputs
    first = rows[..., ::BLOCK]  # [*out[:-1], NB]: each of our blocks' first and last HF row
    last = rows[..., np.minimum(np.arange(nb) * BLOCK + BLOCK - 1, n - 1)]
    # our block's rows are consecutive HF rows, so at most two HF blocks: first's and last's
    scales = s[first // BLOCK]  # [*out[:-1], NB, KB]
    other = s[last // BLOCK]
    values = q.reshape(*out_shape, -1)  # [*out, K]: HF's array, rewritten where a block moves
    for *lead, b, kb in np.argwhere(scales != other):
        block = (*lead, slice(b * BLOCK, (b + 1) * BLOCK), slice(kb * BLOCK, (kb + 1) * BLOCK))
        hf_rows = rows[(*lead, block[-2])]
        exact = values[block].astype(np.float64) * s[hf_rows // BLOCK, kb][:, None]  # 4 x 24 bits
        for scale in (scales[*lead, b, kb], other[*lead, b, kb]):
            v = (exact / scale).astype(E4M3)  # NaN past 448: then not exact
            if np.array_equal(v.astype(np.float64) * scale, exact):
                values[block], scales[*lead, b, kb] = v, scale
                break
        else:
            raise UnsupportedModelError(
                f"tensor {name!r} (for param {param}): our {BLOCK}x{BLOCK} block (output "
                f"{tuple(int(i) for i in lead)}, block {b}, input block {kb}) holds HF rows "
                f"{hf_rows[0]}..{hf_rows[-1]}, which straddle two HF blocks with scales "
                f"{scales[*lead, b, kb]} and {other[*lead, b, kb]}, and its values cannot share "
                f"one scale without rounding (our blocks lie within outputs of {n}, HF's along "
                f"its {q.shape[0]} rows): not loadable as fp8_block exactly"
            )
    return {"values": values.reshape(*out_shape, *in_shape), "scales": scales}


def _nvfp4_piece(packed: np.ndarray, ws: np.ndarray, ws2: np.ndarray, in_shape, out_shape):
    """HF `weight` uint8 [out, K/2], `weight_scale` e4m3 [out, K/16], `weight_scale_2` -> our
    values [*in[:-1], in[-1]/2, *out], block_scales [K/16, *out], tensor_scale [*out[:-1]]. Byte
    j packs flat inputs 2j, 2j+1 in both; with in[-1] even a pair never crosses our last input
    axis, so the bytes move over as they are."""
    values = np.ascontiguousarray(packed.T).reshape(*in_shape[:-1], in_shape[-1] // 2, *out_shape)
    block_scales = np.ascontiguousarray(ws.T).reshape(-1, *out_shape)
    tensor_scale = np.full(out_shape[:-1], ws2.reshape(()), np.float32)
    return {"values": values, "block_scales": block_scales, "tensor_scale": tensor_scale}


# Where each array keeps our logical output axes (a fused weight's parts join along one): the
# axes that follow them (K-major values: the inputs; fp8_block's scales: the input blocks), and
# the output axes it drops at their end (nvfp4's tensor_scale: one per logical output).
_AFTER_OUT_AXES = {("fp8_block", "scales"): lambda n_in: 1,
                   ("fp8_block", "values"): lambda n_in: n_in}  # fmt: skip
_DROPPED_OUT_AXES = {("nvfp4", "tensor_scale"): 1}


class PrequantizedLinears:
    """Our QuantizedWeights of a checkpoint's decoder linears, stored in format `fmt`."""

    def __init__(self, files: Any, fmt: str, mesh: Any) -> None:
        self.tensors = _RawTensors(files)
        self.fmt = fmt
        self.mesh = mesh

    def load(self, parts: list[tuple[str, tuple[int, ...]]], axis: int | None,
             spec: QuantizedWeight, param: str) -> QuantizedWeight:  # fmt: skip
        """The weight `spec` describes from HF `parts` [(weight name, shape of its piece of our
        logical weight)], joined along our logical `axis` (None: one part)."""
        if spec.format.name != self.fmt:
            raise CheckpointError(f"param {param}: the config gives it format {spec.format.name}, "
                                  f"the checkpoint stores it in {self.fmt}")  # fmt: skip
        n_in = spec.in_dims
        pieces = [self._piece(name, shape, n_in, param) for name, shape in parts]
        n_out = len(parts[0][1]) - n_in
        arrays = {}
        for key, part_spec in spec.arrays.items():
            if axis is None:
                a = pieces[0][key]
            else:
                after = _AFTER_OUT_AXES.get((self.fmt, key), lambda n_in: 0)(n_in)
                dropped = _DROPPED_OUT_AXES.get((self.fmt, key), 0)
                at = axis - n_in - n_out + dropped - after  # counted from the end
                a = np.concatenate([p[key] for p in pieces], axis=at)
            if a.shape != part_spec.shape or a.dtype != np.dtype(part_spec.dtype):
                raise AssertionError(f"{param}.{key}: built {a.shape} {a.dtype}, spec says "
                                     f"{part_spec.shape} {np.dtype(part_spec.dtype)}")  # fmt: skip
            sharding = None
            if self.mesh is not None:
                sharding = named_sharding(self.mesh, part_spec.axes, part_spec.shape)
            arrays[key] = jax.device_put(a, sharding)
        jax.block_until_ready(arrays)  # before the next weight's host arrays are made
        return QuantizedWeight(arrays, spec.format, n_in)

    def _piece(self, name: str, shape: tuple[int, ...], n_in: int, param: str) -> dict:
        in_shape, out_shape = shape[:n_in], shape[n_in:]
        k, out = math.prod(in_shape), math.prod(out_shape)
        stem = name.removesuffix("weight")
        read = self.tensors.read
        if self.fmt == "fp8_block":
            q = read(name, (out, k), ("F8_E4M3",), param)
            if np.any((q.view(np.uint8) & 0x7F) == 0x7F):  # S.1111.111, e4m3's NaN
                _refuse_nonfinite(q, name, param)
            scale_shape = (-(-out // BLOCK), -(-k // BLOCK))
            s = read(stem + "weight_scale_inv", scale_shape, _SCALE_DTYPES, param)
            s = s.astype(np.float32)
            _refuse_nonfinite(s, stem + "weight_scale_inv", param)
            return _fp8_block_piece(q, s, in_shape, out_shape, stem + "weight_scale_inv", param)
        packed = read(name, (out, k // 2), ("U8",), param)
        ws = read(stem + "weight_scale", (out, -(-k // NVFP4.block)), ("F8_E4M3",), param)
        _refuse_nonfinite(ws, stem + "weight_scale", param)
        ws2 = self._global_scale(stem + "weight_scale_2", param)
        return _nvfp4_piece(packed, ws, ws2, in_shape, out_shape)

    def _global_scale(self, name: str, param: str) -> np.ndarray:
        """A per-tensor scale: ModelOpt writes shape [] (some exports [1])."""
        shape = (1,) if self.tensors.shape(name, param) == (1,) else ()
        x = self.tensors.read(name, shape, _SCALE_DTYPES, param).astype(np.float32)
        _refuse_nonfinite(x, name, param)
        return x


def prequantized_linears(files: Any, cfg: Any, mesh: Any = None) -> PrequantizedLinears | None:
    """The reader of the checkpoint's quantized decoder linears; None when it stores them plain.
    Refuses a checkpoint whose format is not `cfg.weight_format` (nothing is dequantized or
    re-quantized) and a quantized lm_head or embedding (they are plain in every format)."""
    names = files.names()
    found = {fmt: [n for n in names if n.endswith(sfx)] for fmt, sfx in _SCALE_SUFFIX.items()}
    found = {fmt: hits for fmt, hits in found.items() if hits}
    if not found:
        return None
    if len(found) > 1:
        shown = ", ".join(repr(hits[0]) for hits in found.values())
        raise CheckpointError(f"{files.directory} mixes quantized layouts ({shown})")
    ((fmt, hits),) = found.items()
    top = [n for n in hits if n.startswith(("lm_head.", "model.embed_tokens."))]
    if top:
        raise UnsupportedModelError(
            f"{files.directory}: {top[0]!r}: a quantized lm_head or embedding is not supported "
            "(they load unquantized; per-weight formats are not supported yet)"
        )
    if cfg.weight_format != fmt:
        raise CheckpointError(
            f"{files.directory} stores its linear weights in {fmt} (e.g. {hits[0]!r}), but the "
            f"config asks for weight_format={cfg.weight_format!r}: a pre-quantized checkpoint "
            f"loads only into its own format (load_hf_config reads it from quantization_config)"
        )
    return PrequantizedLinears(files, fmt, mesh)
