"""Export to a Hugging Face model directory (`save_hf_model`), read back by us and by transformers.

Tiny random ModelConfigs (fp32) are exported; the directory must load through `load_hf_model` to
bit-identical params and an equal config, and through `transformers.AutoModelForCausalLM` to
logits that match `dense.forward`. Random init leaves norms at 1 and biases at 0, so every param is
perturbed first: a swapped or dropped norm/bias would otherwise go unnoticed.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import load_file

import jaxinfer.checkpoint.hf_saver as hf_saver
from jaxinfer.checkpoint import (
    config_from_hf,
    config_to_hf,
    load_hf_model,
    load_tokenizer,
    save_hf_model,
)
from jaxinfer.models.config import Llama3RopeScaling, ModelConfig
from jaxinfer.models.dense import forward
from jaxinfer.models.spec import init_params

TOL = 1e-4
BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,  # heads * head_dim != hidden_size, so head_dim must really be written
    max_position_embeddings=256,
    param_dtype="float32",
    dtype="float32",
)
CONFIGS = {
    "llama3.1": ModelConfig(
        **BASE,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        # head_dim 16, theta 5e5: with 64 original positions one frequency falls in each band.
        rope_scaling=Llama3RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "qwen3": ModelConfig(
        **BASE,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        qk_norm=True,
        tie_word_embeddings=True,
        eos_token_ids=(5, 7),
    ),
    "qwen2": ModelConfig(**BASE, rms_norm_eps=1e-6, qkv_bias=True),
    "llama-bias": ModelConfig(**BASE, qkv_bias=True, o_bias=True, mlp_bias=True, bos_token_id=3),
    "mistral-window": ModelConfig(**BASE, sliding_window=5, eos_token_ids=(2,)),
    "qwen2-window": ModelConfig(**BASE, qkv_bias=True, sliding_window=6, tie_word_embeddings=True),
    # per-layer attention types (transformers' `layer_types`): a window in the middle layer only
    "qwen2-mixed": ModelConfig(
        **{**BASE, "num_layers": 3},
        qkv_bias=True,
        sliding_window=4,
        layer_types=("full_attention", "sliding_attention", "full_attention"),
    ),
}
ARCH = {
    "llama3.1": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama-bias": "LlamaForCausalLM",
    "mistral-window": "MistralForCausalLM",
    "qwen2-window": "Qwen2ForCausalLM",
    "qwen2-mixed": "Qwen2ForCausalLM",
}


def random_params(cfg: ModelConfig, seed: int):
    """`init_params`, then every leaf perturbed (norms off 1, biases off 0)."""
    params = init_params(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: (x + 0.1 * rng.standard_normal(x.shape)).astype(x.dtype), params)


def assert_trees_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        assert a.dtype == b.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path)
        )


def load_options_erased(cfg: ModelConfig) -> ModelConfig:
    return cfg.replace(param_dtype="float32", dtype="float32")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def exported(request, tmp_path_factory):
    name = request.param
    cfg = CONFIGS[name]
    params = random_params(cfg, sum(map(ord, name)))
    path = tmp_path_factory.mktemp("export") / name
    assert save_hf_model(path, cfg, params, dtype="float32") == path
    return name, cfg, params, path


def test_directory_contents(exported):
    name, cfg, _, path = exported
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    names = set(load_file(path / "model.safetensors"))
    assert ("lm_head.weight" in names) == (not cfg.tie_word_embeddings), name
    assert "model.layers.1.self_attn.q_proj.weight" in names
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        assert {f.get_slice(n).get_dtype() for n in names} == {"F32"}
        # HF Linear layout [out, in].
        q = f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape()
        assert q == [cfg.num_heads * cfg.head_dim, cfg.hidden_size]
        o = f.get_slice("model.layers.0.self_attn.o_proj.weight").get_shape()
        assert o == [cfg.hidden_size, cfg.num_heads * cfg.head_dim]
    gen = json.loads((path / "generation_config.json").read_text())
    eos = list(cfg.eos_token_ids)
    assert gen == {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": None if not eos else eos[0] if len(eos) == 1 else eos,
    }


def test_load_hf_model_round_trips_bit_identically(exported):
    name, cfg, params, path = exported
    got_cfg, got = load_hf_model(path, dtype="float32")
    assert got_cfg == load_options_erased(cfg), name
    assert_trees_equal(got, params)


def test_config_json_read_by_transformers(exported):
    name, cfg, _, path = exported
    hf = transformers.AutoConfig.from_pretrained(path)
    assert type(hf).__name__ == ARCH[name].replace("ForCausalLM", "Config")
    assert hf.architectures == [ARCH[name]]
    assert hf.vocab_size == cfg.vocab_size
    assert hf.hidden_size == cfg.hidden_size
    assert hf.intermediate_size == cfg.intermediate_size
    assert hf.num_hidden_layers == cfg.num_layers
    assert hf.num_attention_heads == cfg.num_heads
    assert hf.num_key_value_heads == cfg.num_kv_heads
    assert hf.head_dim == cfg.head_dim
    assert hf.hidden_act == "silu"
    assert hf.rms_norm_eps == cfg.rms_norm_eps
    assert hf.max_position_embeddings == cfg.max_position_embeddings
    assert hf.tie_word_embeddings == cfg.tie_word_embeddings
    assert hf.bos_token_id == cfg.bos_token_id
    assert hf.dtype == torch.float32
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {
            "rope_theta": cfg.rope_theta,
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    assert hf.rope_parameters == rope
    if ARCH[name] == "LlamaForCausalLM":
        assert hf.attention_bias == cfg.qkv_bias
        assert hf.mlp_bias == cfg.mlp_bias
    elif ARCH[name] == "MistralForCausalLM":
        assert hf.sliding_window == cfg.sliding_window
    else:
        assert hf.sliding_window == cfg.sliding_window
        kind = "full_attention" if cfg.sliding_window is None else "sliding_attention"
        assert hf.layer_types == (list(cfg.layer_types) or [kind] * cfg.num_layers)


def test_v4_and_v5_rope_fields_each_suffice(exported):
    """Strip either RoPE spelling: transformers and `config_from_hf` read the same config."""
    name, cfg, _, path = exported
    hf = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in hf and "rope_theta" in hf and "rope_scaling" in hf
    v4 = {k: v for k, v in hf.items() if k != "rope_parameters"}
    v5 = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}
    config_cls = getattr(transformers, ARCH[name].replace("ForCausalLM", "Config"))
    full = transformers.AutoConfig.from_pretrained(path).rope_parameters
    for variant in (v4, v5):
        assert config_from_hf(variant, dtype="float32") == load_options_erased(cfg), name
        kwargs = {k: v for k, v in variant.items() if k not in ("architectures", "model_type")}
        assert config_cls(**kwargs).rope_parameters == full, name


def test_transformers_logits_match_forward(exported):
    name, cfg, params, path = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(model).__name__ == ARCH[name]
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 23))
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens)).logits.float().numpy()
    ours = np.asarray(forward(params, cfg, jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0, err_msg=name)


def test_each_layer_keeps_its_attention_type():
    """The mixed config's middle layer really slides: all-full or all-sliding give other logits."""
    cfg = CONFIGS["qwen2-mixed"]
    params = random_params(cfg, 3)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 17)))
    mixed = np.asarray(forward(params, cfg, tokens))
    for uniform in ("full_attention", "sliding_attention"):
        other = np.asarray(forward(params, cfg.replace(layer_types=(uniform,) * 3), tokens))
        assert np.abs(other - mixed).max() > 1e-3, uniform


