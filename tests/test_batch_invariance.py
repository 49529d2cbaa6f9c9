"""engine.batch_invariant (docs/batch_invariance.md): a request's logprobs are the same bits
whatever else is scheduled with it, on CPU in float32.

The parts: the invariant matmul (`layers.linear` over fixed row tiles), row reductions and
attention (`pallas_kernels.paged_attention.invariant`) give a row alone the bits it gets inside
any batch; an MoE model's logits likewise. The engine: probe requests run alone, then inside shuffled
batches of 2, 5 and 8 (the 8 overflow the KV pool: preemptions), with chunked prefill at two
chunk sizes, prefix caching, and n-gram speculation, all give the alone logprobs bit for bit.
The control: default numerics on the same comparison differ. Engines are built without
warm-up and share one model and one kind of shapes, so their steps share compiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config_file import load_config
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import SamplingParams
from jaxinfer.kv.cache import init_kv_cache
from jaxinfer.models.batch import build_ragged_batch
from jaxinfer.models.config import MoeConfig
from jaxinfer.models.dense import compute_logits, forward_paged
from jaxinfer.models.layers import linear
from jaxinfer.models.numerics import BATCH_INVARIANT, DEFAULT_NUMERICS, log_softmax, row_mean
from jaxinfer.models.param_spec import is_spec
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import param_specs
from jaxinfer.quant import QuantizedWeight
from jaxinfer.quant.format import WEIGHT_FORMATS
from pallas_kernels.invariant import fixed_order_sum
from pallas_kernels.paged_attention import PagedAttentionInputs, ragged_paged_attention
from pallas_kernels.paged_attention.dispatch import resolve_backend
from pallas_kernels.paged_attention.invariant import ragged_paged_attention_invariant

# Steps of up to 64 tokens: a probe's prefill alone runs in a 16- or 32-token bucket, inside a
# batch in the 64-token one, where XLA CPU's matmul changes kernel (the control shows it: with
# at most 32 tokens a step, default numerics happen to give these comparisons the same bits).
# 23 usable pages of 8 slots (184 tokens): the batches of 8 below need more, and preempt.
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, num_pages=24, page_size=8,
             max_model_len=128, decode_steps=4, num_logprobs=2)  # fmt: skip
PROBE_LENS = (5, 23, 41)  # prompts of the probe requests: one page, several, several chunks


def _random_params(cfg, seed: int):
    """Params of `cfg` drawn by numpy from their specs (`init_params` compiles its initialisers:
    seconds per model, which this file has none to spare)."""
    rng = np.random.default_rng(seed)

    def draw(spec):
        if spec.init == "normal":
            x = spec.scale * rng.standard_normal(spec.shape)
        else:
            x = np.full(spec.shape, 1.0 if spec.init == "ones" else 0.0)
        return jnp.asarray(x.astype(spec.dtype))

    return jax.tree.map(draw, param_specs(cfg), is_leaf=is_spec)


def _rows_alone_and_within(fn, x, ms, rng, what):
    """fn's row r of x [1, ...] alone equals its row inside batches of each size in `ms` at
    random positions, bit for bit."""
    alone = np.asarray(fn(x))[0]
    for m in ms:
        at = int(rng.integers(m))
        batch = rng.standard_normal((m, *x.shape[1:])).astype(np.float32)
        batch[at] = x[0]
        got = np.asarray(fn(jnp.asarray(batch)))[at]
        assert np.array_equal(got, alone), f"{what}: row {at} of {m} differs from the row alone"


# ---- the parts ---------------------------------------------------------------------------------


# (fp8_block over a fused [K, 2, N] weight, like w_gate_up, once kept its bits only while the
# batch had one 8-row tile: `row_tiled`'s docstring)
@pytest.mark.parametrize("fmt,shape", [(None, (96, 40)), ("int8", (96, 40)),
                                       ("fp8_block", (256, 2, 512))])  # fmt: skip
def test_invariant_matmul_gives_a_row_the_same_bits_in_any_batch(fresh_seed, fmt, shape):
    rng = np.random.default_rng(fresh_seed)
    k = shape[0]
    w = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    if fmt is not None:
        w = QuantizedWeight(WEIGHT_FORMATS[fmt].quantize(w, 1), WEIGHT_FORMATS[fmt])
    x = rng.standard_normal((1, k)).astype(np.float32)
    fn = jax.jit(lambda x: linear(x, w, numerics=BATCH_INVARIANT))
    ms = (2, 9, 64, 65) if fmt is None else (9, 64)
    _rows_alone_and_within(fn, x, ms, rng, f"matmul {fmt}, seed {fresh_seed}")


def test_invariant_row_reductions_give_a_row_the_same_bits_in_any_batch(fresh_seed):
    """The norms' mean and the sampler's log-softmax (XLA's own row sum over 576 elements rounds
    differently from 8 rows on)."""
    rng = np.random.default_rng(fresh_seed)
    x = (3 * rng.standard_normal((1, 576))).astype(np.float32)
    for name, f in (("mean", row_mean), ("log_softmax", log_softmax)):
        fn = jax.jit(lambda x, f=f: f(x, BATCH_INVARIANT))
        _rows_alone_and_within(fn, x, (9, 64), rng, f"{name}, seed {fresh_seed}")
    # trailing zeros (masked keys, padding) do not change a fixed-order sum
    row = jnp.asarray(x[0, :300])
    padded = jnp.concatenate([row, jnp.zeros(700, jnp.float32)])
    assert fixed_order_sum(row) == fixed_order_sum(padded), f"seed {fresh_seed}"


def _paged(keys, vals, page_size, page_ids, num_pages, rng):
    """K and V pools [num_pages, page_size, Hkv, D] of random values holding a sequence's keys
    and values in pages `page_ids`."""
    shape = (num_pages, page_size, *keys.shape[1:])
    k_pages = (5 * rng.standard_normal(shape)).astype(np.float32)
    v_pages = (5 * rng.standard_normal(shape)).astype(np.float32)
    for i, page in enumerate(page_ids):
        chunk = slice(i * page_size, min((i + 1) * page_size, len(keys)))
        k_pages[page, : chunk.stop - chunk.start] = keys[chunk]
        v_pages[page, : chunk.stop - chunk.start] = vals[chunk]
    return jnp.asarray(k_pages), jnp.asarray(v_pages)


def test_invariant_attention_gives_a_sequence_the_same_bits_in_any_batch(fresh_seed):
    """One sequence's new rows alone (a table of its own pages) equal its rows inside a batch of
    prefill and decode rows, with padding rows, a wider page table, other page ids, and another
    page size; and they are the reference's up to rounding. A sliding window of 97 keys (the
    blocks before it hold none of a row's keys: they are skipped)."""
    rng = np.random.default_rng(fresh_seed)
    hq, hkv, d, ctx, new = 4, 2, 16, int(rng.integers(130, 200)), 5
    keys = rng.standard_normal((ctx, hkv, d)).astype(np.float32)
    vals = rng.standard_normal((ctx, hkv, d)).astype(np.float32)
    q = rng.standard_normal((new, hq, d)).astype(np.float32)
    attend = jax.jit(ragged_paged_attention_invariant)

    def alone(page_size):
        pages = -(-ctx // page_size)
        k_pages, v_pages = _paged(keys, vals, page_size, range(1, pages + 1), pages + 1, rng)
        x = PagedAttentionInputs(jnp.asarray(q), k_pages, v_pages, jnp.arange(1, pages + 1)[None],
                                 jnp.asarray([ctx]), jnp.asarray([0, new]), max_q_len=new,
                                 sliding_window=97)  # fmt: skip
        return attend(x), x

    out, x = alone(8)
    ref = jax.jit(ragged_paged_attention)(x)
    np.testing.assert_allclose(out, ref, atol=2e-6, err_msg=f"seed {fresh_seed}")
    assert np.array_equal(alone(16)[0], out), f"page size 16 vs 8, seed {fresh_seed}"

    num_pages, width = 300, 64  # the batch: the sequence is third of five, rows up to 64
    ids = rng.permutation(np.arange(1, num_pages))[: -(-ctx // 8)]
    k_pages, v_pages = _paged(keys, vals, 8, ids, num_pages, rng)
    table = rng.integers(1, num_pages, (5, width)).astype(np.int32)
    table[2, : len(ids)] = ids
    seq_lens = np.array([30, 7, ctx, 120, 1], np.int32)
    qsl = np.concatenate([[0], np.cumsum([3, 1, new, 40, 1])]).astype(np.int32)
    qb = rng.standard_normal((64, hq, d)).astype(np.float32)
    qb[qsl[2] : qsl[3]] = q
    batched = attend(PagedAttentionInputs(
        jnp.asarray(qb), k_pages, v_pages, jnp.asarray(table), jnp.asarray(seq_lens),
        jnp.asarray(qsl), max_q_len=64, sliding_window=97))  # fmt: skip
    assert np.array_equal(np.asarray(batched)[qsl[2] : qsl[3]], out), f"seed {fresh_seed}"


def test_the_kernels_invariant_form_gives_a_row_the_same_bits_decoded_or_in_a_batch(fresh_seed):
    """The Pallas kernel's invariant form (GPU interpreter, bf16 pages): a sequence's last 5
    rows alone (a prefill chunk) equal those rows inside a mixed batch of prefill and decode
    rows, and its last row decoded among other sequences (a decode-only batch of 3) equals
    that row of the chunk; all match the reference to bf16 rounding."""
    from pallas_kernels.paged_attention.mosaic_gpu import ragged_paged_attention_mgpu

    rng = np.random.default_rng(fresh_seed)
    hq, hkv, d, ps, ctx, new = 4, 1, 64, 16, int(rng.integers(130, 160)), 5
    num_pages, width = 40, 12
    bf = jnp.bfloat16
    k_pages = jnp.asarray(rng.standard_normal((num_pages, ps, hkv, d)), bf)
    v_pages = jnp.asarray(rng.standard_normal((num_pages, ps, hkv, d)), bf)
    table = rng.permutation(np.arange(1, num_pages))[: 3 * width].reshape(3, width).astype(np.int32)
    q_all = jnp.asarray(rng.standard_normal((new, hq, d)), bf)
    attend = jax.jit(partial(ragged_paged_attention_mgpu, interpret=True, batch_invariant=True))

    def run(q, rows_table, seq_lens, q_lens):
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        x = PagedAttentionInputs(q, k_pages, v_pages, jnp.asarray(rows_table),
                                 jnp.asarray(seq_lens, jnp.int32), jnp.asarray(qsl),
                                 max_q_len=int(max(q_lens)))  # fmt: skip
        return np.asarray(attend(x).astype(jnp.float32)), x

    alone, x = run(q_all, table[:1], [ctx], [new])
    ref = np.asarray(ragged_paged_attention(x).astype(jnp.float32))
    np.testing.assert_allclose(alone, ref, atol=2e-2, err_msg=f"seed {fresh_seed}")
    # inside a mixed batch: 1 decode row, then the sequence's chunk, then a prefill of 7 rows
    other = jnp.asarray(rng.standard_normal((8, hq, d)), bf)
    q_mix = jnp.concatenate([other[:1], q_all, other[1:]])
    mixed, _ = run(q_mix, table[[1, 0, 2]], [60, ctx, 30], [1, new, 7])
    assert np.array_equal(mixed[1 : 1 + new], alone), f"in a mixed batch, seed {fresh_seed}"
    # its last row decoded, the middle of three decode rows
    q_dec = jnp.concatenate([other[:1], q_all[-1:], other[1:2]])
    decoded3, _ = run(q_dec, table[[1, 0, 2]], [60, ctx, 30], [1, 1, 1])
    assert np.array_equal(decoded3[1], alone[-1]), f"decoded among 3, seed {fresh_seed}"


def test_an_moe_models_logits_alone_equal_its_logits_in_a_batch(fresh_seed):
    """tiny-moe (one layer) through `forward_paged`: a prefill's logits alone equal its logits among other
    sequences (its experts get other row counts: the tiled experts, the router's product and
    softmax), and the default forward's up to rounding. (The default forward differs here in the
    last bits; its experts alone kept theirs at these shapes: XLA CPU lowers `lax.ragged_dot`
    to one dense dot over a masked operand, docs/batch_invariance.md.)"""
    rng = np.random.default_rng(fresh_seed)
    cfg = preset("tiny-moe", num_layers=1)  # (one layer: half the compile)
    params = _random_params(cfg, fresh_seed)
    kv = init_kv_cache(cfg, 40, 8, "auto")

    @partial(jax.jit, static_argnames="numerics")
    def logits(batch, numerics):
        hidden, _ = forward_paged(params, cfg, batch, kv, numerics=numerics)
        return compute_logits(params, cfg, hidden, numerics)

    def batch_of(seqs, num_tokens):
        pages = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(len(seqs))]
        return build_ragged_batch(seqs, [0] * len(seqs), pages, num_tokens=num_tokens,
                                  num_seqs=8, pages_per_seq=4)  # fmt: skip

    probe = rng.integers(3, 512, int(rng.integers(2, 16))).tolist()
    alone = np.asarray(logits(batch_of([probe], 16), BATCH_INVARIANT))[: len(probe)]
    seqs = [rng.integers(3, 512, int(n)).tolist() for n in rng.integers(1, 17, 3)]
    at = int(rng.integers(4))
    seqs.insert(at, probe)
    rows = slice(sum(map(len, seqs[:at])), sum(map(len, seqs[: at + 1])))
    batch = batch_of(seqs, 64)
    got = np.asarray(logits(batch, BATCH_INVARIANT))[rows]
    assert np.array_equal(got, alone), f"sequence {at} of 4, seed {fresh_seed}"
    default = np.asarray(logits(batch, DEFAULT_NUMERICS))[rows]
    np.testing.assert_allclose(got, default, atol=1e-4, err_msg=f"seed {fresh_seed}")


# ---- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny")
    return cfg, _random_params(cfg, 0)


def _engine(model, **overrides) -> Engine:
    cfg, params = model
    config = {**SMALL, "batch_invariant": True, **overrides}
    return Engine(EngineConfig(model="preset:tiny", **config), cfg, params)


def _run(engine: Engine, requests):
    """(tokens, logprobs, top logprobs) of each request, and the sequences."""
    seqs = [engine.add_request(p, s) for p, s in requests]
    engine.run()
    assert all(s.error is None for s in seqs), [s.error for s in seqs]
    outs = [(tuple(s.output_token_ids), tuple(lp["logprob"] for lp in s.output_logprobs),
             tuple(tuple(sorted(lp["top"].items())) for lp in s.output_logprobs))
            for s in seqs]  # fmt: skip
    return outs, seqs


def _probes(rng):
    """Greedy probes and a seeded sampled one (its tokens are invariant too)."""
    prompts = [rng.integers(3, 512, n).tolist() for n in PROBE_LENS]
    sampling = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)] * 2 + [
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, temperature=0.8, top_p=0.9,
                       seed=int(rng.integers(2**31)))]  # fmt: skip
    return list(zip(prompts, sampling, strict=True))


