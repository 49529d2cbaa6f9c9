"""Progress lines for the waits a user sees (`jaxinfer/progress.py`): the warm-up's compile count
and the message for a slow phase, on a fake clock and fake streams (no timing in the checks)."""

from __future__ import annotations

import io
import threading

from jaxinfer.progress import CompileProgress, announce_if_slow


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_the_first_compile_then_a_line_every_few_seconds_and_the_last():
    clock, out = Clock(), io.StringIO()
    progress = CompileProgress("jaxinfer serve", stream=out, every_s=5.0, clock=clock)
    for t, done in [(101, 1), (102, 2), (107, 3), (108, 4), (109.5, 5), (110, 6)]:
        clock.t = t
        progress(done, 6)
    assert out.getvalue().splitlines() == [
        "jaxinfer serve: compiled 1/6 executables (1 s)",
        "jaxinfer serve: compiled 3/6 executables (7 s)",
        "jaxinfer serve: compiled 6/6 executables (10 s)",
    ]


def test_a_terminal_gets_one_line_rewritten_in_place():
    clock, out = Clock(), Terminal()
    progress = CompileProgress("x", stream=out, clock=clock)
    for done in (1, 2, 3):
        clock.t += 1
        progress(done, 3)
    assert out.getvalue() == (
        "\rx: compiled 1/3 executables (1 s)\rx: compiled 2/3 executables (2 s)"
        "\rx: compiled 3/3 executables (3 s)\n"
    )


def test_a_slow_phase_is_announced_and_a_quick_one_is_not():
    quick = io.StringIO()
    with announce_if_slow("loading...", after_s=60.0, stream=quick):
        pass
    assert quick.getvalue() == ""

    written = threading.Event()

    class Stream(io.StringIO):
        def flush(self) -> None:
            written.set()

    slow = Stream()
    with announce_if_slow("loading...", after_s=0.01, stream=slow):
        assert written.wait(30), "the message was not written while the block ran"
    assert slow.getvalue() == "loading...\n"
