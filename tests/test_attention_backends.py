"""The model's paged forward on the Mosaic kernel (GPU interpreter on CPU) against the XLA path.

An engine run on the interpreted kernel takes minutes, so this checks what the engine calls: a
chunked-prefill step then a decode step of the shipped model over a bf16 page pool.
"""

from __future__ import annotations

import jax
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


def test_backend_option_is_validated():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="preset:tiny", attention_backend="flash")
    cfg, _ = load_model("tiny")[:2]
    kv = init_kv_cache(cfg, 4, 16, dtype="float32")
    with pytest.raises(ValueError, match="bf16 or fp8"):
        paged_attention(None, kv, 0, None, backend="pallas")