def _fillers(rng, n, long=False):
    """n filler requests of random lengths, or (`long`) of 56 prompt and 16 output tokens each:
    with the probes that is 60 pages at the end for SMALL's 24, and every admitted request
    grows by a page or two while decoding, so a batch of 8 preempts whatever its order (all 336
    orders of 3 probes among 5 such fillers did; the lengths alone decide the schedule)."""

    def lengths():
        return (56, 16) if long else (int(rng.integers(20, 60)), int(rng.integers(4, 16)))

    return [(rng.integers(3, 512, p).tolist(),
             SamplingParams(max_tokens=o, ignore_eos=True, logprobs=2))
            for p, o in (lengths() for _ in range(n))]  # fmt: skip


def _batch(probes, fillers, rng, probes_first=False):
    """The probes and fillers shuffled (`probes_first`: the probes shuffled, then the fillers):
    (requests, index of each probe in them)."""
    n = len(probes)
    order = (np.concatenate([rng.permutation(n), n + rng.permutation(len(fillers))])
             if probes_first else rng.permutation(n + len(fillers)))  # fmt: skip
    requests = [(probes + fillers)[i] for i in order]
    return requests, [int(np.flatnonzero(order == i)[0]) for i in range(len(probes))]


@pytest.fixture(scope="module")
def base(model):
    """The engine every test's probes run alone on (the reference outputs)."""
    return _engine(model)


