"""Bad requests fail alone, with an error naming the field and the value; the engine is never
wedged by one; preemptions are counted once each, wherever they happen."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams
from jaxinfer.metrics import request_rows, summarize
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=48, page_size=8,
             max_model_len=96, decode_steps=4)  # fmt: skip
GOOD = [5, 9, 11]
SP = SamplingParams(max_tokens=4, ignore_eos=True)


def unchecked(**fields) -> SamplingParams:
    """SamplingParams with fields set past the check at construction (as a caller that built a
    valid one and changed it could): the engine checks again at submission."""
    sp = SamplingParams()
    for name, value in fields.items():
        object.__setattr__(sp, name, value)
    return sp


# (prompt, sampling, what the error must name)
BAD = [
    (5, SP, "prompt must be a str or a list of int token ids, got int 5"),
    (None, SP, "got NoneType None"),
    ([[1, 2], [3]], SP, "item 0 is list [1, 2]"),
    (np.array([[1, 2]]), SP, "shape (1, 2)"),
    ("ab\ud800c", SP, "not valid Unicode"),
    ([1.5, 2.7], SP, "item 0 is float 1.5"),
    (["12", "3"], SP, "item 0 is str '12'"),
    (b"abc", SP, "prompt is bytes"),
    ([True, 2], SP, "item 0 is bool True"),
    (GOOD, unchecked(temperature="hot"), "temperature='hot'"),
    (GOOD, unchecked(temperature=None), "temperature=None"),
    (GOOD, unchecked(top_p="0.9"), "top_p='0.9'"),
    (GOOD, unchecked(stop_token_ids=None), "stop_token_ids=None"),
    (GOOD, unchecked(stop_token_ids=7), "stop_token_ids=7"),
    (GOOD, unchecked(stop_token_ids=("a",)), "stop_token_ids=('a',)"),
    (GOOD, unchecked(max_tokens=True), "max_tokens=True"),
    (GOOD, unchecked(ignore_eos="no"), "ignore_eos='no'"),
    (GOOD, unchecked(seed=2**64), f"seed={2**64}"),
    (GOOD, unchecked(seed=-1), "seed=-1"),
    (GOOD, unchecked(top_k=-2), "top_k=-2"),
    (GOOD, unchecked(stop=("",)), "stop=('',)"),
    (GOOD, unchecked(n=0), "SamplingParams.n=0 is invalid"),
    (GOOD, unchecked(n=-1), "SamplingParams.n=-1 is invalid"),
    (GOOD, unchecked(n="2"), "SamplingParams.n='2' is invalid"),
    (GOOD, unchecked(n=None, best_of=3), "SamplingParams.n=None is invalid"),
    (GOOD, "greedy", "sampling must be a SamplingParams, got str 'greedy'"),
    (GOOD, {"temperature": 0.0}, "sampling must be a SamplingParams, got dict"),
]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", **SMALL)


def test_each_bad_request_fails_alone_naming_the_field_and_value(llm):
    prompts = ["def f(x):\n"] + [p for p, _, _ in BAD] + [[7, 8, 9]]
    sampling = [SP] + [s for _, s, _ in BAD] + [SP]
    outs = llm.generate(prompts, sampling)
    assert len(outs) == len(prompts)
    for out, (_, _, match) in zip(outs[1:-1], BAD, strict=True):
        assert out.error is not None and match in out.error, (match, out.error)
        assert out.finish_reason == "error" and out.token_ids == []
    for out in (outs[0], outs[-1]):
        assert out.error is None and len(out.token_ids) == 4
    # nothing was left queued: the next call runs only its own request
    (again,) = llm.generate([[1, 2, 3]], SP)
    assert again.error is None and not llm.engine.has_unfinished()
    assert llm.engine.sequences == []  # every returned request was released


def test_more_samples_than_the_engine_runs_at_once_fail_alone_naming_n_or_best_of(llm):
    # engine.max_num_seqs is 4: n or best_of above it is refused at submission (n = 10**5 kept an
    # engine busy for minutes), the other requests of the call finish
    many = [SamplingParams(max_tokens=4, n=5), SamplingParams(max_tokens=4, n=2, best_of=5)]
    outs = llm.generate([GOOD, GOOD, GOOD, GOOD], [SP, *many, SamplingParams(max_tokens=4, n=4)])
    assert outs[1].error == "SamplingParams.n=5 is invalid: must be <= engine.max_num_seqs=4 " \
        "(one sequence per sample)", outs[1].error  # fmt: skip
    assert "SamplingParams.best_of=5" in outs[2].error and "engine.max_num_seqs=4" in outs[2].error
    assert outs[0].error is None and len(outs[0].token_ids) == 4
    assert outs[3].error is None and len(outs[3].outputs) == 4
    assert llm.engine.sequences == []


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(temperature="hot"), "temperature='hot'"),
        (dict(top_p="0.9"), "top_p='0.9'"),
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(max_tokens=True), "max_tokens=True"),
        (dict(stop_token_ids=7), "stop_token_ids=7"),
        (dict(seed=2**64), f"seed={2**64}"),
        (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
        (dict(presence_penalty=2.5), "presence_penalty=2.5"),
        (dict(logit_bias={3: 101}), "logit_bias=((3, 101),)"),
        (dict(logit_bias={"x": 1.0}), "logit_bias=(('x', 1.0),)"),
    ],
)
def test_bad_sampling_params_are_refused_when_built(fields, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        SamplingParams(**fields)


def test_what_vllm_accepts_is_accepted(llm):
    seed = 41
    p = list(np.random.default_rng(seed).integers(0, 4000, 6))
    outs = llm.generate(
        [p, tuple(p), np.asarray(p, np.int64), p],
        [SP, SP, SP, SamplingParams(max_tokens=4, ignore_eos=True, top_k=-1, temperature=0.7,
                                    seed=2**64 - 1)],
    )  # fmt: skip
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids, f"seed {seed}"
    assert SamplingParams(stop="abc").stop == ("abc",)  # one stop string, not "a", "b", "c"
    assert SamplingParams(stop=["ab", "c"]).stop == ("ab", "c")


def test_a_stop_string_given_as_str_stops_at_that_string(llm):
    (free,) = llm.generate(["class Stack:\n"], SamplingParams(max_tokens=24, ignore_eos=True))
    text = free.text
    stop = text[3:6]
    (stopped,) = llm.generate(["class Stack:\n"], SamplingParams(max_tokens=24, ignore_eos=True,
                                                                 stop=stop))  # fmt: skip
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]


def test_a_request_whose_batch_cannot_be_built_fails_alone():
    cfg = preset("tiny")
    engine = Engine(EngineConfig(model="preset:tiny", **SMALL), cfg,
                    init_params(cfg, jax.random.key(0)))  # fmt: skip
    engine.warmup()
    good = [engine.add_request([1, 2, 3 + i], SP) for i in range(3)]
    bad = engine.add_request([4, 5, 6], SP)
    engine._seeds[bad.seq_id] = 2**70  # a value that slipped past validation: packing raises
    engine.run()
    assert bad.error is not None and f"request {bad.seq_id} could not be run" in bad.error
    assert all(s.error is None and len(s.output_token_ids) == 4 for s in good)
    again = engine.add_request([1, 2], SP)
    engine.run()
    assert again.error is None and len(again.output_token_ids) == 4
    assert engine.block_manager.num_free_pages == engine.block_manager.capacity


@pytest.mark.parametrize("scheduler", ["fcfs", "static"])
def test_every_preemption_is_counted_once(scheduler):
    seed = 43
    cfg = preset("tiny")
    config = EngineConfig(model="preset:tiny", **{**SMALL, "num_pages": 12, "max_model_len": 64},
                          scheduler=scheduler)  # fmt: skip
    engine = Engine(config, cfg, init_params(cfg, jax.random.key(0)))
    engine.warmup()
    rng = np.random.default_rng(seed)
    seqs = [engine.add_request(rng.integers(0, 500, int(n)).tolist(),
                               SamplingParams(max_tokens=30, ignore_eos=True))
            for n in rng.integers(5, 30, 8)]  # fmt: skip
    engine.run()
    by_requests = sum(s.num_preemptions for s in seqs)
    assert by_requests > 0, f"seed {seed}: nothing was preempted"
    assert sum(r.preemptions for r in engine.step_records) == by_requests, f"seed {seed}"
    m = summarize(request_rows(seqs), engine.step_records, max_num_seqs=4)
    assert m["total_preemptions"] == m["total_request_preemptions"] == by_requests


def test_a_kv_pool_too_small_for_one_request_is_refused_naming_both_keys():
    from jaxinfer.engine.engine import pages_in_budget, workspace_bytes
    from jaxinfer.kv.cache import kv_page_bytes
    from jaxinfer.models.spec import param_bytes

    # 11 pages of 8 slots hold one request of 88 tokens, not of 96: accepted, every request of
    # max_model_len would then fail naming neither key
    with pytest.raises(ValueError) as info:
        EngineConfig(**{**SMALL, "num_pages": 12})
    for key in ("engine.num_pages=12 holds 11 KV pages", "engine.max_model_len=96", ">= 13"):
        assert key in str(info.value), str(info.value)
    EngineConfig(**{**SMALL, "num_pages": 13})
    # num_pages: auto, checked where it is resolved: a budget of 5 pages
    config = EngineConfig(**{**SMALL, "num_pages": "auto"})
    cfg = preset("tiny")
    page = kv_page_bytes(cfg, config.page_size, config.kv_dtype)
    budget = param_bytes(cfg) + workspace_bytes(config, cfg) + 5 * page
    with pytest.raises(ValueError, match=r"engine\.num_pages=auto \(5 pages in a budget of .*"
                                         r"engine\.max_model_len=96"):  # fmt: skip
        pages_in_budget(config, cfg, budget)


def test_a_missing_draft_model_is_named_by_its_key():
    from jaxinfer.engine.engine import make_proposer

    config = EngineConfig(speculative={"method": "draft", "draft_model": "no-such-model-xyz"})
    with pytest.raises(
        ValueError, match=r"^engine\.speculative\.draft_model='no-such-model-xyz': "
    ):
        make_proposer(config, preset("tiny"))
