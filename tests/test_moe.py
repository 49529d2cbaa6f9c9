"""The MoE FFN block (`jaxinfer.models.moe`) and expert parallelism (`jaxinfer.parallel.expert`).

Whole-model parity with transformers for Mixtral, Qwen2-MoE and Qwen3-MoE is in
test_hf_parity.py. Here: DeepSeek-V3's MoE block against transformers' own module (its attention,
MLA, is not implemented, so the model is refused); the sorted, grouped dispatch against a
per-token loop; padding rows; config checks; and, on 8 fake CPU devices, expert-parallel dispatch
against one device and the engine under an expert mesh.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoint.errors import UnsupportedModelError
from jaxinfer.checkpoint.hf_config import config_from_hf
from jaxinfer.checkpoint.orbax_io import config_from_dict, config_to_dict
from jaxinfer.models.config import ModelConfig, MoeConfig
from jaxinfer.models.ffn import FfnContext
from jaxinfer.models.moe import moe_ffn, route, routed_experts
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params


def loop_reference(h, weights, experts, w_gate_up, w_down) -> np.ndarray:
    """sum_j weights[t, j] * SwiGLU_{experts[t, j]}(h[t]), token by token in float64."""
    h, weights, experts = np.float64(h), np.float64(weights), np.asarray(experts)
    w_gate_up, w_down = np.float64(w_gate_up), np.float64(w_down)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for j, x in enumerate(experts[t]):
            if x >= w_gate_up.shape[0]:  # no expert (padding)
                continue
            gate, up = np.einsum("e,esf->sf", h[t], w_gate_up[x])
            act = gate / (1 + np.exp(-gate)) * up
            out[t] += weights[t, j] * act @ w_down[x]
    return out


def _moe_layer(fresh_seed: int, **moe):
    cfg = preset("tiny-moe", moe=MoeConfig(**{"num_experts": 8, "experts_per_token": 2,
                                               "expert_size": 32, **moe}))  # fmt: skip
    params = init_params(cfg, jax.random.key(fresh_seed))["layers"][0]
    return cfg, params


@pytest.mark.parametrize("routing", ["router", "one expert", "two experts, others empty"])
def test_sorted_grouped_dispatch_equals_a_per_token_loop(fresh_seed, routing):
    cfg, p = _moe_layer(fresh_seed)
    h = jax.random.normal(jax.random.key(fresh_seed + 1), (19, cfg.hidden_size))
    weights, experts = route(cfg.moe, p, h)
    if routing == "one expert":  # every token's both choices: expert 5
        experts = jnp.full_like(experts, 5)
    elif routing == "two experts, others empty":
        experts = jnp.stack([jnp.full(19, 1), jnp.full(19, 6)], axis=1).astype(jnp.int32)
    out, sizes = routed_experts(h, weights, experts, p["w_expert_gate_up"], p["w_expert_down"])
    want = loop_reference(h, weights, experts, p["w_expert_gate_up"], p["w_expert_down"])
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-5,
                               err_msg=f"seed {fresh_seed}, {routing}")  # fmt: skip
    np.testing.assert_array_equal(sizes, np.bincount(np.asarray(experts).ravel(), minlength=8))


def test_padding_rows_route_to_no_expert(fresh_seed):
    """The engine's padding tokens cost no expert rows, count in no load, and leave the real
    tokens' outputs as they are."""
    cfg, p = _moe_layer(fresh_seed, shared_expert_size=16, shared_expert_gate=True)
    x = jax.random.normal(jax.random.key(fresh_seed + 2), (12, cfg.hidden_size))
    valid = jnp.arange(12) < 7
    out, sizes = moe_ffn(cfg, p, x, None, FfnContext(valid))
    real, real_sizes = moe_ffn(cfg, p, x[:7])
    np.testing.assert_allclose(out[:7], real, atol=1e-6, err_msg=f"seed {fresh_seed}")
    np.testing.assert_array_equal(sizes, real_sizes)
    assert int(sizes.sum()) == 7 * 2, sizes