def _alone(engine: Engine, probes):
    return [_run(engine, [p])[0][0] for p in probes]


def test_batch_sizes_and_preemption_leave_logprobs_bitwise(base, fresh_seed):
    check_batches(base, fresh_seed)


def check_batches(base, seed):
    """Probes alone, then inside shuffled batches of 2, 5 and 8 (the 8 preempt): bit for bit."""
    rng = np.random.default_rng(seed)
    probes = _probes(rng)
    alone = _alone(base, probes)
    preempted = 0
    for size in (2, 5, 8):
        chosen = [int(rng.integers(len(probes)))] if size == 2 else list(range(len(probes)))
        fillers = _fillers(rng, size - len(chosen), long=size == 8)
        requests, at = _batch([probes[i] for i in chosen], fillers, rng)
        outs, seqs = _run(base, requests)
        preempted += sum(s.num_preemptions for s in seqs)
        for i, j in zip(chosen, at, strict=True):
            assert outs[j] == alone[i], f"probe {i} in a batch of {size}, seed {seed}"
    assert preempted > 0, f"no batch preempted a request, seed {seed}"


# 64 sequences of up to ~60 + 16 tokens (5 pages of 16 each) with room to spare; two decode
# buckets (the probes alone run in 8 rows, the batches in 64) and token buckets up to 128 keep
# the compiles short (with every bucket the engine compiled for over 170 s on the H200)
WIDE = dict(page_size=16, num_pages=400, max_num_seqs=64, max_num_batched_tokens=128,
            decode_buckets=[8, 64])  # fmt: skip

