"""GGUF checkpoints (llama.cpp's single-file format): metadata -> ModelConfig, tensors -> params,
tokenizer and chat template.

The file is read with the `gguf` package (llama.cpp's own reader, memory-mapped). Its metadata is
turned into the Hugging Face config it stands for and goes through `config_from_hf`, and its
tensors are renamed to HF's and served in HF's [out, in] layout to the same loader as safetensors
(`hf_loader.load_params_from`), so the two formats share every check and conversion. Block types
are dequantized on the host to float32 when read (`jaxinfer.quant.ggml`, the one definition of
each layout); the loader casts them to the engine dtype on the device. A model whose weights are
in the file's own block formats (Q8_0 as `q8_0`, Q4_1 as `q4_1`) takes those blocks as they are
(`load_gguf_params`, `GgufFile.read_native`): SmolLM2's Q4_1 file runs from its 4-bit weights.

llama.cpp's converter permutes the rows of Q and K of `llama` models for its interleaved RoPE
(`convert_hf_to_gguf.py`, `LlamaModel.permute`): within each head the rows become
(0, D/2, 1, D/2 + 1, ...). We undo it on load; `qwen2`/`qwen3` files are written unpermuted.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxinfer.checkpoint.errors import CheckpointError, UnsupportedModelError
from jaxinfer.checkpoint.hf_config import config_from_hf
from jaxinfer.checkpoint.hf_loader import layer_parts, load_params_from
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.spec import layer_specs, param_shardings, param_specs
from jaxinfer.quant import QuantizedWeight, ggml
from jaxinfer.quant.ggml import GGML_TYPES, dequantize
from jaxinfer.quant.gguf_formats import format_of_type, from_gguf_components
from jaxinfer.quant.transform import quantize_params

PathLike = str | os.PathLike[str]

# GGUF `general.architecture` -> (HF architecture, Q/K rows permuted by llama.cpp's converter)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by `tokenizer.ggml.pre`; a list is applied
# in order, each splitting the pieces of the one before.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {  # -> (regexes, ignore_merges)
    **{name: ((_GPT2,), False) for name in ("default", "gpt2")},
    **{name: ((r"\p{N}", _GPT2), False) for name in ("smollm", "starcoder", "refact")},
    **{name: ((_LLAMA3,), True) for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")},
    **{name: ((_QWEN2,), False) for name in ("qwen2", "deepseek-r1-qwen")},
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def is_gguf(path: PathLike) -> bool:
    return str(path).endswith(".gguf")


def open_gguf(path: PathLike) -> GgufFile:
    """The GgufFile of `path`, parsed once while the file is unchanged (a parse reads the whole
    vocabulary: seconds for a 49k-token model), so config, tokenizer, template and weights
    share it."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError:
        return GgufFile(path)  # (its own error)
    return _open_cached(p, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_cached(path: Path, size: int, mtime_ns: int) -> GgufFile:
    return GgufFile(path)


class GgufFile:
    """An open GGUF file: its metadata (`field`), and its tensors by HF name (the tensor source
    protocol of `hf_loader.load_params_from`)."""

    def __init__(self, path: PathLike) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {self.path} does not exist")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise CheckpointError(f"{self.path} is not a GGUF file (it starts with {magic!r})")
        try:
            self._reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the reader fails on a short mmap with reshape/view errors
            size = self.path.stat().st_size
            raise CheckpointError(
                f"cannot read GGUF file {self.path} ({size} bytes): it is truncated or corrupt "
                f"({type(e).__name__}: {e})"
            ) from None
        self._gguf = gguf
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported; supported: "
                f"{sorted(ARCHITECTURES)}"
            )
        self.permuted = ARCHITECTURES[self.arch][1]
        self._tensors: dict[str, Any] = {}
        for t in self._reader.tensors:
            self._tensors[self._hf_name(t.name)] = t

    # -- metadata --------------------------------------------------------------------------------

    def field(self, key: str, default: Any = ...) -> Any:
        f = self._reader.fields.get(key)
        if f is None:
            if default is ...:
                raise CheckpointError(f"{self.path}: GGUF metadata has no {key!r}")
            return default
        return f.contents()

    def hf_config(self) -> dict[str, Any]:
        """The Hugging Face config.json this file's metadata stands for."""
        a = self.arch
        if self.field(f"{a}.expert_count", 0):  # (llama.cpp writes Mixtral as "llama")
            raise UnsupportedModelError(
                f"{self.path}: {a}.expert_count={self.field(f'{a}.expert_count')}: MoE GGUF "
                "files are not supported (MoE models load from Hugging Face safetensors)"
            )
        hidden, heads = self.field(f"{a}.embedding_length"), self.field(f"{a}.attention.head_count")
        head_dim = self.field(f"{a}.attention.key_length", hidden // heads)
        rotary = self.field(f"{a}.rope.dimension_count", head_dim)
        if rotary != head_dim:
            raise UnsupportedModelError(f"{self.path}: {a}.rope.dimension_count={rotary} is "
                                        f"partial rotary (head_dim {head_dim}); only full rotary "
                                        "is supported")  # fmt: skip
        if "rope_freqs.weight" in self._tensors:
            raise UnsupportedModelError(
                f"{self.path}: tensor rope_freqs.weight (Llama 3.1-style per-frequency RoPE "
                "factors) is not supported"
            )
        tokens = self.field("tokenizer.ggml.tokens", None)
        vocab = self.field(f"{a}.vocab_size", None) or (len(tokens) if tokens else None)
        if vocab is None:
            embed = self._tensors.get(_TOP_NAMES["token_embd.weight"])
            if embed is None:
                raise CheckpointError(f"{self.path}: no {a}.vocab_size, tokenizer.ggml.tokens "
                                      "or token_embd.weight to take the vocabulary size from")  # fmt: skip
            vocab = int(embed.shape[-1])
        eos = [self.field("tokenizer.ggml.eos_token_id", None)]
        eos += [self.field(f"tokenizer.ggml.{k}_token_id", None) for k in ("eot", "eom")]
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[a][0]],
            "vocab_size": int(vocab),
            "hidden_size": int(hidden),
            "intermediate_size": int(self.field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self.field(f"{a}.block_count")),
            "num_attention_heads": int(heads),
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(head_dim),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.field(f"{a}.context_length")),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": list(dict.fromkeys(int(t) for t in eos if t is not None)),
        }
        kind = self.field(f"{a}.rope.scaling.type", "none")
        if kind not in ("none", None):
            hf["rope_scaling"] = {
                "rope_type": kind,
                "factor": float(self.field(f"{a}.rope.scaling.factor")),
                "rope_theta": hf["rope_theta"],
            }
            original = self.field(f"{a}.rope.scaling.original_context_length", None)
            if original is not None:  # (llama.cpp writes it for YaRN only)
                hf["rope_scaling"]["original_max_position_embeddings"] = int(original)
            for key in ("beta_fast", "beta_slow"):  # (llama.cpp's YaRN keys; others refused)
                value = self.field(f"{a}.rope.scaling.yarn_{key}", None)
                if value is not None:
                    hf["rope_scaling"][key] = float(value)
            if self.field(f"{a}.rope.scaling.yarn_log_multiplier", 0.0):
                raise UnsupportedModelError(f"{self.path}: {a}.rope.scaling.yarn_log_multiplier "
                                            "(DeepSeek's YaRN mscale) is not supported")  # fmt: skip
        window = self.field(f"{a}.attention.sliding_window", None)
        if window:
            hf["sliding_window"], hf["use_sliding_window"] = int(window), True
        return hf

    def model_config(self, *, dtype: str = "bfloat16", param_dtype: str | None = None):
        return config_from_hf(self.hf_config(), dtype=dtype, param_dtype=param_dtype,
                              source=str(self.path))  # fmt: skip

    def chat_template(self) -> str | None:
        return self.field("tokenizer.chat_template", None)

    # -- tensors (hf_loader's tensor source protocol) --------------------------------------------

    def _hf_name(self, name: str) -> str:
        if name in _TOP_NAMES:
            return _TOP_NAMES[name]
        m = _BLOCK.match(name)
        if m and m.group(2) in _LAYER_NAMES:
            return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
        return name  # (unused by the model: the loader ignores it, or refuses extra layers)

    def names(self) -> list[str]:
        return list(self._tensors)

    @property
    def directory(self) -> Path:
        return self.path

    def location(self, name: str) -> Path:
        return self.path

    def read(self, name: str, expected_shape: tuple[int, ...], param: str) -> np.ndarray:
        """The tensor in HF layout as a host array: float types as stored, block types
        dequantized to float32; Q and K rows un-permuted for `llama` files."""
        t = self._tensors.get(name)
        if t is None:
            raise CheckpointError(f"tensor {name!r} (for param {param}) not found in {self.path}")
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists ne0 (contiguous) first
        type_name = self._gguf.GGMLQuantizationType(t.tensor_type).name
        if shape != tuple(expected_shape):
            raise CheckpointError(f"tensor {t.name!r} ({name}) in {self.path} has shape {shape}, "
                                  f"expected {tuple(expected_shape)} (for param {param})")  # fmt: skip
        if type_name not in GGML_TYPES:
            raise CheckpointError(
                f"tensor {t.name!r} in {self.path} has GGML type {type_name}, which is not "
                f"supported; supported: {', '.join(GGML_TYPES)}"
            )
        if type_name in ("F32", "F16"):  # stored as they are; the device casts them
            x = np.asarray(t.data).reshape(shape)
        else:
            try:
                x = dequantize(t.data, type_name, shape)
            except ValueError as e:
                raise CheckpointError(f"tensor {t.name!r} in {self.path}: {e}") from None
        heads = self._permuted_heads(name)
        return x if heads is None else unpermute_rope_rows(x, heads)

    def _permuted_heads(self, name: str) -> int | None:
        """The head count whose rows llama.cpp permuted in tensor `name`; None if unpermuted."""
        if not self.permuted or not name.endswith(
            (
                "self_attn.q_proj.weight",
                "self_attn.q_proj.bias",
                "self_attn.k_proj.weight",
                "self_attn.k_proj.bias",
            )
        ):
            return None
        heads = self.field(f"{self.arch}.attention.head_count")
        if ".k_proj." in name:  # (written only for models with num_key_value_heads)
            heads = self.field(f"{self.arch}.attention.head_count_kv", heads)
        return int(heads)

    # -- weights in their own block format (not dequantized) -------------------------------------

    def type_of(self, name: str) -> str | None:
        """The GGML type name of HF-named tensor `name`; None if the file has no such tensor."""
        t = self._tensors.get(name)
        return None if t is None else self._gguf.GGMLQuantizationType(t.tensor_type).name

    def native_format(self, layer: int, key: str, spec: Any) -> str | None:
        """The weight format storing layer `layer`'s linear param `key` (plain spec `spec`) as
        this file does: every tensor behind it (q, k and v for `w_qkv`) of one GGML type that a
        format stores bit for bit (`gguf_formats.format_of_type`); None otherwise."""
        parts, _ = layer_parts(key, spec)
        names = [f"model.layers.{layer}.{rule.hf_name}" for rule, _ in parts]
        formats = {format_of_type(self.type_of(name)) for name in names}
        fmt = formats.pop() if len(formats) == 1 else None
        return None if fmt is None else fmt.name

    def native_recipe(
        self, cfg: ModelConfig
    ) -> tuple[str | None, tuple[tuple[str, str | None], ...]]:
        """(weight_format, weight_formats) storing each linear weight of the layers of the plain
        `cfg` in the file's own format (`native_format`), or plain where it has none: one
        `weight_format` when every weight has the same, else an entry per weight."""
        entries = [
            (f"layers.{i}.{key}", self.native_format(i, key, spec))
            for i in range(cfg.num_layers)
            for key, spec in layer_specs(cfg, i).items()
            if spec.in_dims
        ]
        formats = {fmt for _, fmt in entries}
        if len(formats) == 1:
            return formats.pop(), ()
        return None, tuple(entries)

    def read_native(self, layer: int, key: str, spec: Any) -> Any:
        """Layer `layer`'s linear param `key` (plain spec `spec`) as a `QuantizedWeight` of its
        tensors' own blocks (`native_format` must name one): quants and float16 scales moved
        over as stored (`gguf_formats.from_gguf_components`), fused parts joined along their
        axis, Q and K rows un-permuted for `llama` files; it dequantizes to `read`'s values."""
        import jax.numpy as jnp

        parts, axis = layer_parts(key, spec)
        pieces = []
        for rule, piece in parts:
            name = f"model.layers.{layer}.{rule.hf_name}"
            t, type_name = self._tensors[name], self.type_of(name)
            n = rule.n_in
            hf_shape = (int(np.prod(piece.shape[n:])), int(np.prod(piece.shape[:n])))
            if tuple(int(d) for d in reversed(t.shape)) != hf_shape:
                raise CheckpointError(f"tensor {t.name!r} ({name}) in {self.path} has shape "
                                      f"{tuple(reversed(t.shape))}, expected {hf_shape}")  # fmt: skip
            components = ggml.unpack(t.data, type_name, hf_shape)  # rows: the outputs
            heads = self._permuted_heads(name)
            if heads is not None:
                components = {c: unpermute_rope_rows(x, heads) for c, x in components.items()}
            pieces.append(from_gguf_components(components, type_name, piece.shape, n))
        if len(pieces) == 1:
            return pieces[0]
        arrays = {c: jnp.concatenate([p.arrays[c] for p in pieces], axis=axis)
                  for c in pieces[0].arrays}  # fmt: skip
        return QuantizedWeight(arrays, pieces[0].format, spec.in_dims)


