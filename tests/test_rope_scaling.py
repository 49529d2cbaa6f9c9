"""RoPE scalings (linear, dynamic NTK, YaRN, LongRoPE, Llama 3.1) against `transformers`.

Tiny random transformers models are saved locally and loaded by jaxinfer; logits (fp32) must match
on prompts longer than the original context, where the scalings change the rotations. Dynamic NTK
and LongRoPE are static here (transformers picks per forward): they match transformers at the
lengths where the two rules agree, and the static formula at the others. Also: the exports
(`config_to_hf`, orbax's config) round-trip each type, bad configs are refused by key and value,
and Qwen2's `max_window_layers` split matches transformers past the window.
"""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from jaxinfer.checkpoint import (  # noqa: E402
    CheckpointError,
    UnsupportedModelError,
    config_from_hf,
    config_to_hf,
    load_hf_model,
)
from jaxinfer.checkpoint.orbax_io import config_from_dict, config_to_dict  # noqa: E402
from jaxinfer.models.config import (  # noqa: E402
    DynamicRopeScaling,
    LinearRopeScaling,
    Llama3RopeScaling,
    LongRopeScaling,
    ModelConfig,
    YarnRopeScaling,
)
from jaxinfer.models.dense import forward  # noqa: E402
from jaxinfer.models.layers import rope_attention_factor, rope_inv_freq  # noqa: E402

transformers.logging.set_verbosity_error()  # (its rope validation warns about tiny contexts)

TOL = 1e-5  # (max abs logits; they are O(1). Seen: 1e-6 to 2e-6)
HEAD_DIM = 16
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD_DIM,
    rms_norm_eps=1e-6,
)
_rng = np.random.default_rng(7)
SHORT, LONG = _rng.uniform(1.0, 2.0, HEAD_DIM // 2), _rng.uniform(2.0, 24.0, HEAD_DIM // 2)

# name -> (config class, config kwargs, prompt length). Every original context is 16 or 32
# positions and every prompt 2-4 times longer (one length: eager ops compile once per shape).
MODELS = {
    "linear": (
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
        64,
    ),
    # theta 20 puts YaRN's ramp (beta_slow = 1 rotation over 32 positions) at dimensions 0-5 of 8:
    # kept, blended and interpolated frequencies all occur. Qwen2.5's own spelling of the keys.
    "yarn-qwen2": (
        "Qwen2Config",
        dict(
            rope_parameters=dict(
                rope_type="yarn", factor=3.0, original_max_position_embeddings=32, rope_theta=20.0
            ),
            max_position_embeddings=96,
        ),
        64,
    ),
    "yarn-qwen3-attention-factor": (
        "Qwen3Config",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=16,
                attention_factor=1.3,
                rope_theta=50.0,
            ),
            max_position_embeddings=64,
        ),
        64,
    ),
    # DeepSeek-style: mscale ratio for the attention factor, own betas, no truncation, and a
    # top-level original context, which transformers prefers to the dict's (its saved config.json
    # has it in both; the precedence itself is in `test_inv_freq_and_attention_factor_...`).
    "yarn-mscale-llama": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                factor=5.0,
                original_max_position_embeddings=64,
                beta_fast=8.0,
                beta_slow=0.5,
                mscale=0.8,
                mscale_all_dim=0.3,
                truncate=False,
                rope_theta=50.0,
            ),
            original_max_position_embeddings=16,
            max_position_embeddings=80,
        ),
        64,
    ),
    # transformers at factor * max_position_embeddings = 64 tokens: the static base exactly.
    "dynamic": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0),
            max_position_embeddings=16,
        ),
        64,
    ),
    # Phi-3's spelling: original context at the top level, factor derived (64 / 16).
    "longrope": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="longrope",
                short_factor=SHORT.tolist(),
                long_factor=LONG.tolist(),
                rope_theta=10000.0,
            ),
            original_max_position_embeddings=16,
            max_position_embeddings=64,
        ),
        64,
    ),
}
_built: dict[tuple, tuple] = {}