VARIANTS = [
    dict(max_num_batched_tokens=16),  # prefill in chunks of at most 16 tokens
    dict(prefix_caching=True),
    # drafts verified in mixed steps (decode_steps 1: no scans; the base decodes in scans), in
    # chunks of at most 32 tokens
    dict(
        speculative={"method": "ngram", "num_draft_tokens": 3},
        decode_steps=1,
        max_num_batched_tokens=32,
    ),
]


def _variant_id(v):
    return ",".join(f"{k}={x}" for k, x in v.items())


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_chunking_prefix_caching_and_speculation_leave_logprobs_bitwise(model, base, variant,
                                                                        fresh_seed):  # fmt: skip
    check_variant(model, base, variant, fresh_seed)


def check_variant(model, base, variant, seed, **common):
    """The probes alone on `base` and inside a shuffled batch of 8 on an engine with `variant`'s
    settings (and `common`'s, as `base`'s): bit for bit."""
    rng = np.random.default_rng(seed)
    probes = _probes(rng)
    alone = _alone(base, probes)
    engine = _engine(model, **common, **variant)
    cached = bool(variant.get("prefix_caching"))
    if cached:  # the probes' pages cached, then hit inside the batch (admitted before any filler
        # can evict them)
        assert _alone(engine, probes) == alone, f"seed {seed}"
    requests, at = _batch(probes, _fillers(rng, 5), rng, probes_first=cached)
    outs, seqs = _run(engine, requests)
    for i, j in enumerate(at):
        assert outs[j] == alone[i], f"probe {i}, {variant}, seed {seed}"
    if cached:
        assert sum(seqs[j].num_cached_tokens for j in at) > 0, f"no prefix hit, seed {seed}"
    if "speculative" in variant:
        assert sum(r.draft_tokens for r in engine.step_records) > 0, "nothing was drafted"