def test_router_variants_change_the_choice_as_configured(fresh_seed):
    """Renormalised weights sum to 1 (times the scaling factor), plain softmax ones do not; the
    selection bias changes which experts are picked but never the weights' source scores."""
    cfg, p = _moe_layer(fresh_seed)
    h = jax.random.normal(jax.random.key(fresh_seed + 3), (64, cfg.hidden_size))
    w_norm, e = route(cfg.moe, p, h)
    np.testing.assert_allclose(w_norm.sum(-1), 1.0, rtol=1e-6, err_msg=f"seed {fresh_seed}")
    w_raw, e_raw = route(MoeConfig(8, 2, 32, norm_topk_prob=False), p, h)
    np.testing.assert_array_equal(e, e_raw)
    assert float(w_raw.sum(-1).max()) < 1.0
    sig = MoeConfig(8, 2, 32, scoring="sigmoid", score_bias=True, routed_scaling_factor=2.5)
    bias = {**p, "router_bias": jnp.zeros(8).at[3].set(10.0)}  # expert 3 always chosen
    w_sig, e_sig = route(sig, bias, h)
    assert bool((e_sig == 3).any(-1).all()), e_sig
    scores = jax.nn.sigmoid(h @ p["router"])
    picked = jnp.take_along_axis(scores, e_sig, 1)
    np.testing.assert_allclose(w_sig, 2.5 * picked / picked.sum(-1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_moe_block_matches_transformers_module(fresh_seed, norm_topk_prob):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hidden, width, experts, shared = 32, 16, 16, 2
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=hidden, moe_intermediate_size=width, n_routed_experts=experts,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=shared,
        routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    torch.manual_seed(fresh_seed)
    block = DeepseekV3MoE(hf_cfg).float().eval()
    with torch.no_grad():
        for t in (*block.parameters(), *block.buffers()):
            t.copy_(0.3 * torch.randn_like(t))
    moe = MoeConfig(num_experts=experts, experts_per_token=4, expert_size=width,
                    scoring="sigmoid", norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5,
                    score_bias=True, num_groups=4, topk_groups=2,
                    shared_expert_size=shared * width)  # fmt: skip
    cfg = ModelConfig(vocab_size=8, hidden_size=hidden, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, moe=moe, param_dtype="float32",
                      dtype="float32")  # fmt: skip

    def a(t):
        return jnp.asarray(t.detach().numpy())

    sh = block.shared_experts
    params = {
        "router": a(block.gate.weight).T,
        "router_bias": a(block.gate.e_score_correction_bias),
        # HF [X, 2F, E] (gate rows, then up) / [X, E, F] -> ours [X, E, 2, F] / [X, F, E]
        "w_expert_gate_up": a(block.experts.gate_up_proj)
        .reshape(experts, 2, width, hidden)
        .transpose(0, 3, 1, 2),
        "w_expert_down": a(block.experts.down_proj).transpose(0, 2, 1),
        "w_shared_gate_up": jnp.stack([a(sh.gate_proj.weight).T, a(sh.up_proj.weight).T], 1),
        "w_shared_down": a(sh.down_proj.weight).T,
    }
    x = torch.randn(1, 40, hidden, generator=torch.Generator().manual_seed(fresh_seed))
    with torch.no_grad():
        want = block(x)[0].numpy()
    got, _ = moe_ffn(cfg, params, jnp.asarray(x[0].numpy()))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5,
                               err_msg=f"seed {fresh_seed}")  # fmt: skip
    # the test sees the group limit and the bias: without either, the output differs
    for change in (dict(num_groups=1, topk_groups=1), dict(score_bias=False)):
        other = cfg.replace(moe=MoeConfig(**{**moe.__dict__, **change}))
        wrong, _ = moe_ffn(other, params, jnp.asarray(x[0].numpy()))
        assert not np.allclose(np.asarray(wrong), want, atol=1e-3), change


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(experts_per_token=9), "experts_per_token (9) exceeds num_experts (8)"),
        (dict(scoring="relu"), "scoring must be one of"),
        (dict(num_groups=3), "num_groups (3) must divide num_experts (8)"),
        (dict(num_groups=4, topk_groups=5), "topk_groups (5) exceeds num_groups (4)"),
        (dict(shared_expert_gate=True), "shared_expert_gate needs a shared expert"),
        (dict(expert_size=0), "expert_size must be a positive int"),
    ],
)
def test_moe_config_names_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=f"ModelConfig.moe: .*{re.escape(message)}"):
        preset("tiny", moe={"num_experts": 8, "experts_per_token": 2, "expert_size": 16, **fields})