def hf_model(config_cls: str, kwargs: dict, tmp_path_factory, weights_of=None):
    """(path, model) of a tiny fp32 model, its weights perturbed (`weights_of`'s, when given)."""
    key = (config_cls, json.dumps(kwargs, sort_keys=True), weights_of is not None)
    if key not in _built:
        cfg = getattr(transformers, config_cls)(**{**TINY, **kwargs})
        torch.manual_seed(len(_built))
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        with torch.no_grad():
            if weights_of is not None:
                model.load_state_dict(weights_of.state_dict())
            else:
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        model = model.float().eval()
        path = tmp_path_factory.mktemp(config_cls)
        model.save_pretrained(path)
        _built[key] = path, model
    return _built[key]


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def ours_and_theirs(name, tmp_path_factory, length, seed):
    config_cls, kwargs, _ = MODELS[name]
    path, model = hf_model(config_cls, kwargs, tmp_path_factory)
    cfg, params = load_hf_model(path, dtype="float32")
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, length))
    ours = np.asarray(forward(params, cfg, jnp.asarray(tokens)))
    return cfg, params, model, tokens, ours, hf_logits(model, tokens)


# --- logits against transformers ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_transformers_past_the_original_context(name, tmp_path_factory, fresh_seed):
    length = MODELS[name][2]
    cfg, params, _, tokens, ours, theirs = ours_and_theirs(
        name, tmp_path_factory, length, fresh_seed
    )
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == name.split("-")[0]
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0, err_msg=name)
    # the scaling matters at this length: plain RoPE would not have passed
    plain = np.asarray(forward(params, cfg.replace(rope_scaling=None), jnp.asarray(tokens)))
    assert np.abs(plain - theirs).max() > 100 * TOL, name


def test_dynamic_ntk_is_static_shorter_prompts_get_the_long_context_base(
    tmp_path_factory, fresh_seed
):
    """Known divergence: transformers keeps the plain base while a batch fits
    max_position_embeddings; ours is the base for factor * max_position_embeddings tokens at every
    length, i.e. transformers' plain RoPE with theta * (f^2 - f + 1)^(d / (d - 2))."""
    config_cls, kwargs, _ = MODELS["dynamic"]
    _, model = hf_model(config_cls, kwargs, tmp_path_factory)
    rp = kwargs["rope_parameters"]
    f, d = rp["factor"], HEAD_DIM
    theta = rp["rope_theta"] * (f * f - (f - 1)) ** (d / (d - 2))
    plain_kwargs = {**kwargs, "rope_parameters": dict(rope_type="default", rope_theta=theta)}
    _, static = hf_model(config_cls, plain_kwargs, tmp_path_factory, weights_of=model)

    cfg, _, _, tokens, ours, theirs = ours_and_theirs("dynamic", tmp_path_factory, 12, fresh_seed)
    assert tokens.shape[1] < cfg.max_position_embeddings
    np.testing.assert_allclose(ours, hf_logits(static, tokens), atol=TOL, rtol=0)
    assert np.abs(ours - theirs).max() > 100 * TOL  # transformers: the plain base at 12 tokens


def test_longrope_is_static_prompts_within_the_original_context_get_the_long_factors(
    tmp_path_factory, fresh_seed
):
    """Known divergence: transformers uses `short_factor` while a batch fits the original
    context; ours uses `long_factor` whenever max_position_embeddings exceeds that context, i.e.
    transformers' LongRoPE with long factors in place of the short ones."""
    config_cls, kwargs, _ = MODELS["longrope"]
    _, model = hf_model(config_cls, kwargs, tmp_path_factory)
    long_kwargs = {**kwargs, "rope_parameters": {**kwargs["rope_parameters"]}}
    long_kwargs["rope_parameters"]["short_factor"] = LONG.tolist()
    _, always_long = hf_model(config_cls, long_kwargs, tmp_path_factory, weights_of=model)

    cfg, _, _, tokens, ours, theirs = ours_and_theirs("longrope", tmp_path_factory, 12, fresh_seed)
    assert tokens.shape[1] <= cfg.rope_scaling.original_max_position_embeddings
    np.testing.assert_allclose(ours, hf_logits(always_long, tokens), atol=TOL, rtol=0)
    assert np.abs(ours - theirs).max() > 100 * TOL  # transformers: the short factors


