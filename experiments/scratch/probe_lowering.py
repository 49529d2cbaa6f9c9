"""Probe: seconds to trace and to lower one decode-scan and one mixed-step bucket of the 8B shape.

Abstract params and cache (nothing is allocated), so it runs anywhere for `xla`; `pallas` needs the
GPU (the Mosaic kernel lowers only there). The warm-up's `lower_s` is this, summed over buckets.
Usage: python experiments/scratch/probe_lowering.py pallas|xla
"""

import sys
import time

import jax
import numpy as np

from jaxinfer.engine import model_runner as mr
from jaxinfer.engine.sampler import SamplingBatch
from jaxinfer.kv.cache import PageTable, init_kv_cache
from jaxinfer.models.batch import RaggedBatch
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import abstract_params

backend = sys.argv[1]
cfg = preset("llama3-8b")
params = abstract_params(cfg)
kv = jax.eval_shape(lambda: init_kv_cache(cfg, 1024, 16, "auto"))
P = 129


def z(*s, d=np.int32):
    return np.zeros(s, d)


for S in (32, 64, 128, 256):
    st = mr.DecodeState(z(S), z(S), z(S), z(S, 8), z(S, d=np.bool_))
    sb = SamplingBatch.build([], [], [], S)
    kw = dict(cfg=cfg, num_steps=8, num_logprobs=0, backend=backend, options=())
    t = time.perf_counter()
    tr = mr.decode_loop.trace(params, kv, z(S, P), st, sb, **kw)
    t1 = time.perf_counter()
    low = tr.lower()
    t2 = time.perf_counter()
    T = S * 8
    batch = RaggedBatch(z(T), z(T), z(S + 1), PageTable(z(S, P), z(S)), T)
    tr = mr.mixed_step.trace(params, kv, batch, z(S), cfg=cfg, backend=backend, options=())
    t3 = time.perf_counter()
    low2 = tr.lower()
    t4 = time.perf_counter()
    print(
        f"S={S} decode trace {t1 - t:.2f}s lower {t2 - t1:.2f}s | mixed trace {t3 - t2:.2f}s lower {t4 - t3:.2f}s  hlo chars {len(low.as_text())}",
        flush=True,
    )
