"""HF safetensors loading, HF config mapping, orbax save/restore and tokenizer loading (CPU).

Tiny random transformers models are saved locally; every loaded param must equal the torch
state_dict tensor after the documented layout transform (HF Linear [out, in] -> ours [in, out] with
heads split). Logits parity against transformers lives in a separate test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from jaxinfer.checkpoint import (
    CheckpointError,
    UnsupportedModelError,
    config_from_hf,
    load_hf_model,
    load_hf_params,
    load_tokenizer,
    restore_params,
    save_params,
)
from jaxinfer.models.config import Llama3RopeScaling
from jaxinfer.models.spec import ParamSpec, is_spec, param_specs
from jaxinfer.parallel.sharding import make_mesh, named_sharding

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

# name -> (config class, model class, extra config kwargs, save_pretrained kwargs)
MODELS = {
    # max_shard_size forces a sharded checkpoint with model.safetensors.index.json.
    "llama_sharded": ("LlamaConfig", "LlamaForCausalLM", {}, {"max_shard_size": "20KB"}),
    "llama_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"attention_bias": True, "mlp_bias": True},
        {},
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}, {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, {}),
    "qwen3_tied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"head_dim": 16, "tie_word_embeddings": True},
        {},
    ),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, dict[str, np.ndarray]]]:
    """name -> (checkpoint dir, torch state_dict as fp32 numpy)."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (config_cls, model_cls, extra, save_kwargs) in MODELS.items():
        cfg = getattr(transformers, config_cls)(**TINY, **extra)
        model = getattr(transformers, model_cls)(cfg)
        with torch.no_grad():  # HF inits biases to 0 and norms to 1: randomize so mixups show.
            for p in model.parameters():
                p.normal_()
        model.save_pretrained(root / name, **save_kwargs)
        sd = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
        out[name] = (root / name, sd)
    return out


def expected_params(sd: dict[str, np.ndarray], hf: dict) -> dict:
    """Our param tree (unrolled layout) written out independently of the loader's rule table."""
    e, hq = hf["hidden_size"], hf["num_attention_heads"]
    hkv = hf["num_key_value_heads"]
    d = hf.get("head_dim") or e // hq
    layers = []
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        g = hq // hkv
        # Fused q/k/v [E, Hkv, G + 2, D], written head by head: query head h of KV group
        # h // G sits at slot h % G of its group, then the group's key, then its value.
        q = sd[p + "self_attn.q_proj.weight"]  # [Hq * D, E]
        k = sd[p + "self_attn.k_proj.weight"]
        v = sd[p + "self_attn.v_proj.weight"]
        w_qkv = np.zeros((e, hkv, g + 2, d), np.float32)
        for h in range(hq):
            w_qkv[:, h // g, h % g, :] = q[h * d : (h + 1) * d].T
        for j in range(hkv):
            w_qkv[:, j, g, :] = k[j * d : (j + 1) * d].T
            w_qkv[:, j, g + 1, :] = v[j * d : (j + 1) * d].T
        layer = {
            "attn_norm": sd[p + "input_layernorm.weight"],
            "mlp_norm": sd[p + "post_attention_layernorm.weight"],
            "w_qkv": w_qkv,
            "wo": sd[p + "self_attn.o_proj.weight"].T.reshape(hq, d, e),
            "w_gate_up": np.stack(
                [sd[p + "mlp.gate_proj.weight"].T, sd[p + "mlp.up_proj.weight"].T], axis=1
            ),
            "w_down": sd[p + "mlp.down_proj.weight"].T,
        }
        if p + "self_attn.q_proj.bias" in sd:
            bq = sd[p + "self_attn.q_proj.bias"].reshape(hkv, g, d)
            bk = sd[p + "self_attn.k_proj.bias"].reshape(hkv, 1, d)
            bv = sd[p + "self_attn.v_proj.bias"].reshape(hkv, 1, d)
            layer["b_qkv"] = np.concatenate([bq, bk, bv], axis=1)
        if p + "self_attn.o_proj.bias" in sd:
            layer["bo"] = sd[p + "self_attn.o_proj.bias"]
        for ours, hf_name in (("q_norm", "q_norm"), ("k_norm", "k_norm")):
            if p + f"self_attn.{hf_name}.weight" in sd:
                layer[ours] = sd[p + f"self_attn.{hf_name}.weight"]
        if p + "mlp.gate_proj.bias" in sd:
            layer["b_gate_up"] = np.stack(
                [sd[p + "mlp.gate_proj.bias"], sd[p + "mlp.up_proj.bias"]], axis=0
            )
        if p + "mlp.down_proj.bias" in sd:
            layer["b_down"] = sd[p + "mlp.down_proj.bias"]
        layers.append(layer)
    tree = {
        "embed": sd["model.embed_tokens.weight"],
        "final_norm": sd["model.norm.weight"],
        "layers": tuple(layers),
    }
    if not hf.get("tie_word_embeddings"):
        tree["lm_head"] = sd["lm_head.weight"].T
    return tree


def assert_tree_equal(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    flat_expected = jax.tree.leaves(expected)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(actual), flat_expected, strict=True
    ):
        assert a.shape == b.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path))


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("name", list(MODELS))
def test_load_matches_state_dict(hf_models, name):
    path, sd = hf_models[name]
    hf = read_config(path)
    cfg, params = load_hf_model(path, dtype="float32")
    assert cfg.param_dtype == "float32"
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))
    assert_tree_equal(params, expected_params(sd, hf))


