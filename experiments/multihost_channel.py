"""The multi-host control channel's cost on CPU: what process 0 pays per announced device call.

    python experiments/multihost_channel.py --out experiments/results/cpu/multihost_channel.json

Launches 2 processes x 2 faked CPU devices on this host, joined by the standard variables
(`parallel/multihost.py`), then measures
1. `Channel.send` of messages of 1 KiB to 1 MiB (`--reps` each): process 0's ms per message;
2. the tiny model on `mesh: {model: 4}` across both processes, `--requests` greedy requests:
   the calls announced while serving (the warm-up's one left out), their mean bytes, process
   0's ms in `Channel.send` per call, and the engine steps' mean wall ms beside it.
On a CPU both processes share this host's cores: the numbers are the plumbing's, not a
network's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

SIZES = (1 << 10, 1 << 13, 1 << 16, 1 << 20)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=16,
              max_model_len=128, decode_steps=4, mesh={"model": 4})  # fmt: skip


def worker(reps: int, requests: int) -> dict | None:
    """One process of the run; process 0 returns the measurements."""
    from jaxinfer.parallel import multihost

    assert multihost.initialize_from_env()
    import jax
    import numpy as np

    leader = jax.process_index() == 0
    channel = multihost.Channel()
    sizes = {}
    for size in SIZES:
        payload = os.urandom(size)
        channel.send(payload) if leader else channel.receive()  # (compiles its broadcasts)
        t = time.perf_counter()
        for _ in range(reps):
            channel.send(payload) if leader else channel.receive()
        sizes[str(size)] = round((time.perf_counter() - t) / reps * 1e3, 3)
    from jaxinfer.engine.config import EngineConfig

    if not leader:
        from jaxinfer.engine.follower import follow

        follow(EngineConfig(model="tiny", **ENGINE))
        return None
    from jaxinfer.engine.llm import LLM
    from jaxinfer.engine.request import SamplingParams

    llm = LLM("tiny", **ENGINE)
    ch = llm.engine.runner.driver.channel
    before = (ch.messages, ch.bytes, ch.seconds)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, int(n)).tolist() for n in rng.integers(3, 60, requests)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    wall = time.perf_counter() - t
    calls, nbytes, seconds = (a - b for a, b in zip((ch.messages, ch.bytes, ch.seconds), before,
                                                    strict=True))  # fmt: skip
    steps = len(llm.engine.step_records)
    llm.close()
    return {
        "send_ms_by_bytes": sizes,
        "serving": {"requests": requests, "calls": calls, "mean_call_bytes": round(nbytes / calls),
                    "send_ms_per_call": round(seconds / calls * 1e3, 3), "steps": steps,
                    "step_ms": round(wall / steps * 1e3, 3),
                    "send_share_of_wall": round(seconds / wall, 4)},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        result = worker(args.reps, args.requests)
        if result is not None:
            print("RESULT " + json.dumps(result))
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(i)}  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", "--out", str(args.out), "--reps",
               str(args.reps), "--requests", str(args.requests)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    if any(p.returncode for p in procs):
        print(f"a process failed: exit codes {[p.returncode for p in procs]}", file=sys.stderr)
        return 1
    result = json.loads(next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))[7:])
    from jaxinfer.provenance import provenance

    result = {**provenance(), "processes": 2, "devices_per_process": 2, "engine": ENGINE, **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["send_ms_by_bytes"]), json.dumps(result["serving"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