def test_qwen2_max_window_layers_split_matches_transformers_past_the_window(
    tmp_path_factory, fresh_seed
):
    """use_sliding_window + max_window_layers (no `layer_types` in the file): layer 0 full,
    layer 1 sliding, on a prompt 3 times the window."""
    kwargs = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    path, model = hf_model("Qwen2Config", kwargs, tmp_path_factory)
    hf = json.loads((path / "config.json").read_text())
    hf.pop("layer_types", None)  # what transformers derives them from, as in older configs
    (path / "config.json").write_text(json.dumps(hf))
    assert model.config.layer_types == ["full_attention", "sliding_attention"]

    cfg, params = load_hf_model(path, dtype="float32")
    assert cfg.layer_types == ("full_attention", "sliding_attention")
    tokens = np.random.default_rng(fresh_seed).integers(0, cfg.vocab_size, (2, 12))
    ours = np.asarray(forward(params, cfg, jnp.asarray(tokens)))
    theirs = hf_logits(model, tokens)
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    for uniform in ("full_attention", "sliding_attention"):  # each layer's type matters
        other = forward(params, cfg.replace(layer_types=(uniform,) * 2), jnp.asarray(tokens))
        assert np.abs(np.asarray(other) - theirs).max() > 100 * TOL, uniform


# --- inverse frequencies and attention factor against transformers' init functions -------------


def _random_rope(rng: np.random.Generator, rope_type: str) -> tuple[dict, dict]:
    """(rope_parameters, other config keys) of a random config of `rope_type`."""
    orig = int(rng.choice([8, 16, 32, 4096]))
    top = dict(max_position_embeddings=orig * int(rng.choice([1, 2, 8])))
    rp = dict(rope_type=rope_type, rope_theta=float(rng.choice([20.0, 1e4, 5e5, 1e6])))
    factor = float(rng.uniform(1.0, 40.0))
    if rope_type in ("linear", "dynamic"):
        rp["factor"] = factor
    elif rope_type == "llama3":
        rp.update(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0)
    elif rope_type == "yarn":
        rp["factor"] = factor
        if rng.random() < 0.5:
            rp.update(beta_fast=float(rng.uniform(4, 64)), beta_slow=float(rng.uniform(0.1, 2)))
        if rng.random() < 0.5:
            rp.update(mscale=float(rng.uniform(0.3, 1.5)), mscale_all_dim=float(rng.random() + 0.3))
        if rng.random() < 0.3:
            rp["attention_factor"] = float(rng.uniform(0.5, 2.0))
        if rng.random() < 0.5:
            rp["truncate"] = bool(rng.random() < 0.5)
    else:  # longrope
        rp.update(short_factor=rng.uniform(1, 4, HEAD_DIM // 2).tolist(),
                  long_factor=rng.uniform(1, 40, HEAD_DIM // 2).tolist())  # fmt: skip
        if rng.random() < 0.5:
            rp["factor"] = factor
    if rope_type in ("llama3", "yarn", "longrope"):  # the original context: dict, top or both
        where = rng.integers(3)
        if where != 1:
            rp["original_max_position_embeddings"] = orig
        if where != 0:
            top["original_max_position_embeddings"] = orig // (2 if where == 2 else 1)
    return rp, top


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "longrope", "llama3"])
def test_inv_freq_and_attention_factor_equal_transformers(rope_type, fresh_seed):
    """Over random configs; transformers at the longest sequence the config admits (dynamic:
    factor * max_position_embeddings, the static rule's length)."""
    rng = np.random.default_rng(fresh_seed)
    for _ in range(20):
        rp, top = _random_rope(rng, rope_type)
        hf = {**TINY, **top, "architectures": ["LlamaForCausalLM"], "rope_parameters": rp}
        cfg = config_from_hf(json.loads(json.dumps(hf)), dtype="float32")
        theirs_cfg = transformers.LlamaConfig(
            **{k: v for k, v in hf.items() if k != "architectures"}
        )
        seq_len = cfg.max_position_embeddings
        if rope_type == "dynamic":
            seq_len = rp["factor"] * cfg.max_position_embeddings
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](theirs_cfg, seq_len=seq_len)
        np.testing.assert_allclose(rope_inv_freq(cfg), inv_freq.numpy(), rtol=2e-6, err_msg=str(hf))
        assert rope_attention_factor(cfg) == pytest.approx(attention_factor, rel=1e-12), hf


