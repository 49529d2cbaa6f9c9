"""MoE grouped matmul (bf16) on the GPU: our Mosaic GPU kernel against XLA's `lax.ragged_dot` and
jax's own Mosaic GPU `ragged_dot_mgpu`, at a prefill shape (TFLOP/s) and decode shapes (TB/s of
expert weights read).

Cases:
- `prefill`: G=8 experts, M=8192 rows, K=4096, N=14336; group sizes a random uneven split of M
  (a multinomial draw, every expert used).
- `decode`: G=128 experts, K=2048, N=768; `tokens` in 64..512, each routed to `top_k`=8 distinct
  experts drawn uniformly: M = tokens * 8 rows, group sizes the experts' counts.

Rows per (case, impl, tiling): `time_us`, `TFLOPs` (2 M K N over the time), `expert_bytes` (the
K x N weights of the experts that have rows: what a kernel must read) and `expert_TBps`, and
`rel_err` against the fp32 `ragged_dot` on the same inputs. Impls: `grouped_pallas`
(pallas_kernels.moe, its default tiling; `--sweep` adds a grid of tilings), `xla_ragged_dot`, and
`jax_ragged_dot_mgpu` (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu with a fixed tiling, or a
small grid under `--sweep`; a note where this jax lacks it). Results are written after every row.

    PYTHONPATH=. python3 experiments/bench_grouped_matmul.py --out $OUT/grouped_matmul.json
    PYTHONPATH=. python3 experiments/bench_grouped_matmul.py --sweep --out $OUT/gm_sweep.json
    python experiments/bench_grouped_matmul.py --smoke --out /tmp/gm.json  # CPU, interpreter
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.provenance import provenance, require_gpu
from pallas_kernels.moe import grouped_matmul, grouped_matmul_ref
from pallas_kernels.moe.grouped_mgpu import SMEM_BYTES, Tiling, default_tiling


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    g: int
    k: int
    n: int
    m: int  # rows (prefill) or tokens (decode)
    top_k: int = 0  # 0: prefill, rows split at random; else tokens routed top_k of g


PREFILL = Case("prefill", g=8, k=4096, n=14336, m=8192)
DECODE_TOKENS = (64, 128, 256, 512)
SMOKE = (Case("prefill", g=2, k=128, n=128, m=256), Case("decode", g=8, k=128, n=128, m=4, top_k=2))

# The tilings `--sweep` tries (ours: (block_m, block_n), num_stages, grid_block_n; block_k 64;
# one warpgroup holds the block_m x block_n fp32 accumulator, so block_m * block_n <= 192 * 128),
# and jax's ragged_dot_mgpu's (block_m, block_n; block_k 64, 4 steps, grid_block_n 8).
SWEEP = {
    "prefill": list(itertools.product([(128, 128), (192, 128), (64, 256)], (3, 4, 5), (4, 8, 16))),
    "decode": list(
        itertools.product([(64, 64), (64, 128), (64, 256), (128, 128)], (4, 6, 8), (8,))
    ),
}
JAX_SWEEP = [(64, 128), (128, 128), (192, 128), (64, 256)]
JAX_DEFAULT = {"prefill": (128, 128), "decode": (64, 128)}

TIMING_METHOD = (
    "one jitted lax.fori_loop of N iterations (N traced, so one compile) around the op; each "
    "iteration passes lhs, rhs and group_sizes through lax.optimization_barrier (nothing can be "
    "hoisted out of the loop), puts the output through another (nothing can be sliced into the "
    "op) and feeds 1e-3 * out[0, 0] back into lhs[0, 0] in place. After a warm-up call, N doubles "
    "until one loop call takes >= min_loop_ms; time_us = median of `repeats` loop calls / N. "
    "Our kernel's time includes its tile table (a few small XLA ops on group_sizes)."
)


def loop_timer(op, min_loop_ms: float, repeats: int):
    """Median time (s) of one `op(lhs, rhs, group_sizes)` inside a jitted loop of N calls."""

    @jax.jit
    def run(args, n):
        def body(_, args):
            lhs, rhs, sizes = lax.optimization_barrier(args)
            y = lax.optimization_barrier(op(lhs, rhs, sizes))
            return lhs.at[0, 0].add((1e-3 * y[0, 0]).astype(lhs.dtype)), rhs, sizes

        return lax.fori_loop(0, n, body, args)[0]

    def time_it(*args) -> float:
        run(args, 1).block_until_ready()  # compile + warm-up
        n = 1
        while True:
            t0 = time.perf_counter()
            run(args, n).block_until_ready()
            if (time.perf_counter() - t0) * 1e3 >= min_loop_ms or n >= 1 << 16:
                break
            n *= 2
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(args, n).block_until_ready()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / n

    return time_it


def group_sizes_of(case: Case, rng: np.random.Generator) -> np.ndarray:
    """int32 [G]: a random uneven split of M rows (prefill), or the experts' counts of `m` tokens
    each routed to top_k distinct experts (decode)."""
    if not case.top_k:
        return rng.multinomial(case.m, rng.dirichlet(np.full(case.g, 4.0))).astype(np.int32)
    picks = np.argsort(rng.random((case.m, case.g)), axis=1)[:, : case.top_k]
    return np.bincount(picks.ravel(), minlength=case.g).astype(np.int32)


def inputs(case: Case):
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    sizes = group_sizes_of(case, rng)
    rows = int(sizes.sum())
    key_l, key_r = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    lhs = jax.random.normal(key_l, (rows, case.k), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(key_r, (case.g, case.k, case.n), jnp.float32) * case.k**-0.5).astype(
        jnp.bfloat16
    )
    return lhs, rhs, jnp.asarray(sizes)


def impls(case: Case, m: int, args, *, interpret: bool) -> list[tuple[str, dict, object]]:
    """(impl, tiling fields, op) for every implementation and tiling of the case (M = m rows)."""
    n = case.n
    out = []
    ours = [dataclasses.asdict(default_tiling(m, case.g, n))]
    if args.sweep and not interpret:
        for (bm, bn), stages, gbn in SWEEP[case.name]:
            t = Tiling(block_m=bm, block_n=bn, block_k=64, num_stages=stages, grid_block_n=gbn)
            if (
                n % bn == 0
                and t.smem_bytes(2, case.k) <= SMEM_BYTES
                and dataclasses.asdict(t) not in ours
            ):
                ours.append(dataclasses.asdict(t))
    extra = {"interpret": True} if interpret else {}
    for t in ours:
        out.append(("grouped_pallas", t,
                    functools.partial(grouped_matmul, backend="pallas", **t, **extra)))  # fmt: skip
    out.append(("xla_ragged_dot", {}, functools.partial(grouped_matmul, backend="xla")))
    if not interpret:
        ragged_dot_mgpu = jax_ragged_dot_mgpu()
        if ragged_dot_mgpu is not None:
            for bm, bn in JAX_SWEEP if args.sweep else [JAX_DEFAULT[case.name]]:
                if n % bn:
                    continue
                t = dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=4,
                         grid_block_n=8)  # fmt: skip
                op = functools.partial(_jax_op, ragged_dot_mgpu, t)
                out.append(("jax_ragged_dot_mgpu", t, op))
    return out


def _jax_op(ragged_dot_mgpu, tiling, lhs, rhs, sizes):
    return ragged_dot_mgpu(lhs, rhs, group_sizes=sizes, **tiling)


def jax_ragged_dot_mgpu():
    try:
        from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    except ImportError:
        return None
    return ragged_dot


def bench_case(case: Case, args, *, interpret: bool) -> list[dict]:
    lhs, rhs, sizes = inputs(case)
    m = lhs.shape[0]
    ref = np.asarray(grouped_matmul_ref(lhs, rhs, sizes))
    touched = int((np.asarray(sizes) > 0).sum())
    base = dict(case=case.name, g=case.g, m=m, k=case.k, n=case.n, dtype="bfloat16",
                experts_touched=touched, expert_bytes=touched * case.k * case.n * 2,
                group_sizes=np.asarray(sizes).tolist())  # fmt: skip
    if case.top_k:
        base.update(tokens=case.m, top_k=case.top_k)
    rows = []
    for impl, tiling, op in impls(case, m, args, interpret=interpret):
        row = dict(impl=impl, tiling=tiling, **base)
        try:
            out = np.asarray(jax.jit(op)(lhs, rhs, sizes), np.float32)
            row["rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            t = loop_timer(op, args.min_loop_ms, args.repeats)(lhs, rhs, sizes)
            row.update(time_us=t * 1e6, TFLOPs=2 * m * case.k * case.n / t / 1e12,
                       expert_TBps=row["expert_bytes"] / t / 1e12)  # fmt: skip
        except Exception as e:  # one failing impl or tiling is an error row, not a crashed run
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        print(json.dumps({k: v for k, v in row.items() if k != "group_sizes"}), flush=True)
        rows.append(row)
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", nargs="+", default=["prefill", "decode"],
                   choices=["prefill", "decode"])  # fmt: skip
    p.add_argument("--tokens", type=int, nargs="+", default=list(DECODE_TOKENS),
                   help=f"decode tokens, each routed top-8 of 128 (default {DECODE_TOKENS})")  # fmt: skip
    p.add_argument("--sweep", action="store_true", help="also time a grid of tilings")
    p.add_argument("--min-loop-ms", type=float, default=50.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU, our kernel under the GPU interpreter")  # fmt: skip
    args = p.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.smoke:
        require_gpu("bench_grouped_matmul.py", "--smoke")
    if args.smoke:
        cases = [c for c in SMOKE if c.name in args.cases]
        args.min_loop_ms, args.repeats = 0.0, 1
    else:
        decode = [Case("decode", g=128, k=2048, n=768, m=t, top_k=8) for t in args.tokens]
        cases = ([PREFILL] if "prefill" in args.cases else []) + (
            decode if "decode" in args.cases else [])  # fmt: skip
    notes = []
    if args.smoke:
        notes.append("jax_ragged_dot_mgpu not run: it has no interpreter mode")
    elif jax_ragged_dot_mgpu() is None:
        notes.append(f"jax_ragged_dot_mgpu not run: jax {jax.__version__} has no "
                     "jax.experimental.pallas.ops.gpu.ragged_dot_mgpu")  # fmt: skip
    result = {**provenance([sys.executable, *(sys.argv if argv is None else [__file__, *argv])]),
              "timing_method": TIMING_METHOD, "notes": notes, "rows": []}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for case in cases:
        result["rows"] += bench_case(case, args, interpret=args.smoke)
        args.out.write_text(json.dumps(result, indent=1))
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
