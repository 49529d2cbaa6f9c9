"""The device's measured ceilings, the anchors that the docs' rooflines and bounds divide by.

    P=/opt/torch/.venv/bin/python3; $P experiments/anchors.py --out $OUT/anchors.json   # H200, ~1 min
    python experiments/anchors.py --quick --out /tmp/anchors.json   # CPU smoke: tiny sizes, seconds

Rows (`name`, `impl`, `value` in `unit`, `method`):

- `copy`: device-to-device copy of a 4 GiB bf16 buffer, bytes read + written per second
  (XLA; torch's `Tensor.copy_`);
- `elementwise_bf16`: XLA's elementwise fusion over the same buffer (x = -x in place), the rate
  of the small bf16 fusions between a step's GEMMs;
- `matmul_bf16`: 8192^3 bf16 GEMM, TFLOP/s (XLA; `torch.mm`);
- `matmul_fp8`: 8192^3 e4m3 x e4m3 GEMM with per-tensor scales and bf16 output, TFLOP/s: XLA as
  a dot of the fp8 operands with the scales applied to its output (`xla`), XLA as dequantize
  (convert times scale) then a bf16 dot (`xla_dequant`, the form flax's fp8 ops write), torch's
  `_scaled_mm`. Each XLA row lists the GEMM kernels of its optimized HLO (`xla_kernels`:
  `__cublas$lt$matmul$f8` is one cuBLASLt fp8 GEMM), so a row that did not become one shows it;
- `gemv_bf16`: the decode GEMV, one row times 14336x4096 bf16 weights: us per call and TB/s of
  weights (two weight copies taken in turn: 235 MB, beyond the 50 MB L2);
- `decode_roofline_llama3_8b`: derived, not timed: the bf16 weights a batch-1 Llama-3-8B decode
  step reads (every parameter once; the input embedding only its one gathered row) over the
  fastest copy row, as ms per token.

GEMM rates depend on the operands' bits (the power they draw), so the GEMM rows use
standard-normal data, like random-init weights, and say so (`data`). torch rows need torch with
CUDA (the GPU image has it under /opt/torch/.venv, see docs/gpu.md); without it they are listed
under `skipped` with the reason. A row that fails is listed under
`errors` and the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# JAX must not take 75% of the GPU before torch's rows allocate theirs.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from jaxinfer.models.presets import preset  # noqa: E402
from jaxinfer.models.spec import num_params  # noqa: E402
from jaxinfer.provenance import provenance, require_gpu  # noqa: E402

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
DATA = "standard normal (fp8: scaled by max |x| / 448 per tensor)"

XLA_LOOP = (
    "one jitted lax.fori_loop of N iterations (N traced: one compile) with every operand in the "
    "loop carry, passed through lax.optimization_barrier at the top of each iteration (nothing "
    "can be hoisted out of the loop); an op with a separate output feeds 1e-3 * out[0, 0] back "
    "into x[0, 0] (in place), so each iteration depends on the one before; the carry is donated "
    "(no copy of it per call); N doubles until one call takes min_loop_s, then per iteration = "
    "median of `repeats` calls / N, host-timed with block_until_ready (a call's ~0.1 ms "
    "dispatch is included: 0.05% of a call at the default min_loop_s of 0.2 s)"
)
TORCH_LOOP = (
    "N back-to-back calls queued from Python between two CUDA events (host launches run ahead of "
    "the GPU); N doubles until one loop takes min_loop_s, then per call = median of `repeats` "
    "loops / N (on a CPU smoke run: perf_counter instead of events)"
)


def sizes(quick: bool) -> dict:
    if quick:
        return dict(copy_elems=2**20, gemm=64, gemv_k=512, gemv_n=256, min_loop_s=0.01, repeats=3)
    return dict(copy_elems=2**31, gemm=8192, gemv_k=14336, gemv_n=4096, min_loop_s=0.2, repeats=5)


# ---------------------------------------------------------------------------------------------
# Timing


def loop_time(run: Callable[[int], float], min_loop_s: float, repeats: int) -> tuple[float, int]:
    """Seconds per iteration: `run(n)` returns the wall time of a loop of n iterations; n doubles
    until one loop takes `min_loop_s`, then the median of `repeats` loops over n."""
    run(1)  # first call: autotuning, transfers
    n = 1
    while run(n) < min_loop_s and n < 2**20:
        n *= 2
    return statistics.median(run(n) for _ in range(repeats)) / n, n


def xla_loop(step: Callable, carry: tuple, min_loop_s: float, repeats: int) -> dict:
    """Time `step(carry) -> carry` in a jitted fori_loop (see XLA_LOOP); also the GEMM kernels
    of the optimized HLO."""

    def loop(n, carry):
        return lax.fori_loop(0, n, lambda i, c: step(lax.optimization_barrier(c)), carry)

    # Donated: the loop runs in the carry's own buffers, with no copy of them per call.
    exe = jax.jit(loop, donate_argnums=1).lower(jnp.int32(1), carry).compile()
    state = [carry]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        state[0] = jax.block_until_ready(exe(jnp.int32(n), state[0]))
        return time.perf_counter() - t0

    seconds, n = loop_time(run, min_loop_s, repeats)
    return {"seconds": seconds, "iterations": n, "xla_kernels": gemm_kernels(exe.as_text())}


def gemm_kernels(hlo: str) -> list[str]:
    """Custom-call targets (cuBLAS, cuBLASLt fp8, cuDNN) and fusion kinds (e.g. `__triton_gemm`)
    of an optimized HLO module; on a CPU usually none."""
    calls = re.findall(r'custom_call_target="([^"]+)"', hlo)
    kinds = re.findall(r'"kind":"(__[A-Za-z0-9_]+)"', hlo)
    return sorted(set(calls) | set(kinds))


def feed_back(x, out):
    """x with 1e-3 * out[0, 0] added at x[0, 0]: a one-element in-place update that makes the
    next iteration wait for this one's output."""
    first = (0,) * x.ndim
    return x.at[first].add((1e-3 * out[(0,) * out.ndim].astype(jnp.float32)).astype(x.dtype))


