"""Version shims for the Pallas APIs the kernels use (jax 0.10.2 on CPU/CI, 0.11.x on the GPU).

Everything that differs between the two, or lives in a private module, is reached from here only.
"""

from __future__ import annotations

import jax


def gpu_interpret_params():
    """Parameters that make a Mosaic GPU kernel run under jax's GPU interpreter (on the CPU).

    Public as `plgpu.InterpretGPUParams` from jax 0.11 on some builds; private before that.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()


def reset_gpu_interpreter() -> None:
    """The GPU interpreter keeps global state that must be reset after a kernel raised."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
            reset_gpu_interpret_mode_state,
        )
    except ImportError:  # pragma: no cover - newer jax moved it
        return
    reset_gpu_interpret_mode_state()


def default_interpret() -> bool:
    """Kernels interpret by default wherever there is no GPU to compile for."""
    return jax.default_backend() != "gpu"


def num_sms(default: int = 132) -> int:
    """Streaming multiprocessors of the first GPU (132 on an H100/H200 SXM); `default` elsewhere."""
    try:
        dev = jax.devices()[0]
        return int(getattr(dev, "core_count", None) or default)
    except Exception:  # no device info: fall back
        return default
