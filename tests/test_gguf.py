"""GGUF files (llama.cpp's format) written here with `gguf.GGUFWriter` from tiny random
`transformers` models, under llama.cpp's converter conventions (`convert_hf_to_gguf.py`): its
metadata keys and tensor names, block-quantized weights, and the Q/K row permutation of `llama`
files. They load to the logits of the `transformers` model holding the dequantized weights, their
byte-level BPE vocabularies tokenize as llama.cpp would, their chat templates render as
transformers renders them, and broken files fail naming the cause.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxinfer.checkpoint import gguf_io  # noqa: E402
from jaxinfer.checkpoint.errors import CheckpointError, UnsupportedModelError  # noqa: E402
from jaxinfer.checkpoint.gguf_io import gguf_tokenizer, load_gguf_model  # noqa: E402
from jaxinfer.models.dense import forward  # noqa: E402

Q = gguf.GGMLQuantizationType
TOL = 1e-5
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
# name -> (transformers config class, GGUF architecture, extra config)
MODELS = {
    "llama": ("LlamaConfig", "llama", dict(rope_theta=5e5, tie_word_embeddings=False)),
    "llama-bias": ("LlamaConfig", "llama", dict(attention_bias=True, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "qwen2", dict(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "qwen3", dict(head_dim=32, tie_word_embeddings=False)),
}
# Storage type by GGUF tensor kind: a mix of block and float types, as quantized files have;
# norms and biases stay F32 (llama.cpp never quantizes 1-D tensors).
TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.F16,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q8_0,
    "attn_v": Q.Q4_1,
    "attn_output": Q.F16,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.BF16,
    "ffn_down": Q.Q8_0,
}
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# ---- writing GGUF files as llama.cpp's converter does ----------------------------------------


def gguf_name(hf_name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight."""
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        layer, rest = stem.removeprefix("model.layers.").split(".", 1)
        return f"blk.{layer}.{GGUF_NAMES[rest]}.{suffix}"
    return f"{GGUF_NAMES[stem]}.{suffix}"