def test_moe_configs_survive_the_orbax_config_file_and_ffn_kinds_need_moe():
    cfg = preset("tiny-moe", ffn_kinds=("dense", "moe"))
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
    with pytest.raises(ValueError, match="ffn_kinds has moe layers but moe is None"):
        preset("tiny", ffn_kinds=("dense", "moe"))


def test_hf_configs_of_moe_families():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    qwen2 = config_from_hf({**base, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 6,
                            "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12,
                            "decoder_sparse_step": 2, "mlp_only_layers": [3]})  # fmt: skip
    assert qwen2.ffn_kinds == ("dense", "moe", "dense", "dense")
    assert qwen2.moe == MoeConfig(6, 4, 8, norm_topk_prob=False, shared_expert_size=12,
                                  shared_expert_gate=True)  # fmt: skip
    mixtral = config_from_hf({**base, "model_type": "mixtral"})
    assert mixtral.moe == MoeConfig(8, 2, 48) and mixtral.ffn_kinds == ()
    for arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
        with pytest.raises(UnsupportedModelError, match="MLA"):
            config_from_hf({**base, "architectures": [arch]})
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        config_from_hf({**base, "architectures": ["Qwen2MoeForCausalLM"],
                        "use_sliding_window": True})  # fmt: skip


EP_SCRIPT = """
    import numpy as np
    import jax, jax.numpy as jnp
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams
    from jaxinfer.models.config import MoeConfig
    from jaxinfer.models.moe import route, routed_experts
    from jaxinfer.models.presets import preset
    from jaxinfer.models.spec import init_params
    from jaxinfer.parallel.expert import capacity_buckets, expert_parallel_experts
    from jaxinfer.parallel.sharding import make_mesh

    seed = SEED
    assert len(jax.devices()) == 8
    assert capacity_buckets(64, 8) == (16, 32, 64) and capacity_buckets(6, 2) == (6,)
    cfg = preset("tiny-moe", moe=MoeConfig(num_experts=16, experts_per_token=3, expert_size=32))
    p = init_params(cfg, jax.random.key(seed))["layers"][0]
    w = (p["w_expert_gate_up"], p["w_expert_down"])
    h = jax.random.normal(jax.random.key(seed + 1), (37, cfg.hidden_size))  # not a multiple of 8
    weights, routed = route(cfg.moe, p, h)
    skewed = jnp.stack([jnp.full(37, 5), jnp.full(37, 6), jnp.full(37, 7)], 1).astype(jnp.int32)
    padded = routed.at[30:].set(16)  # padding tokens: no expert
    # one compile per mesh size, shared by the three routings
    ep = {n: jax.jit(lambda *a, mesh=make_mesh({"expert": n}): expert_parallel_experts(*a, mesh))
          for n in (2, 4, 8)}
    for name, experts in (("router", routed), ("all to one device", skewed), ("padding", padded)):
        want, want_sizes = routed_experts(h, weights, experts, *w)
        for n in (2, 4, 8):
            got, sizes = ep[n](h, weights, experts, *w)
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"seed {seed} {name} ep {n}")
            np.testing.assert_array_equal(sizes, want_sizes, err_msg=f"{name} ep {n}")

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 500, int(n)).tolist() for n in rng.integers(3, 40, 6)]
    sp = [SamplingParams(max_tokens=9, ignore_eos=True),
          SamplingParams(max_tokens=9, temperature=0.8, seed=5)] * 3
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=16,
              max_model_len=128, decode_steps=4)
    llm = LLM("preset:tiny-moe", warmup=False, **kw)  # the reference: compiles what it runs
    base = [o.token_ids for o in llm.generate(prompts, sp)]
    # (a step that read no device results has no load)
    base_load = sum(np.array(r.expert_tokens) for r in llm.engine.step_records if r.expert_tokens)
    for mesh in ({"data": 2, "expert": 4},):  # (the data axis replicates: EP over 4)
        llm = LLM("preset:tiny-moe", mesh=mesh, **kw)
        got = [o.token_ids for o in llm.generate(prompts, sp)]
        assert got == base, (f"seed {seed}", mesh, got, base)
        assert llm.engine.compiles_after_warmup == 0, mesh
        records = [r for r in llm.engine.step_records if r.expert_tokens is not None]
        load = sum(np.array(r.expert_tokens) for r in records)
        np.testing.assert_array_equal(load, base_load)
        for r in records:
            assert len(r.expert_device_tokens) == 4, r
            assert sum(r.expert_device_tokens) == sum(r.expert_tokens), r
    print("ok")
"""


