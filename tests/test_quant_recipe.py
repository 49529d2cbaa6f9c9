"""Quantization recipes (per-pattern weight formats), `quantize`, calibrated `fp8_static`, the
`engine.quant` config through the engine, KV pages sized from a memory budget, orbax round trips
of mixed formats, and GGUF blocks loaded as stored."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoint import restore_params, save_params
from jaxinfer.engine.config import EngineConfig, QuantConfig
from jaxinfer.engine.engine import Engine, pages_in_budget
from jaxinfer.engine.loading import load_model
from jaxinfer.engine.request import SamplingParams
from jaxinfer.models.dense import forward
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import is_spec, num_params, param_bytes, param_specs
from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight
from jaxinfer.quant.fp8 import E4M3_MAX
from jaxinfer.quant.transform import quantize, quantize_params


def random_params(cfg, seed: int):
    """Plain params of `cfg` drawn on the host by their specs (init_params' distributions; no
    compile, which is most of a test's time here)."""
    rng = np.random.default_rng(seed)

    def one(s):
        if s.init != "normal":
            return jnp.full(s.shape, s.init == "ones", s.dtype)
        return jnp.asarray((s.scale * rng.standard_normal(s.shape)).astype(s.dtype))

    return jax.tree.map(one, param_specs(cfg), is_leaf=is_spec)


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset (2 layers, random weights) and its fp32 params."""
    cfg = preset("tiny")
    return cfg, random_params(cfg, 0)


def formats_of(cfg) -> list[dict[str, str | None]]:
    """Each layer's {param: format name or None} from the spec tree."""
    return [{k: s.format.name if isinstance(s, QuantizedWeight) else None for k, s in layer.items()}
            for layer in param_specs(cfg)["layers"]]  # fmt: skip


@functools.cache
def _forward(cfg):
    return jax.jit(lambda p, t: forward(p, cfg, t))


# -- the recipe ----------------------------------------------------------------------------------


def test_first_matching_pattern_gives_the_format_and_weight_format_the_rest():
    cfg = preset("tiny", weight_format="fp8_block",
                 weight_formats=[["layers.0.*", None], ("layers.*.w_down", "int8"),
                                 ("layers.0.w_down", "q8_0")])  # fmt: skip
    assert cfg.weight_formats[0] == ("layers.0.*", None)  # (lists, as JSON gives, are pairs)
    assert formats_of(cfg) == [
        dict(attn_norm=None, w_qkv=None, wo=None, mlp_norm=None, w_gate_up=None, w_down=None),
        dict(attn_norm=None, w_qkv="fp8_block", wo="fp8_block", mlp_norm=None,
             w_gate_up="fp8_block", w_down="int8"),
    ]  # fmt: skip
    specs = param_specs(cfg)
    assert not any(isinstance(specs[k], QuantizedWeight) for k in ("embed", "lm_head"))
    assert cfg.plain() == preset("tiny") and not cfg.plain().has_formats
    assert num_params(cfg) == num_params(preset("tiny"))  # logical weights
    # stored bytes: layer 1's fp8 values 1 byte a weight (+ scales), int8 w_down 1 byte + scales
    plain = param_specs(preset("tiny"))["layers"][1]
    n = {k: int(np.prod(plain[k].shape)) for k in ("w_qkv", "wo", "w_gate_up", "w_down")}
    scales = sum(4 * int(np.prod(a.shape)) for w in specs["layers"][1].values()
                 if isinstance(w, QuantizedWeight) for k, a in w.arrays.items() if k != "values")  # fmt: skip
    saved = sum(n.values()) * (4 - 1) - scales
    assert param_bytes(preset("tiny")) - param_bytes(cfg) == saved


def test_packed_4bit_values_count_one_byte_per_pair():
    cfg = preset("tiny", weight_formats=[("layers.1.w_down", "q4_1")])
    f, e = cfg.intermediate_size, cfg.hidden_size
    qw = param_specs(cfg)["layers"][1]["w_down"]
    assert qw.arrays["values"].shape == (f // 2, e)
    stored = f * e // 2 + 2 * 2 * (f // 32) * e  # nibbles + float16 d and m per 32 inputs
    assert param_bytes(preset("tiny")) - param_bytes(cfg) == 4 * f * e - stored


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (("layers.*", "fp3"), r"\[0\]: pattern 'layers.\*' names format 'fp3', unknown; known: "
                              r"\[.*'fp8_static'"),
        (("layers.*.w_up", "int8"), r"pattern 'layers.\*.w_up' matches no linear weight of the "
                                    r"model \(they are layers.\{0..1\}.\{w_down, w_gate_up"),
        (("layers.7.*", "int8"), r"pattern 'layers.7.\*' matches no linear weight"),
        (("embed", "int8"), r"pattern 'embed' names only weights that always stay plain"),
        (("lm_head", "int8"), r"pattern 'lm_head' names only .*LM head"),
        (("layers.*.mlp_norm", "int8"), r"layers.0.mlp_norm, layers.1.mlp_norm: the embedding"),
        (("layers.0.*",), r"must be a \(pattern, format or None\) pair"),
    ],
)  # fmt: skip
def test_a_recipe_entry_the_model_cannot_take_is_refused_naming_the_pattern(entry, message):
    with pytest.raises(ValueError, match=r"ModelConfig.weight_formats.*" + message):
        param_specs(preset("tiny", weight_formats=[entry]))  # (patterns: checked by the specs)


