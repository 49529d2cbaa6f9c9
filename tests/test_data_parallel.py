"""Data-parallel replicas behind one queue: worker processes, here on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxinfer.engine.config import EngineConfig


def test_data_parallel_option_is_validated():
    with pytest.raises(ValueError, match="data_parallel"):
        EngineConfig(model="preset:tiny", data_parallel=0)


PROCESS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import numpy as np

    N = 13  # requests: enough that both replicas take some


    def trim(engine):  # runs on every engine before warm-up: fewer compiles, the same shapes
        r = engine.runner
        r.token_buckets = r.token_buckets[-1:]


    def closed_error(eng):  # a closed engine refuses work by name
        eng.close()
        try:
            eng.add_request([1, 2, 3])
        except RuntimeError as e:
            return str(e)
        return None


    if __name__ == "__main__":
        from jaxinfer.engine.llm import LLM
        from jaxinfer.engine.request import SamplingParams
        rng = np.random.default_rng(int(sys.argv[1]))  # the test's fresh seed
        prefix = rng.integers(1, 4000, 32).tolist()  # two full pages every prompt shares
        prompts = [prefix + rng.integers(1, 4000, int(n)).tolist()
                   for n in rng.integers(3, 24, N - 1)]
        prompts.insert(5, [])  # a bad request fails alone
        sp = SamplingParams(max_tokens=6, ignore_eos=True)
        kw = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=32, page_size=16,
                  max_model_len=64, decode_steps=1, attention_backend="xla")  # no scans to compile
        single = LLM("tiny", setup=trim, warmup=False, **kw)  # the reference
        assert single.engine.__class__.__name__ == "Engine"  # "auto" with 1 replica: in process
        one = single.generate(prompts, sp)
        # "auto": processes for 2 replicas, each with its own prefix cache
        llm = LLM("tiny", data_parallel=2, setup=trim, prefix_caching=True, **kw)
        eng = llm.engine
        two = llm.generate(prompts, sp)
        again = llm.generate(prompts[:3], sp)  # a second run on the same workers
        print(json.dumps({
            "one": [o.token_ids for o in one], "two": [o.token_ids for o in two],
            "again": [o.token_ids for o in again], "ids": [o.request_id for o in two],
            "again_cached": [o.num_cached_tokens for o in again],
            "again_assign": [eng.assignments[N + i] for i in range(3)],
            "errors": [o.error for o in two], "assign": [eng.assignments[i] for i in range(N)],
            "stats": eng.replica_stats, "compiles": eng.compiles_after_warmup,
            "workers": eng.worker_info, "pids": [p.pid for p in eng._procs], "me": os.getpid(),
            "texts": [o.text for o in two[:2]], "has_tokenizer": llm.tokenizer is not None,
            "closed_error": closed_error(eng)}))
""")


def test_process_replicas_serve_one_queue_with_one_engines_tokens(tmp_path: Path, fresh_seed):
    """One worker process per replica (on the CPU here): same greedy tokens as one engine (the
    replicas with prefix caching on, the one engine with it off), both take work, a bad request
    fails alone, a second run reuses the workers and finds the shared prefix in the cache of
    whichever replica takes it, 0 compiles.

    Three engines of 4 executables each (one token bucket, no decode scans: every replica is a
    whole Engine, whose scans are tested on their own): ~10 s on an idle 2-core machine. The
    budget is 60 times that, for a machine loaded by other test processes; a run killed at the
    budget takes its workers with it (test_dp_workers.py)."""
    script = tmp_path / "dp_process.py"
    script.write_text(PROCESS_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(fresh_seed)], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).parent.parent)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    n = len(out["two"])
    good = [i for i in range(n) if i != 5]
    assert [out["two"][i] for i in good] == [out["one"][i] for i in good]
    assert all(len(out["two"][i]) == 6 for i in good)
    assert out["errors"][5] and "empty" in out["errors"][5]
    assert out["ids"] == list(range(n))
    assert out["again"] == [out["one"][i] for i in range(3)]
    # every replica computed the shared prefix in the first run: its pages serve the second
    assert all(c >= 32 for c in out["again_cached"]), (out["again_cached"], out["again_assign"])
    assert sorted(set(out["assign"])) == [0, 1]  # both workers took work from the one queue
    assert sum(s["requests"] for s in out["stats"]) == 3  # the last run's requests
    assert out["compiles"] == 0
    assert len(set(out["pids"])) == 2 and out["me"] not in out["pids"]
    assert {w["platform"] for w in out["workers"]} == {"cpu"}
    assert out["has_tokenizer"] and all(isinstance(t, str) and t for t in out["texts"])
    assert out["closed_error"] and "closed" in out["closed_error"]


def test_process_backend_is_validated():
    with pytest.raises(ValueError, match="data_parallel_backend"):
        EngineConfig(model="preset:tiny", data_parallel=2, data_parallel_backend="mpi")


def test_experiment_run_refuses_replicas_by_name():
    """`jaxinfer run` measures one replica; asking it for several names the key, before loading."""
    from jaxinfer.experiment.run import load_run_config, run_experiment

    rc = load_run_config(None, ["engine.model=tiny", "engine.data_parallel=2"])
    with pytest.raises(ValueError, match=r"engine\.data_parallel=2.*sweep --workers"):
        run_experiment(rc, show_progress=False)
