"""Numerical parity with `transformers` for every supported architecture (fp32, tiny random models).

Each model is built by `transformers` from a tiny config, its weights perturbed (so zero biases and
unit norms are not trivially right), saved with `save_pretrained`, and loaded by jaxinfer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxinfer.checkpoint import load_hf_model  # noqa: E402
from jaxinfer.generate import greedy_generate  # noqa: E402
from jaxinfer.kv.cache import init_kv_cache  # noqa: E402
from jaxinfer.models.batch import build_ragged_batch  # noqa: E402
from jaxinfer.models.dense import compute_logits, forward, forward_paged  # noqa: E402

TOL = 1e-4
COMMON = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
ARCHS = {
    "llama3.1": (
        "LlamaConfig",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                # head_dim 16, theta 5e5: wavelengths 6, 32, 167, ... so with 64 one frequency
                # falls in each band (kept, interpolated, scaled).
                original_max_position_embeddings=64,
            ),
            rope_theta=500000.0,
            head_dim=16,
        ),
    ),
    "llama2-bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=8)),
    "mistral-window": ("MistralConfig", dict(sliding_window=7, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # MoE: routed experts (renormalised or not), Qwen2-MoE's gated shared expert, dense layers
    # among the sparse ones (mlp_only_layers, decoder_sparse_step)
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_experts=6, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=False,
                                         shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, head_dim=32,
                                         moe_intermediate_size=32, norm_topk_prob=True,
                                         decoder_sparse_step=2, rms_norm_eps=1e-6)),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hf_model_dir(request, tmp_path_factory):
    config_cls, extra = ARCHS[request.param]
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(sum(map(ord, request.param)))
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model = model.float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path, model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def test_full_sequence_logits_match_transformers(hf_model_dir):
    name, path, model = hf_model_dir
    cfg, params = load_hf_model(path, dtype="float32")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 23))
    ours = np.asarray(forward(params, cfg, jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, hf_logits(model, tokens), atol=TOL, rtol=0, err_msg=name)


def test_prefill_then_16_decode_steps_through_shuffled_pages_match_transformers(hf_model_dir):
    name, path, model = hf_model_dir
    cfg, params = load_hf_model(path, dtype="float32")
    rng = np.random.default_rng(1)
    prompt_lens, decode_steps, page_size = [11, 5, 17], 16, 4
    seqs = [rng.integers(0, cfg.vocab_size, n + decode_steps) for n in prompt_lens]
    expected = [hf_logits(model, s[None])[0] for s in seqs]

    pages_per_seq = math.ceil((max(prompt_lens) + decode_steps) / page_size)
    num_pages = len(seqs) * pages_per_seq + 1
    shuffled = rng.permutation(np.arange(1, num_pages)).reshape(len(seqs), pages_per_seq)
    kv = init_kv_cache(cfg, num_pages, page_size)
    kv = type(kv)(kv.pages.at[:, 0].set(jnp.nan))  # the scratch page, K and V

    batch = build_ragged_batch(
        [list(s[:n]) for s, n in zip(seqs, prompt_lens, strict=True)],
        [0, 0, 0],
        shuffled.tolist(),
        num_tokens=40,  # padding rows exercise the scratch page
        num_seqs=4,  # plus one padding slot
        pages_per_seq=pages_per_seq,
    )
    paged = jax.jit(forward_paged, static_argnums=1)  # two compiles (prefill, decode), not per op
    hidden, kv = paged(params, cfg, batch, kv)
    logits = np.asarray(compute_logits(params, cfg, hidden))
    start = 0
    for s, n in enumerate(prompt_lens):
        np.testing.assert_allclose(
            logits[start : start + n], expected[s][:n], atol=TOL, rtol=0, err_msg=f"{name} prefill"
        )
        start += n
    for step in range(decode_steps):
        ctx = [n + step for n in prompt_lens]
        batch = build_ragged_batch(
            [[int(s[c])] for s, c in zip(seqs, ctx, strict=True)],
            ctx,
            shuffled.tolist(),
            num_tokens=4,
            num_seqs=4,
            pages_per_seq=pages_per_seq,
        )
        hidden, kv = paged(params, cfg, batch, kv)
        logits = np.asarray(compute_logits(params, cfg, hidden))
        for s, c in enumerate(ctx):
            np.testing.assert_allclose(
                logits[s], expected[s][c], atol=TOL, rtol=0, err_msg=f"{name} decode {step}"
            )


def test_greedy_32_tokens_equal_transformers_generate(hf_model_dir):
    name, path, model = hf_model_dir
    cfg, params = load_hf_model(path, dtype="float32")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (6, 13)]
    ours = greedy_generate(params, cfg, prompts, 32, page_size=8)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.as_tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32
            )
        assert got == out[0, len(prompt) :].tolist(), name


def test_jitted_unrolled_layers_trace_the_layer_once_and_match_eager(monkeypatch):
    """Inside jit the unrolled loop traces one layer for all of them (the layer index is data),
    and gives the eager loop's logits; called eagerly it runs each layer directly."""
    import jax

    from jaxinfer.models import dense
    from jaxinfer.models.presets import preset
    from jaxinfer.models.spec import init_params

    cfg = preset("tiny").replace(num_layers=4)
    params = init_params(cfg, jax.random.key(3))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 7)))
    calls = []
    real = dense.decoder_layer
    monkeypatch.setattr(dense, "decoder_layer", lambda *a: calls.append(a[-2]) or real(*a))
    eager = forward(params, cfg, tokens)
    assert [int(i) for i in calls] == [0, 1, 2, 3]
    calls.clear()
    jitted = jax.jit(forward, static_argnums=1)(params, cfg, tokens)
    assert len(calls) == 1 and isinstance(calls[0], jax.core.Tracer)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-5, rtol=1e-5)