def test_quantize_returns_the_recipes_config_and_refuses_what_it_cannot_do(tiny):
    cfg, params = tiny
    qcfg, qparams = quantize(cfg, params, "int8", {"layers.1.*": "none"})
    assert qcfg.weight_format == "int8" and qcfg.weight_formats == (("layers.1.*", None),)
    assert isinstance(qparams["layers"][0]["wo"], QuantizedWeight)
    assert not isinstance(qparams["layers"][1]["wo"], QuantizedWeight)
    with pytest.raises(ValueError, match=r"quantize takes a plain model"):
        quantize(qcfg, qparams)
    with pytest.raises(ValueError, match=r"weights='fp3' is unknown; known: \[.*'int8'"):
        quantize(cfg, params, "fp3")
    with pytest.raises(ValueError, match=r"recipe.layers.0.wo='int3' is unknown: a format is one"):
        quantize(cfg, params, recipe={"layers.0.wo": "int3"})
    with pytest.raises(ValueError, match=r"fp8_static weights need calibration token batches"):
        quantize(cfg, params, "fp8_static")


# -- numerics against the fp32 model -------------------------------------------------------------

# max |logits - fp32 logits| / max |fp32 logits| on the random tiny model: the largest of 20
# seeds' tokens was 0.11 (fp8_block), 0.019 (int8), 0.22 (q4_1), 0.09 (fp8_static, calibrated
# on 512 other tokens; on 64 an unseen attention output clipped to 0.38): bounds ~1.6x that
LOGIT_BOUNDS = {"fp8_block": 0.18, "int8": 0.03, "q4_1": 0.35, "fp8_static": 0.15}


@pytest.mark.parametrize("name", sorted(LOGIT_BOUNDS))
def test_quantized_logits_stay_within_the_formats_bound_of_the_fp32_model(tiny, name, fresh_seed):
    cfg, params = tiny
    rng = np.random.default_rng(fresh_seed)
    tokens = rng.integers(0, cfg.vocab_size, (2, 16))
    calibration = [rng.integers(0, cfg.vocab_size, (32, 16))] if name == "fp8_static" else None
    qcfg, qparams = quantize(cfg, params, name, calibration=calibration)
    assert formats_of(qcfg)[1]["w_qkv"] == name
    want = np.asarray(_forward(cfg)(params, tokens))
    got = np.asarray(_forward(qcfg)(qparams, tokens))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err <= LOGIT_BOUNDS[name], f"seed {fresh_seed}: {name} relative error {err:.3g}"


# -- calibration ---------------------------------------------------------------------------------