def torch_loop(torch, op: Callable[[], object], min_loop_s: float, repeats: int) -> dict:
    cuda = torch.cuda.is_available()

    def run(n: int) -> float:
        if not cuda:
            t0 = time.perf_counter()
            for _ in range(n):
                op()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            op()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    seconds, n = loop_time(run, min_loop_s, repeats)
    return {"seconds": seconds, "iterations": n}


# ---------------------------------------------------------------------------------------------
# Rows: XLA


def bf16_buffer(elems: int):
    block = jax.random.normal(jax.random.key(0), (2**20,), jnp.bfloat16)
    return jnp.tile(block, elems // block.size)


def xla_copy(s: dict) -> dict:
    src, dst = bf16_buffer(s["copy_elems"]), bf16_buffer(s["copy_elems"])
    nbytes = src.size * src.dtype.itemsize
    # Both buffers are loop carries, so returning src twice makes XLA copy it into dst.
    t = xla_loop(lambda c: (c[0], c[0]), (src, dst), s["min_loop_s"], s["repeats"])
    return {
        "name": "copy",
        "impl": "xla",
        "value": 2 * nbytes / t["seconds"] / 1e12,
        "unit": "TB/s",
        "buffer_bytes": nbytes,
        "time_us": t["seconds"] * 1e6,
        **t,
        "method": "dst = src, two bf16 loop carries (XLA copies src into dst's buffer each "
        "iteration); value = 2 x buffer bytes (read + written) / time",
        "timing": "xla_loop",
    }


def xla_elementwise(s: dict) -> dict:
    x = bf16_buffer(s["copy_elems"])
    nbytes = x.size * x.dtype.itemsize
    t = xla_loop(lambda c: (-c[0],), (x,), s["min_loop_s"], s["repeats"])
    return {
        "name": "elementwise_bf16",
        "impl": "xla",
        "value": 2 * nbytes / t["seconds"] / 1e12,
        "unit": "TB/s",
        "buffer_bytes": nbytes,
        "time_us": t["seconds"] * 1e6,
        **t,
        "method": "x = -x over the whole bf16 buffer (one elementwise fusion reading and "
        "writing every byte once, in place); value = 2 x buffer bytes / time",
        "timing": "xla_loop",
    }


def gemm_operands(key, m: int, k: int, n: int, *, fp8: bool):
    """a [m, k] and b [n, k] (contracted over their last dims: the layout cuBLASLt's fp8 GEMM
    takes without a transpose), and per-tensor scales for fp8."""
    ka, kb = jax.random.split(key)
    a = jax.random.normal(ka, (m, k), jnp.float32)
    b = jax.random.normal(kb, (n, k), jnp.float32)
    if not fp8:
        return a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    sa, sb = jnp.max(jnp.abs(a)) / FP8_MAX, jnp.max(jnp.abs(b)) / FP8_MAX
    return (a / sa).astype(FP8), (b / sb).astype(FP8), sa, sb


CONTRACT_LAST = (((1,), (1,)), ((), ()))


def bf16_gemm(a, b):
    """A bf16 dot with bf16 output."""
    return lax.dot_general(a, b, CONTRACT_LAST, preferred_element_type=jnp.bfloat16)


def fp8_dequant_gemm(a, b, sa, sb):
    """Dequantize (convert times scale), then a bf16 dot, as flax's fp8 ops write it."""
    da = a.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16)
    db = b.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16)
    return lax.dot_general(da, db, CONTRACT_LAST, preferred_element_type=jnp.bfloat16)


