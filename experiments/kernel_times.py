"""Each GPU kernel's own time in one call of a quantized matmul, from Nsight Compute: which part
of a `w4_triton` / `fp8_block_pallas` row's time is the kernel and which is the XLA ops
around it (padding, the even/odd split of x, split-K sums, casts, activation quantization).

The script runs itself under `ncu` (one metric pass per kernel: duration and DRAM bytes), warms
the op up outside the profiled range, then profiles exactly one call. The results file lists
the kernels in launch order with their microseconds and bytes, and their sum.

    PYTHONPATH=. python3 experiments/kernel_times.py --out $OUT/w4_kernel_times.json \\
        --op w4_triton:int4_g128_sym:1:14336:4096 \\
        --op fp8_block:64:7168:2048 [--metric sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active ...]

`w4_triton` is the weight-only kernel's product (pallas_kernels.matmul.w4_matmul). `--metric` adds
ncu metrics (raw names) to every kernel's row, under `metrics`: where a kernel's time goes.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")


def make_op(spec: str):
    """(jitted op, its args) for `w4_triton:FMT:M:N:K` or `fp8_block:M:N:K`."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.quant import WEIGHT_FORMATS

    kind, *rest = spec.split(":")
    key = jax.random.key(zlib.crc32(spec.encode()))
    kx, kw = jax.random.split(key)
    if kind == "w4_triton":
        from pallas_kernels.matmul import w4_matmul

        fmt, (m, n, k) = rest[0], map(int, rest[1:])
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5
        arrays = jax.jit(lambda w: WEIGHT_FORMATS[fmt].quantize(w, 1))(w)
        return jax.jit(lambda x, a: w4_matmul(x, **a, fmt=fmt, backend="triton")), (x, arrays)
    if kind == "fp8_block":
        from jaxinfer.quant import QuantizedWeight
        from jaxinfer.quant.fp8 import Fp8Block

        m, n, k = map(int, rest)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5
        fmt = Fp8Block("fp8_block", backend="pallas")
        a = jax.jit(lambda w: fmt.quantize(w, 1))(w)
        return jax.jit(lambda x, a: fmt.matmul(x, QuantizedWeight(a, fmt, 1))), (x, a)
    raise ValueError(f"--op {spec!r}: expected w4_triton:FMT:M:N:K or fp8_block:M:N:K")


def child(spec: str) -> None:
    """Warm up, then one profiled call between cudaProfilerStart/Stop."""
    import jax
    from cuda.bindings import runtime as cudart

    op, args = make_op(spec)
    jax.block_until_ready(args)
    for _ in range(3):
        op(*args).block_until_ready()
    cudart.cudaProfilerStart()
    op(*args).block_until_ready()
    cudart.cudaProfilerStop()


def parse(text: str, extra: tuple[str, ...] = ()) -> list[dict]:
    """ncu's --csv --page raw output -> [{kernel, us, dram_read_MB, dram_write_MB}], with
    `metrics` {name: value} for the `extra` metric names (numbers where they read as one)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    out = []
    for r in rows:
        if not _is_number(r.get("gpu__time_duration.sum", "")):
            continue  # the units row after the header
        out.append({"kernel": r["Kernel Name"][:160],
                    "us": float(r["gpu__time_duration.sum"].replace(",", "")) / 1e3,  # ns
                    "dram_read_MB": float(r["dram__bytes_read.sum"].replace(",", "")) / 1e6,
                    "dram_write_MB": float(r["dram__bytes_write.sum"].replace(",", "")) / 1e6})  # fmt: skip
        if extra:
            values = {name: r.get(name, "") for name in extra}
            out[-1]["metrics"] = {name: float(v.replace(",", "")) if _is_number(v) else v
                                  for name, v in values.items()}  # fmt: skip
    return out


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
        return True
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--op", action="append", default=[])
    p.add_argument("--metric", action="append", default=[],
                   help="an extra ncu metric (raw name) for every kernel")  # fmt: skip
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    from jaxinfer.provenance import provenance

    if not args.out or not args.op:
        p.error("--out and at least one --op are required")
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    metrics = [*METRICS, *args.metric]
    result = {**provenance([sys.executable, *sys.argv]), "metrics": metrics, "ops": []}
    for spec in args.op:
        cmd = [ncu, "--profile-from-start", "off", "--metrics", ",".join(metrics), "--csv",
               "--page", "raw", "--print-units", "base", sys.executable, __file__, "--child", spec]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
        row = {"op": spec}
        try:
            kernels = parse(proc.stdout, tuple(args.metric))
            if not kernels:
                raise RuntimeError("ncu profiled no kernel")
            row.update(kernels=kernels, total_us=sum(k["us"] for k in kernels))
        except Exception as e:  # an unreadable report is an error row with ncu's tail
            row["error"] = f"{type(e).__name__}: {e}"
        if proc.returncode or "error" in row:
            row["ncu_rc"], row["ncu_tail"] = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        print(json.dumps(row), flush=True)
        result["ops"].append(row)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