def test_calibration_sets_each_input_scale_to_its_inputs_amax_over_every_batch(tiny, fresh_seed):
    """Layer 0's w_qkv reads the embedding times the attention norm's weight (the norm's row
    scale is applied after the matmul: `deferred_rms_norm`), so its amax is known by hand; the
    largest value sits in the second batch."""
    cfg, params = tiny
    rng = np.random.default_rng(fresh_seed)
    norm = rng.uniform(0.5, 2.0, cfg.hidden_size).astype(np.float32)
    layer0 = {**params["layers"][0], "attn_norm": jnp.asarray(norm)}
    params = {**params, "layers": (layer0, *params["layers"][1:])}
    batches = [rng.integers(0, cfg.vocab_size, (2, 5)), rng.integers(0, cfg.vocab_size, (1, 7))]
    embed = np.array(params["embed"])
    embed[batches[1][0, 3]] *= 3.0  # this token's inputs are the largest
    params["embed"] = jnp.asarray(embed)
    _, qparams = quantize(cfg, params, "fp8_static", calibration=batches)
    want = max(np.abs(embed[b] * norm).max() for b in batches) / E4M3_MAX
    got = qparams["layers"][0]["w_qkv"].arrays["input_scale"]
    assert got.shape == () and got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), want, rtol=1e-6, err_msg=f"seed {fresh_seed}")
    for i, name in [(0, "wo"), (0, "w_gate_up"), (0, "w_down"), (1, "w_qkv")]:  # their own
        scale = float(qparams["layers"][i][name].arrays["input_scale"])
        assert 0 < scale != 1.0 and scale != float(got), (i, name, f"seed {fresh_seed}")
    # past the calibrated range the activations clip at 448 x input_scale
    qw = qparams["layers"][0]["w_qkv"]
    x = jnp.zeros((1, cfg.hidden_size)).at[0, 0].set(10 * E4M3_MAX * float(got))
    y = qw.format.matmul(x, qw)
    clipped = E4M3_MAX * float(got) * qw.format.dequantize(qw)[0]
    np.testing.assert_allclose(np.asarray(y[0]), np.asarray(clipped), rtol=1e-5, atol=1e-6)


# -- engine.quant ---------------------------------------------------------------------------------


def test_engine_quant_values_are_refused_naming_their_key():
    with pytest.raises(ValueError, match=r"engine.quant.weights='fp3' is invalid: must be one of "
                                         r"none, gguf, .*fp8_block"):  # fmt: skip
        EngineConfig(quant={"weights": "fp3"})
    with pytest.raises(ValueError, match=r"engine.quant.recipe.layers.0.wo='int3' is unknown"):
        EngineConfig(quant={"recipe": {"layers.0.wo": "int3"}})
    with pytest.raises(ValueError, match=r"engine.quant.recipes is unknown: the keys are "
                                         r"calibration, recipe, weights"):  # fmt: skip
        EngineConfig(quant={"recipes": {}})
    with pytest.raises(ValueError, match=r"engine.quant.calibration.seq_len=0 is invalid"):
        EngineConfig(quant={"calibration": {"seq_len": 0}})
    with pytest.raises(ValueError, match=r"engine.num_pages='many' is invalid"):
        EngineConfig(num_pages="many")
    with pytest.raises(ValueError, match=r"engine.quant.recipe \(engine.model='preset:tiny'\): "
                                         r"pattern 'lm_head' names only weights"):  # fmt: skip
        load_model("preset:tiny", quant=QuantConfig("int8", {"lm_head": "int8"}))
    with pytest.raises(ValueError, match=r"engine.quant.weights=gguf takes each weight's format "
                                         r"from a GGUF file; engine.model='preset:tiny'"):  # fmt: skip
        load_model("preset:tiny", quant=QuantConfig("gguf"))


def test_run_config_takes_engine_quant_from_yaml_and_dotted_overrides(tmp_path):
    from jaxinfer.experiment.run import load_run_config

    file = tmp_path / "run.yaml"
    file.write_text("engine:\n  num_pages: auto\n  memory_budget_gb: 2\n  quant:\n"
                    "    weights: fp8_block\n    recipe:\n      'layers.0.*': none\n")  # fmt: skip
    rc = load_run_config(file, ["engine.quant.recipe.layers.*.w_down=int8"])
    assert rc.engine.num_pages == "auto" and rc.engine.memory_budget_gb == 2.0
    assert rc.engine.quant.weights == "fp8_block"
    assert rc.engine.quant.recipe == {"layers.0.*": None, "layers.*.w_down": "int8"}
    with pytest.raises(ValueError, match=r"engine.quant.weights='int3' is invalid"):
        load_run_config(file, ["engine.quant.weights=int3"])