# --- exports ------------------------------------------------------------------------------------

BASE = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=HEAD_DIM, max_position_embeddings=128,
    param_dtype="float32", dtype="float32",
)  # fmt: skip
SCALINGS = {
    "linear": LinearRopeScaling(factor=2.5),
    "dynamic": DynamicRopeScaling(factor=3.0),
    "yarn": YarnRopeScaling(factor=4.0, original_max_position_embeddings=32),
    "yarn-full": YarnRopeScaling(
        8.0,
        16,
        beta_fast=16.0,
        beta_slow=2.0,
        mscale=0.7,
        mscale_all_dim=0.9,
        attention_factor=1.2,
        truncate=False,
    ),
    "longrope": LongRopeScaling(tuple(SHORT), tuple(LONG), 32, factor=4.0),
    "longrope-attention": LongRopeScaling(tuple(SHORT), tuple(LONG), 32, 4.0, attention_factor=1.1),
    "llama3": Llama3RopeScaling(8.0, 1.0, 4.0, 32),
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_exports_round_trip_and_transformers_reads_the_same_rope(name):
    """config_to_hf (v4 and v5 spellings each) and orbax's config dict read back to the config;
    transformers computes our inverse frequencies and attention factor from the HF config."""
    cfg = ModelConfig(**BASE, rope_theta=10000.0, rope_scaling=SCALINGS[name])
    hf = json.loads(json.dumps(config_to_hf(cfg, dtype="float32")))  # (checks it reads back)
    v4 = {k: v for k, v in hf.items() if k != "rope_parameters"}
    v5 = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}
    theirs = []
    for variant in (v4, v5):
        assert config_from_hf(variant, dtype="float32") == cfg, name
        kwargs = {k: v for k, v in variant.items() if k not in ("architectures", "model_type")}
        theirs.append(transformers.LlamaConfig(**kwargs))
    assert theirs[0].rope_parameters == theirs[1].rope_parameters
    rope_type = cfg.rope_scaling.rope_type
    seq_len = 3.0 * cfg.max_position_embeddings if rope_type == "dynamic" else None
    if rope_type == "longrope":
        seq_len = cfg.max_position_embeddings
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](theirs[1], seq_len=seq_len)
    np.testing.assert_allclose(rope_inv_freq(cfg), inv_freq.numpy(), rtol=2e-6)
    assert rope_attention_factor(cfg) == pytest.approx(attention_factor, rel=1e-12)

    saved = json.loads(json.dumps(config_to_dict(cfg)))
    assert saved["rope_scaling"].get("rope_type", "llama3") == rope_type
    assert config_from_dict(saved) == cfg