def test_sharded_checkpoint_really_is_sharded(hf_models):
    path, _ = hf_models["llama_sharded"]
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert not (path / "model.safetensors").exists()


def test_config_flags_follow_architecture(hf_models):
    cfgs = {name: load_hf_model(hf_models[name][0], dtype="float32")[0] for name in MODELS}
    assert (cfgs["llama_sharded"].qkv_bias, cfgs["llama_sharded"].o_bias) == (False, False)
    assert (cfgs["llama_bias"].qkv_bias, cfgs["llama_bias"].o_bias) == (True, True)
    assert cfgs["llama_bias"].mlp_bias
    assert (cfgs["qwen2"].qkv_bias, cfgs["qwen2"].o_bias, cfgs["qwen2"].qk_norm) == (
        True,
        False,
        False,
    )
    assert cfgs["qwen3_tied"].qk_norm and cfgs["qwen3_tied"].tie_word_embeddings
    assert cfgs["qwen3_tied"].head_dim == 16
    assert cfgs["mistral"].sliding_window == 16
    assert cfgs["qwen2"].sliding_window is None
    assert cfgs["llama_sharded"].rms_norm_eps == 1e-6
    assert cfgs["llama_sharded"].eos_token_ids == (2,)


def test_bf16_cast_and_mesh_placement(hf_models):
    path, sd = hf_models["llama_bias"]
    mesh = make_mesh()
    cfg, params = load_hf_model(path, dtype="bfloat16", mesh=mesh)
    expected = expected_params(sd, read_config(path))
    specs = param_specs(cfg)
    for (keypath, spec), a, b in zip(
        jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec),
        jax.tree.leaves(params),
        jax.tree.leaves(expected),
        strict=True,
    ):
        assert isinstance(spec, ParamSpec)
        assert a.dtype == jax.numpy.bfloat16, jax.tree_util.keystr(keypath)
        assert a.sharding == named_sharding(mesh, spec.axes, spec.shape)
        np.testing.assert_array_equal(
            np.asarray(a, np.float32), b.astype(jax.numpy.bfloat16).astype(np.float32)
        )