def fp8_dot_gemm(a, b, sa, sb):
    """A dot of the fp8 operands themselves with bf16 output, times the product of the
    scales."""
    out = lax.dot_general(a, b, CONTRACT_LAST, preferred_element_type=jnp.bfloat16)
    return out * (sa * sb).astype(jnp.bfloat16)


def xla_matmul(s: dict, variant: str) -> dict:
    size = s["gemm"]
    fp8 = variant != "bf16"
    operands = gemm_operands(jax.random.key(1), size, size, size, fp8=fp8)
    gemm = {"bf16": bf16_gemm, "fp8": fp8_dot_gemm, "fp8_dequant": fp8_dequant_gemm}
    fn = gemm[variant]

    def step(c):
        return (feed_back(c[0], fn(*c)), *c[1:])

    t = xla_loop(step, operands, s["min_loop_s"], s["repeats"])
    flops = 2 * size**3
    return {
        "name": "matmul_fp8" if fp8 else "matmul_bf16",
        "impl": "xla_dequant" if variant == "fp8_dequant" else "xla",
        "value": flops / t["seconds"] / 1e12,
        "unit": "TFLOP/s",
        "shape": [size, size, size],
        "dtype": "float8_e4m3fn, per-tensor scales, bf16 out" if fp8 else "bfloat16",
        "data": DATA,
        "time_us": t["seconds"] * 1e6,
        **t,
        "method": " ".join(fn.__doc__.split()) + " a [M, K], b [N, K], contracted over K; "
        "value = 2 M N K / time",
        "timing": "xla_loop",
    }


