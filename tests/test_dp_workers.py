"""Data-parallel worker processes die with the process that started them, however it ends (a
killed test once left its workers running for 43 minutes: issue 35)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")

SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    os.environ["JAX_PLATFORMS"] = "cpu"

    if __name__ == "__main__":
        from jaxinfer.engine.config import EngineConfig
        from jaxinfer.engine.data_parallel import ProcessDataParallelEngine

        config = EngineConfig(model="tiny", data_parallel=2, max_num_seqs=2, num_pages=8,
                              page_size=16, max_model_len=32, attention_backend="xla")
        if sys.argv[1] == "thread":  # built by a thread that then ends
            built = []
            t = threading.Thread(target=lambda: built.append(ProcessDataParallelEngine(config)))
            t.start()
            t.join()
            (engine,) = built
        else:
            engine = ProcessDataParallelEngine(config)
        print(json.dumps([p.pid for p in engine._procs]), flush=True)
        time.sleep(600)  # idle workers wait on their control queues until this process is killed
""")


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper is gone: it runs nothing and holds no memory)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def start_engine(tmp_path: Path, how: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "dp_parent.py"
    script.write_text(SCRIPT)
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:  # a file: workers that outlive the parent keep it open
        parent = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE,
                                  stderr=err, text=True,
                                  cwd=Path(__file__).parent.parent)  # fmt: skip
    line = parent.stdout.readline()  # the workers' pids, once both are ready
    if not line:
        parent.kill()
        raise AssertionError(stderr.read_text()[-3000:])
    return parent, json.loads(line)


def kill_and_wait(parent: subprocess.Popen, workers: list[int], within_s: float) -> list[int]:
    """kill -9 the parent; the workers still alive `within_s` later."""
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + within_s
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in workers if alive(pid)]


@pytest.mark.parametrize("how", ["main", "thread"])
def test_workers_die_within_seconds_of_a_killed_parent(tmp_path, how):
    """kill -9 of the process that built the engine (on its main thread, or on a thread that has
    since ended) takes its idle workers with it within seconds."""
    parent, workers = start_engine(tmp_path, how)
    try:
        assert len(workers) == 2 and all(map(alive, workers)), workers
        if how == "thread":  # the parent-death signal follows the thread: it must not fire here
            time.sleep(1.0)
            assert all(map(alive, workers)), "workers died with the thread that started them"
        left = kill_and_wait(parent, workers, within_s=5.0)
        assert left == [], f"workers {left} outlived their killed parent by 5 s"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in workers:  # this test's own workers, by pid
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
