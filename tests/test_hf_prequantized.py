"""Pre-quantized HF checkpoints (FP8 block-scaled, ModelOpt NVFP4) load into fp8_block / nvfp4
without rounding anything: tiny Llama checkpoints are written here with numpy and ml_dtypes, and
every loaded weight must dequantize to exactly the HF tensors' dequantization, done by hand and
carried to the plain loader as a second, unquantized checkpoint (the reference)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxinfer.checkpoint import (
    CheckpointError,
    UnsupportedModelError,
    config_from_hf,
    load_hf_config,
    load_hf_model,
    load_hf_params,
)
from jaxinfer.models.dense import forward
from jaxinfer.quant import QuantizedWeight

E4M3 = ml_dtypes.float8_e4m3fn
VOCAB, HIDDEN, FFN, LAYERS = 96, 256, 320, 2  # 320: partial 128-blocks on the FFN axes
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}  # fmt: skip
NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
         "exclude_modules": ["lm_head"], "kv_cache_quant_algo": None}  # fmt: skip
QUANT = {"fp8_block": FP8, "nvfp4": NVFP4}
HEADS = {64: (4, 2), 96: (3, 1), 128: (2, 1)}  # head_dim -> (heads, kv heads)


def hf_config(head_dim: int, quant: dict | None = None) -> dict:
    heads, kv_heads = HEADS[head_dim]
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
           "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip
    return cfg if quant is None else {**cfg, "quantization_config": quant}


def linear_shapes(head_dim: int) -> dict[str, tuple[int, int]]:
    """HF module name -> nn.Linear weight shape [out, in]."""
    heads, kv_heads = HEADS[head_dim]
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = {"self_attn.q_proj": (q, HIDDEN), "self_attn.k_proj": (kv, HIDDEN),
                 "self_attn.v_proj": (kv, HIDDEN), "self_attn.o_proj": (HIDDEN, q),
                 "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN),
                 "mlp.down_proj": (HIDDEN, FFN)}  # fmt: skip
    return {f"model.layers.{i}.{m}": s for i in range(LAYERS) for m, s in per_layer.items()}


def plain_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The unquantized tensors (embeddings, norms, lm_head), random so that mixups show."""
    t = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)),
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN),
         "lm_head.weight": rng.standard_normal((VOCAB, HIDDEN)) / 16}  # fmt: skip
    for i in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN)
    return {k: v.astype(np.float32) for k, v in t.items()}


