"""The model's paged forward on the Mosaic kernel (GPU interpreter on CPU) against the XLA path.

An engine run on the interpreted kernel takes minutes, so this checks what the engine calls: a
chunked-prefill step then a decode step over a bf16 page pool, of a one-layer random model of the
kernel's shapes (head dim 64, 2 query heads per KV head; the interpreter's time grows with
layers). `tests/test_gpu_engine.py` runs the whole engine on the compiled kernel.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention_kernel import interpreter_compiles_each_thread_once

from jaxinfer.engine.config import EngineConfig
from jaxinfer.kv.cache import init_kv_cache
from jaxinfer.models.attention import ATTENTION_OPTIONS, AttentionConfig, write_kv_and_attend
from jaxinfer.models.batch import build_ragged_batch
from jaxinfer.models.dense import forward_paged
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params


@pytest.fixture(scope="module", autouse=True)
def _interpreter_compiles_each_thread_once():
    with interpreter_compiles_each_thread_once():  # (the prefill launches are warp-specialised)
        yield


def load_model(seed: int = 0):
    cfg = preset("tiny", hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64,
                 param_dtype="bfloat16", dtype="bfloat16")  # fmt: skip
    return cfg, init_params(cfg, jax.random.key(seed))


# One jitted step for every test: a batch shape and backend compiled once serves them all.
step = jax.jit(forward_paged, static_argnames=("cfg", "attention"))


def test_pallas_backend_matches_xla_through_prefill_and_decode(fresh_seed):
    cfg, params = load_model()
    rng = np.random.default_rng(fresh_seed)
    p1, p2 = [list(rng.integers(1, cfg.vocab_size, n)) for n in (21, 7)]
    hidden = {}
    for backend in ("xla", "pallas"):
        kv = init_kv_cache(cfg, 48, 16, dtype="bfloat16")
        attention = AttentionConfig(backend)
        prefill = build_ragged_batch([p1, p2], [0, 0], [[5, 2], [7]], num_tokens=32, num_seqs=4,
                                     pages_per_seq=4, max_q_len=32)  # fmt: skip
        h1, kv = step(params, cfg, prefill, kv, attention=attention)
        decode = build_ragged_batch([[5], [9]], [21, 7], [[5, 2], [7]], num_tokens=8, num_seqs=4,
                                    pages_per_seq=4, max_q_len=1)  # fmt: skip
        h2, kv = step(params, cfg, decode, kv, attention=attention)
        hidden[backend] = [np.asarray(h1[:28], np.float32), np.asarray(h2[:2], np.float32)]
    for ref, out in zip(hidden["xla"], hidden["pallas"], strict=True):
        assert np.isfinite(out).all()
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_step_writes_kv_in_the_kernel(monkeypatch, fresh_seed, q_len):
    """A decode step on the Pallas backend writes its K/V inside the attention kernel (no XLA
    scatter): the same hidden states and the same pages (bar the scratch page, where only the
    scatter writes padding tokens) as with `fused_kv_write` off, and the fused launch ran. So does a
    verification-shaped step (3 tokens a sequence, in decode blocks)."""
    from pallas_kernels.paged_attention import mosaic_gpu

    writes = []
    launch = mosaic_gpu._launch

    def spy(*a, **kw):
        writes.append(kw.get("write_kv", False))
        return launch(*a, **kw)

    monkeypatch.setattr(mosaic_gpu, "_launch", spy)
    cfg, params = load_model()
    rng = np.random.default_rng(fresh_seed)
    p1, p2 = [list(rng.integers(1, cfg.vocab_size, n)) for n in (21, 15)]
    prefill = build_ragged_batch([p1, p2], [0, 0], [[5, 2], [7]], num_tokens=48, num_seqs=4,
                                 pages_per_seq=4, max_q_len=48)  # fmt: skip
    kv0 = init_kv_cache(cfg, 48, 16, dtype="bfloat16")
    _, kv0 = step(params, cfg, prefill, kv0, attention=AttentionConfig())
    # sequence 1's new tokens cross from page 1 into page 2 of its table (positions 15, 16, ..)
    new = [list(rng.integers(1, cfg.vocab_size, q_len)) for _ in range(2)]
    decode = build_ragged_batch(new, [21, 15], [[5, 2], [7, 3]], num_tokens=8, num_seqs=4,
                                pages_per_seq=4, max_q_len=q_len)  # fmt: skip
    out = {}
    for fused in (True, False):
        # (a jit of its own: the spy sees the launch when the step is traced)
        fused_step = jax.jit(lambda p, b, kv, fused=fused: forward_paged(
            p, cfg, b, kv, attention=AttentionConfig("pallas", (("fused_kv_write", fused),))))  # fmt: skip
        writes.clear()
        h, kv = fused_step(params, decode, jax.tree.map(jnp.copy, kv0))
        assert writes and set(writes) == {fused}, writes  # (the layer is traced once)
        out[fused] = np.asarray(h[: 2 * q_len], np.float32), np.asarray(kv.pages[:, 1:], np.float32)
    # a decode step past the token limit (an int option) scatters first: the launch is decided
    # while tracing, so a trace (no run of the interpreted kernel) shows it
    writes.clear()
    jax.eval_shape(functools.partial(forward_paged, cfg=cfg, attention=AttentionConfig(
        "pallas", (("fused_kv_write", 7),))), params, batch=decode, kv=kv0)  # fmt: skip
    assert writes and not any(writes), writes
    np.testing.assert_array_equal(out[True][1], out[False][1])
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    h_xla, _ = step(params, cfg, decode, jax.tree.map(jnp.copy, kv0), attention=AttentionConfig())
    ref = np.asarray(h_xla[: 2 * q_len], np.float32)
    assert np.linalg.norm(out[True][0] - ref) / np.linalg.norm(ref) < 1e-2, f"seed {fresh_seed}"
    # the new slots were empty before (pool pages 2, 7, 3 are indices 1, 6, 2 here)
    before = np.asarray(kv0.pages[:, 1:], np.float32)
    slots = [(1, 5 + j) for j in range(q_len)] + [(6 if j == 0 else 2, (15 + j) % 16)
                                                   for j in range(q_len)]  # fmt: skip
    for page, slot in slots:
        assert np.all(before[:, page, :, slot] == 0), (page, slot)
        # (written: the pages equal the scatter's, above; a K or V element may be 0 in bf16)
        assert np.count_nonzero(out[True][1][:, page, :, slot]) > 0, (page, slot)


def test_mixed_step_and_kernel_options(fresh_seed):
    """A step mixing a decode token and a prompt chunk (the kernel's two launches) against XLA,
    after an XLA prefill; kernel options reach the kernel (a bad value raises there)."""
    cfg, params = load_model()
    rng = np.random.default_rng(fresh_seed)
    p1, p2 = [list(rng.integers(1, cfg.vocab_size, n)) for n in (21, 9)]
    prefill = build_ragged_batch([p1], [0], [[5, 2]], num_tokens=32, num_seqs=4, pages_per_seq=4,
                                 max_q_len=32)  # fmt: skip
    mixed = build_ragged_batch([[5], p2], [21, 0], [[5, 2], [7]], num_tokens=16, num_seqs=4,
                               pages_per_seq=4, max_q_len=16)  # fmt: skip
    kv = init_kv_cache(cfg, 48, 16, dtype="bfloat16")
    _, kv = step(params, cfg, prefill, kv, attention=AttentionConfig())
    hidden = {}
    for backend in ("xla", "pallas"):
        h, _ = step(
            params, cfg, mixed, jax.tree.map(jnp.copy, kv), attention=AttentionConfig(backend)
        )
        hidden[backend] = np.asarray(h[:10], np.float32)
    out, ref = hidden["pallas"], hidden["xla"]
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    with pytest.raises(ValueError, match="block_kv"):  # (raised while tracing: no kernel runs)
        jax.eval_shape(functools.partial(forward_paged, cfg=cfg, attention=AttentionConfig(
            "pallas", (("block_kv", 96),))), params, batch=mixed, kv=kv)  # fmt: skip


def test_backend_option_is_validated():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="preset:tiny", attention_backend="flash")
    with pytest.raises(ValueError, match=r"attention_options\.num_warps"):
        EngineConfig(model="preset:tiny", attention_options={"num_warps": 4})
    assert EngineConfig(attention_options={"split_decode_rows": False}).attention_options
    # every option's values are checked at configuration (the kernel meets them only when a step
    # is traced for a GPU; a CPU run would ignore them)
    good = dict(split_decode_rows=False, num_splits=3, num_stages=2, warp_specialized=True,
                block_kv=128, num_consumers=2, token_major_decode=False, fused_kv_write=32)  # fmt: skip
    assert EngineConfig(attention_options=good).attention_options == good
    bad = dict(split_decode_rows=1, num_splits=0, num_stages="2", warp_specialized="yes",
               block_kv=96, num_consumers=True, token_major_decode=None, fused_kv_write=-1)  # fmt: skip
    assert set(bad) == set(good) == set(ATTENTION_OPTIONS)
    for key, value in bad.items():
        with pytest.raises(ValueError, match=re.escape(f"options.{key}={value!r} is invalid")):
            EngineConfig(attention_options={key: value})
    cfg, _ = load_model()
    kv = init_kv_cache(cfg, 4, 16, dtype="float32")
    with pytest.raises(ValueError, match="bf16 or fp8"):
        write_kv_and_attend(None, None, None, kv, 0, None, None, None,
                            attention=AttentionConfig("pallas"))  # fmt: skip
    with pytest.raises(ValueError, match="attention backend"):
        AttentionConfig("flash")
