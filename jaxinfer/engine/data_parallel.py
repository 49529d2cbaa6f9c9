"""Data parallelism: one engine replica per GPU, each in its own worker process, all fed from one
request queue (`ProcessDataParallelEngine`, `engine.data_parallel > 1`).

Each replica is a whole `Engine` (its own scheduler, block manager, KV cache and compiled steps)
in a process that sees one GPU, so replicas' host work runs in parallel. Replicas *pull*
requests from the shared queue while they hold fewer than `max_num_seqs` (running + waiting), so a
replica that runs ahead takes more work: load balances by progress, not by a guess at arrival.
Replicas as threads of one process scaled worse, their host work sharing one GIL, and were removed
(docs/decisions.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import jax

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.loading import load_model
from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.request import Sequence as Request

# -- one process per replica ------------------------------------------------------------------------
_STOP = "stop"
_NO_MORE = None  # in the request queue: this run has no more requests (one per worker)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _serve(engine: Engine, requests, tokenizer) -> tuple[list, dict]:
    """Worker side of one run: pull from the shared queue while holding < max_num_seqs, step while
    anything is unfinished, stop after this worker's end-of-run marker once all it took is done."""
    from queue import Empty

    taken: dict[int, Request] = {}
    sched, cap = engine.scheduler, engine.config.max_num_seqs
    draining, steps, t0 = False, 0, time.perf_counter()
    while True:
        while not draining and sched.num_running + sched.num_waiting < cap:
            busy = engine.has_unfinished()
            try:  # never block while there is device work to issue
                item = requests.get_nowait() if busy else requests.get(timeout=60.0)
            except Empty:
                if busy:
                    break
                continue
            if item is _NO_MORE:
                draining = True
                break
            idx, prompt, sampling, arrival, priority = item
            taken[idx] = engine.add_request(prompt, sampling, arrival_time=arrival,
                                            priority=priority)  # fmt: skip
        if engine.has_unfinished():
            engine.step()
            steps += 1
        elif draining:
            break
    outs = []
    for idx, seq in taken.items():
        out = RequestOutput.of(seq, tokenizer)
        out.request_id = idx
        outs.append((idx, out))
    stats = {"requests": len(taken), "steps": steps, "busy_s": round(time.perf_counter() - t0, 3),
             "compiles_after_warmup": engine.compiles_after_warmup}  # fmt: skip
    return outs, stats


def _exit_with_parent(parent_pid: int, *, death_signal: bool) -> None:
    """A worker never outlives the process that started it: its control queue would block forever
    (an orphaned worker would hold its GPU indefinitely). On Linux the kernel kills it
    when the thread that started it ends (PR_SET_PDEATHSIG; only asked for when that thread is the
    main one, which ends with its process); a thread that polls the parent pid covers the rest
    (other systems, engines built off the main thread, a parent gone before prctl)."""
    import os
    import signal
    import sys
    import threading

    if death_signal and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    def watch() -> None:
        while os.getppid() == parent_pid:  # an orphan is re-parented: the pid changes
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _worker(rank: int, config: dict, setup, control, requests, results, parent_pid: int,
            death_signal: bool) -> None:  # fmt: skip
    """A replica's process: load the model on the one GPU it sees, then serve commands."""
    import traceback

    _exit_with_parent(parent_pid, death_signal=death_signal)
    try:
        engine_config = EngineConfig(**{**config, "data_parallel": 1})
        cfg, params, tokenizer = load_model(engine_config.model, engine_config.dtype,
                                            engine_config.seed, quant=engine_config.quant)  # fmt: skip
        engine = Engine(engine_config, cfg, params, tokenizer)
        if setup is not None:
            setup(engine)
        device = jax.devices()[0]
        results.put(("ready", rank, {"device": str(device), "platform": device.platform}))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        return
    while True:
        cmd = control.get()
        try:
            if cmd == _STOP:
                return
            if cmd == "warmup":
                results.put(("warm", rank, engine.warmup()))
            elif cmd == "run":
                results.put(("done", rank, _serve(engine, requests, tokenizer)))
        except BaseException:
            results.put(("error", rank, traceback.format_exc()))


def _warn_if_this_process_holds_a_gpu() -> None:
    """Workers need their GPU's memory; JAX preallocates 75% of every GPU it initialises."""
    import os
    import warnings

    try:
        from jax._src import xla_bridge

        held = xla_bridge.backends_are_initialized() and any(
            d.platform == "gpu" for d in jax.devices()
        )  # fmt: skip
    except Exception:  # a private API: no warning rather than an error
        return
    if held and os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() != "false":
        warnings.warn(
            "engine.data_parallel_backend=process: this process already initialised JAX on the "
            "GPU (75% of each GPU preallocated), so worker processes may run out of memory. Build "
            "the data-parallel engine before other JAX work, or set XLA_PYTHON_CLIENT_PREALLOCATE="
            "false.",
            stacklevel=3,
        )