def test_expert_parallel_equals_one_device_on_8_fake_devices(run_on_cpu_devices, fresh_seed):
    run_on_cpu_devices(EP_SCRIPT.replace("SEED", str(fresh_seed % 10_000)), 8, timeout=900)


def test_expert_stacks_refuse_weight_formats_and_a_recipe_keeps_them_plain(fresh_seed):
    from jaxinfer.models.dense import forward
    from jaxinfer.models.spec import param_specs
    from jaxinfer.quant import QuantizedWeight, is_quantized
    from jaxinfer.quant.transform import quantize_params

    with pytest.raises(ValueError, match=r"layers\.0\.w_expert_gate_up, a stacked MoE expert"):
        param_specs(preset("tiny-moe", weight_format="int8"))
    plain = preset("tiny-moe")
    cfg = plain.replace(weight_format="int8", weight_formats=(("layers.*.w_expert_*", None),))
    params = init_params(plain, jax.random.key(fresh_seed))
    q = quantize_params(cfg, params)
    assert isinstance(q["layers"][0]["w_qkv"], QuantizedWeight)
    assert q["layers"][0]["w_expert_down"] is params["layers"][0]["w_expert_down"]
    # the reference runs the plain model on the int8 weights' dequantized values, so routing sees
    # the same inputs on both sides (comparing with the unquantized model would hinge on near-tie
    # routes, i.e. on the seed)
    deq = jax.tree.map(lambda x: x.format.dequantize(x).astype(plain.param_dtype) if is_quantized(x) else x,
                       q, is_leaf=is_quantized)  # fmt: skip
    tokens = jnp.arange(9)[None]
    want, got = forward(deq, plain, tokens), forward(q, cfg, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                               err_msg=f"seed {fresh_seed}")  # fmt: skip


@pytest.mark.parametrize(
    "moe_fields",
    [
        dict(qk_norm=True, ffn_kinds=("moe", "dense"), moe=MoeConfig(8, 2, 32)),  # Qwen3-MoE
        dict(qk_norm=False, qkv_bias=True, moe=MoeConfig(8, 3, 32, norm_topk_prob=False, shared_expert_size=24,
                                          shared_expert_gate=True)),  # Qwen2-MoE
        dict(qk_norm=False, intermediate_size=32, sliding_window=5,
             moe=MoeConfig(4, 2, 32)),  # Mixtral
    ],
    ids=["qwen3-moe", "qwen2-moe", "mixtral"],
)  # fmt: skip
def test_saved_moe_models_run_in_transformers_as_ours(tmp_path, fresh_seed, moe_fields):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxinfer.checkpoint import load_hf_model, save_hf_model
    from jaxinfer.models.dense import forward

    cfg = preset("tiny-moe", **moe_fields)
    params = init_params(cfg, jax.random.key(fresh_seed))
    if cfg.qkv_bias:  # nonzero biases, so a dropped one shows
        for layer in params["layers"]:
            layer["b_qkv"] = 0.1 * jax.random.normal(jax.random.key(1), layer["b_qkv"].shape)
    save_hf_model(tmp_path / "m", cfg, params, dtype="float32")
    tokens = np.random.default_rng(fresh_seed).integers(0, cfg.vocab_size, (1, 17))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").float().eval()
    with torch.no_grad():
        want = model(torch.as_tensor(tokens)).logits.numpy()
    got = np.asarray(forward(params, cfg, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"seed {fresh_seed}")
    back_cfg, back = load_hf_model(tmp_path / "m", dtype="float32")
    assert back_cfg.replace(eos_token_ids=cfg.eos_token_ids) == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)


