"""Multi-host launch on CPU: 2 processes x 2 faked CPU devices joined by
`multihost.initialize_from_env` (the standard JAX_* variables, gloo collectives), one engine on a
4-device mesh spanning both. Process 0 schedules; process 1 follows its device calls
(`engine/follower.py`). A follower that did not make the same calls would leave process 0's
first collective waiting: the timeout turns that into a failure naming both processes' output."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jaxinfer.parallel.multihost import Leader, follow, mirrored

WORKER = """
    import json, sys
    from jaxinfer.parallel import multihost

    assert multihost.initialize_from_env()
    import jax
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.engine.follower import follow
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams

    kw, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
    if jax.process_index() == 0:
        llm = LLM("tiny", **kw)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        channel = llm.engine.runner.driver.channel
        result = {"tokens": [o.token_ids for o in outs],
                  "compiles": llm.engine.compiles_after_warmup,
                  "kv_heads": llm.engine.model_config.num_kv_heads,
                  "messages": channel.messages, "bytes": channel.bytes,
                  "seconds": channel.seconds}
        llm.close()
    else:
        result = {"calls": follow(EngineConfig(model="tiny", **kw))}
    print("RESULT " + json.dumps(result))
"""

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=16,
              max_model_len=128, decode_steps=4)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(script, args: list[str], n: int, timeout: float) -> list[dict]:
    """Run `script` as processes 0..n-1 of one multi-process run; each one's RESULT line."""
    port = _free_port()
    procs = []
    for i in range(n):
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(n),
               "JAX_PROCESS_ID": str(i)}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    outputs, failure = [], None
    for i, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            failure = f"process {i} still running after {timeout:.0f} s (a follower out of step?)"
            break
        outputs.append((out, err))
        if proc.returncode != 0:
            failure = f"process {i} exited {proc.returncode}"
            break
    if failure is not None:
        for proc in procs:
            proc.kill()
        tails = [f"--- process {i} stderr:\n{p.communicate()[1][-3000:]}"
                 for i, p in enumerate(procs)]  # fmt: skip
        raise AssertionError("\n".join([failure, *tails]))
    lines = [[ln for ln in out.splitlines() if ln.startswith("RESULT ")] for out, _ in outputs]
    return [json.loads(ln[-1].removeprefix("RESULT ")) for ln in lines]


def test_two_process_engine_matches_one_device_and_the_follower_mirrors_it(tmp_path, fresh_seed):
    """`mesh: {model: 4}` over 2 processes x 2 devices (tiny's 2 KV heads each on 2 devices):
    process 0's greedy tokens equal a one-process, one-device engine's; no compile after its
    warm-up; process 1 made every call process 0 announced, and both exit 0 once it closes."""
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams

    rng = np.random.default_rng(fresh_seed)
    prompts = [rng.integers(1, 500, int(n)).tolist() for n in rng.integers(3, 40, 5)]
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    leader, follower = _run_processes(
        script, [json.dumps({**ENGINE, "mesh": {"model": 4}}), json.dumps(prompts)], 2, 300
    )
    base = LLM("tiny", warmup=False, **ENGINE)
    want = [o.token_ids for o in base.generate(prompts, SamplingParams(max_tokens=8,
                                                                       ignore_eos=True))]  # fmt: skip
    assert leader["kv_heads"] == 4
    assert leader["tokens"] == want, (f"seed {fresh_seed}", leader["tokens"], want)
    assert leader["compiles"] == 0
    assert follower["calls"] == leader["messages"] >= 3  # warm-up, a mixed step, a decode scan


class _ListChannel:
    """The channel's messages in a list (one process plays both sides in turn)."""

    def __init__(self):
        self.sent = []
        self.messages = 0

    def send(self, message):
        self.sent.append(pickle.loads(pickle.dumps(message)))  # (what crosses must pickle)
        self.messages += 1

    def receive(self):
        return self.sent.pop(0)


class _Runner:
    """A model runner's device-call surface: `put` and one mirrored step."""

    def __init__(self):
        from jaxinfer.parallel.sharding import EngineShardings

        self.driver, self.shardings, self.made = None, EngineShardings.for_config({}), []

    def put(self, x):
        out = self.shardings.put(x)
        if self.driver is not None:
            self.driver.record_put(x, out)
        return out

    @mirrored()
    def step(self, x, prev=None, *, scale=1):
        out = (x * scale if prev is None else x + prev[0], x.sum())
        self.made.append([np.array(o, copy=True) for o in out])
        return out


def test_a_follower_rebuilds_every_announced_call_from_puts_and_earlier_outputs(fresh_seed):
    """Process 0's calls, replayed by `follow` from the messages alone, make the same values:
    host inputs travel as values, earlier outputs as handles (a wrong handle changes a value);
    dropped outputs leave with the next message; a device array of unknown origin is refused."""
    rng = np.random.default_rng(fresh_seed)
    channel = _ListChannel()
    leader = _Runner()
    leader.driver = Leader(channel)
    x = leader.put(rng.integers(0, 100, 5).astype(np.int32))
    prev = leader.step(x, scale=3)
    for _ in range(4):
        y = leader.put(rng.integers(0, 100, 5).astype(np.int32))
        prev = leader.step(y, prev)  # (the previous outputs are dropped here)
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        leader.step(jax.numpy.ones(5, np.int32))
    leader.driver.close()
    dropped = [h for m in channel.sent if m != "shutdown" for h in m[2]]
    assert sorted(dropped) == list(range(6))  # calls 1 to 3's outputs, sent with calls 3 to 5
    follower = _Runner()
    assert follow(follower, channel) == 5
    for got, want in zip(follower.made, leader.made, strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"seed {fresh_seed}")
