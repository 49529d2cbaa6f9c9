"""The OpenAI-compatible server against the official `openai` client on loopback (CPU, `tiny`).

One server (engine thread + uvicorn thread) serves the module; `ref` is a second LLM of the same
engine settings for offline references (it shares the server's compiled executables). Seeded
requests must equal the offline `LLM.generate` / `LLM.chat` token for token, text and logprobs;
bad requests get a 4xx naming the problem and the next request is served; a client that leaves
has its request aborted and its KV pages freed; a bounded load loses and duplicates nothing and
compiles nothing.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest

from jaxinfer.engine.compile_counter import compile_count
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams
from jaxinfer.serve.server import ServeOptions, Server

# the official client is a test extra; the GPU image lacks it, and its `-m gpu` collection
# (experiments/run_gpu_tests.py) must not stop at this file, which has no GPU test
openai = pytest.importorskip("openai")

KW = dict(max_num_seqs=32, max_num_batched_tokens=256, num_pages=192, page_size=16,
          max_model_len=256, decode_steps=4, num_logprobs=3, decode_buckets=[8, 32])  # fmt: skip
# A ChatML-like template for `tiny` (it ships none); the server's --chat-template does the same.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")  # fmt: skip
MAX_BODY = 1 << 20
PROMPTS = ("def read_lines(path):\n", "class Queue:\n    def __init__(self", "import os\n\n\ndef ",
           "    for i in range(", "try:\n    import ")  # fmt: skip


@pytest.fixture(scope="module")
def server():
    llm = LLM("tiny", **KW)
    llm.chat_template = TEMPLATE
    srv = Server(llm, ServeOptions(port=0, max_queue=64, max_body_bytes=MAX_BODY,
                                   log_level="warning")).start()  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref():
    llm = LLM("tiny", warmup=False, **KW)
    llm.chat_template = TEMPLATE
    return llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def _idle(server, timeout: float = 20.0) -> None:
    """Wait until the engine holds nothing: no request, no page (the scratch page aside)."""
    engine, deadline = server.state.llm.engine, time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (not engine.has_unfinished() and engine.block_manager.num_used_pages == 0
                and server.engine_loop.num_outstanding == 0):  # fmt: skip
            return
        time.sleep(0.02)
    bm = engine.block_manager
    raise AssertionError(f"engine not idle: unfinished={engine.has_unfinished()}, used pages="
                         f"{bm.num_used_pages}, outstanding={server.engine_loop.num_outstanding}")  # fmt: skip


def _metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return 0.0


def _assert_served(client) -> None:
    r = client.completions.create(model="tiny", prompt="def f(", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1


def test_seeded_completions_equal_offline_generate_tokens_text_and_logprobs(client, ref,
                                                                            fresh_seed):  # fmt: skip
    rng = np.random.default_rng(fresh_seed)
    prompt = PROMPTS[rng.integers(len(PROMPTS))]
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=1.0, top_p=0.95, n=3,
        seed=fresh_seed, logprobs=2,
        extra_body={"top_k": 40, "min_p": 0.02, "ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    (want,) = ref.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95,
                                                   top_k=40, min_p=0.02, n=3, seed=fresh_seed,
                                                   logprobs=2, ignore_eos=True))  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in want.outputs}) > 1, "samples should differ"
    for got, w in zip(r.choices, want.outputs, strict=True):
        assert got.token_ids == w.token_ids and got.text == w.text
        np.testing.assert_allclose(got.logprobs.token_logprobs, [e["logprob"] for e in w.logprobs],
                                   rtol=0, atol=1e-5)  # fmt: skip
        for top, e in zip(got.logprobs.top_logprobs, w.logprobs, strict=True):
            assert sorted(top.values()) == pytest.approx(sorted(e["top"].values())[-2:], abs=1e-5)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == 36


def test_streamed_completion_equals_the_unstreamed_one_with_usage(client, fresh_seed):
    prompts = list(PROMPTS[:2])
    common = dict(model="tiny", prompt=prompts, max_tokens=10, temperature=0.8, n=2,
                  seed=fresh_seed, extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    whole = client.completions.create(**common)
    texts, ids, usage, finish = {}, {}, None, {}
    for chunk in client.completions.create(**common, stream=True,
                                           stream_options={"include_usage": True}):  # fmt: skip
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            ids[c.index] = ids.get(c.index, []) + c.token_ids
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2, 3]  # prompt i, sample j: choice 2 i + j
    for c in whole.choices:
        assert texts[c.index] == c.text and ids[c.index] == c.token_ids
        assert finish[c.index] == c.finish_reason == "length"
    assert usage.completion_tokens == whole.usage.completion_tokens == 40
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_cuts_the_text_and_the_stream_never_sends_it(client, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    prompt = PROMPTS[rng.integers(len(PROMPTS))]
    common = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    full = client.completions.create(**common).choices[0].text
    k = int(rng.integers(2, max(3, len(full) - 4)))
    stop = full[k : k + 3]
    want = full[: full.find(stop)]
    cut = client.completions.create(**common, stop=[stop, "\x00never"]).choices[0]
    assert cut.text == want and cut.finish_reason == "stop", (full, stop)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **common, stop=[stop], stream=True) if c.choices)  # fmt: skip
    assert streamed == want, (full, stop)


def test_seeded_chat_equals_offline_chat_streamed_or_not(client, ref, fresh_seed):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": f"Write a function number {fresh_seed % 97}."}]  # fmt: skip
    common = dict(model="tiny", messages=messages, max_tokens=10, temperature=1.0, n=2,
                  seed=fresh_seed, extra_body={"ignore_eos": True})  # fmt: skip
    r = client.chat.completions.create(**common, logprobs=True, top_logprobs=2)
    (want,) = ref.chat(messages, SamplingParams(max_tokens=10, temperature=1.0, n=2,
                                                seed=fresh_seed, ignore_eos=True, logprobs=2))  # fmt: skip
    for got, w in zip(r.choices, want.outputs, strict=True):
        assert got.message.role == "assistant" and got.message.content == w.text
        np.testing.assert_allclose([t.logprob for t in got.logprobs.content],
                                   [e["logprob"] for e in w.logprobs], rtol=0, atol=1e-5)  # fmt: skip
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    content, roles = {}, {}
    for chunk in client.chat.completions.create(**common, stream=True):
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            roles.setdefault(c.index, c.delta.role)
    assert content == {i: w.text for i, w in enumerate(want.outputs)}
    assert roles == {0: "assistant", 1: "assistant"}


BAD = [  # (body, status, what the message must say)
    (b"{not json", 400, "not valid JSON"),
    (b'["a list"]', 400, "JSON object"),
    (b'{"model": "tiny"}', 400, "prompt: required"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": -3}', 400, "max_tokens"),
    (b'{"model": "gpt-9", "prompt": "x"}', 404, "gpt-9"),
    (b'{"model": "tiny", "prompt": "x", "temperature": "hot"}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "x", "top_p": 0}', 400, "top_p"),
    (b'{"model": "tiny", "prompt": "x", "logprobs": 9}', 400, "logprobs"),
    (b'{"model": "tiny", "prompt": "x", "response_format": {}}', 400, "response_format"),
    (b'{"model": "tiny", "prompt": "x", "presence_penalty": 1.0}', 400, "penalties"),
    (b'{"model": "tiny", "prompt": [1, 99999]}', 400, "[0, 4096)"),
    (b'{"model": "tiny", "prompt": "x", "n": 2, "best_of": 1}', 400, "best_of"),
    (
        b'{"model": "tiny", "prompt": "x", "n": 33}',
        400,
        "n=33 is invalid: must be <= engine.max_num_seqs=32",
    ),
    (b'{"model": "tiny", "prompt": "x", "best_of": 40}', 400, "best_of=40"),
    (
        json.dumps({"model": "tiny", "prompt": list(range(3, 250)), "max_tokens": 16}).encode(),
        400,
        "247 tokens and max_tokens is 16",
    ),
    (json.dumps({"model": "tiny", "prompt": list(range(3, 300))}).encode(), 400, "297 tokens"),
    (b'{"model": "tiny", "prompt": "' + b"x" * (MAX_BODY + 10) + b'"}', 413, "limit"),
]


@pytest.mark.parametrize("body,status,says", BAD, ids=[f"{s}-{w}" for _, s, w in BAD])
def test_bad_request_gets_4xx_naming_the_problem_and_the_next_is_served(server, client, body,
                                                                        status, says):  # fmt: skip
    resp = httpx.post(server.base_url + "/completions", content=body,
                      headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert resp.status_code == status, resp.text
    assert says in resp.json()["error"]["message"], resp.text
    _assert_served(client)


def test_bad_requests_through_the_openai_client_raise_its_errors(server, client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(
        openai.BadRequestError, match="16 tokens and max_tokens is 1000: 1016 tokens exceed"
    ):
        client.chat.completions.create(model="tiny", max_tokens=1000,
                                       messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    _assert_served(client)


class _HeldEngine:
    """The engine thread runs `free` steps, then waits before each further one until `go` is set
    (by the test, or by the server asking to abort when `on_abort`): a request stays outstanding
    however fast this machine decodes (200 tokens of `tiny` can finish in less than 0.3 s)."""

    def __init__(self, monkeypatch, server, free: int = 2, on_abort: bool = False):
        self.free, self.steps, self.go = free, 0, threading.Event()
        engine, loop = server.state.llm.engine, server.engine_loop
        step, abort = engine.step, loop.abort

        def held_step():
            self.steps += 1
            if self.steps > self.free:
                self.go.wait(30)
            return step()

        def go_on_abort(subs):
            abort(subs)  # (queued before the held step goes on)
            self.go.set()

        monkeypatch.setattr(engine, "step", held_step)
        if on_abort:
            monkeypatch.setattr(loop, "abort", go_on_abort)

    def again(self) -> None:
        self.steps = 0
        self.go.clear()


def test_client_leaving_mid_stream_aborts_and_frees_every_page(server, client, monkeypatch):
    engine = server.state.llm.engine
    aborted = _metric(server, "jaxinfer_requests_finished_total", '{finish_reason="abort"}')
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True, "n": 2}  # fmt: skip
    held = _HeldEngine(monkeypatch, server, on_abort=True)
    try:
        with httpx.stream("POST", server.base_url + "/completions", json=body,
                          timeout=30) as resp:  # fmt: skip
            assert resp.status_code == 200
            lines = resp.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            assert engine.block_manager.num_used_pages > 0  # it holds pages while it streams
        # a non-streaming request whose client gives up before the reply
        held.again()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/completions", json={**body, "stream": False},
                       timeout=0.3)  # fmt: skip
        _idle(server)
    finally:
        held.go.set()
        monkeypatch.undo()
    assert (
        _metric(server, "jaxinfer_requests_finished_total", '{finish_reason="abort"}')
        == aborted + 4
    )  # (2 requests x n = 2 samples)
    engine.block_manager.check_invariants()
    _assert_served(client)


def test_full_queue_answers_429_with_retry_after_then_serves(server, client, monkeypatch):
    loop = server.engine_loop
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 120, "ignore_eos": True,
            "stream": True}  # fmt: skip
    # The engine waits before its third step until the 429 has been answered (the streaming
    # request once finished its 120 tokens before the second request arrived).
    held = _HeldEngine(monkeypatch, server)
    capacity = loop.capacity
    try:
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=30) as resp:
            next(resp.iter_lines())
            loop.capacity = 1  # the streaming request fills it
            try:
                full = httpx.post(server.base_url + "/completions",
                                  json={**body, "stream": False})  # fmt: skip
            finally:
                loop.capacity = capacity
            assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text
            assert "capacity" in full.json()["error"]["message"]
    finally:
        held.go.set()
        monkeypatch.undo()
    _idle(server)
    _assert_served(client)


async def _load(base_url: str, n: int, concurrency: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    jobs = [(i, rng.integers(3, 4000, int(rng.integers(4, 60))).tolist(), int(rng.integers(2, 12)),
             bool(rng.integers(2))) for i in range(n)]  # fmt: skip
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    slots = asyncio.Semaphore(concurrency)

    async def one(i, prompt, max_tokens, stream):
        async with slots:
            kw = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                      extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
            if not stream:
                r = await client.completions.create(**kw)
                return i, r.id, r.usage.prompt_tokens, r.choices[0].token_ids
            ids, rid, usage = [], None, None
            async for chunk in await client.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}
            ):
                rid = chunk.id
                usage = chunk.usage or usage
                for c in chunk.choices:
                    ids += c.token_ids
            return i, rid, usage.prompt_tokens, ids

    try:
        results = await asyncio.gather(*(one(*job) for job in jobs))
    finally:
        await client.close()
    return jobs, results


def test_bounded_load_loses_nothing_duplicates_nothing_and_compiles_nothing(server, ref,
                                                                            fresh_seed):  # fmt: skip
    engine = server.state.llm.engine
    finished = _metric(server, "jaxinfer_requests_finished_total", '{finish_reason="length"}')
    before = compile_count()
    jobs, results = asyncio.run(_load(server.base_url, 300, 48, fresh_seed))
    assert compile_count() == before, "compiled after the warm-up"
    assert len({r[1] for r in results}) == len(jobs), "response ids repeat"
    for (i, prompt, max_tokens, _), (j, _, prompt_tokens, ids) in zip(jobs, results, strict=True):
        assert i == j and prompt_tokens == len(prompt) and len(ids) == max_tokens, i
    # every answer is its own prompt's: a sample against the offline engine
    pick = np.random.default_rng(fresh_seed).choice(len(jobs), 6, replace=False)
    want = ref.generate([jobs[k][1] for k in pick],
                        [SamplingParams(max_tokens=jobs[k][2], ignore_eos=True) for k in pick])  # fmt: skip
    assert [results[k][3] for k in pick] == [w.token_ids for w in want]
    _idle(server)
    assert _metric(server, "jaxinfer_requests_finished_total",
                   '{finish_reason="length"}') == finished + len(jobs)  # fmt: skip
    assert not engine.sequences and not engine.step_records  # (nothing kept: memory stays flat)
    assert not server.engine_loop._live


def test_models_health_and_metrics_endpoints(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    root = server.base_url.removesuffix("/v1")
    assert httpx.get(root + "/health").json() == {"status": "ok"}
    text = httpx.get(root + "/metrics").text
    for name in ("jaxinfer_requests_waiting", "jaxinfer_requests_running",
                 "jaxinfer_kv_cache_usage", "jaxinfer_time_to_first_token_seconds_bucket",
                 "jaxinfer_time_per_output_token_seconds_bucket", "jaxinfer_preemptions_total",
                 "jaxinfer_compiles_after_warmup"):  # fmt: skip
        assert name in text, name


def test_engine_abort_frees_pages_and_voids_the_step_in_flight(ref, fresh_seed):
    engine = ref.engine
    rng = np.random.default_rng(fresh_seed)
    prompt = rng.integers(3, 4000, 40).tolist()
    sp = SamplingParams(max_tokens=30, temperature=1.0, seed=fresh_seed, n=2, ignore_eos=True)
    seq = engine.add_request(prompt, sp)
    for _ in range(int(rng.integers(1, 5))):  # (each step leaves one dispatched, unread)
        engine.step()
    engine.abort(seq)
    for s in (seq, *seq.siblings):
        assert s.finish_reason == "abort" and not s.page_ids
        assert all(t >= 0 for t in s.output_token_ids), "placeholders left"
    assert engine.block_manager.num_used_pages == 0
    kept = [list(s.output_token_ids) for s in (seq, *seq.siblings)]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in (seq, *seq.siblings)] == kept, "tokens after the abort"
    engine.release([seq])
    # the freed pages serve the next request as if nothing had happened
    other = rng.integers(3, 4000, 25).tolist()
    (after,) = ref.generate(other, SamplingParams(max_tokens=8, ignore_eos=True))
    fresh = LLM("tiny", warmup=False, **KW).generate(other, SamplingParams(max_tokens=8,
                                                                           ignore_eos=True))  # fmt: skip
    assert after.token_ids == fresh[0].token_ids


def test_bench_serve_measures_the_server_into_a_run_folder_report_reads(server, tmp_path):
    from jaxinfer.experiment.report import load_points
    from jaxinfer.serve.bench import load_bench_config, run_bench

    bc = load_bench_config(None, [
        f"base_url={server.base_url}", f"out_dir={tmp_path / 'b'}", "max_concurrency=8",
        "workload.num_requests=24", "workload.prompt_len.value=20",
        "workload.output_len.value=6", "workload.arrival.process=poisson",
        "workload.arrival.rate=60", "workload.avoid_token_ids=[0]", "slo.ttft=30",
    ])  # fmt: skip
    m = run_bench(bc, show_progress=False)
    assert m["num_completed"] == 24 and m["num_failed"] == 0, m["failed_errors"]
    assert m["total_output_tokens"] == 24 * 6 and m["total_prompt_tokens"] == 24 * 20
    # the server's count, from its /metrics (the process-wide counter also counts `ref`'s)
    assert m["compiles_after_warmup"] == server.state.llm.engine.compiles_after_warmup
    assert m["good_requests"] == 24
    assert 0 < m["ttft_median"] <= m["e2e_median"] and m["tpot_median"] > 0
    (point,), _ = load_points([tmp_path / "b"])
    reqs = point.requests
    assert len(reqs) == 24 and (reqs["output_len"] == 6).all()
    assert (reqs["ttft"] <= reqs["e2e"]).all() and point.params["workload.arrival.rate"] == 60


def test_serve_curve_starts_a_server_and_gathers_each_rates_metrics(tmp_path):
    """experiments/serve_curve.py: one `jaxinfer serve` child, a bench per rate, one results
    file with a row per rate (the exact token counts of the workload), a plot, the server gone;
    --offline adds the same workload through `jaxinfer run`.
    The model is a preset without a tokenizer, as on the H200 (8B shape, random weights): token
    ids go in and come back as ids (a text-only count saw no content there)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "curve.json"
    script = Path(__file__).parent.parent / "experiments" / "serve_curve.py"
    cmd = [sys.executable, str(script), "--model", "preset:tiny", "--rates", "inf", "50",
           "--num-prompts", "6", "--out", str(out), "--plot", str(tmp_path / "curve.png"),
           "--offline",
           "--serve", "engine.max_num_seqs=4", "engine.max_num_batched_tokens=32",
           "engine.max_model_len=128", "engine.decode_steps=1",  # fewer executables to warm up
           "--bench", "workload.prompt_len.value=8", "workload.output_len.value=5"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["rate"] for r in result["rows"]] == ["inf", "50"]
    for row in result["rows"]:
        assert row["num_completed"] == 6 and row["num_failed"] == 0, row
        assert row["output_throughput"] > 0 and row["ttft_median"] > 0, row
        assert row["server_rss_mb"] > 0, row
    offline = result["offline"]  # the inf rate's workload through `jaxinfer run`, no server
    assert offline["num_completed"] == 6 and offline["output_throughput"] > 0, offline
    assert result["http_overhead"] == pytest.approx(
        1 - result["rows"][0]["output_throughput"] / offline["output_throughput"], abs=1e-4
    )
    assert result["commit"] and result["server_start_s"] > 0
    assert (tmp_path / "curve.png").stat().st_size > 0
    with pytest.raises(httpx.TransportError):  # the server was stopped
        httpx.get(f"http://127.0.0.1:{result['port']}/health", timeout=2)