def permute_rope_rows(x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: per head, rows (0..D/2-1 | D/2..D-1) interleaved, so a
    rotate-half RoPE pair (i, i + D/2) becomes the adjacent rows (2i, 2i + 1)."""
    d = x.shape[0] // heads
    return x.reshape(heads, 2, d // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def storage_type(name: str, x: np.ndarray) -> Any:
    kind = name.split(".")[-2]
    return TYPES.get(kind, Q.F32) if x.ndim == 2 else Q.F32


def stored(x: np.ndarray, qtype: Any) -> np.ndarray:
    """What reading back a tensor stored as `qtype` gives (the `gguf` package's reference)."""
    return gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype).astype(np.float32)


def write_gguf(path, arch: str, metadata: dict[str, Any], tensors: dict[str, tuple]) -> None:
    """A GGUF file of `metadata` (full keys; the Python type picks the GGUF value type) and
    `tensors` {GGUF name: (float32 array in HF [out, in] layout, GGML type) or (raw uint8
    [rows, bytes], GGML type)}."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    for name, (x, qtype) in tensors.items():
        if x.dtype == np.uint8:  # raw blocks, as given
            writer.add_tensor(name, x, raw_dtype=qtype)
        elif qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, x.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def arch_metadata(arch: str, cfg) -> dict[str, Any]:
    """The `{arch}.*` keys llama.cpp's converter writes for a transformers config."""
    head_dim = head_dim_of(cfg)
    meta = {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
    }
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = head_dim
    if arch == "llama":
        meta[f"{arch}.vocab_size"] = cfg.vocab_size
        meta[f"{arch}.rope.dimension_count"] = head_dim
    return meta


def gguf_tensors(state: dict[str, np.ndarray], arch: str, cfg) -> dict[str, tuple]:
    """HF tensors -> {GGUF name: (array, type)}: renamed, and Q/K rows permuted for `llama`."""
    out = {}
    for hf_name, x in state.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output.weight
        if arch == "llama" and ".q_proj." in hf_name:
            x = permute_rope_rows(x, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            x = permute_rope_rows(x, cfg.num_key_value_heads)
        name = gguf_name(hf_name)
        out[name] = (x, storage_type(name, x))
    return out


def tiny_model(name: str, config_cls: str, **extra):
    """A tiny random transformers model (weights perturbed, so that zero biases and unit norms
    are not trivially right), seeded by its name."""
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.float().eval()


def write_converted(path, arch: str, model, *, drop=(), metadata=None):
    """Write `model` as llama.cpp's converter would (without the metadata keys `drop`, with
    `metadata` added) and return it holding the weights as the file stores them."""
    cfg = model.config
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tensors = gguf_tensors(state, arch, cfg)
    meta = {**arch_metadata(arch, cfg), **(metadata or {})}
    write_gguf(path, arch, {k: v for k, v in meta.items() if k not in drop}, tensors)
    # Quantization is by blocks along each row, so it commutes with the row permutation: the
    # stored values, in HF layout, are `stored` of the HF tensor itself.
    reference = {
        k: torch.from_numpy(stored(x, storage_type(gguf_name(k), x)))
        for k, x in state.items()
        if gguf_name(k) in tensors  # (a tied head is the embedding, stored once)
    }
    model.load_state_dict(reference, strict=not cfg.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.fixture(scope="module", params=sorted(MODELS))
def gguf_model(request, tmp_path_factory):
    """(name, GGUF path, the transformers model holding the weights as the file stores them)."""
    config_cls, arch, extra = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    model = write_converted(path, arch, tiny_model(request.param, config_cls, **extra))
    return request.param, path, model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def assert_logits_match(path, model, seed: int, name: str = ""):
    """The file's logits (fp32) are the reference model's on fresh tokens; returns its config."""
    cfg, params = load_gguf_model(path, dtype="float32")
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 19))
    ours = np.asarray(forward(params, cfg, jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, hf_logits(model, tokens), atol=TOL, rtol=0, err_msg=name)
    return cfg


def test_block_quantized_gguf_logits_match_transformers_on_the_dequantized_weights(
    gguf_model, fresh_seed
):
    name, path, model = gguf_model
    cfg = assert_logits_match(path, model, fresh_seed, name)
    hf = model.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, head_dim_of(hf)
    )  # fmt: skip
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.qk_norm == (name == "qwen3") and cfg.qkv_bias == (name in ("qwen2", "llama-bias"))


@pytest.mark.parametrize("written", [True, False], ids=["written", "absent"])
def test_llama_file_without_head_count_kv_is_multi_head_attention(tmp_path, written, fresh_seed):
    """llama.cpp's converter writes head_count_kv only when config.json has num_key_value_heads
    (older Llama checkpoints do not), and llama.cpp then takes head_count."""
    model = tiny_model("mha", "LlamaConfig", num_key_value_heads=4, tie_word_embeddings=False)
    drop = () if written else ("llama.attention.head_count_kv",)
    model = write_converted(tmp_path / "mha.gguf", "llama", model, drop=drop)
    assert assert_logits_match(tmp_path / "mha.gguf", model, fresh_seed).num_kv_heads == 4


@pytest.mark.parametrize("written", [True, False], ids=["written", "absent"])
def test_linear_rope_scaling_needs_no_original_context_length(tmp_path, written, fresh_seed):
    """llama.cpp's converter writes a linear RoPE scaling as its type and factor only."""
    model = tiny_model("linear", "LlamaConfig", rope_scaling={"rope_type": "linear", "factor": 4.0})
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    if written:
        meta["llama.rope.scaling.original_context_length"] = COMMON["max_position_embeddings"]
    model = write_converted(tmp_path / "linear.gguf", "llama", model, metadata=meta)
    cfg = assert_logits_match(tmp_path / "linear.gguf", model, fresh_seed)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 4.0


@pytest.mark.parametrize("gguf_model", ["llama", "qwen2"], indirect=True)
def test_qk_rows_are_unpermuted_for_llama_files_only(gguf_model, monkeypatch):
    """The un-permutation matters: flipped (llama files read as written, qwen2 files permuted
    back), the logits are far off transformers'. So the parity test above checks both ways."""
    name, path, model = gguf_model
    hf_arch, permuted = gguf_io.ARCHITECTURES[name]
    monkeypatch.setitem(gguf_io.ARCHITECTURES, name, (hf_arch, not permuted))
    gguf_io._open_cached.cache_clear()  # (files are parsed once; this one must be re-read)
    try:
        cfg, params = load_gguf_model(path, dtype="float32")
    finally:
        gguf_io._open_cached.cache_clear()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 19))
    ours = np.asarray(forward(params, cfg, jnp.asarray(tokens)))
    assert np.abs(ours - hf_logits(model, tokens)).max() > 100 * TOL