def test_tensor_parallel_loads_put_each_tensor_onto_its_shards_and_equal_one_device(
    hf_models, run_on_cpu_devices, fresh_seed
):
    """On `model` 2 and 4 and `data` 2 x `model` 4 meshes (8 CPU devices) every param equals a
    single-device load, has its rules' sharding and shards of its slice's shape, so a device
    holds its share of the bytes; every host tensor goes to the mesh with a sharding of it, never
    whole onto one device (stacked experts too). At model 2 the fused q/k/v are split by KV head
    and gate/up on F."""
    path, _ = hf_models["llama_bias"]
    code = f"""
        import math
        import jax, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jaxinfer.checkpoint import load_hf_model
        from jaxinfer.checkpoint.hf_loader import _Loader
        from jaxinfer.models.spec import ParamSpec, is_spec, param_specs
        from jaxinfer.parallel.sharding import make_mesh, named_sharding

        puts = []  # (host input?, where) of every device_put
        device_put = jax.device_put
        def recording_put(x, device=None, **kw):
            puts.append((isinstance(x, np.ndarray), device))
            return device_put(x, device, **kw)
        jax.device_put = recording_put

        _, single = load_hf_model({str(path)!r})
        for shape in ({{"model": 2}}, {{"model": 4}}, {{"data": 2, "model": 4}}):
            mesh = make_mesh(shape)
            puts.clear()
            cfg, sharded = load_hf_model({str(path)!r}, mesh=mesh)
            assert puts and all(isinstance(d, NamedSharding) and d.mesh == mesh
                                for host, d in puts if host), (shape, puts)
            specs = jax.tree.leaves(param_specs(cfg), is_leaf=is_spec)
            on_device0, total = 0, 0
            for spec, a, b in zip(specs, jax.tree.leaves(sharded), jax.tree.leaves(single),
                                  strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
                sharding = named_sharding(mesh, spec.axes, spec.shape)
                assert a.sharding == sharding, (shape, spec, a.sharding)
                split = [1 if ax is None else mesh.shape[ax] for ax in sharding.spec]
                split += [1] * (a.ndim - len(split))
                want = tuple(n // k for n, k in zip(a.shape, split))
                assert all(s.data.shape == want for s in a.addressable_shards), (spec, want)
                on_device0 += sum(s.data.nbytes for s in a.addressable_shards
                                  if s.device == mesh.devices.flat[0])
                total += a.nbytes // math.prod(split)
            assert on_device0 == total, (shape, on_device0, total)
            layer = sharded["layers"][0]
            assert sharded["lm_head"].sharding.spec == P(None, "model"), shape
            assert layer["w_down"].sharding.spec == P("model", None), shape
            if shape == {{"model": 2}}:
                for name, spec in (("w_qkv", (None, "model", None, None)),
                                   ("b_qkv", ("model", None, None)),
                                   ("w_gate_up", (None, None, "model")),
                                   ("b_gate_up", (None, "model"))):
                    assert layer[name].sharding.spec == P(*spec), name

            class Stacked:  # a stacked expert tensor [X, out, in] (transformers v5's layout)
                host = np.random.default_rng({fresh_seed}).normal(size=(4, 8, 6))
                host = host.astype(np.float32)
                def read(self, name, shape, param):
                    assert shape == self.host.shape
                    return self.host
            spec = ParamSpec((4, 6, 8), np.float32, ("expert", "embed", "mlp"), "normal", 1.0)
            puts.clear()
            got = _Loader(Stacked(), mesh).load_stacked("w", spec, "w")
            assert all(isinstance(d, NamedSharding) for host, d in puts if host), puts
            np.testing.assert_array_equal(np.asarray(got), Stacked.host.transpose(0, 2, 1))
            assert got.sharding == named_sharding(mesh, spec.axes, spec.shape)
        print("ok")
        """
    run_on_cpu_devices(code, 8)