def test_bf16_export_holds_rounded_values(tmp_path):
    cfg = CONFIGS["qwen3"]
    params = random_params(cfg, 5)
    path = save_hf_model(tmp_path / "bf16", cfg, params)  # bfloat16 is the default
    hf = json.loads((path / "config.json").read_text())
    assert hf["torch_dtype"] == hf["dtype"] == "bfloat16"
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}  # noqa: SIM118
    _, got = load_hf_model(path, dtype="float32")
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    assert_trees_equal(got, rounded)
    assert not np.array_equal(np.asarray(got["embed"]), np.asarray(params["embed"]))
    _, got_bf16 = load_hf_model(path, dtype="bfloat16")
    assert got_bf16["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(got_bf16["embed"]), np.asarray(params["embed"]).astype(ml_dtypes.bfloat16)
    )


def test_float16_export_and_bf16_params(tmp_path):
    cfg = CONFIGS["qwen2"].replace(param_dtype="bfloat16")
    params = random_params(cfg, 6)
    assert params["embed"].dtype == jnp.bfloat16
    path = save_hf_model(tmp_path / "f16", cfg, params, dtype="float16")
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"F16"}  # noqa: SIM118
    _, got = load_hf_model(path, dtype="bfloat16")
    via_f16 = jax.tree.map(lambda x: x.astype(jnp.float16).astype(jnp.bfloat16), params)
    assert_trees_equal(got, via_f16)