def test_deepseek_routing_is_not_exported():
    from jaxinfer.checkpoint.hf_saver import config_to_hf

    sigmoid = MoeConfig(8, 2, 32, scoring="sigmoid", score_bias=True)
    with pytest.raises(ValueError, match=r"ModelConfig\.moe=.* cannot be exported: DeepSeek"):
        config_to_hf(preset("tiny-moe", moe=sigmoid))


def test_step_metrics_report_expert_load(tmp_path):
    """Step records of an MoE engine carry its load; the summary and the parquet tables too."""
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams
    from jaxinfer.metrics.summary import summarize
    from jaxinfer.metrics.tables import write_tables

    llm = LLM("preset:tiny-moe", max_num_seqs=4, max_num_batched_tokens=32, num_pages=32,
              page_size=16, max_model_len=96, decode_steps=4, warmup=False)  # fmt: skip
    outs = llm.generate([[1, 2, 3, 4, 5], [7] * 20], SamplingParams(max_tokens=6, ignore_eos=True))
    records = [r for r in llm.engine.step_records if r.expert_tokens is not None]
    routed = sum(sum(r.expert_tokens) for r in records)
    # every token fed (the last sampled one is not), x top-2 x 2 MoE layers, and the rows a decode
    # scan re-feeds for a sequence that finished in it (computed: they count)
    tokens = 25 + sum(len(o.token_ids) for o in outs) - 2
    assert routed % 4 == 0 and routed >= tokens * 4, (routed, tokens)
    assert all(1 <= r.experts_active <= 8 for r in records), records
    summary = summarize([], llm.engine.step_records)
    assert summary["expert_imbalance_mean"] >= 1 and 1 <= summary["experts_active_mean"] <= 8
    import pyarrow.parquet as pq

    _, steps = write_tables(tmp_path, [], llm.engine.step_records)
    assert pq.read_table(steps).column("expert_tokens").to_pylist()[-1] is not None