def unpermute_rope_rows(x: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (0, D/2, 1, D/2+1, ...) -> (0..D-1)."""
    d = x.shape[0] // heads
    return x.reshape(heads, d // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def load_gguf_config(path: PathLike, *, dtype: str = "bfloat16",
                     param_dtype: str | None = None) -> ModelConfig:  # fmt: skip
    return open_gguf(path).model_config(dtype=dtype, param_dtype=param_dtype)


def load_gguf_model(
    path: PathLike,
    *,
    dtype: str = "bfloat16",
    param_dtype: str | None = None,
    mesh: Any = None,
    allow_unused_layers: bool = False,
):
    """(config, params) of a GGUF file; block types are dequantized to `param_dtype`."""
    file = open_gguf(path)
    cfg = file.model_config(dtype=dtype, param_dtype=param_dtype)
    return cfg, load_params_from(file, cfg, mesh, allow_unused_layers=allow_unused_layers)


def load_gguf_params(file: GgufFile, cfg: ModelConfig, mesh: Any = None, *,
                     allow_unused_layers: bool = False):  # fmt: skip
    """Params for `cfg`, whose weights may be in formats, from `file`.

    A layer weight whose format is its tensors' own GGML type (q8_0 of Q8_0 tensors, q4_1 of
    Q4_1: `GgufFile.native_format`) is taken block for block, never requantized; the others are
    dequantized and, if `cfg` gives them a format, quantized on the device (`quantize_params`).
    The plain model is loaded first (every param checked finite, on `mesh`), so the load's peak
    memory is a plain load's; what stays on the device is the formatted model.
    """
    plain_cfg = cfg.plain()
    params = load_params_from(file, plain_cfg, mesh, allow_unused_layers=allow_unused_layers)
    if not cfg.has_formats:
        return params
    plain_specs, layers = param_specs(plain_cfg)["layers"], []
    for i, (layer, specs) in enumerate(zip(params["layers"], param_specs(cfg)["layers"],
                                           strict=True)):  # fmt: skip
        layer = dict(layer)
        for key, spec in specs.items():
            if isinstance(spec, QuantizedWeight) and (
                file.native_format(i, key, plain_specs[i][key]) == spec.format.name
            ):
                layer[key] = file.read_native(i, key, plain_specs[i][key])
        layers.append(layer)
    params = quantize_params(cfg, {**params, "layers": tuple(layers)}, mesh)
    if mesh is not None:
        import jax

        params = jax.device_put(params, param_shardings(cfg, mesh))
    return params


def gguf_tokenizer(path: PathLike | GgufFile):
    """The `tokenizers.Tokenizer` a GGUF file describes (byte-level BPE, `tokenizer.ggml.model`
    "gpt2", with llama.cpp's pre-tokenizer of `tokenizer.ggml.pre`), or None with a warning for
    other tokenizer models (prompts must then be token ids)."""
    import warnings

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    file = path if isinstance(path, GgufFile) else open_gguf(path)
    kind = file.field("tokenizer.ggml.model", None)
    if kind != "gpt2":
        warnings.warn(f"{file.path}: tokenizer.ggml.model={kind!r} is not supported (only "
                      "byte-level BPE, 'gpt2'): loading it without a tokenizer (prompts must be "
                      "token ids)", stacklevel=2)  # fmt: skip
        return None
    pre = file.field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(f"{file.path}: tokenizer.ggml.pre={pre!r} is not supported; "
                                    f"supported: {sorted(PRE_TOKENIZERS)}")  # fmt: skip
    regexes, ignore_merges = PRE_TOKENIZERS[pre]
    tokens = file.field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in file.field("tokenizer.ggml.merges")]
    types = file.field("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=ignore_merges)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) and user-defined ones are matched whole in the text, as
    # llama.cpp does; only control tokens are special (dropped by skip_special_tokens).
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types, strict=True) if k == _CONTROL])  # fmt: skip
    tok.add_tokens([AddedToken(t, normalized=False)
                    for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED])  # fmt: skip
    bos = file.field("tokenizer.ggml.bos_token_id", None)
    if file.field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], bos)]
        )  # fmt: skip
    return tok
