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


def default_interpret(device: jax.Device | None = None) -> bool:
    """Kernels interpret by default wherever there is no GPU to compile for: when `device` (None:
    `jax.devices()[0]`) is not a GPU."""
    device = jax.devices()[0] if device is None else device
    return device.platform != "gpu"


def num_sms(device: jax.Device | None = None, default: int = 132) -> int:
    """Streaming multiprocessors of `device` (None: `jax.devices()[0]`; 132 on an H100/H200 SXM);
    `default` where the device does not say (a CPU)."""
    try:
        device = jax.devices()[0] if device is None else device
        return int(getattr(device, "core_count", None) or default)
    except Exception:  # no device info: fall back
        return default


def call_with_page_refs(kernel, args, pages):
    """Run `kernel(*args, *refs)` with mutable refs in GPU global memory over `pages` (which it
    updates in place: aliased in and out); returns (kernel outputs, updated pages).

    Refs with a memory space exist only inside a trace, so this is its own (nested) jit: inlined
    into the caller's when traced, so a donated buffer is updated without a copy."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def run(args, pages):
        refs = [jax.new_ref(p, memory_space=plgpu.GMEM) for p in pages]
        outs = kernel(*args, *refs)
        return outs, [r[...] for r in refs]

    return jax.jit(run)(args, pages)


def mgpu_ref_kernel(body, *, out_type, scratch_types, grid, grid_names, compiler_params,
                    num_threads=None, thread_name=None, interpret=None):  # fmt: skip
    """`plgpu.kernel` for kernels that take refs (aliased in and out, updated in place).

    `plgpu.kernel` (jax 0.10-0.11) wraps its launch in a `custom_vmap`, which loses the effects of
    ref arguments; this builds the same launch (a Mosaic GPU mesh, scratch buffers allocated in
    a scope around the body) on `pl.kernel`, which aliases every ref argument.
    """
    import functools

    from jax._src import config as _config
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=num_threads,
                      thread_name=thread_name)  # fmt: skip

    def kernel_body(*refs):
        pl.run_scoped(functools.partial(body, *refs), *scratch_types,
                      collective_axes=thread_name if thread_name is not None else ())  # fmt: skip

    def call(*args):
        with _config._check_vma(False):
            return pl.kernel(kernel_body, out_type=out_type, mesh=mesh,
                             compiler_params=compiler_params, interpret=interpret or False,
                             name=getattr(body, "__name__", "kernel"))(*args)  # fmt: skip

    return call
