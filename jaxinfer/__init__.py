"""jaxinfer: a JAX/XLA research framework for LLM inference."""

import os as _os

__version__ = "0.1.0"

# XLA records each command buffer (CUDA graph) as one chain of its commands, not a DAG of buffer
# uses. With the DAG, a speculative engine's batch-1 decode scans ran, by chance per process, at
# one of two speeds ~12% apart (in the slow one almost no kernel starts while the one before
# drains); with the chain the always-on EAGLE engine was fast in 5 processes of 5 on an H100, and
# plain decoding at 1-256 rows stayed within run-to-run spread (docs/decisions.md, XLA
# compilation). As the decode scans' compiler option it did not hold, so it is set process-wide:
# it must be in XLA_FLAGS before JAX starts its backend (import jaxinfer first); a mode already
# set stays.
_MODE = "--xla_gpu_command_buffer_scheduling_mode"
if _MODE not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = f"{_os.environ.get('XLA_FLAGS', '')} {_MODE}=SERIALIZE".strip()