def test_engine_quantizes_the_model_it_is_given_and_serves_the_fp32_models_tokens():
    """EngineConfig.quant on the shipped (trained) tiny model: the engine quantizes the plain
    params it is given, and greedy decoding keeps the fp32 model's tokens (fp8 activations and
    weights, int8 w_down; layer 0 plain)."""
    seed = 3
    config = EngineConfig(
        model="tiny", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, page_size=8,
        num_pages="auto", memory_budget_gb=0.02, decode_steps=1,
        quant={"weights": "fp8_block", "recipe": {"layers.0.*": "none", "layers.*.w_down": "int8"}},
    )  # fmt: skip
    cfg, params, tokenizer = load_model(config.model, config.dtype)
    engine = Engine(config, cfg, params, tokenizer)
    qcfg = engine.model_config
    assert [f["w_qkv"] for f in formats_of(qcfg)] == [None, "fp8_block", "fp8_block", "fp8_block"]
    assert formats_of(qcfg)[2]["w_down"] == "int8"
    assert isinstance(engine.runner.params["layers"][3]["wo"], QuantizedWeight)
    # num_pages: auto sized the pool from the budget; the quantized model's params leave more
    budget = int(0.02e9)
    assert engine.config.num_pages == pages_in_budget(config, qcfg, budget)
    assert engine.config.num_pages > pages_in_budget(config, cfg, budget)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 12, 20)]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
    engine.run()
    # each token the engine sampled is the fp32 model's argmax after the same context (one
    # forward over the right-padded sequences: causal, so the padding changes nothing before it)
    rows = [p + s.output_token_ids for p, s in zip(prompts, seqs, strict=True)]
    tokens = np.array([r + [0] * (max(map(len, rows)) - len(r)) for r in rows])
    argmax = np.asarray(jnp.argmax(_forward(cfg)(params, tokens), axis=-1))
    agree = [argmax[i, len(p) - 1 : len(p) + 7] == seqs[i].output_token_ids
             for i, p in enumerate(prompts)]  # fmt: skip
    assert np.mean(agree) >= 0.9, f"seed {seed}: {np.mean(agree):.0%} of tokens agree"


def test_auto_pages_give_a_quantized_model_more_pages_and_need_a_budget_on_cpu():
    config = EngineConfig(model="preset:llama3-8b", num_pages="auto", dtype="bfloat16")
    bf16 = preset("llama3-8b", param_dtype="bfloat16", dtype="bfloat16")
    fp8 = bf16.replace(weight_format="fp8_block")
    budget = 40 * 10**9
    pages = {name: pages_in_budget(config, c, budget) for name, c in (("bf16", bf16), ("fp8", fp8))}
    # (params 16.1 GB bf16, 9.1 GB fp8: 7 GB more for pages of 2 MiB each)
    assert pages["fp8"] - pages["bf16"] == pytest.approx(
        (param_bytes(bf16) - param_bytes(fp8)) / (32 * 2 * 16 * 8 * 128 * 2), abs=1
    )
    assert pages["bf16"] > 2
    with pytest.raises(ValueError, match=r"fewer than 2 KV pages .* raise engine.memory_budget_gb"):
        pages_in_budget(config, bf16, 10 * 10**9)
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(ValueError, match=r"num_pages=auto needs engine.memory_budget_gb"):
            pages_in_budget(config, bf16)


def test_a_budget_past_the_devices_allocator_is_refused_by_name(monkeypatch):
    """A budget the allocator cannot hold fails at configuration, not at the first decode."""

    class Gpu:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 107 * 10**9}

    monkeypatch.setattr(jax, "devices", lambda *a: [Gpu()])
    config = EngineConfig(model="preset:llama3-8b", num_pages="auto", dtype="bfloat16",
                          memory_budget_gb=120)  # fmt: skip
    bf16 = preset("llama3-8b", param_dtype="bfloat16", dtype="bfloat16")
    with pytest.raises(ValueError, match=r"memory_budget_gb=120 is more than the gpu device's "
                                         r"allocator holds \(107 GB.*XLA_PYTHON_CLIENT_MEM"):  # fmt: skip
        pages_in_budget(config, bf16)
    within = pages_in_budget(dataclasses.replace(config, memory_budget_gb=100), bf16)
    default = pages_in_budget(dataclasses.replace(config, memory_budget_gb=None), bf16)
    assert default < within  # (no budget: 0.9 x the limit, 96.3 GB)


# -- checkpoints ---------------------------------------------------------------------------------