def random_linear(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """1/sqrt(in)-scaled, each output row scaled differently so that HF's blocks differ."""
    w = rng.standard_normal(shape) / np.sqrt(shape[1]) * rng.uniform(0.3, 3, (shape[0], 1))
    return w.astype(np.float32)


# -- the HF layouts, by hand --------------------------------------------------------------------


def blockwise(s: np.ndarray, shape: tuple[int, int], rows: int, cols: int) -> np.ndarray:
    return np.repeat(np.repeat(s, rows, 0), cols, 1)[: shape[0], : shape[1]]


def fp8_block_quantize(w: np.ndarray) -> dict[str, np.ndarray]:
    """DeepSeek-V3's layout: e4m3 weight, fp32 weight_scale_inv = amax / 448 per 128x128 block."""
    (out, inn), ob, ib = w.shape, -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    padded = np.zeros((ob * 128, ib * 128), np.float32)
    padded[:out, :inn] = np.abs(w)
    amax = padded.reshape(ob, 128, ib, 128).max(axis=(1, 3))
    s = np.where(amax > 0, amax / 448, 1).astype(np.float32)
    q = np.clip(w / blockwise(s, w.shape, 128, 128), -448, 448).astype(E4M3)
    return {"weight": q, "weight_scale_inv": s}


def fp8_block_dequantize(t: dict[str, np.ndarray]) -> np.ndarray:
    q, s = t["weight"], t["weight_scale_inv"]
    return (q.astype(np.float64) * blockwise(s.astype(np.float64), q.shape, 128, 128)).astype(
        np.float32
    )


def nvfp4_quantize(w: np.ndarray) -> dict[str, np.ndarray]:
    """ModelOpt's NVFP4 layout: weight uint8 [out, in/2] with input 2i in the low nibble,
    weight_scale e4m3 [out, in/16], weight_scale_2 = amax / (6 * 448), input_scale (unused)."""
    ws2 = np.float32(np.abs(w).max() / (6 * 448))
    amax = np.abs(w).reshape(w.shape[0], -1, 16).max(-1)
    ws = (amax / 6 / ws2).astype(E4M3)
    scale = blockwise(ws.astype(np.float32) * ws2, w.shape, 1, 16)
    v = np.clip(np.where(scale > 0, w / np.where(scale > 0, scale, 1), 0), -6, 6)
    codes = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return {"weight": packed, "weight_scale": ws, "weight_scale_2": np.array(ws2, np.float32),
            "input_scale": np.array(0.01, np.float32)}  # fmt: skip


def nvfp4_dequantize(t: dict[str, np.ndarray]) -> np.ndarray:
    packed = t["weight"]
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    e2m1 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    ws = blockwise(t["weight_scale"].astype(np.float64), e2m1.shape, 1, 16)
    return (e2m1 * ws * np.float64(t["weight_scale_2"])).astype(np.float32)


QUANTIZE = {"fp8_block": fp8_block_quantize, "nvfp4": nvfp4_quantize}
DEQUANTIZE = {"fp8_block": fp8_block_dequantize, "nvfp4": nvfp4_dequantize}


def write(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def write_pair(root: Path, fmt: str, head_dim: int, seed: int, linears=None, mutate=None):
    """(quantized checkpoint, plain checkpoint of its by-hand dequantized weights). `linears`:
    module -> HF tensors (default: `fmt`'s quantization of random weights)."""
    rng = np.random.default_rng(seed)
    if linears is None:
        linears = {
            m: QUANTIZE[fmt](random_linear(rng, s)) for m, s in linear_shapes(head_dim).items()
        }
    plain = plain_tensors(rng)
    quantized = {**plain, **{f"{m}.{k}": v for m, t in linears.items() for k, v in t.items()}}
    if mutate is not None:
        mutate(quantized)
    dequantized = {**plain, **{f"{m}.weight": DEQUANTIZE[fmt](t) for m, t in linears.items()}}
    return (write(root / "quantized", hf_config(head_dim, QUANT[fmt]), quantized),
            write(root / "plain", hf_config(head_dim), dequantized))  # fmt: skip


@jax.jit
def dequantized(params):
    one = lambda w: w.format.dequantize(w) if isinstance(w, QuantizedWeight) else w  # noqa: E731
    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def assert_loads_as_the_dequantized_checkpoint(quantized: Path, plain: Path, fmt: str, seed: int):
    cfg, params = load_hf_model(quantized, dtype="float32")
    plain_cfg, want = load_hf_model(plain, dtype="float32")
    assert cfg.weight_format == fmt and cfg.replace(weight_format=None) == plain_cfg
    for key in ("w_qkv", "wo", "w_gate_up", "w_down"):
        qw = params["layers"][0][key]
        assert isinstance(qw, QuantizedWeight) and qw.format.name == fmt, key
    got = jax.tree_util.tree_leaves_with_path(dequantized(params))
    for (path, a), b in zip(got, jax.tree.leaves(want), strict=True):
        where = f"seed {seed}: {jax.tree_util.keystr(path)}"
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)


# -- exact loads --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4"])
@pytest.mark.parametrize("head_dim", [64, 128])  # 64: two heads per HF fp8 block; 128: one
def test_checkpoint_dequantizes_exactly_as_its_hf_tensors(fmt, head_dim, tmp_path, fresh_seed):
    quantized, plain = write_pair(tmp_path, fmt, head_dim, fresh_seed)
    assert_loads_as_the_dequantized_checkpoint(quantized, plain, fmt, fresh_seed)


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4"])
def test_logits_match_the_dequantized_models(fmt, tmp_path, fresh_seed):
    """nvfp4 is weight-only: the same weights, the same logits. fp8_block also quantizes the
    activations (e4m3 per token per 128 channels, ~2^-4 relative each), so its logits are only
    close: about 12% off in L2 here, as the same weights re-quantized by `quantize_params` are."""
    quantized, plain = write_pair(tmp_path, fmt, 64, fresh_seed)
    cfg, params = load_hf_model(quantized, dtype="float32")
    plain_cfg, want_params = load_hf_model(plain, dtype="float32")
    tokens = np.random.default_rng(fresh_seed).integers(0, VOCAB, (2, 9))
    run = jax.jit(forward, static_argnums=1)
    got, want = (
        np.asarray(run(params, cfg, tokens)),
        np.asarray(run(want_params, plain_cfg, tokens)),
    )
    if fmt == "nvfp4":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=f"seed {fresh_seed}")  # fmt: skip
    else:
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel <= 0.25, f"seed {fresh_seed}: logits {rel:.3g} off in L2"


