"""One linear op for every matmul, taking a plain weight or a weight pytree (`jaxinfer.quant`).

The test-only format `test_channel_scaled` (values times a per-output-channel scale,
`spine_parts.ChannelScaled`) stores w / s and s: a model that ignored the scales, applied them on
an input axis, or skipped `layers.linear` anywhere would compute something else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spine_parts

from jaxinfer.checkpoint import restore_params, save_params
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import SamplingParams
from jaxinfer.models.dense import forward
from jaxinfer.models.layers import linear
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import ParamSpec, init_params, is_spec, param_bytes, param_specs
from jaxinfer.quant import QuantizedWeight
from jaxinfer.quant.transform import quantize_params

FORMAT = spine_parts.CHANNEL_SCALED.name
# configs name the format, so it is registered while this module's tests run (and only then)
pytestmark = pytest.mark.usefixtures("channel_scaled_format")


@pytest.mark.parametrize("in_dims", [1, 2])
def test_linear_with_a_formatted_weight_equals_the_plain_product(in_dims):
    seed = 11 + in_dims
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((3, 5, *[4] * in_dims)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((*[4] * in_dims, 6, 2)) * rng.uniform(0.1, 9, (6, 2)))
    qw = QuantizedWeight(spine_parts.CHANNEL_SCALED.quantize(w, in_dims), spine_parts.CHANNEL_SCALED,
                         in_dims)  # fmt: skip
    assert not np.allclose(qw.arrays["values"], w), f"seed {seed}: the format stored w itself"
    want = np.tensordot(np.asarray(x), np.asarray(w), in_dims)
    np.testing.assert_allclose(linear(x, w, in_dims), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(linear(x, qw, in_dims), want, rtol=1e-5, atol=1e-5,
                               err_msg=f"seed {seed}")  # fmt: skip
    np.testing.assert_allclose(qw.format.dequantize(qw), w, rtol=1e-6, atol=1e-6)


def test_spec_tree_describes_each_array_of_a_formatted_weight():
    cfg = preset("tiny", weight_format=FORMAT)
    layer = param_specs(cfg)["layers"][0]
    qkv = layer["w_qkv"]
    assert isinstance(qkv, QuantizedWeight) and qkv.format.name == FORMAT and qkv.in_dims == 1
    plain = param_specs(cfg.replace(weight_format=None))["layers"][0]["w_qkv"]
    assert qkv.arrays["values"].shape == plain.shape and qkv.arrays["values"].axes == plain.axes
    assert qkv.arrays["scales"] == ParamSpec(plain.shape[1:], jnp.float32, plain.axes[1:],
                                             "normal", plain.scale)  # fmt: skip
    assert layer["wo"].arrays["scales"].axes == ("embed",)  # wo's input is (heads, head_dim)
    assert is_spec(layer["attn_norm"]) and is_spec(param_specs(cfg)["lm_head"])  # not linear/layers
    params = init_params(cfg, jax.random.key(0))
    got = params["layers"][1]["w_gate_up"]
    assert isinstance(got, QuantizedWeight)
    assert got.arrays["scales"].shape == (2, cfg.intermediate_size)
    # stored bytes count every array: the scales add to the plain model's
    extra = sum(4 * np.prod(s.shape) for layer in param_specs(cfg)["layers"]
                for w in layer.values() if isinstance(w, QuantizedWeight)
                for s in [w.arrays["scales"]])  # fmt: skip
    assert param_bytes(cfg) == param_bytes(cfg.replace(weight_format=None)) + extra


def test_formatted_model_runs_through_the_engine_with_the_plain_models_tokens():
    seed = 5
    plain_cfg = preset("tiny")
    cfg = plain_cfg.replace(weight_format=FORMAT)
    plain = init_params(plain_cfg, jax.random.key(seed))
    # uneven output channels, so that scales matter
    rng = np.random.default_rng(seed)
    plain["layers"] = tuple(
        {k: (v * rng.uniform(0.2, 5.0, v.shape[1:]).astype(np.float32) if k.startswith("w") else v)
         for k, v in layer.items()} for layer in plain["layers"]
    )  # fmt: skip
    params = quantize_params(cfg, plain)
    assert isinstance(params["layers"][0]["wo"], QuantizedWeight)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)))
    np.testing.assert_allclose(forward(params, cfg, tokens), forward(plain, plain_cfg, tokens),
                               rtol=2e-4, atol=2e-4, err_msg=f"seed {seed}")  # fmt: skip
    ignored = jax.tree.map(lambda x: x, params)  # a model that skipped the scales
    for layer in ignored["layers"]:
        for k, w in layer.items():
            if isinstance(w, QuantizedWeight):
                layer[k] = w.arrays["values"]
    assert not np.allclose(forward(ignored, plain_cfg, tokens), forward(plain, plain_cfg, tokens),
                           atol=1e-2)  # fmt: skip

    small = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=48, page_size=8,
                 max_model_len=96, decode_steps=4)  # fmt: skip
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 17, 40)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for name, (c, p) in {"plain": (plain_cfg, plain), "formatted": (cfg, params)}.items():
        engine = Engine(EngineConfig(model="preset:tiny", **small), c, p)
        engine.warmup()
        seqs = [engine.add_request(q, sp) for q in prompts]
        engine.run()
        assert engine.compiles_after_warmup == 0, name
        outs[name] = [s.output_token_ids for s in seqs]
    assert outs["formatted"] == outs["plain"], f"seed {seed}"


def test_formatted_params_save_and_restore_with_orbax(tmp_path):
    cfg = preset("tiny", weight_format=FORMAT)
    params = init_params(cfg, jax.random.key(3))
    save_params(tmp_path / "ck", cfg, params)
    cfg2, params2 = restore_params(tmp_path / "ck")
    assert cfg2 == cfg and jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hf_checkpoint_loads_into_a_formatted_model(tmp_path):
    """Loading a checkpoint for a config with a weight format quantizes its weights on the
    device: the same logits as the plain load."""
    from jaxinfer.checkpoint import load_hf_params, save_hf_model

    plain_cfg = preset("tiny")
    params = init_params(plain_cfg, jax.random.key(4))
    save_hf_model(tmp_path / "m", plain_cfg, params, dtype="float32")
    cfg = plain_cfg.replace(weight_format=FORMAT)
    loaded = load_hf_params(tmp_path / "m", cfg)
    assert isinstance(loaded["layers"][1]["w_down"], QuantizedWeight)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (1, 7)))
    np.testing.assert_allclose(forward(loaded, cfg, tokens), forward(params, plain_cfg, tokens),
                               rtol=2e-4, atol=2e-4, err_msg="seed 4")  # fmt: skip


def test_unknown_weight_format_is_refused_by_name():
    with pytest.raises(ValueError, match=r"weight_format='fp3'.*test_channel_scaled"):
        preset("tiny", weight_format="fp3")
