"""Repetition, presence and frequency penalties and logit biases, on the device, against a numpy
statement of vLLM's semantics (`jaxinfer.engine.sampler` module docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spine_parts

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.sampler import Penalties, apply_penalties
from jaxinfer.models.dense import forward
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params


def np_penalize(logits, context, num_prompt, sp: SamplingParams):
    """One row: logit_bias added; repetition on tokens of prompt or output; frequency times the
    output count and presence once per output token, subtracted."""
    out = np.array(logits, np.float64)
    for token, bias in sp.logit_bias:
        out[token] += bias
    seen = set(context)
    outputs = context[num_prompt:]
    for t in seen:
        out[t] = out[t] / sp.repetition_penalty if out[t] > 0 else out[t] * sp.repetition_penalty
    for t in set(outputs):
        out[t] -= sp.frequency_penalty * outputs.count(t) + sp.presence_penalty
    return out


def test_penalties_equal_the_numpy_statement(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    v, length, rows = 40, 24, 6
    params = [
        SamplingParams(repetition_penalty=float(rng.uniform(0.5, 2.0)),
                       presence_penalty=float(rng.uniform(-2, 2)),
                       frequency_penalty=float(rng.uniform(-2, 2)),
                       logit_bias={int(t): float(rng.uniform(-5, 5))
                                   for t in rng.choice(v, 3, replace=False)})
        for _ in range(rows - 1)
    ] + [SamplingParams()]  # fmt: skip
    logits = rng.normal(0, 3, (rows, v)).astype(np.float32)
    history = np.full((rows, length), -1, np.int32)
    num_prompt = rng.integers(1, 8, rows).astype(np.int32)
    position = rng.integers(8, length, rows).astype(np.int32)
    for r in range(rows):  # tokens written past the row's position too (later drafts)
        n = int(rng.integers(position[r], length + 1))
        history[r, :n] = rng.integers(0, 12, n)  # a small alphabet: repeats
    pen = Penalties.pack(params, rows, 4)
    got = np.asarray(apply_penalties(jnp.asarray(logits), jax.tree.map(jnp.asarray, pen),
                                     jnp.asarray(history), jnp.asarray(num_prompt),
                                     jnp.asarray(position)))  # fmt: skip
    for r in range(rows):
        context = [int(t) for t in history[r, : position[r]] if t >= 0]
        want = np_penalize(logits[r], context, int(num_prompt[r]), params[r])
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-5, err_msg=f"row {r}")


SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=8,
             max_model_len=96, penalties=True, max_logit_bias=4)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny")
    return cfg, init_params(cfg, jax.random.key(51))


_forward = jax.jit(forward, static_argnames="cfg")
REF_LEN = 40  # every reference forward is padded to this length: one compile for all prefixes


def reference(model, prompt, sp: SamplingParams, n: int) -> list[int]:
    """Greedy decoding by full (causal) forwards, penalised in numpy."""
    cfg, params = model
    tokens = list(prompt)
    for _ in range(n):
        padded = jnp.asarray([tokens + [0] * (REF_LEN - len(tokens))])
        logits = np.asarray(_forward(params, cfg=cfg, tokens=padded)[0, len(tokens) - 1])
        tokens.append(int(np.argmax(np_penalize(logits, tokens, len(prompt), sp))))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("variant", [dict(decode_steps=1), dict(decode_steps=4), "drafts"])
def test_engine_greedy_with_penalties_equals_the_reference(model, variant, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    prompts = [rng.integers(0, 40, int(n)).tolist() for n in (6, 20, 11)]  # repeats likely
    sps = [
        # (below 1 and negative: the context's tokens are favoured, so the outputs change)
        SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=0.4),
        SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=-1.5,
                       presence_penalty=0.7, logit_bias={3: 4.0, 7: -3.0}),
        SamplingParams(max_tokens=12, ignore_eos=True),
    ]  # fmt: skip
    want = [reference(model, p, sp, 12) for p, sp in zip(prompts, sps, strict=True)]
    for i in (0, 1):  # a prompt whose penalised continuation differs (most do; redraw otherwise)
        for _ in range(20):
            if want[i] != reference(model, prompts[i], SamplingParams(), 12):
                break
            prompts[i] = rng.integers(0, 40, len(prompts[i])).tolist()
            want[i] = reference(model, prompts[i], sps[i], 12)
        else:
            raise AssertionError(f"the penalties changed nothing in 20 prompts (seed {fresh_seed})")
    kw = variant if isinstance(variant, dict) else dict(decode_steps=4)
    proposer = None
    if variant == "drafts":
        proposer = spine_parts.KnownTokens(list(zip(prompts, want, strict=True)), 3, 512)
    engine = Engine(EngineConfig(model="preset:tiny", **SMALL, **kw), *model, proposer=proposer)
    engine.warmup()
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, sps, strict=True)]
    engine.run()
    assert [s.output_token_ids for s in seqs] == want
    assert engine.compiles_after_warmup == 0


def test_penalties_need_an_engine_built_for_them(model):
    engine = Engine(EngineConfig(model="preset:tiny", **{**SMALL, "penalties": False}), *model)
    seq = engine.add_request([1, 2, 3], SamplingParams(presence_penalty=0.5))
    assert seq.error and "engine.penalties=true" in seq.error
    engine = Engine(EngineConfig(model="preset:tiny", **SMALL), *model)
    seq = engine.add_request([1, 2], SamplingParams(logit_bias={i: 1.0 for i in range(5)}))
    assert seq.error and "engine.max_logit_bias=4" in seq.error


def test_all_64_bits_of_a_seed_key_the_draws():
    """Seeds that share their low 32 bits draw differently (the high word is folded in)."""
    from jaxinfer.engine.sampler import SamplingBatch, sample

    logits = jnp.zeros((2, 1000))
    sp = SamplingParams(temperature=1.0)
    draws = []
    for position in range(20):
        sb = SamplingBatch.build([sp, sp], [5, 5 + 2**32], [position] * 2, 2)
        draws.append(np.asarray(sample(logits, sb)[0]))
    draws = np.stack(draws)
    assert (draws[:, 0] != draws[:, 1]).sum() >= 15, draws.T