class ProcessDataParallelEngine:
    """`engine.data_parallel` replicas, one worker *process* per GPU, behind one request queue.

    Each worker sees one GPU (`CUDA_VISIBLE_DEVICES` is set when it starts), loads the model
    itself and runs a whole `Engine`; host work (scheduling, sampling bookkeeping) of different
    replicas runs in parallel, which threads in one process cannot do (the GIL). Workers pull
    requests from a shared queue while they hold fewer than `max_num_seqs`, as the threaded
    engine's replicas do. This process never initialises a JAX backend, so it holds no GPU memory.

    `setup(engine)`, a picklable function, runs in every worker on its engine before warm-up (e.g.
    to trim compile buckets). On a machine without GPUs the workers run on the CPU (tests).
    Workers exit when this process does, however it ends (`close()`, interpreter exit, kill -9).
    """

    def __init__(self, config: EngineConfig, *, setup=None, gpu_ids: Sequence[str] | None = None,
                 start_timeout_s: float = 1800.0) -> None:  # fmt: skip
        import dataclasses
        import multiprocessing as mp
        import os
        import threading

        n = config.data_parallel
        if gpu_ids is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            gpu_ids = visible.split(",") if visible else [str(i) for i in range(n)]
        if len(gpu_ids) < n:
            raise ValueError(f"engine.data_parallel={n} needs {n} GPUs; CUDA_VISIBLE_DEVICES "
                             f"lists {len(gpu_ids)}")  # fmt: skip
        _warn_if_this_process_holds_a_gpu()
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited JAX or CUDA state
        self._requests, self._results = ctx.Queue(), ctx.Queue()
        self._controls = [ctx.Queue() for _ in range(n)]
        self.config, self.n = config, n
        self.clock = time.perf_counter  # CLOCK_MONOTONIC: the same clock in every process
        self._submitted = 0
        self._outputs: dict[int, object] = {}  # RequestOutput by submission index
        self.assignments: dict[int, int] = {}
        self.replica_stats: list[dict] = []
        self.worker_info: list[dict] = [{} for _ in range(n)]
        self._compiles: int | None = None
        self._procs = []
        fields = dataclasses.asdict(config)
        # The kernel's parent-death signal follows the thread that starts a worker: only the main
        # thread lives as long as this process (_exit_with_parent).
        death_signal = threading.current_thread() is threading.main_thread()
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            for r in range(n):
                os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu_ids[r]).strip()
                p = ctx.Process(target=_worker, name=f"replica-{r}", daemon=True,
                                args=(r, fields, setup, self._controls[r], self._requests,
                                      self._results, os.getpid(), death_signal))  # fmt: skip
                p.start()
                self._procs.append(p)
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        try:
            for rank, info in self._collect("ready", start_timeout_s):
                self.worker_info[rank] = {"gpu": str(gpu_ids[rank]), **info}
            platforms = {i["platform"] for i in self.worker_info}
            if len(platforms) > 1:
                raise RuntimeError(
                    f"engine.data_parallel={n}: replicas ended up on different platforms "
                    f"{[(i['gpu'], i['platform']) for i in self.worker_info]}; a worker whose "
                    f"CUDA_VISIBLE_DEVICES names no GPU falls back to the CPU"
                )  # fmt: skip
        except BaseException:
            self.close()
            raise

    # -- plumbing ---------------------------------------------------------------------------------
    def _collect(self, kind: str, timeout_s: float) -> list[tuple[int, object]]:
        """One `kind` message from every worker; a worker error or death raises here."""
        from queue import Empty

        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.n:
            try:
                msg, rank, payload = self._results.get(timeout=2.0)
            except Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"data-parallel worker(s) exited: (replica, exit code) "
                                       f"{dead}") from None  # fmt: skip
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.n)) - set(got))
                    raise TimeoutError(f"data-parallel workers: no '{kind}' from replicas "
                                       f"{missing} in {timeout_s} s") from None  # fmt: skip
                continue
            if msg == "error":
                raise RuntimeError(f"data-parallel replica {rank} failed:\n{payload}")
            if msg != kind:
                raise RuntimeError(f"data-parallel replica {rank}: expected '{kind}', got '{msg}'")
            got[rank] = payload
        return sorted(got.items())

    def _check_open(self) -> None:
        if not self._procs:
            raise RuntimeError("this data-parallel engine is closed (closed, or a replica failed); "
                               "build a new one")  # fmt: skip

    def _broadcast(self, cmd: str) -> None:
        for q in self._controls:
            q.put(cmd)

    def close(self) -> None:
        """Stop the workers (also done at interpreter exit: they are daemons)."""
        for q, p in zip(self._controls, self._procs, strict=False):
            if p.is_alive():
                q.put(_STOP)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self._procs = []

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()

    # -- the engine interface ---------------------------------------------------------------------
    def add_request(self, prompt, sampling: SamplingParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0) -> int:  # fmt: skip
        """Queue a request; returns its index (results come back from `run()` by index)."""
        self._check_open()
        now = self.clock() if arrival_time is None else arrival_time
        idx = self._submitted
        self._submitted += 1
        self._requests.put((idx, prompt, sampling or SamplingParams(), now, priority))
        return idx

    def warmup(self) -> float:
        """Every replica compiles its buckets (at once, each on its own GPU); returns seconds."""
        self._check_open()
        t0 = time.perf_counter()
        self._broadcast("warmup")
        self.warmup_s_per_replica = [s for _, s in self._collect("warm", 1e9)]
        return time.perf_counter() - t0

    def run(self, timeout_s: float = 1e9) -> list:
        """Serve until the queue is drained and every replica is done. Returns `RequestOutput`s
        of every request submitted so far, by index (`request_id` is the index)."""
        self._check_open()
        for _ in range(self.n):  # FIFO: each marker comes after every queued request
            self._requests.put(_NO_MORE)
        self._broadcast("run")
        self.replica_stats = []
        try:
            done = self._collect("done", timeout_s)
        except BaseException:  # a replica failed mid-run: queue state is unknown, stop them all
            self.close()
            raise
        for rank, (outs, stats) in done:
            for idx, out in outs:
                self._outputs[idx] = out
                self.assignments[idx] = rank
            self.replica_stats.append({"replica": rank, **stats})
        counts = [s["compiles_after_warmup"] for s in self.replica_stats]
        self._compiles = None if None in counts else sum(counts)  # None: a replica never warmed up
        return [self._outputs[i] for i in range(self._submitted)]

    @property
    def compiles_after_warmup(self) -> int | None:
        """Compilations after warm-up summed over replicas (each process counts its own)."""
        return self._compiles