def test_unpermute_rope_rows_inverts_the_converters_permutation(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    heads, head_dim = 3, 8
    weight, bias = rng.normal(size=(heads * head_dim, 5)), rng.normal(size=heads * head_dim)
    for x in (weight, bias):
        permuted = permute_rope_rows(x, heads)
        assert not np.array_equal(permuted, x)
        np.testing.assert_array_equal(gguf_io.unpermute_rope_rows(permuted, heads), x)
    # Row 1 of each head is its D/2: the partner of row 0 in a rotate-half RoPE pair.
    rows = permute_rope_rows(np.arange(heads * head_dim), heads)
    assert rows[:head_dim].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


# ---- tokenizer ---------------------------------------------------------------------------------

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool>"]
# BPE merges in rank order (byte-level: "Ġ" is the space byte, "Ċ" the newline).
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2", "Ġ Ġ",
          "ĠĠ Ġ", "e l"]  # fmt: skip


def byte_alphabet() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


def write_tokenizer_gguf(path, pre: str = "smollm", add_bos: bool = False) -> list[str]:
    """A GGUF holding only a byte-level BPE vocabulary (control tokens, the 256 byte symbols,
    the merged tokens, one user-defined token); returns its tokens."""
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = CONTROL + byte_alphabet() + merged + USER_DEFINED
    types = [int(gguf.TokenType.CONTROL)] * len(CONTROL)
    types += [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(CONTROL) - len(USER_DEFINED))
    types += [int(gguf.TokenType.USER_DEFINED)] * len(USER_DEFINED)
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": add_bos,
    }
    write_gguf(path, "llama", metadata, {})
    return tokens


@pytest.mark.parametrize(
    "pre, text, pieces",
    [
        ("smollm", "hello world", ["hello", "Ġworld"]),
        ("smollm", "ell", ["e", "ll"]),  # merge ranks, not left to right: "l l" before "e l"
        ("smollm", "<|im_start|>user\nhello<|im_end|>",
         ["<|im_start|>", "u", "s", "e", "r", "Ċ", "hello", "<|im_end|>"]),
        ("smollm", "<tool> hello", ["<tool>", "Ġ", "hello"]),
        ("smollm", "x 123", ["x", "Ġ", "1", "2", "3"]),  # digits one by one: no "1 2" merge
        ("gpt2", "x 123", ["x", "Ġ", "12", "3"]),  # " 123" one piece: merged
        ("smollm", "\n   2", ["Ċ", "ĠĠĠ", "2"]),  # the whitespace run is one piece
        ("smollm", "é", ["Ã", "©"]),  # a 2-byte character: two byte symbols
    ],
)  # fmt: skip
def test_gguf_vocabulary_tokenizes_as_llama_cpp(tmp_path, pre, text, pieces):
    tokens = write_tokenizer_gguf(tmp_path / "tok.gguf", pre=pre)
    tok = gguf_tokenizer(tmp_path / "tok.gguf")
    ids = tok.encode(text).ids
    assert ids == [tokens.index(p) for p in pieces], [tokens[i] for i in ids]
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_control_tokens_are_special_and_user_defined_ones_are_text(tmp_path):
    write_tokenizer_gguf(tmp_path / "tok.gguf")
    tok = gguf_tokenizer(tmp_path / "tok.gguf")
    text = "<|im_start|>hello <tool> world<|im_end|>"
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "hello <tool> world"


def test_add_bos_token_prepends_the_bos_token(tmp_path):
    tokens = write_tokenizer_gguf(tmp_path / "tok.gguf", add_bos=True)
    ids = gguf_tokenizer(tmp_path / "tok.gguf").encode("hello").ids
    assert ids == [1, tokens.index("hello")]