def test_batches_of_16_and_64_leave_logprobs_bitwise(model, fresh_seed):
    """The probes alone and inside shuffled batches of 16 and 64 (decode rows past XLA CPU's
    64-row kernel change)."""
    check_large_batches(_engine(model, **WIDE), fresh_seed)


def test_fp8_pages_leave_logprobs_bitwise(model, fresh_seed):
    """FP8 KV pages under the switch (written at one fixed scale: a page's bits do not depend on
    how its tokens were grouped into writes): the batches with preemption, and a prefill in
    chunks of 16 tokens, bit for bit."""
    fp8 = dict(kv_dtype="float8_e4m3fn")
    base = _engine(model, **fp8)
    assert base.runner.kv.is_quantized
    check_batches(base, fresh_seed)
    check_variant(model, base, VARIANTS[0], fresh_seed, **fp8)


def test_default_numerics_differ_on_the_same_comparison(model, base):
    """The control: without the switch a batch of 8 changes logprobs (so the tests above can
    fail). A fixed draw (the greedy probes): on XLA CPU a prefill row in a 16- or 32-token step
    and in a 64-token one rounds differently (the matmul kernel changes at 64 rows). And the
    invariant engine computes the same model: its tokens are the default's, its logprobs equal
    up to rounding."""
    alone, inv_alone = check_control(model, base)
    for (tokens, lps, _), (inv_tokens, inv_lps, _) in zip(alone, inv_alone, strict=True):
        assert tokens == inv_tokens
        np.testing.assert_allclose(inv_lps, lps, atol=1e-4)