def xla_gemv(s: dict) -> dict:
    k, n = s["gemv_k"], s["gemv_n"]
    ks = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(ks[0], (1, k), jnp.bfloat16)
    ws = [jax.random.normal(kw, (k, n), jnp.bfloat16) for kw in ks[1:]]

    def step(c):
        x, *ws = c
        for w in ws:  # each weight copy in turn, each product fed into the next one's input
            x = feed_back(x, x @ w)
        return (x, *ws)

    t = xla_loop(step, (x, *ws), s["min_loop_s"], s["repeats"])
    per_call = t["seconds"] / len(ws)
    wbytes = k * n * 2
    return {
        "name": "gemv_bf16",
        "impl": "xla",
        "value": per_call * 1e6,
        "unit": "us",
        "weights_TBps": wbytes / per_call / 1e12,
        "shape": [1, k, n],
        "weight_copies": len(ws),
        "time_us": per_call * 1e6,
        **t,
        "method": f"x [1, {k}] @ w [{k}, {n}] bf16 (the model's [in, out] layout), over "
        f"{len(ws)} weight copies in turn per iteration; value = time per product, "
        "weights_TBps = weight bytes / that time",
        "timing": "xla_loop",
    }


# ---------------------------------------------------------------------------------------------
# Rows: torch