def test_plain_rope_traces_no_attention_factor():
    """The default step is unchanged: an attention factor of 1 adds no multiply to cos."""
    import jax

    from jaxinfer.models.layers import apply_rope

    x, pos = jnp.ones((3, 2, HEAD_DIM)), jnp.arange(3)
    inv_freq = rope_inv_freq(ModelConfig(**BASE))
    plain = jax.make_jaxpr(lambda x, p: apply_rope(x, p, inv_freq))(x, pos)
    scaled = jax.make_jaxpr(lambda x, p: apply_rope(x, p, inv_freq, 1.5))(x, pos)
    count = lambda jaxpr: sum(e.primitive.name == "mul" for e in jaxpr.jaxpr.eqns)  # noqa: E731
    assert count(scaled) == count(plain) + 1
    scaled_out, plain_out = apply_rope(x, pos, inv_freq, 1.5), apply_rope(x, pos, inv_freq)
    np.testing.assert_allclose(np.asarray(scaled_out), 1.5 * np.asarray(plain_out), rtol=1e-6)


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rope", "error", "pattern"),
    [
        ({"rope_type": "proportional"}, UnsupportedModelError, r"rope_type='proportional'.*yarn"),
        ({"type": "su", "factor": 2.0}, UnsupportedModelError, r"rope_type='su'"),
        ({"rope_type": "linear"}, CheckpointError, r"'linear' but no 'factor'"),
        ({"rope_type": "dynamic", "factor": None}, CheckpointError, r"'dynamic' but no 'factor'"),
        ({"rope_type": "yarn"}, CheckpointError, r"'yarn' but no 'factor'"),
        ({"rope_type": "linear", "factor": 0.0}, CheckpointError, r"factor must be >= 1.*0\.0"),
        ({"rope_type": "yarn", "factor": 0.5}, CheckpointError, r"factor must be >= 1.*0\.5"),
        ({"rope_type": "dynamic", "factor": "4"}, CheckpointError, r"factor must be a number.*'4'"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
         CheckpointError, r"original_max_position_embeddings must be a positive int, got 0"),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0},
         CheckpointError, r"attention_factor must be >= 0.*-1\.0"),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, CheckpointError, r"truncate"),
        ({"rope_type": "longrope", "long_factor": [1.0] * 8}, CheckpointError,
         r"'longrope' but no 'short_factor'"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7},
         CheckpointError, r"long_factor has 7 entries, head_dim 16 needs 8"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 7 + [0.0], "long_factor": [1.0] * 8},
         CheckpointError, r"short_factor must be a list of positive numbers"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, CheckpointError,
         r"'llama3' but no 'high_freq_factor'"),
    ],
)  # fmt: skip
def test_bad_rope_configs_are_refused_naming_key_value_and_file(rope, error, pattern):
    hf = {**TINY, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 64}
    for spelling in ({"rope_parameters": rope}, {"rope_scaling": rope}):
        key = next(iter(spelling))
        with pytest.raises(error, match=rf"some/config\.json: {key}.*{pattern}"):
            config_from_hf({**hf, **spelling}, source="some/config.json")


def test_orbax_config_refuses_an_unknown_rope_type():
    data = config_to_dict(ModelConfig(**BASE, rope_scaling=LinearRopeScaling(2.0)))
    data["rope_scaling"]["rope_type"] = "ntk-by-parts"
    with pytest.raises(CheckpointError, match=r"m\.json: rope_scaling.rope_type='ntk-by-parts'"):
        config_from_dict(data, source="m.json")
    with pytest.raises(CheckpointError, match=r"m\.json: bad rope_scaling.*factor"):
        config_from_dict({**data, "rope_scaling": {"rope_type": "linear"}}, source="m.json")


def test_yarn_null_factor_is_the_context_ratio_as_in_transformers():
    """DeepSeek-V3 and Phi-3 leave `factor` null: max_position_embeddings / original."""
    hf = {**TINY, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 96}
    rope = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 24}
    cfg = config_from_hf({**hf, "rope_parameters": rope})
    assert cfg.rope_scaling.factor == 4.0
    assert rope_attention_factor(cfg) == pytest.approx(0.1 * math.log(4.0) + 1)


@pytest.mark.parametrize(
    ("scaling", "max_pos", "context"),
    [
        (None, 64, 64),
        (LinearRopeScaling(factor=4.0), 64, 256),
        (DynamicRopeScaling(factor=2.0), 64, 128),
        (YarnRopeScaling(factor=4.0, original_max_position_embeddings=32), 64, 128),
        (YarnRopeScaling(factor=2.0, original_max_position_embeddings=16), 64, 64),
        (Llama3RopeScaling(factor=8.0, original_max_position_embeddings=16), 64, 64),
    ],
)
def test_stretched_context_is_what_the_engine_and_generate_admit(scaling, max_pos, context):
    """vLLM's rule: linear/dynamic stretch max_position_embeddings by the factor, YaRN the
    original context; a sequence one token longer is refused, naming the stretched context."""
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.engine.engine import Engine
    from jaxinfer.generate import greedy_generate

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_scaling=scaling,
                      max_position_embeddings=max_pos)  # fmt: skip
    assert cfg.max_context == context
    with pytest.raises(ValueError, match=f"exceeds the model's .*{context}") as err:
        Engine(EngineConfig(model="preset:tiny", max_model_len=context + 1), cfg, None)
    if scaling is not None and context != max_pos:
        assert f"{scaling.rope_type} RoPE scaling" in str(err.value)
    with pytest.raises(ValueError, match=f"exceeds the model's context.*{context}"):
        greedy_generate(None, cfg, [[1] * context], 1)
