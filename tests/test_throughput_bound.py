"""The throughput bound counts the model's matmul weights, the workload's tokens and the K/V bytes
its decode steps read as the parameter tree and a token-by-token walk do, and reads a results file
with clear errors for what it lacks."""

from __future__ import annotations

import json
import math
import random

import experiment_scripts
import jax
import pytest

from jaxinfer.models.presets import preset
from jaxinfer.models.spec import is_spec, param_specs


@pytest.fixture(scope="module")
def tb():
    return experiment_scripts.load("throughput_bound")


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "mistral-7b", "tiny"])
def test_weights_match_the_parameter_tree(tb, name):
    cfg = preset(name)
    tree = param_specs(cfg)
    # matrices of the layers (every spec of rank >= 2: norms and biases are vectors)
    layer = sum(math.prod(s.shape) for s in jax.tree.leaves(tree["layers"], is_leaf=is_spec)
                if len(s.shape) >= 2)  # fmt: skip
    assert tb.layer_weights(cfg) == layer
    head = tree["embed"] if cfg.tie_word_embeddings else tree["lm_head"]
    assert tb.head_weights(cfg) == math.prod(head.shape)


def test_counts_match_a_token_by_token_walk(tb, fresh_seed):
    rng = random.Random(fresh_seed)
    prompts = [rng.randint(1, 300) for _ in range(37)]
    outputs = [rng.randint(1, 200) for _ in range(37)]
    decode = attended = pairs = 0
    for p, o in zip(prompts, outputs, strict=True):
        pairs += sum(q + 1 for q in range(p))  # prompt position q sees keys 0..q
        length = p  # after prefill: the prompt is cached, output token 1 sampled
        for _ in range(o - 1):  # each later output token: one decode step over cache + its input
            length += 1
            decode += 1
            attended += length
    c = tb.workload_counts(prompts, outputs)
    assert (c["decode_tokens"], c["decode_attended_tokens"], c["prefill_causal_pairs"]) == (
        decode, attended, pairs)  # fmt: skip
    assert (c["prompt_tokens"], c["output_tokens"]) == (sum(prompts), sum(outputs))
    with pytest.raises(ValueError, match="output token"):
        tb.workload_counts([4, 5], [3, 0])


def test_bound_adds_gemm_attention_and_small_kernels(tb):
    cfg = preset("llama3-8b")
    c = tb.workload_counts([128] * 10, [128] * 10)
    b = tb.bound(cfg, c, gemm_flops_per_s=1e15, hbm_bytes_per_s=4e12, kv_itemsize=2,
                 small_kernel_s=0.25)  # fmt: skip
    flops = 2 * 2550 * tb.layer_weights(cfg) + 2 * 1280 * tb.head_weights(cfg)
    assert b["gemm_flops"] == flops
    kv = c["decode_attended_tokens"] * 2 * 32 * 8 * 128 * 2
    assert b["decode_kv_bytes"] == kv
    expect = (flops + b["prefill_attention_flops"]) / 1e15 + kv / 4e12 + 0.25
    assert b["total_s"] == pytest.approx(expect, abs=1e-4)
    assert b["output_tok_s"] == pytest.approx(1280 / expect, rel=1e-3)


def _results(**over):
    res = {
        "device": "gpu:H x1", "jax": "0.x", "commit": "abc", "date": "d", "command": "c",
        "preset": "llama3-8b", "dtype": "bfloat16", "hbm_bytes_per_s": 4.3e12,
        "engine": {"decode_steps": 8},
        "workloads": {"fixed_128_128": {"prompt_len": 128, "output_len": 128, "num_requests": 1000}},
        "throughput": [{"impl": "jaxinfer", "workload": "fixed_128_128", "output_tok_s": 16000.0,
                        "wall_s": 8.0, "steps": {"mixed": 35, "decode_scans": 31}}],
        "profile_decode": [{"batch": 64, "context": 512, "kinds_ms_per_step": {"fusion": 0.4}},
                           {"batch": 512, "context": 512,
                            "kinds_ms_per_step": {"fusion": 1.2, "kv_write": 0.4, "matmul": 9}}],
    }  # fmt: skip
    res.update(over)
    return res


def test_main_reads_a_results_file(tb, tmp_path):
    src = tmp_path / "e2e.json"
    src.write_text(json.dumps(_results()))
    out = tb.main(
        ["--results", str(src), "--gemm-tflops", "699", "--out", str(tmp_path / "b.json")]
    )
    assert json.loads((tmp_path / "b.json").read_text())["bounds"] == out["bounds"]
    assert out["small_kernels"] == {"batch": 512, "context": 512, "ms_per_step": 1.6,
                                    "decode_steps": 248}  # fmt: skip
    (b,) = out["bounds"]
    assert b["with_measured_small_kernels"]["small_kernels_s"] == pytest.approx(1.6 * 248 / 1e3)
    assert b["measured_over_bound"] == pytest.approx(16000 / b["output_tok_s"], abs=1e-4)
    assert 15000 < b["output_tok_s"] < 30000  # the 8B shape at 699 TFLOP/s: about 21k
    assert out["source"]["commit"] == "abc"
    # an FP8 K/V pool reads half the bytes
    src.write_text(json.dumps(_results(engine={"decode_steps": 8, "kv_dtype": "float8_e4m3fn"})))
    (b8,) = tb.main(["--results", str(src), "--gemm-tflops", "699"])["bounds"]
    assert b8["decode_kv_bytes"] * 2 == b["decode_kv_bytes"]


@pytest.mark.parametrize(
    "over,args,match",
    [
        ({"preset": None}, [], "no 'preset'"),
        ({}, ["--workload", "sharegpt_like"], "--workload 'sharegpt_like'"),
        ({"throughput": []}, [], "no jaxinfer throughput row"),
        ({"engine": {"kv_dtype": "int4"}}, [], "K/V dtype 'int4'"),
        (
            {
                "workloads": {
                    "fixed_128_128": {
                        "prompt_len": {"median": 200},
                        "output_len": 128,
                        "num_requests": 10,
                    }
                }
            },
            [],
            "only fixed lengths",
        ),
    ],
)
def test_main_names_what_the_file_lacks(tb, tmp_path, over, args, match):
    res = _results(**over)
    res = {k: v for k, v in res.items() if v is not None}
    src = tmp_path / "e2e.json"
    src.write_text(json.dumps(res))
    with pytest.raises(SystemExit, match=match):
        tb.main(["--results", str(src), *args])