def test_hf_quant_config_json_alone_names_nvfp4(tmp_path, fresh_seed):
    """ModelOpt's own hf_quant_config.json ({"producer", "quantization"}) beside a config.json
    without quantization_config."""
    quantized, plain = write_pair(tmp_path, "nvfp4", 64, fresh_seed)
    (quantized / "config.json").write_text(json.dumps(hf_config(64)))
    inner = {k: v for k, v in NVFP4.items() if k != "quant_method"}
    (quantized / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": inner})
    )
    assert_loads_as_the_dequantized_checkpoint(quantized, plain, "nvfp4", fresh_seed)


def test_two_way_tensor_parallel_load_places_each_array_by_its_spec(
    tmp_path, fresh_seed, run_on_cpu_devices
):
    """On a 2-way `model` mesh every array of a loaded QuantizedWeight sits where its spec's axes
    say (w_qkv's values, scales and tensor scales split by KV head) and holds a single-device
    load's values."""
    dirs = [write_pair(tmp_path / fmt, fmt, 64, fresh_seed)[0] for fmt in QUANT]
    code = f"""
        import jax, numpy as np
        from jax.sharding import PartitionSpec as P
        from jaxinfer.checkpoint import load_hf_model
        from jaxinfer.models.spec import param_specs
        from jaxinfer.parallel.sharding import make_mesh, named_sharding
        mesh = make_mesh({{"data": 1, "model": 2}})
        for path in {[str(d) for d in dirs]!r}:
            cfg, single = load_hf_model(path, dtype="float32")
            _, sharded = load_hf_model(path, dtype="float32", mesh=mesh)
            specs = param_specs(cfg)["layers"][0]["w_qkv"].arrays
            for key, a in sharded["layers"][0]["w_qkv"].arrays.items():
                assert a.sharding == named_sharding(mesh, specs[key].axes, a.shape), (path, key)
                assert a.sharding.spec[specs[key].axes.index("kv_heads")] == "model", (path, key)
            for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
                bits = lambda x: np.asarray(x).reshape(-1).view(np.uint8)  # noqa: E731
                np.testing.assert_array_equal(bits(a), bits(b))
        print("ok")
        """
    run_on_cpu_devices(code, 2)


# -- fp8 blocks that straddle HF's ----------------------------------------------------------------


def fp8_power_of_two_linear(rng: np.random.Generator, shape: tuple[int, int]) -> dict:
    """e4m3 values of magnitude 1..224 and block scales 2^-9 or 2^-8: a value moved to the other
    scale of its pair (times 2 or 1/2) is again an e4m3 value."""
    table = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    codes = np.flatnonzero((np.abs(table) >= 1) & (np.abs(table) <= 224)).astype(np.uint8)
    q = rng.choice(codes, shape).view(E4M3)
    s = 2.0 ** rng.integers(-9, -7, (-(-shape[0] // 128), -(-shape[1] // 128)))
    return {"weight": q, "weight_scale_inv": s.astype(np.float32)}


def test_fp8_blocks_straddling_two_hf_scales_are_re_expressed_exactly(tmp_path, fresh_seed):
    """head_dim 96: query head 1 holds HF rows 96..191, in HF's row blocks 0 and 1."""
    rng = np.random.default_rng(fresh_seed)
    linears = {m: fp8_power_of_two_linear(rng, s) for m, s in linear_shapes(96).items()}
    q = linears["model.layers.0.self_attn.q_proj"]["weight_scale_inv"]
    q[0], q[1] = 2.0**-9, 2.0**-8  # (at least one straddle with two scales)
    quantized, plain = write_pair(tmp_path, "fp8_block", 96, fresh_seed, linears)
    assert_loads_as_the_dequantized_checkpoint(quantized, plain, "fp8_block", fresh_seed)


def test_fp8_blocks_that_cannot_share_a_scale_are_refused_naming_the_tensor(tmp_path, fresh_seed):
    quantized, _ = write_pair(tmp_path, "fp8_block", 96, fresh_seed)  # amax scales: any ratio
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    with pytest.raises(UnsupportedModelError, match=re.escape(name) + ".*straddle") as e:
        load_hf_model(quantized, dtype="float32")
    assert "without rounding" in str(e.value), f"seed {fresh_seed}"


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"quant_method": "awq"}, "'awq'"),
        ({**FP8, "weight_block_size": [64, 64]}, "weight_block_size"),
        ({**FP8, "weight_block_size": None}, "weight_block_size"),
        ({**FP8, "activation_scheme": "static"}, "activation_scheme='static'"),
        ({**FP8, "fmt": "e5m2"}, "fmt='e5m2'"),
        ({**FP8, "weight_per_tensor": True}, "weight_per_tensor"),
        ({**NVFP4, "quant_algo": "FP8"}, "quant_algo='FP8'"),
        ({**NVFP4, "group_size": 32}, "group_size=32"),
        ({"quantization": {"quant_algo": "W4A8_AWQ"}}, "quantization.quant_algo='W4A8_AWQ'"),
    ],
)
def test_unsupported_quantization_config_is_refused_by_name(quant, named):
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        config_from_hf(hf_config(64, quant))


