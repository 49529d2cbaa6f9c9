"""A generator run in a fresh process, for benchmarks whose configurations must not run beside
what an earlier one left in the process.

On an H100, SmolLM2's adaptive EAGLE engine built third in a process (after a plain and an
always-on EAGLE engine, each deleted before the next was built) ran its batch-8 speculative scans
10-14% slower than the same engine built alone after a plain one, which matched always-on EAGLE
(`experiments/results/h100/speculative_adaptive_alone.json`). The earlier engines' Python objects
are freed; what outlives them and slows the next is not known (JAX's caches keep compiled
executables and their CUDA graphs; the allocator keeps its state). A configuration in a process
of its own is measured alone.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable, Iterator


def _child(conn, fn: Callable[..., Iterator], args: tuple) -> None:
    try:
        for item in fn(*args):
            conn.send(("item", item))
    except BaseException:  # (KeyboardInterrupt too: the parent hears why the items stopped)
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def in_own_process(fn: Callable[..., Iterator], *args) -> Iterator:
    """The items of the generator `fn(*args)`, run in a fresh ("spawn") process, as it makes them:
    nothing of this process's state is there (no JAX backend started, nothing compiled), and this
    process need not start one. An exception there is raised here as a RuntimeError carrying its
    traceback, and a process that dies (killed, out of memory) raises one naming its exit code,
    after the items it sent; closing this generator early ends the process. `fn` and `args` must
    pickle (`fn` a module-level function)."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args), daemon=True)
    proc.start()
    send.close()  # (this end is the child's: EOF here once the child's copy closes)
    name, done = getattr(fn, "__name__", repr(fn)), False
    try:
        while True:
            try:
                kind, payload = recv.recv()
            except EOFError:
                done = True
                break
            if kind == "error":
                done = True
                raise RuntimeError(f"{name} failed in its own process:\n{payload}")
            yield payload
    finally:
        recv.close()
        if not done:
            proc.terminate()
        proc.join()
    if proc.exitcode:
        raise RuntimeError(f"{name}'s process exited with code {proc.exitcode} before it finished")
