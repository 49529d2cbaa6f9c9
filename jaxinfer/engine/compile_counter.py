"""Counts XLA backend compiles process-wide: a compile after warm-up is a bug to report."""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _listener(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


def compile_count() -> int:
    """Backend compiles since the listener was installed (installed on first call)."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True
        return _count