@pytest.mark.parametrize(
    ("fmt", "key", "pattern"),
    [
        ("fp8_block", "modules_to_not_convert", "model.layers.1.mlp.down_proj"),
        ("fp8_block", "ignored_layers", "q_proj"),  # transformers' substring match
        ("nvfp4", "exclude_modules", "model.layers.0.self_attn*"),  # ModelOpt's glob
        ("nvfp4", "ignore", "model.layers.1.mlp.up_proj"),
    ],
)
def test_unquantized_decoder_linears_are_refused_by_name(fmt, key, pattern):
    quant = {**QUANT[fmt], key: ["lm_head", pattern]}
    with pytest.raises(UnsupportedModelError, match=re.escape(f"{key} keeps {pattern!r}")):
        config_from_hf(hf_config(64, quant))
    # lm_head and the embeddings (plain in every format) may stay unquantized
    quant = {**QUANT[fmt], key: ["lm_head", "model.embed_tokens", "*.mlp.gate"]}
    assert config_from_hf(hf_config(64, quant)).weight_format == fmt


@pytest.mark.parametrize(
    ("fmt", "tensor", "shape"),
    [("fp8_block", "self_attn.k_proj.weight_scale_inv", (2, 2)),  # k_proj: [128, 256] -> (1, 2)
     ("nvfp4", "mlp.up_proj.weight_scale", (320, 8)),  # [320, 256] -> (320, 16)
     ("nvfp4", "self_attn.o_proj.weight_scale_2", (2,))],
)  # fmt: skip
def test_a_malformed_scale_is_refused_naming_its_tensor(fmt, tensor, shape, tmp_path, fresh_seed):
    name = f"model.layers.1.{tensor}"

    def mutate(tensors):
        tensors[name] = np.ones(shape, tensors[name].dtype)

    quantized, _ = write_pair(tmp_path, fmt, 64, fresh_seed, mutate=mutate)
    with pytest.raises(CheckpointError, match=re.escape(f"{name!r}") + ".*shape"):
        load_hf_model(quantized, dtype="float32")


def test_a_quantized_lm_head_is_refused_by_name(tmp_path, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    head = {
        f"lm_head.{k}": v for k, v in nvfp4_quantize(random_linear(rng, (VOCAB, HIDDEN))).items()
    }

    def mutate(tensors):
        tensors.update(head)  # (replacing the plain lm_head.weight)

    quantized, _ = write_pair(tmp_path, "nvfp4", 64, fresh_seed, mutate=mutate)
    with pytest.raises(UnsupportedModelError, match=r"'lm_head\.weight_scale_2'.*lm_head"):
        load_hf_model(quantized, dtype="float32")


def test_a_quantized_checkpoint_loads_only_into_its_own_format(tmp_path, fresh_seed):
    quantized, _ = write_pair(tmp_path, "nvfp4", 64, fresh_seed)
    cfg = load_hf_config(quantized, dtype="float32")
    for other in (None, "fp8_block"):
        with pytest.raises(CheckpointError, match=f"nvfp4.*weight_format={other!r}"):
            load_hf_params(quantized, cfg.replace(weight_format=other))