def _copy_single(src: Path, dst: Path, mutate=None, filename: str = "model.safetensors") -> Path:
    """Copy a single-file checkpoint, optionally rewriting its tensors dict."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    if mutate is not None:
        mutate(tensors)
    save_file(tensors, dst / filename)
    return dst


def test_f16_checkpoint_and_any_safetensors_name(hf_models, tmp_path):
    src, sd = hf_models["qwen2"]

    def to_f16(tensors):
        for k in tensors:
            tensors[k] = tensors[k].astype(np.float16)

    path = _copy_single(src, tmp_path / "ck", to_f16, filename="weights-00001.safetensors")
    _, params = load_hf_model(path, dtype="float32")
    expected = jax.tree.map(
        lambda x: x.astype(np.float16).astype(np.float32), expected_params(sd, read_config(src))
    )
    assert_tree_equal(params, expected)


def test_generation_config_eos_ids_are_merged(hf_models, tmp_path):
    src, _ = hf_models["llama_bias"]
    path = _copy_single(src, tmp_path / "ck")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    cfg, _ = load_hf_model(path, dtype="float32")
    assert cfg.eos_token_ids == (2, 7, 9)


# --- errors -------------------------------------------------------------------------------------


def test_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match="nope"):
        load_hf_model(tmp_path / "nope")


def test_missing_config_json(hf_models, tmp_path):
    path = _copy_single(hf_models["llama_bias"][0], tmp_path / "ck")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_hf_model(path)


def test_no_safetensors(hf_models, tmp_path):
    path = tmp_path / "ck"
    path.mkdir()
    shutil.copy(hf_models["llama_bias"][0] / "config.json", path / "config.json")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors in .*ck"):
        load_hf_model(path)


def test_unsupported_architecture(hf_models, tmp_path):
    path = _copy_single(hf_models["llama_bias"][0], tmp_path / "ck")
    hf = read_config(path)
    hf["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_hf_model(path)


def test_missing_tensor(hf_models, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _copy_single(hf_models["llama_bias"][0], tmp_path / "ck", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"{name}.*model\.safetensors"):
        load_hf_model(path, dtype="float32")


def test_missing_tensor_in_index(hf_models, tmp_path):
    src, _ = hf_models["llama_sharded"]
    path = tmp_path / "ck"
    shutil.copytree(src, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*index\.json"):
        load_hf_model(path, dtype="float32")


def test_missing_lm_head_when_untied(hf_models, tmp_path):
    path = _copy_single(
        hf_models["llama_bias"][0], tmp_path / "ck", lambda t: t.pop("lm_head.weight")
    )
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        load_hf_model(path, dtype="float32")


def test_misshaped_tensor(hf_models, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"

    def mutate(tensors):
        tensors[name] = np.zeros((63, 32), np.float32)

    path = _copy_single(hf_models["llama_bias"][0], tmp_path / "ck", mutate)
    with pytest.raises(CheckpointError) as err:
        load_hf_model(path, dtype="float32")
    msg = str(err.value)
    assert name in msg and "(63, 32)" in msg and "(64, 32)" in msg


def test_unsupported_dtype(hf_models, tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight"

    def mutate(tensors):
        tensors[name] = tensors[name].astype(np.int8)

    path = _copy_single(hf_models["llama_bias"][0], tmp_path / "ck", mutate)
    with pytest.raises(CheckpointError, match=rf"{name}.*I8"):
        load_hf_model(path, dtype="float32")


def test_load_hf_params_missing_dir(tmp_path):
    cfg = config_from_hf({"architectures": ["LlamaForCausalLM"], **TINY})
    with pytest.raises(CheckpointError, match="missing"):
        load_hf_params(tmp_path / "missing", cfg)


# --- config mapping -----------------------------------------------------------------------------


def hf_dict(arch: str = "LlamaForCausalLM", **extra) -> dict:
    return {"architectures": [arch], **TINY, **extra}


def test_llama3_rope_v5_and_v4_styles_agree():
    scaling = dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    v5 = config_from_hf(
        hf_dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling})
    )
    v4 = config_from_hf(
        hf_dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **scaling})
    )
    v4_type = config_from_hf(
        hf_dict(rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling})
    )
    assert v5 == v4 == v4_type
    assert v5.rope_theta == 500000.0
    assert v5.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)


def test_default_rope_and_defaults():
    cfg = config_from_hf(
        hf_dict(
            rope_scaling=None,
            rope_theta=1e6,
            head_dim=None,
            num_key_value_heads=None,
            eos_token_id=[5, 6],
        ),
        dtype="float16",
    )
    assert cfg.rope_scaling is None and cfg.rope_theta == 1e6
    assert cfg.head_dim == 32 // 4 and cfg.num_kv_heads == 4
    assert cfg.eos_token_ids == (5, 6)
    assert cfg.dtype == cfg.param_dtype == "float16"
    mixed = config_from_hf(hf_dict(), dtype="bfloat16", param_dtype="float32")
    assert (mixed.dtype, mixed.param_dtype) == ("bfloat16", "float32")


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"rope_parameters": {"rope_type": "proportional"}}, "rope_parameters.*proportional"),
        ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling.*su"),
    ],
)
def test_unsupported_rope_type(extra, pattern):
    with pytest.raises(UnsupportedModelError, match=pattern):
        config_from_hf(hf_dict(**extra))


def test_unsupported_rope_type_from_dir(hf_models, tmp_path):
    path = _copy_single(hf_models["llama_bias"][0], tmp_path / "ck")
    hf = read_config(path)
    hf["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedModelError, match="proportional"):
        load_hf_model(path)


def test_missing_required_key_names_key_and_file():
    hf = hf_dict()
    del hf["intermediate_size"]
    with pytest.raises(CheckpointError, match=r"some/config\.json.*intermediate_size"):
        config_from_hf(hf, source="some/config.json")


def test_hidden_act_must_be_silu():
    with pytest.raises(UnsupportedModelError, match="gelu"):
        config_from_hf(hf_dict(hidden_act="gelu"))


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_sliding_window(arch):
    # Only from layer 1 on: per-layer attention types (as transformers derives them).
    mixed = hf_dict(arch, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    cfg = config_from_hf(mixed)
    assert cfg.layer_types == ("full_attention", "sliding_attention")
    assert cfg.layer(0).sliding_window is None and cfg.layer(1).sliding_window == 8
    # Listed sliding layers without use_sliding_window: transformers applies no window; refused.
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        config_from_hf(hf_dict(arch, layer_types=["full_attention", "sliding_attention"]))
    with pytest.raises(UnsupportedModelError, match="chunked"):
        config_from_hf(hf_dict(arch, layer_types=["chunked_attention"] * 2))
    # Declared but disabled (what real Qwen2.5 configs ship): full attention.
    off = config_from_hf(hf_dict(arch, use_sliding_window=False, sliding_window=32768))
    assert off.sliding_window is None
    # Every layer sliding is the same as Mistral's uniform window.
    uniform = hf_dict(arch, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert config_from_hf(uniform).sliding_window == 8


def test_mistral_null_sliding_window_and_no_bias():
    cfg = config_from_hf(hf_dict("MistralForCausalLM", sliding_window=None, attention_bias=True))
    assert cfg.sliding_window is None and not cfg.qkv_bias and not cfg.o_bias


def test_model_type_fallback():
    hf = dict(TINY, model_type="qwen3", head_dim=8)
    assert config_from_hf(hf).qk_norm


# --- orbax --------------------------------------------------------------------------------------


def test_orbax_round_trip(hf_models, tmp_path):
    path, _ = hf_models["qwen3_tied"]
    cfg, params = load_hf_model(path, dtype="bfloat16")
    cfg = cfg.replace(
        rope_scaling=Llama3RopeScaling(2.0, 1.0, 4.0, 16), eos_token_ids=(3, 4), bos_token_id=1
    )
    save_params(tmp_path / "ck", cfg, params)
    assert json.loads((tmp_path / "ck" / "model_config.json").read_text())["rope_scaling"] == {
        "factor": 2.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    cfg2, params2 = restore_params(tmp_path / "ck")
    assert cfg2 == cfg
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params), strict=True):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_orbax_existing_dir_needs_force(hf_models, tmp_path):
    cfg, params = load_hf_model(hf_models["llama_bias"][0], dtype="float32")
    save_params(tmp_path / "ck", cfg, params)
    with pytest.raises(CheckpointError, match="force=True"):
        save_params(tmp_path / "ck", cfg, params)
    doubled = jax.tree.map(lambda x: x * 2, params)
    save_params(tmp_path / "ck", cfg, doubled, force=True)
    _, restored = restore_params(tmp_path / "ck")
    assert_tree_equal(restored, jax.tree.map(np.asarray, doubled))


def test_orbax_rejects_params_not_matching_cfg(hf_models, tmp_path):
    cfg, params = load_hf_model(hf_models["llama_bias"][0], dtype="float32")
    with pytest.raises(ValueError, match="bfloat16"):
        save_params(tmp_path / "ck", cfg.replace(param_dtype="bfloat16"), params)


def test_restore_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="nothing_here"):
        restore_params(tmp_path / "nothing_here")


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_round_trip(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "jax": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("hello jax world").ids == [1, 3, 2]
    assert loaded.encode("hello mars").ids == [1, 0]
    assert loaded.decode([1, 3, 2]) == "hello jax world"
    assert load_tokenizer(tmp_path / "tokenizer.json").get_vocab() == vocab


def test_missing_tokenizer(tmp_path):
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
