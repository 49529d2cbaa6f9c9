"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


@pytest.fixture
def run_on_cpu_devices():
    """run(code, n): run `code` in a fresh Python that sees `n` CPU devices (a mesh on one host);
    the code must exit 0 with "ok" as its last printed line."""

    def run(code: str, n: int, timeout: float = 300) -> None:
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}  # fmt: skip
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                             capture_output=True, text=True, timeout=timeout)  # fmt: skip
        assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]

    return run
