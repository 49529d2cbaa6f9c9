"""Layers that differ: per-layer FFN kinds (`ModelConfig.ffn_kinds`, `FFN_BLOCKS`) and attention
types (`layer_types`), each layer's specs from its own kind, layers of one kind traced once.

The FFN kind `test_split_dense` (`spine_parts`) computes a dense SwiGLU from separate gate and up
weights: a model mixing it with dense layers equals the all-dense model whose fused weights hold
the same values, so the dispatch by kind and the per-layer specs are checked against a model the
rest of the suite checks against transformers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spine_parts

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import SamplingParams
from jaxinfer.models.dense import forward
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params, param_specs

KINDS = ("dense", "test_split_dense", "dense", "test_split_dense")
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=8,
             max_model_len=128, decode_steps=4)  # fmt: skip


@pytest.fixture(scope="module")
def models():
    dense = preset("tiny", num_layers=4)
    mixed = dense.replace(ffn_kinds=KINDS)
    params = init_params(dense, jax.random.key(7))
    split = {**params, "layers": tuple(
        spine_parts.split_layer(p) if k == "test_split_dense" else p
        for k, p in zip(KINDS, params["layers"], strict=True))}  # fmt: skip
    return dense, params, mixed, split


def test_each_layer_has_its_kinds_specs(models):
    _, _, mixed, split = models
    specs = param_specs(mixed)["layers"]
    assert "w_gate_up" in specs[0] and "w_gate_up" not in specs[1]
    assert {"w_gate", "w_up", "w_down"} <= set(specs[1])
    assert jax.tree.structure(init_params(mixed, jax.random.key(0))) == jax.tree.structure(split)


def test_mixed_ffn_kinds_compute_the_equivalent_dense_model_and_trace_each_kind_once(models):
    dense, params, mixed, split = models
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, dense.vocab_size, (2, 11)))
    want = forward(params, dense, tokens)
    spine_parts.SPLIT_DENSE_TRACES.clear()
    got = jax.jit(lambda p, t: forward(p, mixed, t))(split, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg="seed 7")
    # two layers of the kind, one trace (apply_layers' nested jit per LayerKind)
    assert len(spine_parts.SPLIT_DENSE_TRACES) == 1, spine_parts.SPLIT_DENSE_TRACES


def test_engine_serves_mixed_ffn_kinds_with_the_dense_models_tokens(models):
    dense, params, mixed, split = models
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, dense.vocab_size, n).tolist() for n in (5, 30, 2)]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = []
    for cfg, p in ((dense, params), (mixed, split)):
        engine = Engine(EngineConfig(model="preset:tiny", **SMALL), cfg, p)
        engine.warmup()
        seqs = [engine.add_request(q, sp) for q in prompts]
        engine.run()
        assert engine.compiles_after_warmup == 0
        outs.append([s.output_token_ids for s in seqs])
    assert outs[0] == outs[1], "seed 8"


def test_engine_honours_per_layer_attention_types():
    """Paged attention with a window in some layers only gives the greedy tokens of the dense
    causal forward (an independent attention implementation) with the same layer types."""
    cfg = preset("tiny", num_layers=3, sliding_window=6,
                 layer_types=("sliding_attention", "full_attention", "sliding_attention"))  # fmt: skip
    assert [cfg.layer(i).sliding_window for i in range(3)] == [6, None, 6]
    params = init_params(cfg, jax.random.key(9))
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (20, 9)]
    engine = Engine(EngineConfig(model="preset:tiny", **SMALL), cfg, params)
    engine.warmup()
    seqs = [engine.add_request(q, SamplingParams(max_tokens=8, ignore_eos=True)) for q in prompts]
    engine.run()
    # The reference: full causal forwards over a fixed padded length (later positions never
    # change earlier logits), so one compile serves every prefix.
    ref = jax.jit(lambda t: forward(params, cfg, t))
    for prompt, seq in zip(prompts, seqs, strict=True):
        tokens = list(prompt)
        for _ in range(8):
            padded = jnp.asarray([tokens + [0] * (len(prompt) + 8 - len(tokens))])
            tokens.append(int(jnp.argmax(ref(padded)[0, len(tokens) - 1])))
        assert seq.output_token_ids == tokens[len(prompt) :], "seed 9"
    # all-full or all-sliding give other logits on a 20-token prompt
    full = np.asarray(forward(params, cfg.replace(layer_types=()), jnp.asarray([prompts[0]])))
    nowin = np.asarray(forward(params, cfg.replace(layer_types=("full_attention",) * 3),
                               jnp.asarray([prompts[0]])))  # fmt: skip
    mixed = np.asarray(forward(params, cfg, jnp.asarray([prompts[0]])))
    assert np.abs(full - mixed).max() > 1e-3 and np.abs(nowin - mixed).max() > 1e-3


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(ffn_kinds=("dense",)), r"ffn_kinds has 1 entries for 2 layers"),
        (dict(ffn_kinds=("dense", "moe9")), r"ffn_kinds: \['moe9'\] unknown"),
        (dict(layer_types=("full_attention", "local")), r"layer_types: \['local'\] unknown"),
        (dict(layer_types=("sliding_attention",) * 2), r"sliding_window is None"),
    ],
)
def test_bad_layer_kinds_are_refused_by_name(overrides, match):
    with pytest.raises(ValueError, match=match):
        param_specs(preset("tiny", **overrides))  # (FFN kinds: checked by the specs)