def check_control(model, base, **common):
    """Asserts that default numerics change the greedy probes' logprobs inside a batch of 8;
    returns (the probes alone by default, alone batch-invariant)."""
    rng = np.random.default_rng(0)
    probes = _probes(rng)[:2]
    engine = _engine(model, batch_invariant=False, **common)
    alone = _alone(engine, probes)
    requests, at = _batch(probes, _fillers(rng, 6), rng)
    outs, _ = _run(engine, requests)
    assert any(outs[j][1] != alone[i][1] for i, j in enumerate(at)), "no logprob differed"
    return alone, _alone(base, probes)


# ---- on the GPU: bfloat16, the invariant GEMM kernel -------------------------------------------


@pytest.fixture(scope="module")
def gpu_model():
    """A bf16 model whose every matmul fits the invariant GEMM kernel (K multiples of 64, N of
    64), so the engine runs it for all of them."""
    cfg = preset("tiny", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                 head_dim=64, dtype="bfloat16", param_dtype="bfloat16")  # fmt: skip
    return cfg, _random_params(cfg, 0)


# The kernel's smallest page: 11 usable pages of 16 slots (176 tokens), as tight as SMALL's pool.
GPU_PAGES = dict(page_size=16, num_pages=12)


@pytest.fixture(scope="module")
def gpu_base(gpu_model):
    return _engine(gpu_model, **GPU_PAGES)


@pytest.mark.gpu
def test_gpu_batch_sizes_and_preemption_leave_logprobs_bitwise(gpu_base, fresh_seed):
    assert gpu_base.runner.numerics.gpu, "the engine did not resolve GPU numerics"
    pool, _ = gpu_base.runner.kv.pool()
    q = jax.ShapeDtypeStruct((1, 4, 64), jnp.bfloat16)
    assert resolve_backend(gpu_base.runner.attention.backend, q, pool) == "pallas"
    check_batches(gpu_base, fresh_seed)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_gpu_chunking_prefix_caching_and_speculation_leave_logprobs_bitwise(
    gpu_model, gpu_base, variant, fresh_seed
):
    check_variant(gpu_model, gpu_base, variant, fresh_seed, **GPU_PAGES)


@pytest.mark.gpu
def test_gpu_default_numerics_differ_on_the_same_comparison(gpu_model, gpu_base):
    """The control on the GPU (default: the kernel's batch-shaped configurations, XLA's GEMMs);
    and the invariant engine computes the same model: each probe's first token by default is
    among the invariant engine's two most likely there, with the same logprob to bf16 rounding
    (random weights make near-ties: greedy picks may differ)."""
    alone, inv_alone = check_control(gpu_model, gpu_base, **GPU_PAGES)
    for (tokens, lps, _), (_, _, inv_top) in zip(alone, inv_alone, strict=True):
        top = dict(inv_top[0])
        assert tokens[0] in top, (tokens[0], top)
        np.testing.assert_allclose(top[tokens[0]], lps[0], atol=0.05)


def check_large_batches(engine: Engine, seed: int, sizes=(16, 64)):
    """Probes alone, then inside shuffled batches of `sizes` requests (random fillers): bit for
    bit. `engine` must hold max(sizes) sequences."""
    rng = np.random.default_rng(seed)
    probes = _probes(rng)
    alone = _alone(engine, probes)
    for size in sizes:
        requests, at = _batch(probes, _fillers(rng, size - len(probes)), rng)
        outs, _ = _run(engine, requests)
        for i, j in enumerate(at):
            assert outs[j] == alone[i], f"probe {i} at {j} of a batch of {size}, seed {seed}"


@pytest.mark.gpu
def test_gpu_batches_of_16_and_64_leave_logprobs_bitwise(gpu_model, fresh_seed):
    check_large_batches(_engine(gpu_model, **WIDE), fresh_seed)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8_block", "nvfp4"])
def test_gpu_weight_formats_leave_logprobs_bitwise(gpu_model, fmt, fresh_seed):
    """Weight formats under the switch on the GPU: each product over fixed 8-row tiles (int8 and
    nvfp4 on the weight-only kernel, fp8_block on our block-scaled kernel)."""
    engine = _engine(gpu_model, quant={"weights": fmt}, **GPU_PAGES)
    assert engine.model_config.has_formats, fmt
    check_batches(engine, fresh_seed)


