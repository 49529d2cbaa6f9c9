"""The engine on the Pallas attention kernel against the engine on XLA's attention (GPU only:
`python -m pytest -m gpu tests/test_gpu_engine.py`).

No CPU test runs the compiled kernel inside the engine, and the CPU interpreter cannot see
memory-ordering bugs (`tests/test_paged_attention_kernel.py` says what only the GPU checks). Here
the shipped `tiny` model (trained, head dim 64) serves the same requests with
`attention_backend` pallas and xla, with bf16 and fp8 pages, through mixed steps (prefill chunks
with decodes), decode scans (the kernel's fused K/V write at <= 64 tokens) and preemption (a
pool too small for all requests at once): the greedy tokens must agree, up to near-ties of the
XLA run's own logits (bf16 numerics differ between the two). Then every page, free or scratch,
and every FP8 scale is poisoned with NaN and the pallas engine must give the same tokens again:
a read of a page a sequence does not own, or past its length, would reach an output.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [
    "def read_config(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "    for i in range(len(items)):\n        if items[i] is None:\n",
    '"""Utilities for parsing command lines."""\n\nimport re\n',
    "def fib(n):\n    if n < 2:\n        return n\n",
    "try:\n    import json\nexcept ImportError:\n",
    "    def __repr__(self):\n        return",
] * 3  # 24 requests: more than the pool holds at once
MAX_TOKENS = [40, 64, 23, 80, 17, 55, 31, 72] * 3
ENGINE = dict(dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=128, page_size=16,
              max_model_len=256, decode_steps=8, num_logprobs=2, compile_workers=8)  # fmt: skip
# Top-2 logprob gap under which the two backends may pick differently: the logits are computed in
# bf16 (the model's dtype), whose spacing at |logit| in [8, 16) is 1/16, so two ulps are a tie.
NEAR_TIE = 2 / 16 + 1e-3


def serve(llm: LLM):
    sampling = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=2) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, sampling)
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    assert llm.engine.compiles_after_warmup == 0
    return outs


def assert_same_up_to_near_ties(ref, got, what: str) -> None:
    identical = 0
    for r, g in zip(ref, got, strict=True):
        if r.token_ids == g.token_ids:
            identical += 1
            continue
        i = next(
            j for j, (a, b) in enumerate(zip(r.token_ids, g.token_ids, strict=False)) if a != b
        )
        top = sorted(r.logprobs[i]["top"].values(), reverse=True)
        assert top[0] - top[1] < NEAR_TIE, (what, r.request_id, i, top, r.token_ids, g.token_ids)
    assert identical >= 0.8 * len(ref), f"{what}: {identical} of {len(ref)} identical"


def poison(llm: LLM) -> None:
    runner = llm.engine.runner
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.capacity  # every request done: every page free
    kv = runner.kv  # host arrays moved to the device: nothing is compiled
    pages = np.full(kv.pages.shape, np.nan, kv.pages.dtype)
    scales = None if kv.scales is None else np.full(kv.scales.shape, np.nan, np.float32)
    runner.kv = jax.device_put(type(kv)(pages, scales), jax.tree.map(lambda a: a.sharding, kv))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs the compiled kernel")
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_pallas_engine_gives_the_xla_engines_tokens(kv_dtype):
    num_pages = 1 + 40  # 40 pages of 16 tokens: some of the 24 requests wait or are preempted
    outs = {}
    for backend in ("xla", "pallas"):
        llm = LLM("tiny", attention_backend=backend, kv_dtype=kv_dtype, num_pages=num_pages,
                  **ENGINE)  # fmt: skip
        outs[backend] = serve(llm)
        records = llm.engine.step_records
        assert any(r.decode_steps > 1 for r in records), "no decode scan ran"
        assert any(not r.is_decode_only for r in records), "no mixed step ran"
        assert sum(o.num_preemptions for o in outs[backend]) > 0, "nothing was preempted"
        if backend == "pallas":
            poison(llm)
            again = serve(llm)
            assert [o.token_ids for o in again] == [o.token_ids for o in outs["pallas"]], (
                "tokens changed after every page was poisoned with NaN"
            )
            assert all(np.isfinite([lp["logprob"] for lp in o.logprobs]).all() for o in again)
    assert_same_up_to_near_ties(outs["xla"], outs["pallas"], kv_dtype)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs the compiled kernel")
def test_verification_in_decode_blocks_gives_the_xla_engines_tokens():
    """Speculative rounds (n-gram drafts, gamma 4: 5 rows a sequence) in the kernel's decode
    blocks with the K/V written in the kernel, through preemption, then with
    every page poisoned: the same tokens as the XLA engine's, up to near-ties."""
    spec = dict(speculative={"method": "ngram", "num_draft_tokens": 4}, num_pages=1 + 40)
    ref = serve(LLM("tiny", attention_backend="xla", **spec, **ENGINE))
    llm = LLM("tiny", attention_backend="pallas", **spec, **ENGINE)
    got = serve(llm)
    assert any(r.decode_steps > 1 for r in llm.engine.step_records), "no decode scan ran"
    poison(llm)
    again = serve(llm)
    assert [o.token_ids for o in again] == [o.token_ids for o in got], "tokens changed on poison"
    assert_same_up_to_near_ties(ref, got, "verification in decode blocks")
