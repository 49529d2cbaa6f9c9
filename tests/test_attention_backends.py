"""The model's paged forward on the Mosaic kernel (GPU interpreter on CPU) against the XLA path.

An engine run on the interpreted kernel takes minutes, so this checks what the engine calls: a
chunked-prefill step then a decode step of the shipped model over a bf16 page pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.loading import load_model
from jaxinfer.kv.cache import init_kv_cache
from jaxinfer.models.attention import paged_attention
from jaxinfer.models.batch import build_ragged_batch
from jaxinfer.models.dense import forward_paged


def test_pallas_backend_matches_xla_through_prefill_and_decode():
    cfg, params = load_model("tiny")[:2]
    rng = np.random.default_rng()
    p1, p2 = [list(rng.integers(1, cfg.vocab_size, n)) for n in (21, 7)]
    hidden = {}
    for backend in ("xla", "pallas"):
        kv = init_kv_cache(cfg, 48, 16, dtype="bfloat16")
        step = jax.jit(lambda p, b, kv, backend=backend: forward_paged(
            p, cfg, b, kv, attention_backend=backend))  # fmt: skip
        prefill = build_ragged_batch([p1, p2], [0, 0], [[5, 2], [7]], num_tokens=32, num_seqs=4,
                                     pages_per_seq=4, max_q_len=32)  # fmt: skip
        h1, kv = step(params, prefill, kv)
        decode = build_ragged_batch([[5], [9]], [21, 7], [[5, 2], [7]], num_tokens=8, num_seqs=4,
                                    pages_per_seq=4, max_q_len=1)  # fmt: skip
        h2, kv = step(params, decode, kv)
        hidden[backend] = [np.asarray(h1[:28], np.float32), np.asarray(h2[:2], np.float32)]
    for ref, out in zip(hidden["xla"], hidden["pallas"], strict=True):
        assert np.isfinite(out).all()
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_mixed_step_and_kernel_options():
    """A step mixing a decode token and a prompt chunk (the kernel's two launches) against XLA,
    after an XLA prefill; kernel options reach the kernel (a bad value raises there)."""
    cfg, params = load_model("tiny")[:2]
    rng = np.random.default_rng()
    p1, p2 = [list(rng.integers(1, cfg.vocab_size, n)) for n in (21, 9)]
    prefill = build_ragged_batch([p1], [0], [[5, 2]], num_tokens=32, num_seqs=4, pages_per_seq=4,
                                 max_q_len=32)  # fmt: skip
    mixed = build_ragged_batch([[5], p2], [21, 0], [[5, 2], [7]], num_tokens=16, num_seqs=4,
                               pages_per_seq=4, max_q_len=16)  # fmt: skip
    kv = init_kv_cache(cfg, 48, 16, dtype="bfloat16")
    _, kv = jax.jit(lambda p, b, kv: forward_paged(p, cfg, b, kv))(params, prefill, kv)
    hidden = {}
    for backend in ("xla", "pallas"):
        step = jax.jit(lambda p, b, kv, backend=backend: forward_paged(
            p, cfg, b, kv, attention_backend=backend))  # fmt: skip
        h, _ = step(params, mixed, jax.tree.map(jnp.copy, kv))
        hidden[backend] = np.asarray(h[:10], np.float32)
    out, ref = hidden["pallas"], hidden["xla"]
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    with pytest.raises(ValueError, match="block_kv"):
        forward_paged(params, cfg, mixed, kv, attention_backend="pallas",
                      attention_options=(("block_kv", 96),))  # fmt: skip


def test_backend_option_is_validated():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="preset:tiny", attention_backend="flash")
    with pytest.raises(ValueError, match=r"attention_options\.num_warps"):
        EngineConfig(model="preset:tiny", attention_options={"num_warps": 4})
    assert EngineConfig(attention_options={"split_decode_rows": False}).attention_options
    cfg, _ = load_model("tiny")[:2]
    kv = init_kv_cache(cfg, 4, 16, dtype="float32")
    with pytest.raises(ValueError, match="bf16 or fp8"):
        paged_attention(None, kv, 0, None, backend="pallas")
