"""`jaxinfer serve` stopped by Ctrl-C (SIGINT) with a stream in flight."""

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

# The child holds its engine after two steps until a stream is aborted (as test_serve.py's
# _HeldEngine does), so the stream is open however fast this machine decodes.
CHILD = """
import sys, threading
from jaxinfer.engine.engine import Engine
from jaxinfer.serve.engine_loop import EngineLoop
go, steps, step, abort = threading.Event(), [0], Engine.step, EngineLoop.abort
def held_step(self):
    steps[0] += 1
    if steps[0] > 2:
        go.wait(30)
    return step(self)
def abort_and_go(self, subs):
    abort(self, subs)
    go.set()
Engine.step, EngineLoop.abort = held_step, abort_and_go
from jaxinfer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _line_with(stream, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([stream], [], [], deadline - time.monotonic())[0]:
            line = stream.readline()
            assert line, "the server exited"
            if text in line:
                return line
    raise AssertionError(f"no line with {text!r} in {timeout} s")


def test_sigint_ends_open_streams_with_an_error_and_done_and_exits_quietly():
    cmd = [sys.executable, "-c", CHILD, "serve", "--model", "tiny", "--host", "127.0.0.1",
           "--port", "0", "engine.max_num_seqs=2", "engine.max_num_batched_tokens=32",
           "engine.max_model_len=128", "serve.log_level=warning"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    try:
        url = _line_with(proc.stdout, "(Ctrl-C stops)", 300).split(" at ")[1].split()[0]
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 100, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", url + "/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            lines = (x for x in resp.iter_lines() if x)
            assert next(lines).startswith("data: {")  # the stream is open
            proc.send_signal(signal.SIGINT)
            rest = list(lines)
        error = json.loads(rest[-2].removeprefix("data: "))
        assert error["error"]["message"] == "the server is shutting down", rest[-2:]
        assert rest[-1] == "data: [DONE]"
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    compiled = [x.split()[3] for x in err.splitlines() if x.startswith("jaxinfer serve: compiled")]
    done, total = compiled[-1].split("/") if compiled else ("", "?")
    assert done == total, err  # the warm-up's progress lines, the last with every one compiled
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert err.strip().splitlines()[-1] == (
        "jaxinfer serve: stopped on Ctrl-C; 1 open stream(s) ended with an error event"
    ), err
