"""Multi-host engines: joining the processes, and process 0 driving the others' device calls.

One engine process per host drives that host's devices; `engine.mesh` spans every process's
devices (`jax.devices()`). Every process builds the engine alike: the same config makes the same
device calls (loading or drawing the params, the KV cache). From then on only process 0
schedules. Each device call of its model runner (`mirrored`: warm-up, mixed steps, decode scans)
is first broadcast to the others, and each of them makes the same call (`follow`). So every
process runs the same executables on the same global arrays in the same order, which is what
their collectives need. A call made inside a mirrored call (the steps of a warm-up) is part of
it, on every process alike, and is not announced again.

A call's message names the runner method and gives its arguments, with each device array
replaced by
- `Put(value)`: a host value that process 0 put on the mesh, replicated (`ModelRunner.put`:
  batches, page tables, sampling parameters). A follower puts the same value, which gives the
  same global array;
- `Ref(handle)`: an output of an earlier mirrored call (a previous step's tokens, a scan's
  final DecodeState). Outputs are numbered in the order they are made, alike on every process,
  so each process keeps its own copy under the same handle. When process 0 drops one, the
  handle goes out with its next message and the followers drop theirs.

The channel is `jax.experimental.multihost_utils.broadcast_one_to_all`, public jax API (the
distributed runtime's key-value store is not public). It is a device collective, ordered on each
device after the work already queued there, so process 0 waits for the step in flight before it
dispatches the next one; its cost is in docs/parallel.md.
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import pickle
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

# The standard variables: JAX reads the first itself (0.10); the other two are read here, so a
# launch does not depend on a cluster manager that jax can detect.
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"


def _env_int(environ, name: str) -> int | None:
    value = environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be an integer") from None


def initialize_from_env(environ=os.environ) -> bool:
    """Join a multi-process run when JAX_COORDINATOR_ADDRESS (host:port, reachable from every
    host; process 0 serves it) is set, with JAX_NUM_PROCESSES and JAX_PROCESS_ID (unset: jax
    detects them under SLURM, Open MPI, ...). Must run before anything touches a device. CPU
    collectives go through gloo. Returns whether this is a multi-process run."""
    address = environ.get(COORDINATOR_ENV)
    if not address:
        return False
    if jax.distributed.is_initialized():
        return True
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes=_env_int(environ, NUM_PROCESSES_ENV),
                               process_id=_env_int(environ, PROCESS_ID_ENV))  # fmt: skip
    return True


def is_follower() -> bool:
    """Whether this process is one of a multi-process run's followers (not process 0). Touches
    no device in a single-process run."""
    return jax.distributed.is_initialized() and jax.process_index() != 0


class Channel:
    """Messages (picklable host data) from process 0 to all the others.

    One `broadcast_one_to_all` of a BLOCK-byte uint8 array carries the message's length and its
    start; a longer message sends the rest in a second one, padded to a power of two (few
    shapes: few compiles). Every process makes the same broadcasts: a follower's `receive`
    blocks until process 0 sends."""

    BLOCK = 8192
    _LEN = 8  # bytes of the length

    def __init__(self) -> None:
        from jax.experimental import multihost_utils

        self._broadcast = multihost_utils.broadcast_one_to_all
        self.messages, self.bytes, self.seconds = 0, 0, 0.0  # process 0's sends

    def send(self, message: Any) -> None:
        t = time.perf_counter()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._exchange(data)
        self.messages, self.bytes = self.messages + 1, self.bytes + len(data)
        self.seconds += time.perf_counter() - t

    def receive(self) -> Any:
        return pickle.loads(self._exchange(None))

    def _exchange(self, data: bytes | None) -> bytes:
        source = data is not None
        first = np.zeros(self.BLOCK, np.uint8)
        room = self.BLOCK - self._LEN
        if source:
            head = len(data).to_bytes(self._LEN, "little") + data[:room]
            first[: len(head)] = np.frombuffer(head, np.uint8)
        got = np.asarray(self._broadcast(first, is_source=source))
        n = int.from_bytes(got[: self._LEN].tobytes(), "little")
        body = got[self._LEN : self._LEN + min(n, room)].tobytes()
        if n > room:
            rest = n - room
            buf = np.zeros(1 << (rest - 1).bit_length(), np.uint8)
            if source:
                buf[:rest] = np.frombuffer(data, np.uint8, offset=room)
            body += np.asarray(self._broadcast(buf, is_source=source))[:rest].tobytes()
        return body


@dataclass(frozen=True)
class Put:
    """A host value put on the mesh replicated (`ModelRunner.put`)."""

    value: Any


@dataclass(frozen=True)
class Ref:
    """An output of an earlier mirrored call, by its handle."""

    handle: int


_SHUTDOWN = "shutdown"


def mirrored(leader_only: tuple[str, ...] = ()):
    """Marks a ModelRunner method that every process of a multi-host engine makes: with a driver
    (process 0's `Leader`) it is announced to the others first. `leader_only`: keyword
    arguments that stay on process 0 (a progress callback); the others get their defaults."""

    def wrap(method):
        @functools.wraps(method)
        def call(runner, *args, **kwargs):
            driver = runner.driver
            if driver is None:  # one process, or a follower making an announced call
                return method(runner, *args, **kwargs)
            return driver.call(method, runner, args, kwargs, leader_only)

        return call

    return wrap


class Leader:
    """Process 0's driver: announces each mirrored call before making it, and keeps what the
    followers need to rebuild its arguments (the host values of its puts, its outputs' handles;
    both by the device array's id while that array lives)."""

    def __init__(self, channel: Channel | None = None) -> None:
        self.channel = channel or Channel()
        self._puts: dict[int, tuple[weakref.ref, Any]] = {}
        self._outputs: dict[int, tuple[weakref.ref, int]] = {}
        self._next = 0  # the next output's handle
        self._dropped: collections.deque[int] = collections.deque()  # (weakref callbacks)
        self._depth = 0  # > 0 inside a mirrored call: nothing is announced
        # one announced call at a time, from any thread (a server's engine loop, a close)
        self._lock = threading.Lock()
        self.closed = False
        atexit.register(self.close)  # followers never wait on a process 0 that has gone

    def record_put(self, host: Any, device: Any) -> None:
        """`device` is `host` put replicated (outside a mirrored call, a call's input)."""
        if self._depth:
            return

        def record(h, d):
            key = id(d)
            self._puts[key] = (weakref.ref(d, lambda _: self._puts.pop(key, None)), h)

        jax.tree.map(record, host, device)

    def call(self, method, runner, args: tuple, kwargs: dict, leader_only: tuple[str, ...]):
        if self._depth:
            return method(runner, *args, **kwargs)
        with self._lock:
            if self.closed:
                raise RuntimeError("the multi-host engine is closed: its followers have exited")
            sent = {k: v for k, v in kwargs.items() if k not in leader_only}
            encoded = self._encode((args, sent))  # (first: a refused call drops nothing)
            dropped = [self._dropped.popleft() for _ in range(len(self._dropped))]
            self.channel.send((method.__name__, encoded, dropped, self._next))
            self._depth += 1
            try:
                result = method(runner, *args, **kwargs)
            finally:
                self._depth -= 1
            for leaf in jax.tree.leaves(result):
                self._keep(leaf)
            return result

    def _keep(self, leaf) -> None:
        key, handle = id(leaf), self._next
        self._next += 1
        if key in self._outputs:  # one array twice in the outputs: the last handle names it
            self._dropped.append(self._outputs[key][1])

        def drop(_):
            self._outputs.pop(key, None)
            self._dropped.append(handle)

        self._outputs[key] = (weakref.ref(leaf, drop), handle)

    def _encode(self, tree):
        def leaf(x):
            if not isinstance(x, jax.Array):
                return x
            if id(x) in self._outputs:
                return Ref(self._outputs[id(x)][1])
            if id(x) in self._puts:
                return Put(self._puts[id(x)][1])
            raise RuntimeError(
                f"a mirrored call's argument {x.shape} {x.dtype} is a device array the other "
                "processes cannot rebuild: make it with ModelRunner.put or a mirrored call"
            )

        return jax.tree.map(leaf, tree)

    def close(self) -> None:
        """Tell the followers to stop (once). A call still running in another thread (an
        interrupted warm-up) keeps the lock: then nothing is sent, and the followers end when
        the distributed runtime sees this process gone."""
        if self.closed or not self._lock.acquire(timeout=10):
            return
        try:
            if not self.closed:
                self.closed = True
                self.channel.send(_SHUTDOWN)
        finally:
            self._lock.release()


def follow(runner, channel: Channel | None = None) -> int:
    """A follower's loop: make each call process 0 announces on this process's `runner` (built
    as process 0's was), until process 0 closes. Returns the number of calls made."""
    channel = channel or Channel()
    held: dict[int, Any] = {}
    next_handle, calls = 0, 0

    def rebuild(x):
        if isinstance(x, Put):
            return runner.put(x.value)
        if isinstance(x, Ref):
            return held[x.handle]
        return x

    while True:
        message = channel.receive()
        if message == _SHUTDOWN:
            return calls
        name, (args, kwargs), dropped, first = message
        if first != next_handle:
            raise RuntimeError(f"process {jax.process_index()} diverged from process 0: its next "
                               f"output is {next_handle}, process 0's {first}")  # fmt: skip
        for handle in dropped:
            del held[handle]
        args, kwargs = jax.tree.map(rebuild, (args, kwargs))
        for leaf in jax.tree.leaves(getattr(runner, name)(*args, **kwargs)):
            held[next_handle] = leaf
            next_handle += 1
        calls += 1