@pytest.mark.gpu
def test_gpu_fp8_pages_leave_logprobs_bitwise(gpu_model, fresh_seed):
    """FP8 pages at the fixed scale, read by the attention kernel's invariant form."""
    engine = _engine(gpu_model, kv_dtype="float8_e4m3fn", **GPU_PAGES)
    assert engine.runner.kv.is_quantized
    check_batches(engine, fresh_seed)


@pytest.mark.gpu
def test_gpu_moe_model_leaves_logprobs_bitwise(fresh_seed):
    """A bf16 MoE model on the GPU (its experts in the tiled XLA form, the router's product and
    softmax invariant): batches of 2, 5 and 8 with preemption, bit for bit."""
    cfg = preset("tiny-moe", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                 moe=MoeConfig(num_experts=8, experts_per_token=2, expert_size=128),
                 dtype="bfloat16", param_dtype="bfloat16")  # fmt: skip
    engine = _engine((cfg, _random_params(cfg, 0)), **GPU_PAGES)
    assert engine.runner.numerics.gpu, "the engine did not resolve GPU numerics"
    check_batches(engine, fresh_seed)


# ---- the switch --------------------------------------------------------------------------------


@dataclass
class _Root:
    engine: EngineConfig = field(default_factory=EngineConfig)


def test_the_switch_is_a_checked_engine_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("engine:\n  batch_invariant: true\n")
    assert load_config(_Root, path, what="test").engine.batch_invariant
    over = load_config(_Root, None, ["engine.batch_invariant=true"], what="test")
    assert over.engine.batch_invariant and not EngineConfig().batch_invariant
    with pytest.raises(ValueError, match=r"engine\.batch_invariant"):
        EngineConfig(batch_invariant="yes")
    with pytest.raises(ValueError, match=r"engine\.attention_backend"):
        EngineConfig(batch_invariant=True, attention_backend="cudnn")
    with pytest.raises(ValueError, match=r"engine\.moe_backend"):
        EngineConfig(batch_invariant=True, moe_backend="pallas")
    assert EngineConfig(batch_invariant=True, mesh={"model": 2, "data": 1}).mesh["model"] == 2
    for axis in ("data", "expert"):
        with pytest.raises(ValueError, match=rf"\"model\" axis only.*also splits \['{axis}'\]"):
            EngineConfig(batch_invariant=True, mesh={"model": 2, axis: 2})


def test_tensor_parallelism_is_refused_on_gpus_only():
    """The CPU forms run under tensor parallelism (the test below); the GPU kernels do not yet."""
    from types import SimpleNamespace

    from jaxinfer.engine.model_runner import resolve_numerics

    config = EngineConfig(batch_invariant=True, mesh={"model": 2})
    assert resolve_numerics(config, SimpleNamespace(platform="cpu")) == BATCH_INVARIANT
    with pytest.raises(ValueError, match=r"on GPUs runs on one device: engine\.mesh="):
        resolve_numerics(config, SimpleNamespace(platform="gpu"))
    one = resolve_numerics(EngineConfig(batch_invariant=True), SimpleNamespace(platform="gpu"))
    assert one.batch_invariant and one.gpu


TENSOR_PARALLEL = """
    import sys
    sys.path.insert(0, "tests")
    import test_batch_invariance as tbi
    from jaxinfer.models.presets import preset

    for name in ("tiny", "tiny-moe"):
        cfg = preset(name)
        base = tbi._engine((cfg, tbi._random_params(cfg, 0)), mesh={"model": 2})
        assert base.shardings.mesh.shape["model"] == 2, base.shardings.mesh
        tbi.check_batches(base, SEED)
    print("ok")
"""


def test_tensor_parallel_batches_leave_logprobs_bitwise(run_on_cpu_devices, fresh_seed):
    """tiny and tiny-moe on 2 CPU devices (the model axis: attention per device, row-parallel O
    and down projections summed across them): probes alone equal the same probes in shuffled
    batches of 2, 5 and 8, with preemption, bit for bit (seed in the subprocess's failure)."""
    run_on_cpu_devices(TENSOR_PARALLEL.replace("SEED", str(fresh_seed)), 2)
