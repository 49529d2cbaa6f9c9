"""End-to-end engine tests on CPU with a tiny random model."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams
from jaxinfer.generate import greedy_generate
from jaxinfer.models.attention import AttentionConfig
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params

SMALL = dict(
    max_num_seqs=8, max_num_batched_tokens=64, num_pages=96, page_size=8, max_model_len=256
)


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny")
    return cfg, init_params(cfg, jax.random.key(0))


def make_engine(model, **overrides) -> Engine:
    cfg, params = model
    engine = Engine(EngineConfig(model="preset:tiny", **{**SMALL, **overrides}), cfg, params)
    engine.warmup()
    return engine


def run(engine: Engine, prompts, sampling):
    seqs = [engine.add_request(p, s) for p, s in zip(prompts, sampling, strict=True)]
    engine.run()
    return seqs


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 512, int(n)).tolist() for n in rng.integers(1, 90, 10)]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_draft_tokens": 2}])
def test_no_scan_is_chained_past_the_end_of_its_sequences(model, prompts, speculative):
    """A decode scan is not chained after one that may end every sequence in it: it would run
    void on the device, ahead of the next request's prefill. Lengths land on, before and after a
    scan's end; the outputs stay the reference's and the other scans still chain."""
    extra = {"speculative": speculative} if speculative else {}
    engine = make_engine(model, decode_steps=4, max_num_seqs=2, **extra)
    lens = [24, 26, 29, 31]
    for p, n in zip(prompts, lens, strict=False):
        (seq,) = run(engine, [p + p[:3]], [greedy(n)])  # (a repeat for the n-gram to find)
        (ref,) = greedy_generate(model[1], model[0], [p + p[:3]], n)
        assert seq.output_token_ids == ref, (speculative, n)
    scans = [r for r in engine.step_records if r.decode_steps > 1]
    void = [r for r in scans if r.num_batched_tokens == 0]
    assert not void, f"{len(void)} of {len(scans)} scans made no token ({speculative})"
    assert engine.chained_scans >= len(scans) // 2, (engine.chained_scans, len(scans))


def test_batched_greedy_equals_each_request_alone_and_the_reference(model, prompts):
    engine = make_engine(model, decode_steps=4)
    lens = [5 + 3 * i for i in range(len(prompts))]
    batched = run(engine, prompts, [greedy(n) for n in lens])
    assert all(s.error is None for s in batched)
    assert engine.compiles_after_warmup == 0, "a compile after warm-up"
    for p, n, seq in zip(prompts, lens, batched, strict=True):
        (alone,) = run(engine, [p], [greedy(n)])
        assert alone.output_token_ids == seq.output_token_ids
    assert engine.compiles_after_warmup == 0  # (the counter is process-wide: check before below)
    assert any(r.decode_steps == 4 for r in engine.step_records), "decode fast path never ran"
    assert engine.chained_scans > 0, "async decode never overlapped a scan with host work"
    assert engine.overlapped_steps > 0, "async scheduling never fed a step from the device"
    assert any(not r.is_decode_only for r in engine.step_records)
    for p, n, seq in zip(prompts, lens, batched, strict=True):
        (ref,) = greedy_generate(model[1], model[0], [p], n)
        assert seq.output_token_ids == ref


def test_step_records_say_which_steps_were_decode_only(model):
    """A step that prefills whole prompts is not decode-only; the steps after it are."""
    engine = make_engine(model, decode_steps=1)
    run(engine, [[1, 2, 3, 4, 5], [6, 7]], [greedy(4), greedy(4)])
    assert [r.is_decode_only for r in engine.step_records] == [False, True, True, True]


@pytest.mark.parametrize(
    "variant",
    [
        dict(scheduler="static"),
        dict(chunked_prefill=False),
        dict(max_num_batched_tokens=16, chunked_prefill=True),  # long prompts split into chunks
        dict(allocation="reserve_max"),
        dict(decode_steps=1),
        dict(async_decode=False),
        dict(async_schedule=False),  # every mixed step read before the next is built
        dict(async_schedule=False, async_decode=False, decode_steps=1),  # fully synchronous
        dict(scheduler="shortest_first"),
        dict(scheduler="priority"),
    ],
    ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_policies_and_chunking_do_not_change_greedy_tokens(model, prompts, variant):
    sampling = [greedy(12) for _ in prompts]
    base = [s.output_token_ids for s in run(make_engine(model), prompts, sampling)]
    engine = make_engine(model, **variant)
    got = [s.output_token_ids for s in run(engine, prompts, sampling)]
    assert got == base
    assert engine.compiles_after_warmup == 0


def test_preempted_and_resumed_requests_give_uninterrupted_tokens(model, prompts):
    sampling = [greedy(40) for _ in prompts]
    base = [s.output_token_ids for s in run(make_engine(model), prompts, sampling)]
    # 19 usable pages of 8 slots (152 tokens: one request of max_model_len): forces preemption
    tight = make_engine(model, num_pages=20, max_model_len=152)
    seqs = run(tight, prompts, sampling)
    assert sum(s.num_preemptions for s in seqs) > 0, "the test did not preempt anything"
    assert [s.output_token_ids for s in seqs] == base
    assert tight.block_manager.num_free_pages == tight.block_manager.capacity


def test_seeded_sampling_is_independent_of_batch_composition(model, prompts):
    engine = make_engine(model, decode_steps=4)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    together = run(engine, prompts, [params] * len(prompts))
    (alone,) = run(engine, [prompts[3]], [params])
    assert alone.output_token_ids == together[3].output_token_ids
    unseeded = run(engine, prompts[:2], [SamplingParams(max_tokens=16, temperature=0.9)] * 2)
    assert unseeded[0].output_token_ids != together[0].output_token_ids
    no_chunk = make_engine(model, decode_steps=1, chunked_prefill=False)
    (again,) = run(no_chunk, [prompts[3]], [params])
    assert again.output_token_ids == alone.output_token_ids


def test_bad_requests_fail_alone_with_clear_errors(model, prompts):
    engine = make_engine(model)
    cases = [
        ([], greedy(4), "prompt is empty"),
        (prompts[0], SamplingParams(stop_token_ids=(10**6,)), "stop_token_ids"),
        (prompts[0], SamplingParams(top_k=10**6), "top_k"),
        (prompts[0], SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
        ([1] * 250, greedy(10), "max_model_len"),
        ([10**6], greedy(4), "prompt token ids"),
        (prompts[0], SamplingParams(stop=("x",)), "tokenizer"),
        ("a string prompt", greedy(4), "tokenizer"),
        (prompts[0], SamplingParams(logprobs=5), "num_logprobs"),
    ]
    good = engine.add_request(prompts[1], greedy(8))
    bad = [engine.add_request(p, s) for p, s, _ in cases]
    engine.run()
    for seq, (_, _, match) in zip(bad, cases, strict=True):
        assert seq.error is not None and match in seq.error, (match, seq.error)
    assert good.error is None and len(good.output_token_ids) == 8


def test_stop_tokens_and_logprobs(model, prompts):
    engine = make_engine(model, num_logprobs=3)
    (free,) = run(engine, [prompts[2]], [greedy(12)])
    stop_at = free.output_token_ids[5]
    first = free.output_token_ids.index(stop_at)
    params = SamplingParams(max_tokens=12, stop_token_ids=(stop_at,), logprobs=3)
    (stopped,) = run(engine, [prompts[2]], [params])
    assert stopped.output_token_ids == free.output_token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and free.finish_reason == "length"
    lp = stopped.output_logprobs[0]
    assert lp["token"] == stopped.output_token_ids[0] and len(lp["top"]) == 3
    assert max(lp["top"].values()) == pytest.approx(lp["logprob"])  # greedy: top-1 is the token
    assert all(v <= 0 for v in lp["top"].values())


def test_reserve_max_wastes_more_kv_than_on_demand(model, prompts):
    sampling = [greedy(30) for _ in prompts]
    waste = {}
    for alloc in ("on_demand", "reserve_max"):
        engine = make_engine(model, allocation=alloc, max_model_len=256)
        run(engine, prompts, sampling)
        rows = [r for r in engine.step_records if r.kv_slots_allocated]
        waste[alloc] = np.mean([r.wasted_slots / r.kv_slots_allocated for r in rows])
    assert waste["on_demand"] < 0.5 * waste["reserve_max"], waste


def test_streaming_yields_the_generated_tokens(model, prompts):
    llm = LLM.__new__(LLM)  # reuse the module's random model instead of loading one
    llm.config, llm.tokenizer = EngineConfig(model="preset:tiny", **SMALL), None
    llm.engine = make_engine(model)
    sampling = greedy(10)
    streamed: dict[int, list[int]] = {}
    finished = []
    for ev in llm.stream(prompts[:4], sampling):
        streamed.setdefault(ev.request_id, []).extend(ev.token_ids)
        if ev.finished:
            finished.append(ev.request_id)
    outs = llm.generate(prompts[:4], sampling)
    assert sorted(finished) == sorted(streamed), "each request must finish exactly once"
    assert sorted(streamed.values()) == sorted(o.token_ids for o in outs)


def test_streams_release_their_requests_when_consumed_or_abandoned(model, prompts):
    llm = LLM.__new__(LLM)
    llm.config, llm.tokenizer = EngineConfig(model="preset:tiny", **SMALL), None
    llm.engine = engine = make_engine(model, decode_steps=2)
    # a bad request, a parallel-sampled one and plain ones: nothing stays once consumed
    reqs = [prompts[0], [10**6], prompts[1], *prompts[2:6]]
    sampling = [
        greedy(6),
        greedy(6),
        SamplingParams(max_tokens=6, ignore_eos=True, n=3),
        *[greedy(6)] * 4,
    ]
    for _ in range(3):
        events = list(llm.stream(reqs, sampling))
        assert sum(ev.finished for ev in events) == len(reqs) + 2  # (3 samples of one)
        assert engine.sequences == [] and engine._seeds == {}
    # abandoned after its first tokens: the rest are aborted (pages freed) and released
    stream = llm.stream(prompts[:6], greedy(40))
    next(ev for ev in stream if ev.token_ids)
    stream.close()
    assert engine.sequences == [] and engine._seeds == {}
    assert not engine.scheduler.has_unfinished()
    assert engine.block_manager.num_used_pages == 0
    (out,) = llm.generate([prompts[0]], greedy(5))  # the engine serves on
    assert len(out.token_ids) == 5 and engine.sequences == []


def test_shipped_model_text_prompts_and_stop_strings():
    llm = LLM("tiny", max_num_seqs=4, max_num_batched_tokens=64, num_pages=64, max_model_len=256)
    free, stopped = llm.generate(
        ["def read_lines(path):\n", "def read_lines(path):\n"],
        [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, stop=("\n",))],
    )
    assert free.error is None and "\n" in free.text, free.text
    assert stopped.finish_reason == "stop" and "\n" not in stopped.text
    assert free.text.startswith(stopped.text)
    assert llm.engine.compiles_after_warmup == 0


def test_eos_after_ends_requests_early_without_telling_the_allocator(model, prompts):
    engine = make_engine(model, allocation="reserve_max", max_model_len=256)
    params = SamplingParams(max_tokens=150, ignore_eos=True, eos_after=9)
    seqs = [engine.add_request(p, params) for p in prompts[:3]]
    engine.step()  # first prefill step: reserve_max has planned for 150 new tokens
    held = max(len(s.page_ids) for s in seqs)
    assert held * SMALL["page_size"] >= 150
    engine.run()
    for s in seqs:
        assert len(s.output_token_ids) == 9 and s.finish_reason == "stop"
    (base,) = run(make_engine(model), [prompts[0]], [greedy(9)])
    assert base.output_token_ids == seqs[0].output_token_ids


def test_parallel_warmup_compiles_every_bucket_and_nothing_after(model, prompts):
    engine = make_engine(model, compile_workers=0)  # one compile thread per core
    runner = engine.runner
    assert {k[0] for k in runner._executables} == {"mixed", "decode", "sample"}
    assert len(runner._executables) == len(runner._warmup_calls())
    stats = runner.warmup_stats  # lowering pipelined with compiles: both timed, every bucket
    assert stats["executables"] == len(runner._executables)
    assert 0 <= stats["lower_s"] <= stats["lower_and_compile_s"]  # 0: lowerings cached earlier
    seqs = run(engine, prompts[:3], [greedy(6)] * 3)
    assert all(len(s.output_token_ids) == 6 for s in seqs)
    # sampled rows use the filtered variants (mixed sampler and decode scans), compiled too
    hot = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    seqs = run(engine, prompts[:3], [hot, greedy(12), hot])
    assert all(len(s.output_token_ids) == 12 for s in seqs)
    assert engine.compiles_after_warmup == 0
    with pytest.raises(ValueError, match="compile_workers"):
        EngineConfig(model="preset:tiny", compile_workers=-1)


def test_async_schedule_off_never_feeds_placeholders_and_matches(model, prompts):
    """Placeholders (device-fed tokens) exist only with async_schedule; both give the same
    tokens, including sequences that stop at a stop id while the next step is in flight."""
    stop = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[7, 11, 13, 17, 19])
    sampling = [greedy(20), stop] * (len(prompts) // 2)
    got = {}
    for flag in (True, False):
        engine = make_engine(model, async_schedule=flag, decode_steps=1)
        seqs = run(engine, prompts, sampling)
        got[flag] = [s.output_token_ids for s in seqs]
        assert (engine.overlapped_steps > 0) is flag
        assert all(t >= 0 for ids in got[flag] for t in ids), "a placeholder leaked"
        assert all(not s.final_pending or s.is_finished for s in seqs)
        assert engine.block_manager.num_free_pages == engine.block_manager.capacity
        stopped = [s for s in seqs if s.finish_reason == "stop"]
        assert stopped and all(len(s.output_token_ids) < 30 for s in stopped)
    assert got[True] == got[False]


def test_warmup_errors_name_the_executable_and_settings(model):
    """A warm-up lowering failure names the bucket, the attention settings and the XLA options;
    a shared-memory overflow (Mosaic's message on the GPU) adds which options to lower."""
    engine = Engine(EngineConfig(model="preset:tiny", **SMALL), *model)
    runner = engine.runner
    # the kernel on fp32 pages: tracing the first executable (the largest decode scan) fails
    runner.attention = AttentionConfig("pallas", (("block_kv", 96), ("num_stages", 3)))
    with pytest.raises(RuntimeError, match=r"could not lower the decode scan of 8 rows") as err:
        runner.warmup()
    text = str(err.value)
    assert "reads bf16 or fp8" in text and "'num_stages': 3" in text
    assert "attention_backend='pallas'" in text and isinstance(err.value.__cause__, ValueError)
    smem = ValueError("Requested 232560 bytes, which exceeds available shared memory (232448)")
    msg = str(runner._warmup_error(("mixed", 64, 64), "lower", smem))
    assert "mixed step of 64 tokens" in msg and "lower engine.attention_options num_stages" in msg


def test_compiler_options_reach_each_kinds_compile(model, prompts):
    """Per-kind and per-bucket XLA options reach the warm-up compiles (an option XLA does not
    know, set for "sample" only, fails the warm-up naming it; set for mixed steps of >= 64
    tokens, only a bucket that large fails); a kind's entry overrides "all"'s, a size entry the
    kind's (smallest bound first), and None drops one; known options, a bool among them, leave
    the tokens unchanged."""
    engine = Engine(EngineConfig(model="preset:tiny", **SMALL), *model)
    runner = engine.runner
    # the defaults: tiny is small, so its decode scans keep XLA's CUDA graphs ("auto")
    assert runner.decode_cuda_graphs and runner._compiler_options("decode") == {}
    for rows in (64, 128, 255):
        assert runner._compiler_options("decode", rows) == {
            "xla_gpu_experimental_force_split_k": 1}  # fmt: skip
    assert runner._compiler_options("decode", 256) == {}
    cmdbuf = {"xla_gpu_enable_command_buffer": ""}
    runner.config.decode_cuda_graphs = False  # graphs off: command buffers off, decode only
    assert runner._compiler_options("decode", 32) == cmdbuf
    assert runner._compiler_options("decode", 64) == {
        **cmdbuf,
        "xla_gpu_experimental_force_split_k": 1,
    }
    assert runner._compiler_options("mixed", 64) == {}
    runner.config.compiler_options = {"decode": {"xla_gpu_enable_command_buffer": None}}
    assert runner._compiler_options("decode") == {}  # the kind's entry overrides the choice
    runner.config.decode_cuda_graphs = "auto"
    runner.cfg = dataclasses.replace(runner.cfg, hidden_size=4096)  # "auto" at the 8B's size
    runner.config.compiler_options = {}
    assert not runner.decode_cuda_graphs and runner._compiler_options("decode") == cmdbuf
    plain = runner.config.quant
    runner.config.quant = dataclasses.replace(plain, weights="fp8_static")
    assert runner.decode_cuda_graphs  # quantized weights keep them at any size
    runner.config.quant = plain
    runner.cfg = engine.model_config
    runner.config.compiler_options = {"all": {"xla_gpu_graph_min_graph_size": 7},
                               "sample": {"xla_gpu_graph_min_graph_size": None, "xla_bogus": 1}}  # fmt: skip
    assert runner._compiler_options("mixed") == {"xla_gpu_graph_min_graph_size": 7}
    assert runner._compiler_options("sample") == {"xla_bogus": 1}
    with pytest.raises(RuntimeError, match=r"could not compile the sampler: (?s:.*)xla_bogus"):
        runner.warmup()
    assert runner.token_buckets[-1] == 64 and runner.token_buckets[0] < 64
    runner.config.compiler_options = {"mixed>=64": {"xla_bogus_big": 1}}
    assert runner._compiler_options("mixed", runner.token_buckets[-2]) == {}
    with pytest.raises(RuntimeError, match=r"mixed step of 64 tokens: (?s:.*)xla_bogus_big"):
        runner.warmup()
    runner.config.compiler_options = {"mixed>=65": {"xla_bogus_big": 1}}  # no bucket that large
    runner.warmup()
    # known options compile; a bool stays a bool (XLA refuses the string "false" for one)
    runner.config.compiler_options = {"all": {"xla_gpu_graph_min_graph_size": 7,
                                       "xla_gpu_enable_triton_gemm": False}}  # fmt: skip
    runner.warmup()
    (seq,) = run(engine, prompts[:1], [greedy(5)])
    (base,) = run(make_engine(model), prompts[:1], [greedy(5)])
    assert seq.output_token_ids == base.output_token_ids
    for bad, match in (({"decodes": {}}, "compiler_options.decodes"),
                       ({"decode": {"gpu_x": "1"}}, "compiler_options.decode"),
                       ({"sample>=8": {}}, r"compiler_options.sample>=8: a size bound"),
                       ({"decode>=many": {}}, r"compiler_options.decode>=many")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            EngineConfig(model="preset:tiny", compiler_options=bad)
    with pytest.raises(ValueError, match=r"engine.decode_cuda_graphs='yes' is invalid"):
        EngineConfig(model="preset:tiny", decode_cuda_graphs="yes")


def test_max_model_len_past_the_models_positions_is_refused(model):
    cfg, params = model
    # (a pool that holds one request of 4096 tokens: the position check is the one under test)
    too_long = EngineConfig(model="preset:tiny",
                            **{**SMALL, "max_model_len": 4096, "num_pages": 4096 // 8 + 1})  # fmt: skip
    with pytest.raises(
        ValueError, match=r"max_model_len=4096 exceeds .*max_position_embeddings=2048"
    ):
        Engine(too_long, cfg, params)


def test_a_stop_string_at_the_start_of_the_output_leaves_no_text(fresh_seed):
    """A stop string that the output's first characters hold cuts the text to "" (it once fell
    back to the whole decoded output, stop string included)."""
    llm = LLM("tiny", **SMALL, warmup=False)
    prompt = np.random.default_rng(fresh_seed).integers(1, 500, 8).tolist()
    free = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert free.text, f"seed {fresh_seed}: no text to stop on"
    cut = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True,
                                                stop=(free.text[:1],)))[0]  # fmt: skip
    assert (cut.text, cut.finish_reason) == ("", "stop"), (f"seed {fresh_seed}", free.text, cut)
