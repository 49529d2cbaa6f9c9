"""Progress lines on stderr for the phases a user waits through: loading a model and compiling
its executables (tens of seconds on a CPU, minutes for a large model's every batch shape)."""

from __future__ import annotations

import sys
import threading
import time


class CompileProgress:
    """A `progress(done, total)` callback for `Engine.warmup` that writes
    "LABEL: compiled D/T executables (E s)", E counted from this object's creation (so a model
    load before the warm-up is included). On a terminal the line is rewritten in place; elsewhere
    (a log, a pipe) one line is written for the first compile, then at most one every `every_s`
    seconds, and one for the last."""

    def __init__(self, label: str, *, stream=None, every_s: float = 5.0, clock=time.monotonic):
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.every_s = every_s
        self.clock = clock
        self.start = clock()
        self.last: float | None = None  # when the last line was written
        isatty = getattr(self.stream, "isatty", None)
        self.in_place = bool(isatty and isatty())

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        line = f"{self.label}: compiled {done}/{total} executables ({now - self.start:.0f} s)"
        if self.in_place:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
        elif self.last is None or done >= total or now - self.last >= self.every_s:
            self.stream.write(line + "\n")
        else:
            return
        self.last = now
        self.stream.flush()


class announce_if_slow:  # (lower case: read as a function, `with announce_if_slow(...)`)
    """Writes `message` on stderr if the `with` block is still running after `after_s` seconds:
    a wait the user sees explained, and nothing at all for a quick one (so a quick failure stays
    a one-line error)."""

    def __init__(self, message: str, *, after_s: float = 2.0, stream=None):
        self.message = message
        self.stream = sys.stderr if stream is None else stream
        self.timer = threading.Timer(after_s, self._write)
        self.timer.daemon = True

    def _write(self) -> None:
        self.stream.write(self.message + "\n")
        self.stream.flush()

    def __enter__(self):
        self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.timer.cancel()
