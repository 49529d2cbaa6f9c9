"""Where, when, on what and by which command a result was produced: stamped on every results file."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import jax


def git_commit() -> str:
    """The commit being measured: $JAXINFER_COMMIT (set when the tree travels without .git)."""
    if os.environ.get("JAXINFER_COMMIT"):
        return os.environ["JAXINFER_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def typed_command() -> list[str]:
    """This process's command line as the user typed it: `python -m jaxinfer.cli run ...` (the
    interpreter's own argv), `jaxinfer run ...` for an entry point (whose argv[0] is its full
    path), `python script.py ...` for a script."""
    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is not None or sys.argv[0].endswith(".py"):  # -m, script
        return list(sys.orig_argv)
    return [Path(sys.argv[0]).name, *sys.argv[1:]]


def provenance(command: list[str] | None = None) -> dict:
    dev = jax.devices()[0]
    return {
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')} x{jax.device_count()}",
        "jax": jax.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(command if command is not None else typed_command()),
    }


def backend_of_a_fresh_process() -> str:
    """`jax.default_backend()` as a child process sees it: for scripts that must leave the GPUs
    untouched (to worker processes, or to a transformers run)."""
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                           capture_output=True, text=True,
                           env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})  # fmt: skip
    return (probe.stdout.split() or ["none"])[-1]


def require_gpu(script: str, cpu_version: str, *, ask_a_child: bool = False) -> None:
    """Exit 2 with one line unless JAX's backend is a GPU: GPU-sized benchmarks on a CPU run for
    minutes and then run out of memory. `cpu_version`: the flags of the script's CPU smoke run."""
    backend = backend_of_a_fresh_process() if ask_a_child else jax.default_backend()
    if backend != "gpu":
        print(f"{script} needs a GPU (JAX backend: {backend}); {cpu_version} runs its CPU smoke "
              "version", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