def test_existing_dir_needs_force(tmp_path):
    cfg = CONFIGS["qwen2"]
    path = save_hf_model(tmp_path / "m", cfg, random_params(cfg, 1), dtype="float32")
    before = (path / "model.safetensors").read_bytes()
    (path / "stale.txt").write_text("from an earlier save")
    new = random_params(cfg, 2)
    with pytest.raises(FileExistsError, match="not empty"):
        save_hf_model(path, cfg, new, dtype="float32")
    assert (path / "model.safetensors").read_bytes() == before
    assert save_hf_model(path, cfg, new, dtype="float32", force=True) == path
    assert not (path / "stale.txt").exists()
    assert_trees_equal(load_hf_model(path, dtype="float32")[1], new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp or backup dirs left

    (tmp_path / "empty").mkdir()
    save_hf_model(tmp_path / "empty", cfg, new, dtype="float32")  # empty dir: no force needed
    assert (tmp_path / "empty" / "config.json").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        save_hf_model(tmp_path / "file", cfg, new, dtype="float32", force=True)


def test_interrupted_save_leaves_no_directory(tmp_path, monkeypatch):
    cfg = CONFIGS["qwen2"]
    params = random_params(cfg, 3)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_saver, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        save_hf_model(tmp_path / "m", cfg, params)
    assert list(tmp_path.iterdir()) == []

    monkeypatch.undo()
    path = save_hf_model(tmp_path / "m", cfg, params, dtype="float32")
    monkeypatch.setattr(hf_saver, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        save_hf_model(path, cfg, random_params(cfg, 4), force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert_trees_equal(load_hf_model(path, dtype="float32")[1], params)  # old model intact


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(o_bias=True), "o_bias"),  # o bias without q/k/v bias: no architecture has it
        (dict(qk_norm=True, qkv_bias=True), "o_bias"),  # Qwen3 biases all four or none
        (dict(qk_norm=True, mlp_bias=True), "mlp_bias"),
        (dict(qkv_bias=True, mlp_bias=True), "mlp_bias"),  # Qwen2 has no MLP bias
        (dict(sliding_window=8, mlp_bias=True), "mlp_bias"),  # Mistral has no biases
        (dict(sliding_window=8, qkv_bias=True, o_bias=True), "qkv_bias"),
    ],
)
def test_unrepresentable_configs_are_refused(tmp_path, changes, field):
    cfg = ModelConfig(**BASE).replace(**changes)
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}="):
        config_to_hf(cfg)
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}="):
        save_hf_model(tmp_path / "m", cfg, random_params(cfg, 0))
    assert list(tmp_path.iterdir()) == []


def test_params_must_match_config(tmp_path):
    cfg = CONFIGS["llama3.1"]
    params = random_params(cfg, 0)
    no_bias = {**params, "layers": tuple({**layer} for layer in params["layers"])}
    no_bias["layers"][1]["b_qkv"] = jnp.zeros((cfg.num_kv_heads, cfg.q_per_kv + 2, cfg.head_dim))
    with pytest.raises(ValueError, match=r"unexpected \['b_qkv'\]"):
        save_hf_model(tmp_path / "a", cfg, no_bias)
    with pytest.raises(ValueError, match=r"missing \['lm_head'\]"):
        save_hf_model(tmp_path / "b", cfg, {k: v for k, v in params.items() if k != "lm_head"})
    bad = {**params, "embed": params["embed"][:-1]}
    with pytest.raises(ValueError, match="param embed has shape"):
        save_hf_model(tmp_path / "c", cfg, bad)
    short = {**params, "layers": params["layers"][:1]}
    with pytest.raises(ValueError, match=r"a tuple of 2 per-layer dicts"):
        save_hf_model(tmp_path / "d", cfg, short)
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_is_copied(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_file = tmp_path / "tok.json"
    tok.save(str(tok_file))
    cfg = CONFIGS["qwen2"]
    params = random_params(cfg, 0)
    with pytest.raises(FileNotFoundError):
        save_hf_model(tmp_path / "m", cfg, params, tokenizer_file=tmp_path / "missing.json")
    assert not (tmp_path / "m").exists()
    path = save_hf_model(tmp_path / "m", cfg, params, tokenizer_file=tok_file)
    assert (path / "tokenizer.json").read_bytes() == Path(tok_file).read_bytes()
    assert load_tokenizer(path).encode("hello world oops").ids == [1, 2, 0]
