"""Data-parallel replicas behind one queue, on two forced CPU devices (in a subprocess: the device
count is fixed when jax starts)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxinfer.engine.config import EngineConfig

SCRIPT = textwrap.dedent("""
    import os, json, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import numpy as np
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams
    rng = np.random.default_rng()
    prompts = [rng.integers(1, 4000, int(n)).tolist() for n in rng.integers(3, 40, 20)]
    prompts.append([])  # a bad request fails alone
    sp = SamplingParams(max_tokens=7, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, num_pages=64, page_size=16,
              max_model_len=128, decode_steps=4, attention_backend="xla")
    one = LLM("tiny", **kw).generate(prompts, sp)
    llm = LLM("tiny", data_parallel=2, **kw)
    two = llm.generate(prompts, sp)
    devices = [str(next(iter(e.runner.kv.k_pages.devices()))) for e in llm.engine.replicas]
    print(json.dumps({
        "one": [o.token_ids for o in one], "two": [o.token_ids for o in two],
        "errors": [o.error for o in two], "assign": list(llm.engine.assignments.values()),
        "compiles": llm.engine.compiles_after_warmup, "devices": devices}))
""")


def test_two_replicas_serve_one_queue_with_one_engines_tokens(tmp_path: Path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["two"][:-1] == out["one"][:-1]  # greedy tokens independent of the replica
    assert all(len(t) == 7 for t in out["two"][:-1])
    assert out["errors"][-1] and "empty" in out["errors"][-1]
    assert sorted(set(out["assign"])) == [0, 1]  # both replicas took work from the queue
    assert out["compiles"] == 0
    assert len(set(out["devices"])) == 2  # each replica's KV cache on its own device


def test_data_parallel_option_is_validated():
    with pytest.raises(ValueError, match="data_parallel"):
        EngineConfig(model="preset:tiny", data_parallel=0)