def test_moe_vs_dense_pairs_rows_and_refuses_disjoint_results(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe_vs_dense", "experiments/moe_vs_dense.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def result(step_ms, tok_s, batches=(1, 64)):
        rows = [{"batch": b, "context": 512, "step_ms": step_ms * b ** 0.5, "roofline_ms": 1.0,
                 "weight_bytes_per_step": 10 * b} for b in batches]  # fmt: skip
        tput = [
            {"impl": "jaxinfer", "workload": "fixed_128_128", "output_tok_s": tok_s},
            {"impl": "transformers", "workload": "fixed_128_128", "output_tok_s": 1.0},
        ]
        return {"decode": rows, "throughput": tput, "preset": "p"}

    out = mod.compare(result(2.0, 3000.0, (1, 8, 64)), result(1.0, 6000.0))
    assert [(r["batch"], r["moe_over_dense"]) for r in out["decode"]] == [(1, 2.0), (64, 2.0)]
    assert out["throughput"] == [{"workload": "fixed_128_128", "moe_output_tok_s": 3000.0,
                                  "dense_output_tok_s": 6000.0, "moe_over_dense": 0.5}]  # fmt: skip
    with pytest.raises(ValueError, match="share no decode"):
        mod.compare({"decode": [], "throughput": []}, result(1.0, 1.0))


MULTI_HOST_WORKER = """
    import sys
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    pid, port, seed = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from jaxinfer.models.config import MoeConfig
    from jaxinfer.models.moe import route, routed_experts
    from jaxinfer.models.presets import preset
    from jaxinfer.models.spec import init_params
    from jaxinfer.parallel.expert import expert_parallel_experts
    from jaxinfer.parallel.sharding import make_mesh

    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
    cfg = preset("tiny-moe", moe=MoeConfig(num_experts=8, experts_per_token=2, expert_size=32))
    mesh = make_mesh({"expert": 4})  # both processes' devices
    p = init_params(cfg, jax.random.key(seed), mesh)["layers"][0]
    assert len(p["w_expert_down"].sharding.device_set) == 4
    rep = NamedSharding(mesh, P())
    h = jax.jit(lambda k: jax.random.normal(k, (21, 64)), out_shardings=rep)(jax.random.key(seed))
    w, e = jax.jit(lambda p, h: route(cfg.moe, p, h), out_shardings=rep)(p, h)
    ep = jax.jit(lambda *a: expert_parallel_experts(*a, mesh), out_shardings=(rep, rep))
    out, sizes = ep(h, w, e, p["w_expert_gate_up"], p["w_expert_down"])
    # the reference: the same arrays gathered to this process, all experts on one device
    host = [multihost_utils.process_allgather(x, tiled=True)
            for x in (h, w, e, p["w_expert_gate_up"], p["w_expert_down"])]
    with jax.default_device(jax.local_devices()[0]):
        want, want_sizes = routed_experts(*host)
    np.testing.assert_allclose(np.asarray(out.addressable_data(0)), want, atol=1e-5,
                               err_msg=f"seed {seed} process {pid}")
    np.testing.assert_array_equal(np.asarray(sizes.addressable_data(0)), want_sizes)
    print("ok")
"""


def test_expert_parallel_across_two_processes(tmp_path, fresh_seed):
    """Multi-host: two processes (2 CPU devices each) joined by jax.distributed.initialize run
    one expert-parallel layer over a 4-device mesh spanning both, equal to one device."""
    import os
    import socket
    import subprocess
    import sys
    import textwrap

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(MULTI_HOST_WORKER))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port), str(fresh_seed % 9999)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]  # fmt: skip
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.strip().endswith("ok"), f"process {i}: {err[-3000:]}"


def _bf16_moe_layer(fresh_seed: int):
    """A bf16 MoE layer whose dims the Pallas grouped matmul takes (K, N multiples of 64)."""
    cfg = preset("tiny-moe", dtype="bfloat16", param_dtype="bfloat16",
                 moe=MoeConfig(num_experts=4, experts_per_token=2, expert_size=64,
                               shared_expert_size=64))  # fmt: skip
    return cfg, init_params(cfg, jax.random.key(fresh_seed))["layers"][0]


def test_moe_block_through_the_pallas_kernel_matches_xla(fresh_seed, monkeypatch):
    """backend "pallas" (the Mosaic GPU kernel, interpreted on CPU) in the MoE block, with padding
    tokens and a shared expert: the kernel runs (a spy counts it) and gives XLA's output."""
    import jaxinfer.models.experts as experts

    calls = []
    kernel = experts.grouped_matmul_mgpu
    monkeypatch.setattr(
        experts, "grouped_matmul_mgpu", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    cfg, p = _bf16_moe_layer(fresh_seed)
    x = jax.random.normal(jax.random.key(fresh_seed + 3), (24, cfg.hidden_size), jnp.bfloat16)
    valid = jnp.arange(24) < 19
    want, want_sizes = moe_ffn(cfg, p, x, None, FfnContext(valid, None, "xla"))
    assert not calls
    got, sizes = moe_ffn(cfg, p, x, None, FfnContext(valid, None, "pallas"))
    assert len(calls) == 2, calls  # gate_up and down
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0,
                               atol=2e-2 * np.abs(want).max(), err_msg=f"seed {fresh_seed}")  # fmt: skip
    np.testing.assert_array_equal(sizes, want_sizes)