def torch_rows(s: dict, errors: list, skipped: list) -> list[dict]:
    names = ["copy", "matmul_bf16", "matmul_fp8"]
    try:
        import torch
    except ImportError as e:
        skipped += [{"name": n, "impl": "torch", "reason": f"no torch: {e}"} for n in names]
        return []
    on_cpu = jax.devices()[0].platform == "cpu"
    if not torch.cuda.is_available() and not on_cpu:
        reason = f"torch {torch.__version__} sees no CUDA device"
        skipped += [{"name": n, "impl": "torch", "reason": reason} for n in names]
        return []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def measure(name: str, make: Callable[[], dict]) -> None:
        try:
            rows.append({"name": name, "impl": "torch", "torch": torch.__version__, **make()})
        except Exception as e:  # one failed row must not lose the others
            errors.append({"name": name, "impl": "torch", "error": f"{type(e).__name__}: {e}"})
        if dev == "cuda":
            torch.cuda.empty_cache()

    def copy() -> dict:
        src = torch.randn(s["copy_elems"], device=dev, generator=gen, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        t = torch_loop(torch, lambda: dst.copy_(src), s["min_loop_s"], s["repeats"])
        nbytes = src.numel() * src.element_size()
        return {
            "value": 2 * nbytes / t["seconds"] / 1e12,
            "unit": "TB/s",
            "buffer_bytes": nbytes,
            "time_us": t["seconds"] * 1e6,
            **t,
            "method": "dst.copy_(src), bf16; value = 2 x buffer bytes / time",
            "timing": "torch_loop",
        }

    size = s["gemm"]
    flops = 2 * size**3

    def mm() -> dict:
        a = torch.randn(size, size, device=dev, generator=gen, dtype=torch.bfloat16)
        b = torch.randn(size, size, device=dev, generator=gen, dtype=torch.bfloat16)
        out = torch.empty(size, size, device=dev, dtype=torch.bfloat16)
        t = torch_loop(torch, lambda: torch.mm(a, b.t(), out=out), s["min_loop_s"], s["repeats"])
        return {
            "value": flops / t["seconds"] / 1e12,
            "unit": "TFLOP/s",
            "shape": [size] * 3,
            "dtype": "bfloat16",
            "data": DATA,
            "time_us": t["seconds"] * 1e6,
            **t,
            "method": "torch.mm(a, b.t(), out=...), b [N, K]; value = 2 M N K / time",
            "timing": "torch_loop",
        }

    def scaled_mm() -> dict:
        a = torch.randn(size, size, device=dev, generator=gen)
        b = torch.randn(size, size, device=dev, generator=gen)
        sa, sb = a.abs().max() / FP8_MAX, b.abs().max() / FP8_MAX
        a8, b8 = (a / sa).to(torch.float8_e4m3fn), (b / sb).to(torch.float8_e4m3fn)
        del a, b

        def op():
            return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

        t = torch_loop(torch, op, s["min_loop_s"], s["repeats"])
        return {
            "value": flops / t["seconds"] / 1e12,
            "unit": "TFLOP/s",
            "shape": [size] * 3,
            "dtype": "float8_e4m3fn, per-tensor scales, bf16 out",
            "data": DATA,
            "time_us": t["seconds"] * 1e6,
            **t,
            "method": "torch._scaled_mm(a8, b8.t(), scale_a, scale_b, out_dtype=bf16), "
            "per-tensor f32 scales, b [N, K] (column-major as _scaled_mm needs); "
            "value = 2 M N K / time",
            "timing": "torch_loop",
        }

    measure("copy", copy)
    measure("matmul_bf16", mm)
    measure("matmul_fp8", scaled_mm)
    return rows


# ---------------------------------------------------------------------------------------------


def decode_weight_bytes(name: str = "llama3-8b") -> int:
    """bf16 weight bytes a batch-1 decode step reads: every parameter once, the untied input
    embedding only its one gathered row (as bench_e2e.py's roofline counts them)."""
    cfg = preset(name)
    n = num_params(cfg)
    if not cfg.tie_word_embeddings:
        n -= cfg.vocab_size * cfg.hidden_size - cfg.hidden_size
    return n * cfg.jnp_param_dtype.itemsize


def roofline_row(rows: list[dict]) -> dict:
    copy = max((r for r in rows if r["name"] == "copy"), key=lambda r: r["value"])
    wbytes = decode_weight_bytes()
    seconds = wbytes / (copy["value"] * 1e12)
    return {
        "name": "decode_roofline_llama3_8b",
        "impl": "derived",
        "value": seconds * 1e3,
        "unit": "ms",
        "tok_s": 1 / seconds,
        "weight_bytes": wbytes,
        "copy_TBps": copy["value"],
        "copy_impl": copy["impl"],
        "method": "derived, not timed: Llama-3-8B bf16 weight bytes a batch-1 decode step "
        "reads (every parameter once, the untied input embedding one row; no K/V) / the "
        "fastest copy row's bandwidth",
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a CPU smoke run")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch rows")
    args = ap.parse_args(argv)
    if not args.quick:  # 4 GiB buffers, 8192^3 GEMMs
        require_gpu("anchors.py", "--quick")
    s = sizes(args.quick)
    command = [sys.executable, "experiments/anchors.py", *(sys.argv[1:] if argv is None else argv)]
    result = {
        **provenance(command),
        "quick": args.quick,
        "sizes": s,
        "timing": {"xla_loop": XLA_LOOP, "torch_loop": TORCH_LOOP},
        "env": {
            k: os.environ.get(k)
            for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "CUDA_VISIBLE_DEVICES")
        },
    }
    rows, errors, skipped = [], [], []
    xla = [
        ("copy", lambda: xla_copy(s)),
        ("elementwise_bf16", lambda: xla_elementwise(s)),
        ("matmul_bf16", lambda: xla_matmul(s, "bf16")),
        ("matmul_fp8", lambda: xla_matmul(s, "fp8")),
        ("matmul_fp8", lambda: xla_matmul(s, "fp8_dequant")),
        ("gemv_bf16", lambda: xla_gemv(s)),
    ]
    for name, measure in xla:
        try:
            rows.append(measure())
            print(summary(rows[-1]), flush=True)
        except Exception as e:  # one failed row must not lose the others
            errors.append({"name": name, "impl": "xla", "error": f"{type(e).__name__}: {e}"})
            print(errors[-1], flush=True)
    if args.no_torch:
        skipped.append({"name": "*", "impl": "torch", "reason": "--no-torch"})
    else:
        rows += torch_rows(s, errors, skipped)
    if any(r["name"] == "copy" for r in rows):
        rows.append(roofline_row(rows))
    result.update(rows=rows, errors=errors, skipped=skipped)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(map(summary, rows)), *errors, f"-> {args.out}", sep="\n")
    return result


def summary(row: dict) -> str:
    kernels = " ".join(row.get("xla_kernels", []))
    return f"{row['name']:<26} {row['impl']:<12} {row['value']:>9.4g} {row['unit']:<8} {kernels}"


if __name__ == "__main__":
    main()