def test_mixed_format_params_save_and_restore_with_orbax(tmp_path, fresh_seed):
    cfg = preset("tiny", num_layers=1)
    params = random_params(cfg, fresh_seed)
    qcfg = cfg.replace(weight_format="q4_1",
                       weight_formats=(("layers.0.wo", "fp8_static"), ("layers.0.w_down", None)))  # fmt: skip
    qparams = quantize_params(qcfg, params)
    wo = qparams["layers"][0]["wo"]
    qparams["layers"][0]["wo"] = wo.replace(arrays={**wo.arrays, "input_scale": jnp.float32(0.02)})
    save_params(tmp_path / "ck", qcfg, qparams)
    cfg2, params2 = restore_params(tmp_path / "ck")
    assert cfg2 == qcfg and jax.tree.structure(params2) == jax.tree.structure(qparams)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(qparams), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"seed {fresh_seed}")


def _gguf_file(path, types: dict[tuple[int, str], str], seed: int) -> None:
    """A 2-layer llama GGUF file of random weights (test_gguf's writer), tensor (layer, kind)
    stored as GGML type `types[...]` (else F32)."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("torch")  # (test_gguf's module needs it)
    from test_gguf import write_gguf

    e, f, heads, kv, d, vocab = 64, 128, 4, 2, 16, 256
    rng = np.random.default_rng(seed)
    shapes = dict(attn_q=(heads * d, e), attn_k=(kv * d, e), attn_v=(kv * d, e),
                  attn_output=(e, heads * d), ffn_gate=(f, e), ffn_up=(f, e), ffn_down=(e, f))  # fmt: skip
    q = gguf.GGMLQuantizationType
    tensors = {"token_embd.weight": (rng.standard_normal((vocab, e)).astype(np.float32), q.F32),
               "output_norm.weight": (np.ones(e, np.float32), q.F32)}  # fmt: skip
    for i in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = (rng.uniform(0.5, 1.5, e).astype(np.float32), q.F32)
        for kind, shape in shapes.items():
            x = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
            tensors[f"blk.{i}.{kind}.weight"] = (x, q[types.get((i, kind), "F32")])
    meta = {"llama.context_length": 128, "llama.embedding_length": e, "llama.block_count": 2,
            "llama.feed_forward_length": f, "llama.attention.head_count": heads,
            "llama.attention.head_count_kv": kv, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.rope.freq_base": 10000.0, "llama.vocab_size": vocab,
            "llama.rope.dimension_count": d}  # fmt: skip
    write_gguf(path, "llama", meta, tensors)


@pytest.mark.filterwarnings("ignore:.*tokenizer")  # (the file has no vocabulary)
def test_gguf_blocks_load_as_stored_and_dequantize_to_the_dequantizing_loaders_weights(
    tmp_path, fresh_seed
):
    """Layer 0 all Q4_1 but a Q8_0 ffn_down; layer 1's attn_v Q8_0 among Q4_1 q and k (its
    fused w_qkv has no one format), the rest of layer 1 F32."""
    path = tmp_path / "m.gguf"
    q41 = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")
    types = {**{(0, k): "Q4_1" for k in q41}, (0, "ffn_down"): "Q8_0",
             (1, "attn_q"): "Q4_1", (1, "attn_k"): "Q4_1", (1, "attn_v"): "Q8_0"}  # fmt: skip
    _gguf_file(path, types, fresh_seed)
    plain_cfg, plain, _ = load_model(str(path))
    cfg, params, _ = load_model(str(path), quant=QuantConfig("gguf"))
    assert formats_of(cfg) == [
        dict(attn_norm=None, w_qkv="q4_1", wo="q4_1", mlp_norm=None, w_gate_up="q4_1",
             w_down="q8_0"),
        dict(attn_norm=None, w_qkv=None, wo=None, mlp_norm=None, w_gate_up=None, w_down=None),
    ]  # fmt: skip
    assert cfg.plain() == plain_cfg
    for i, layer in enumerate(params["layers"]):
        for key, w in layer.items():
            want = np.asarray(plain["layers"][i][key])
            got = np.asarray(w.format.dequantize(w)) if isinstance(w, QuantizedWeight) else w
            np.testing.assert_array_equal(got, want, err_msg=f"seed {fresh_seed}: {i}.{key}")
    # asked for q4_1: Q4_1 blocks as stored, the Q8_0 w_down requantized to q4_1
    _, params2, _ = load_model(str(path), quant=QuantConfig("q4_1"))
    w_qkv = params2["layers"][0]["w_qkv"]
    for part in ("values", "d", "m"):
        np.testing.assert_array_equal(w_qkv.arrays[part], params["layers"][0]["w_qkv"].arrays[part])
    assert params2["layers"][0]["w_down"].format is WEIGHT_FORMATS["q4_1"]