def test_moe_backend_resolves_by_device_and_model_and_names_the_key():
    from types import SimpleNamespace

    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.models.moe import resolve_moe_backend

    gpu, cpu = SimpleNamespace(platform="gpu"), jax.devices("cpu")[0]
    big = preset("qwen3-30b-a3b")
    assert resolve_moe_backend("auto", big, gpu) == "pallas"
    assert resolve_moe_backend("auto", big, cpu) == "xla"
    assert resolve_moe_backend("xla", big, gpu) == "xla"
    tiny = preset("tiny-moe")  # float32, expert_size 32: not the kernel's
    assert resolve_moe_backend("auto", tiny, gpu) == "xla"
    with pytest.raises(ValueError, match=r"engine\.moe_backend=.pallas.*float32"):
        resolve_moe_backend("pallas", tiny, gpu)
    odd = preset("tiny-moe", dtype="bfloat16", moe=MoeConfig(num_experts=8, experts_per_token=2,
                                                             expert_size=32))  # fmt: skip
    with pytest.raises(ValueError, match=r"moe\.expert_size a multiple of 64, got 32"):
        resolve_moe_backend("pallas", odd, gpu)
    assert resolve_moe_backend("pallas", preset("tiny"), gpu) == "xla"  # dense: unused
    with pytest.raises(ValueError, match=r"engine\.moe_backend='cuda' is invalid"):
        EngineConfig(moe_backend="cuda")


def test_engine_steps_pass_the_moe_backend_to_the_grouped_matmul(monkeypatch):
    """The engine's resolved moe_backend reaches every MoE layer of its mixed steps and decode
    scans (a spy records the backend each grouped matmul is traced with and runs XLA's)."""
    import jaxinfer.engine.model_runner as model_runner
    import jaxinfer.models.experts as experts
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams

    seen = set()
    reference = experts.grouped_matmul

    def spy(lhs, rhs, sizes, backend="xla"):
        seen.add(backend)
        return reference(lhs, rhs, sizes)

    monkeypatch.setattr(experts, "grouped_matmul", spy)
    monkeypatch.setattr(model_runner, "resolve_moe_backend", lambda *a: "pallas")
    llm = LLM("preset:tiny-moe", max_num_seqs=2, max_num_batched_tokens=16, num_pages=16,
              page_size=16, max_model_len=64, decode_steps=2, warmup=False)  # fmt: skip
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(outs[0].token_ids) == 4 and llm.engine.runner.moe_backend == "pallas"
    assert seen == {"pallas"}, seen


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [8, 512])
def test_qwen3_moe_block_on_the_gpu_kernel_matches_xla(fresh_seed, tokens):
    """Qwen3-30B-A3B's MoE block (128 experts of 768, top-8) in bf16 on the GPU: the Pallas
    grouped matmul gives XLA's ragged_dot output, at a decode and a prefill size, with padding."""
    cfg = preset("qwen3-30b-a3b", num_layers=1)
    p = init_params(cfg, jax.random.key(fresh_seed))["layers"][0]
    x = jax.random.normal(jax.random.key(fresh_seed + 4), (tokens, cfg.hidden_size), jnp.bfloat16)
    valid = jnp.arange(tokens) < tokens - 3
    run = jax.jit(lambda p, x, backend: moe_ffn(cfg, p, x, None, FfnContext(valid, None, backend)),
                  static_argnums=2)  # fmt: skip
    want, want_sizes = run(p, x, "xla")
    got, sizes = run(p, x, "pallas")
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0,
                               atol=2e-2 * np.abs(want).max(), err_msg=f"seed {fresh_seed}")  # fmt: skip
    np.testing.assert_array_equal(sizes, want_sizes)