# ---- chat template ------------------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "Be <brief> & précis."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye"},
]
TEMPLATES = {
    "chatml": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    # Jinja's `loopcontrols` extension ({% break %}, {% continue %}), which transformers enables
    "loop-controls": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{{ m.content }}\n{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}",
    # transformers' own `tojson`: not HTML- or ASCII-escaped, keys in order (e.g. Qwen2.5's tools)
    "tojson": "{% for m in messages %}{{ m | tojson }}\n{% endfor %}",
    # transformers' {% generation %} tag (marks the assistant tokens: return_assistant_tokens_mask)
    "generation-tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_gguf_chat_template_renders_as_transformers_renders_it(tmp_path, name):
    from transformers.utils.chat_template_utils import render_jinja_template

    from jaxinfer.engine.chat import render_chat
    from jaxinfer.engine.loading import model_chat_template

    path = tmp_path / "chat.gguf"
    write_gguf(path, "llama", {"tokenizer.chat_template": TEMPLATES[name]}, {})
    template = model_chat_template(str(path))
    assert template == TEMPLATES[name]
    (want,), _ = render_jinja_template([CHAT], chat_template=template, add_generation_prompt=True)
    assert render_chat(template, CHAT) == want


# ---- broken files fail naming the cause ---------------------------------------------------------


def small_llama_gguf(path, *, drop: str | None = None, raw: dict | None = None) -> None:
    """A 1-layer llama file of random weights, without metadata key `drop`, with `raw` tensors
    {GGUF name: (uint8 bytes [rows, row bytes], type)} in place of the float ones."""
    cfg = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1, "intermediate_size": 256})
    model = transformers.LlamaForCausalLM(cfg)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tensors = {**gguf_tensors(state, "llama", cfg), **(raw or {})}
    meta = {k: v for k, v in arch_metadata("llama", cfg).items() if k != drop}
    write_gguf(path, "llama", meta, tensors)


def test_moe_gguf_is_refused_by_its_expert_count(tmp_path):
    path = tmp_path / "mixtral.gguf"
    write_gguf(path, "llama", {"llama.expert_count": 8, "llama.block_count": 1}, {})
    with pytest.raises(UnsupportedModelError, match="expert_count=8: MoE GGUF") as e:
        load_gguf_model(path)
    assert str(path) in str(e.value)


def test_unsupported_architecture_names_itself_and_the_file(tmp_path):
    path = tmp_path / "gemma.gguf"
    write_gguf(path, "gemma", {"gemma.block_count": 1}, {})
    with pytest.raises(UnsupportedModelError, match="'gemma'") as e:
        load_gguf_model(path)
    assert str(path) in str(e.value) and "llama" in str(e.value)  # and the supported ones


@pytest.mark.parametrize(
    "tensor, qtype, shape",
    [("blk.0.ffn_up.weight", Q.IQ4_NL, (256, 64)), ("blk.0.ffn_down.weight", Q.Q5_K, (64, 256))],
    ids=["IQ4_NL", "Q5_K"],
)
def test_unsupported_tensor_type_names_the_tensor_the_type_and_the_file(
    tmp_path, tensor, qtype, shape
):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, n = shape
    raw = np.zeros((rows, n // block * size), np.uint8)
    path = tmp_path / "iq.gguf"
    small_llama_gguf(path, raw={tensor: (raw, qtype)})
    with pytest.raises(CheckpointError) as e:
        load_gguf_model(path, dtype="float32")
    assert tensor in str(e.value) and qtype.name in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize(
    "keep",
    [lambda n: 250, lambda n: 800, lambda n: n // 2, lambda n: n - 1],  # (infos: ~450-1150)
    ids=["in-metadata", "in-tensor-infos", "in-weights", "last-byte-missing"],
)
def test_truncated_file_says_truncated(tmp_path, keep):
    path = tmp_path / "cut.gguf"
    small_llama_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_gguf_model(path, dtype="float32")
    assert str(path) in str(e.value)


def test_a_file_that_is_not_gguf_says_so(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    with pytest.raises(CheckpointError, match="is not a GGUF file") as e:
        load_gguf_model(path)
    assert str(path) in str(e.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gguf_model(tmp_path / "missing.gguf")


@pytest.mark.parametrize(
    "key", ["llama.feed_forward_length", "llama.attention.layer_norm_rms_epsilon"]
)
def test_missing_required_metadata_key_is_named(tmp_path, key):
    path = tmp_path / "partial.gguf"
    small_llama_gguf(path, drop=key)
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")) as e:
        load_gguf_model(path)
    assert str(path) in str(e.value)


def test_unknown_pre_tokenizer_is_named(tmp_path):
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, pre="made-up-pre")
    with pytest.raises(UnsupportedModelError, match="made-up-pre") as e:
        gguf_tokenizer(path)
    assert str(path) in str(e.value) and "smollm" in str(e.value)  # and the supported ones
