"""Data parallelism: one engine replica per device, all fed from one request queue.

Each replica is a whole `Engine` (its own scheduler, block manager, KV cache and compiled steps)
whose arrays live on one device; a host thread drives it inside `jax.default_device(device)`
(thread-local), so its host-built batches land on its device. Replicas *pull* requests from the
shared queue while they hold fewer than `max_num_seqs` (running + waiting), so a replica that
runs ahead takes more work: load balances by progress, not by a guess at arrival.

Device work of different replicas overlaps: JAX releases the GIL while a computation runs and the
engine dispatches asynchronously; host work (scheduling, post-processing) is serialised by the GIL,
which is the cost to watch on a many-GPU host (see the replica's `host_ms` step records).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import jax

from jaxinfer.engine.compile_counter import compile_count
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.request import Sequence as Request


class DataParallelEngine:
    """`len(devices)` replicas of one engine configuration behind one FIFO request queue."""

    def __init__(
        self,
        config: EngineConfig,
        cfg,
        params,
        tokenizer=None,
        devices: Sequence[jax.Device] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        devices = list(devices if devices is not None else jax.devices())
        if not devices:
            raise ValueError("data parallelism needs at least one device")
        self.devices, self.clock = devices, clock
        self.replicas: list[Engine] = []
        for dev in devices:
            with jax.default_device(dev):
                local = jax.device_put(params, dev)
                self.replicas.append(Engine(config, cfg, local, tokenizer, clock))
        self._queue: deque[tuple[int, object, SamplingParams, float, int]] = deque()
        self._lock = threading.Lock()
        self._submitted = 0
        self._results: dict[int, Request] = {}
        self.assignments: dict[int, int] = {}  # request index -> replica index

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt, sampling: SamplingParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0) -> int:  # fmt: skip
        """Queue a request; returns its index (results come back in `run()` by index)."""
        now = self.clock() if arrival_time is None else arrival_time
        with self._lock:
            idx = self._submitted
            self._submitted += 1
            self._queue.append((idx, prompt, sampling or SamplingParams(), now, priority))
        return idx

    def _pull(self, r: int, engine: Engine) -> bool:
        """Move queued requests to replica `r` until it holds `max_num_seqs` (running + waiting),
        so its scheduler can fill every free slot in one step. True if it took any.

        (Pulling only while nothing waited handed a replica one request per step: on 2 H200s the
        8B engine then admitted one prompt per step and ran at 0.70x one GPU,
        experiments/results/h200x2/multi_gpu.json.)
        """
        took = False
        sched = engine.scheduler
        while sched.num_running + sched.num_waiting < engine.config.max_num_seqs:
            with self._lock:
                if not self._queue:
                    break
                idx, prompt, sampling, arrival, priority = self._queue.popleft()
            seq = engine.add_request(prompt, sampling, arrival_time=arrival, priority=priority)
            with self._lock:
                self._results[idx], self.assignments[idx] = seq, r
            took = True
        return took

    # -- running ----------------------------------------------------------------------------------
    def _on_each(self, fn: Callable[[int, Engine], None]) -> None:
        """Run fn(replica index, engine) on one thread per replica, inside its default device."""
        errors: list[BaseException] = []

        def target(r: int, engine: Engine) -> None:
            try:
                with jax.default_device(self.devices[r]):
                    fn(r, engine)
            except BaseException as e:  # surfaced below, on the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=target, args=(r, e), name=f"replica-{r}")
                   for r, e in enumerate(self.replicas)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def warmup(self) -> float:
        """Compile every replica's buckets (replicas compile concurrently); returns seconds."""
        t0 = time.perf_counter()
        self._on_each(lambda r, e: e.warmup())
        for engine in self.replicas:  # counted from when the *last* replica finished compiling
            engine._compiles_at_warmup = compile_count()
        return time.perf_counter() - t0

    def run(self) -> list[Request]:
        """Serve until the queue is empty and every replica has finished; results by index."""

        def loop(r: int, engine: Engine) -> None:
            while True:
                self._pull(r, engine)
                if engine.has_unfinished():
                    engine.step()
                    continue
                with self._lock:
                    if not self._queue:
                        return

        self._on_each(loop)
        return [self._results[i] for i in range(self._submitted)]

    @property
    def compiles_after_warmup(self) -> int | None:
        # The compile counter is process-wide: every replica reports the same count.
        return self.replicas[0].compiles_after_warmup
