"""Paged attention: our Mosaic GPU kernel against XLA, jax's bundled Pallas kernel and cuDNN.

Decode (one new token per sequence, every sequence `context` tokens long on shuffled pages) is
reported in TB/s of K/V read; causal prefill (whole prompts, no prior context) in TFLOP/s. Every row
carries its relative error against the fp32 XLA reference on the same inputs (for FP8 pages, on
the dequantized values). `--check` first runs a correctness sweep of our kernel on ragged batches.
Results are written after every row, so a run cut short keeps what it finished; `--resume` skips
rows already measured.

    PYTHONPATH=. python3 experiments/bench_paged_attention.py --quick --check \\
        --out $OUT/paged_attention.json
    python experiments/bench_paged_attention.py --smoke --out /tmp/pa.json   # CPU, tiny shapes

Layout conversions each implementation needs (transposes, q pre-scaling, cuDNN's page-table shape,
contiguous K/V) happen before timing; only the attention call itself is in the timed loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import statistics
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxinfer.provenance import provenance, require_gpu
from pallas_kernels.paged_attention import (
    PagedAttentionInputs,
    paged_attention,
    ragged_paged_attention,
)
from pallas_kernels.paged_attention import cudnn as cudnn_pa

L2_BYTES = 50e6  # H100/H200 L2: K/V sets that fit may be served from it, not from HBM
FP8 = "float8_e4m3fn"
DECODE_IMPLS = ("jaxinfer_pallas", "xla", "jax_bundled_pallas", "cudnn_paged")
PREFILL_IMPLS = ("jaxinfer_pallas", "xla", "cudnn_dense", "jax_attention_mgpu")
FP8_IMPLS = ("jaxinfer_pallas", "xla")  # the others have no per-(page, head) fp8 path
MAX_LOOP_ITERS = 20_000
REF_CHUNK_TOKENS = 2**19  # decode reference: gather at most this many keys (x Hkv x D) at once

TIMING_METHOD = (
    "one jitted lax.fori_loop of N iterations (N traced, so one compile) around the op; each "
    "iteration feeds 1e-3 * out[:1] back into q[:1] (in place) so no call can be hoisted or "
    "deduplicated, and passes q and the K/V operands through lax.optimization_barrier so XLA "
    "cannot hoist the q-independent part of an op (e.g. the XLA reference's page gather) out of "
    "the loop. When one K/V set is under twice the L2 (50 MB), each iteration calls the op once on "
    "each of kv_sets distinct pool sets in turn (time is per call; l2_resident marks rows whose "
    "sets all fit in L2 even so). After a warm-up call, N grows until "
    "one loop call takes >= min_loop_ms; time_ms = median of `repeats` loop calls / (N * kv_sets), "
    "timed on the host with block_until_ready (~0.1 ms dispatch per loop call included)."
)


# ---------------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "decode" | "prefill"
    batch: int
    context: int  # decode: tokens per sequence incl. the new one; prefill: prompt length
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    kv_dtype: str

    @property
    def label(self) -> str:
        dt = "fp8" if self.kv_dtype == FP8 else "bf16"
        return f"{self.kind} B{self.batch} L{self.context} p{self.page_size} {dt}"

    @property
    def kv_bytes(self) -> int:
        """K and V bytes a call must read (plus per-(page, head) fp32 scales for fp8)."""
        elems = self.batch * self.context * self.kv_heads * self.head_dim * 2
        scales = 0
        if self.kv_dtype == FP8:
            pages = self.batch * math.ceil(self.context / self.page_size)
            scales = pages * self.kv_heads * 4 * 2
        return elems * jnp.dtype(self.kv_dtype).itemsize + scales

    @property
    def causal_flops(self) -> int:
        """Prefill: 2 matmuls (QK^T, PV) x 2 flops per multiply-add x D, over the causal pairs
        (query i sees keys 0..i: L(L+1)/2 pairs), per sequence and query head."""
        pairs = self.context * (self.context + 1) // 2
        return 4 * self.batch * self.q_heads * self.head_dim * pairs


def decode_cases(batches, contexts, page_sizes, kv_dtypes, *, max_kv_gb, heads=(32, 8), d=128):
    out = []
    for dtype in kv_dtypes:
        for ps in page_sizes:
            for b in batches:
                for ctx in contexts:
                    case = Case("decode", b, ctx, *heads, d, ps, dtype)
                    if case.kv_bytes <= max_kv_gb * 1e9:
                        out.append(case)
    return out


def select_cases(args) -> list[Case]:
    if args.smoke:  # tiny, CPU
        cases = [
            Case("decode", 2, 64, 4, 2, 64, 16, "bfloat16"),
            Case("decode", 2, 64, 4, 2, 64, 16, FP8),
            Case("prefill", 2, 32, 4, 2, 64, 16, "bfloat16"),
        ]
    elif args.quick:
        q = [(64, 2048), (1, 32768), (8, 8192), (256, 2048)]
        cases = [Case("decode", b, ctx, 32, 8, 128, 16, "bfloat16") for b, ctx in q]
        cases += [Case("decode", 64, 2048, 32, 8, 128, 16, FP8)]
        cases += [Case("prefill", 4, 4096, 32, 8, 128, 16, "bfloat16")]
    elif args.full:
        cases = decode_cases(
            args.batches, args.contexts, args.page_sizes, args.kv_dtypes, max_kv_gb=args.max_kv_gb
        )
        if "bfloat16" in args.kv_dtypes:
            cases += [
                Case("prefill", 4, 4096, 32, 8, 128, ps, "bfloat16") for ps in args.page_sizes
            ]
    else:
        cases = []
    return [c for c in cases if c.kind in args.kinds]


# ---------------------------------------------------------------------------------------------
# Inputs (fresh random normal; pages handed out in a shuffled order)


class PoolSet(NamedTuple):
    k_pages: jax.Array  # [P, ps, Hkv, D] bf16 or e4m3fn
    v_pages: jax.Array
    page_table: jax.Array  # [B, pages_per_seq] int32, a random permutation of the pages
    k_scales: jax.Array | None  # [P, Hkv] f32 (fp8 only)
    v_scales: jax.Array | None


class DecodeInputs(NamedTuple):
    q: jax.Array  # [B, Hq, D] bf16 (one token per sequence, so T = B)
    seq_lens: jax.Array  # [B]
    query_start_loc: jax.Array  # [B + 1]
    sets: list[PoolSet]


class PrefillInputs(NamedTuple):
    q: jax.Array  # [B, L, Hq, D] bf16
    k: jax.Array  # [B, L, Hkv, D] bf16, contiguous
    v: jax.Array
    pools: PoolSet  # the same K/V in shuffled pages


def quantize_pages(x):
    """Per-(page, kv head) e4m3fn: scale = amax over (page_size, D) / 448."""
    try:
        from pallas_kernels.paged_attention.fp8 import quantize_pages as q
    except ImportError:
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(1, 3))
        scales = jnp.maximum(amax, 1e-12) / 448.0
        pages = (x.astype(jnp.float32) / scales[:, None, :, None]).astype(jnp.float8_e4m3fn)
        return pages, scales
    return q(x)


def dequantize_pages(pages, scales):
    return pages.astype(jnp.float32) * scales[:, None, :, None]


def kv_sets_for(case: Case) -> int:
    """Distinct K/V sets to rotate over: enough to span twice the L2 (at most 8), so that a set is
    evicted before its next use; the smallest cases stay L2-resident even so (`l2_resident`)."""
    if case.kind != "decode" or case.kv_bytes >= 2 * L2_BYTES:
        return 1
    return min(8, max(2, math.ceil(2 * L2_BYTES / case.kv_bytes)))


def random_pools(key, num_pages, case: Case, table_shape) -> PoolSet:
    kk, kv, kp = jax.random.split(key, 3)
    shape = (num_pages, case.page_size, case.kv_heads, case.head_dim)
    k = jax.random.normal(kk, shape, jnp.bfloat16)
    v = jax.random.normal(kv, shape, jnp.bfloat16)
    table = jax.random.permutation(kp, num_pages).astype(jnp.int32).reshape(table_shape)
    if case.kv_dtype == FP8:
        (k, ks), (v, vs) = quantize_pages(k), quantize_pages(v)
        return PoolSet(k, v, table, ks, vs)
    return PoolSet(k, v, table, None, None)


def make_decode_inputs(case: Case, n_sets: int, key) -> DecodeInputs:
    pps = math.ceil(case.context / case.page_size)
    num_pages = case.batch * pps
    keys = jax.random.split(key, n_sets + 1)
    q = jax.random.normal(keys[0], (case.batch, case.q_heads, case.head_dim), jnp.bfloat16)
    sets = [random_pools(k, num_pages, case, (case.batch, pps)) for k in keys[1:]]
    seq_lens = jnp.full((case.batch,), case.context, jnp.int32)
    qsl = jnp.arange(case.batch + 1, dtype=jnp.int32)
    return DecodeInputs(q, seq_lens, qsl, sets)


def make_prefill_inputs(case: Case, key) -> PrefillInputs:
    b, n, ps = case.batch, case.context, case.page_size
    kq, kk, kv, kp = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, n, case.q_heads, case.head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (b, n, case.kv_heads, case.head_dim), jnp.bfloat16)
    v = jax.random.normal(kv, (b, n, case.kv_heads, case.head_dim), jnp.bfloat16)
    pps = n // ps
    table = jax.random.permutation(kp, b * pps).astype(jnp.int32).reshape(b, pps)

    @jax.jit
    def paginate(x, table):  # page table[b, j] holds tokens j*ps .. of sequence b
        pages = x.reshape(b * pps, ps, case.kv_heads, case.head_dim)
        return jnp.zeros_like(pages).at[table.reshape(-1)].set(pages)

    pools = PoolSet(paginate(k, table), paginate(v, table), table, None, None)
    return PrefillInputs(q, k, v, pools)


# ---------------------------------------------------------------------------------------------
# fp32 references on the same inputs


def decode_reference(inp: DecodeInputs, pools: PoolSet) -> jax.Array:
    """[B, Hq, D] f32 through `ragged_paged_attention`, a chunk of sequences at a time (bounded
    memory): each chunk's pages are gathered (and dequantized) into a small f32 pool first."""
    batch, pps = pools.page_table.shape
    page_size = pools.k_pages.shape[1]
    limit = max(REF_CHUNK_TOKENS, pps * page_size)
    chunk = max(d for d in range(1, batch + 1) if batch % d == 0 and d * pps * page_size <= limit)

    @jax.jit
    def one(q, k_pages, v_pages, table, k_scales, v_scales, lens):
        ids = table.reshape(-1)
        if k_scales is None:
            k, v = k_pages[ids].astype(jnp.float32), v_pages[ids].astype(jnp.float32)
        else:
            k = dequantize_pages(k_pages[ids], k_scales[ids])
            v = dequantize_pages(v_pages[ids], v_scales[ids])
        local = jnp.arange(ids.shape[0], dtype=jnp.int32).reshape(table.shape)
        qsl = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
        return ragged_paged_attention(
            PagedAttentionInputs(q.astype(jnp.float32), k, v, local, lens, qsl, max_q_len=1)
        )

    outs = [
        one(inp.q[i : i + chunk], pools.k_pages, pools.v_pages, pools.page_table[i : i + chunk],
            pools.k_scales, pools.v_scales, inp.seq_lens[i : i + chunk])
        for i in range(0, batch, chunk)
    ]  # fmt: skip
    return jnp.concatenate(outs)


@jax.jit
def prefill_reference(q, k, v):
    """Causal attention on contiguous [B, L, H, D] in f32, one sequence at a time; [B*L, Hq, D].

    Mathematically `ragged_paged_attention` for prompts with no prior context; its token-major path
    would gather L keys per query token (137 GB at 4 x 4096 tokens), so it cannot serve here."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]

    def one(args):
        qb, kb, vb = (x.astype(jnp.float32) for x in args)
        qg = qb.reshape(n, hkv, hq // hkv, d)
        s = jnp.einsum("lhgd,mhd->hglm", qg, kb) * d**-0.5
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("hglm,mhd->lhgd", p, vb).reshape(n, hq, d)

    return lax.map(one, (q, k, v)).reshape(b * n, hq, d)


def rel_err(out, ref) -> float:
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


# ---------------------------------------------------------------------------------------------
# Implementations: each returns the op, its first operand (q, fed back) and its operand sets, in
# the layout the op wants, converted here -- outside the timed loop.


class Prepared(NamedTuple):
    op: Callable  # op(q, *operands) -> out, shaped like q
    q: jax.Array
    operand_sets: list[tuple]
    to_tokens: Callable  # out -> [T, Hq, D]
    params: dict


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _need_gpu(what: str, on_gpu: bool) -> None:
    if not on_gpu:
        raise NotImplementedError(f"{what} needs an NVIDIA GPU (backend: {jax.default_backend()})")


def _check_xla_reference_fits(case: Case, rows: int, max_kv: int, resident_bytes: int) -> None:
    """The XLA reference materializes each row's K and V in f32 (decode: a row per sequence;
    prefill: a row per query token). Refuse up front what cannot fit: XLA would only fail after
    compiling, with pages of allocator logs that push the summary out of the output's tail."""
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    need = 2 * rows * max_kv * case.kv_heads * case.head_dim * 4
    if limit and need + resident_bytes > limit:
        raise MemoryError(
            f"skipped: the XLA reference would materialize {need / 1e9:.0f} GB of f32 K/V "
            f"(+ {resident_bytes / 1e9:.0f} GB resident) on a {limit / 1e9:.0f} GB device"
        )


def prepare_decode(impl: str, case: Case, inp: DecodeInputs, on_gpu: bool) -> Prepared:
    tokens = lambda out: out.reshape(case.batch, case.q_heads, case.head_dim)  # noqa: E731
    if impl in ("jaxinfer_pallas", "xla"):
        backend = "pallas" if impl == "jaxinfer_pallas" else "xla"
        if backend == "xla":
            max_kv = inp.sets[0].page_table.shape[1] * case.page_size
            _check_xla_reference_fits(case, case.batch, max_kv, len(inp.sets) * case.kv_bytes)

        def op(q, k, v, table, lens, qsl, ks, vs):
            x = PagedAttentionInputs(q, k, v, table, lens, qsl, max_q_len=1, k_scales=ks,
                                     v_scales=vs)  # fmt: skip
            return paged_attention(x, backend=backend)

        sets = [(s.k_pages, s.v_pages, s.page_table, inp.seq_lens, inp.query_start_loc,
                 s.k_scales, s.v_scales) for s in inp.sets]  # fmt: skip
        return Prepared(op, inp.q, sets, tokens, {"backend": backend})
    if case.kv_dtype == FP8:
        raise NotImplementedError(f"{impl}: no per-(page, head) fp8 path")
    if impl == "jax_bundled_pallas":
        with warnings.catch_warnings():  # deprecated from jax 0.11 (Triton backend)
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu.paged_attention import (
                paged_attention as bundled,
            )
        pps = inp.sets[0].page_table.shape[1]
        k_splits = _largest_divisor(pps, 16)
        per_block = _largest_divisor(pps // k_splits, max(1, 128 // case.page_size))
        params = {"k_splits": k_splits, "pages_per_compute_block": per_block,
                  "block_h": 16, "interpret": not on_gpu}  # fmt: skip

        def op(q, k, v, table, lens):
            return bundled(q, k, v, table, lens, **params)

        # It wants [Hkv, P, ps, D] pools and does not scale q by 1/sqrt(D).
        to_head_major = jax.jit(lambda x: jnp.transpose(x, (2, 0, 1, 3)))
        q = (inp.q.astype(jnp.float32) * case.head_dim**-0.5).astype(inp.q.dtype)
        sets = [(to_head_major(s.k_pages), to_head_major(s.v_pages), s.page_table, inp.seq_lens)
                for s in inp.sets]  # fmt: skip
        return Prepared(op, q, sets, tokens, params)
    if impl == "cudnn_paged":
        cudnn_pa.check_supported(max_q_len=1, kv_dtype=case.kv_dtype)
        convert = jax.jit(cudnn_pa.to_cudnn_layout)
        converted = [convert(PagedAttentionInputs(inp.q, s.k_pages, s.v_pages, s.page_table,
                                                  inp.seq_lens, inp.query_start_loc, max_q_len=1))
                     for s in inp.sets]  # fmt: skip
        assert converted[0].q.shape[0] == case.batch, "pool of B * pages_per_seq pages: no dummies"

        def op(q, k, v, table, q_seqlen, kv_seqlen):
            return cudnn_pa.cudnn_paged_decode(q, k, v, table, q_seqlen, kv_seqlen)

        sets = [tuple(c)[1:] for c in converted]
        return Prepared(op, converted[0].q, sets, tokens, {"mask": "PADDING", "layout": "BTNH"})
    raise ValueError(f"unknown decode impl {impl!r}")


def prepare_prefill(impl: str, case: Case, inp: PrefillInputs, on_gpu: bool) -> Prepared:
    b, n, hq, d = inp.q.shape
    tokens = lambda out: out.reshape(b * n, hq, d)  # noqa: E731
    if impl in ("jaxinfer_pallas", "xla"):
        backend = "pallas" if impl == "jaxinfer_pallas" else "xla"
        if backend == "xla":
            _check_xla_reference_fits(case, b * n, n, 3 * case.kv_bytes)

        def op(q, *ops):
            return paged_attention(PagedAttentionInputs(q, *ops, max_q_len=n), backend=backend)

        lens = jnp.full((b,), n, jnp.int32)
        qsl = jnp.arange(b + 1, dtype=jnp.int32) * n
        p = inp.pools
        q = inp.q.reshape(b * n, hq, d)
        return Prepared(op, q, [(p.k_pages, p.v_pages, p.page_table, lens, qsl)], tokens,
                        {"backend": backend, "max_q_len": n})  # fmt: skip
    if impl == "cudnn_dense":
        _need_gpu("cuDNN attention", on_gpu)

        def op(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

        return Prepared(op, inp.q, [(inp.k, inp.v)], tokens, {"layout": "BTNH contiguous"})
    if impl == "jax_attention_mgpu":
        _need_gpu("jax's attention_mgpu", on_gpu)
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        config = attention_mgpu.TuningConfig(
            block_q=64, block_kv=128, max_concurrent_steps=2, causal=True
        )

        def op(q, k, v):
            return attention_mgpu.attention(q, k, v, config)

        # f16 (jax's tuned dtype); it does not scale q by 1/sqrt(D).
        q = (inp.q.astype(jnp.float32) * d**-0.5).astype(jnp.float16)
        k, v = inp.k.astype(jnp.float16), inp.v.astype(jnp.float16)
        params = {"dtype": "float16", **dataclasses.asdict(config)}
        return Prepared(op, q, [(k, v)], tokens, {k_: v_ for k_, v_ in params.items()
                                                  if v_ is not None})  # fmt: skip
    raise ValueError(f"unknown prefill impl {impl!r}")


# ---------------------------------------------------------------------------------------------
# Timing


def time_op(prep: Prepared, *, min_loop_s: float, repeats: int) -> dict:
    """Per-call seconds of `prep.op` (see TIMING_METHOD)."""
    op, sets = prep.op, prep.operand_sets

    @jax.jit
    def loop(n, q, sets):
        def body(_, q):
            for ops in sets:
                q, ops = lax.optimization_barrier((q, ops))
                out = op(q, *ops)
                q = q.at[:1].add((1e-3 * out[:1]).astype(q.dtype))
            return q

        return lax.fori_loop(0, n, body, q)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        loop(n, prep.q, sets).block_until_ready()
        return time.perf_counter() - t0

    compile_s = run(1)  # compile + warm-up
    n, t = 2, run(2)
    while t < min_loop_s and n < MAX_LOOP_ITERS:
        n = min(MAX_LOOP_ITERS, max(2 * n, math.ceil(1.2 * n * min_loop_s / max(t, 1e-6))))
        t = run(n)
    times = [run(n) for _ in range(repeats)]
    loop_s = statistics.median(times)
    return {
        "time_s": loop_s / (n * len(sets)),
        "n_iters": n,
        "loop_ms": round(loop_s * 1e3, 3),
        "first_call_s": round(compile_s, 2),
    }


# ---------------------------------------------------------------------------------------------
# Correctness sweep (our kernel, and cuDNN where it applies, on ragged batches vs the reference)


@dataclasses.dataclass(frozen=True)
class CheckCase:
    name: str
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    page_size: int = 16
    kv_heads: int = 2
    group: int = 4
    head_dim: int = 128
    kv_dtype: str = "bfloat16"
    soft_cap: float | None = None
    sliding_window: int | None = None
    poison: bool = True  # NaN in every page slot and query row no sequence owns


def check_cases(smoke: bool) -> list[CheckCase]:
    mixed = dict(q_lens=(1, 7, 1, 33, 16), ctx_lens=(100, 0, 517, 20, 64))
    decode = dict(q_lens=(1,) * 9, ctx_lens=(1, 15, 16, 17, 250, 777, 1024, 1500, 2047))
    if smoke:
        return [
            CheckCase("smoke_mixed", q_lens=(1, 5, 3), ctx_lens=(20, 0, 9), head_dim=64),
            CheckCase("smoke_decode", q_lens=(1, 1), ctx_lens=(30, 3), head_dim=64),
        ]
    return [
        CheckCase("mixed_p16_d128_gqa4", **mixed),
        CheckCase("mixed_p32_d64_gqa1", **mixed, page_size=32, kv_heads=4, group=1, head_dim=64),
        CheckCase("mixed_p64_d256_gqa8", **mixed, page_size=64, kv_heads=1, group=8, head_dim=256),
        CheckCase(
            "long_p128_d128_gqa4", q_lens=(1, 200, 3), ctx_lens=(3000, 1000, 0), page_size=128
        ),
        CheckCase("prefill_only_p64", q_lens=(512, 300), ctx_lens=(0, 0), page_size=64),
        CheckCase("decode_p16_d128_gqa4", **decode),
        CheckCase("decode_p16_d128_gqa4_clean", **decode, poison=False),
        CheckCase("decode_p64_d64_gqa8", **decode, page_size=64, group=8, head_dim=64),
        CheckCase("decode_p128_d256_gqa1", **decode, page_size=128, group=1, head_dim=256),
        CheckCase("softcap_mixed", **mixed, soft_cap=30.0),
        CheckCase("window64_mixed", **mixed, sliding_window=64),
        CheckCase("window100_decode", **decode, sliding_window=100),
        CheckCase("fp8_mixed", **mixed, kv_dtype=FP8),
        CheckCase("fp8_decode", **decode, kv_dtype=FP8),
        CheckCase(
            "fp8_mixed_p64_d256_gqa8",
            **mixed,
            page_size=64,
            kv_heads=1,
            group=8,
            head_dim=256,
            kv_dtype=FP8,
        ),
    ]


def make_check_inputs(c: CheckCase, rng: np.random.Generator, pad_tokens: int = 3):
    """A ragged batch in our layout (+ one padding slot); K/V as the kernel sees them and the f32
    values the reference sees. Pages are handed out in a shuffled order; page 0 is scratch."""
    seq_lens = [a + b for a, b in zip(c.ctx_lens, c.q_lens, strict=True)]
    needed = [math.ceil(n / c.page_size) for n in seq_lens]
    pps = max(needed) + 1  # a spare column that must stay unread
    num_pages = sum(needed) + 4
    perm = rng.permutation(np.arange(1, num_pages))
    shape = (num_pages, c.page_size, c.kv_heads, c.head_dim)
    k = np.zeros(shape, np.float32)
    v = np.zeros(shape, np.float32)
    dead = np.ones(shape[:2], bool)  # slots no sequence owns
    table = np.zeros((len(seq_lens) + 1, pps), np.int32)
    used = 0
    for s, n in enumerate(seq_lens):
        ids = perm[used : used + needed[s]]
        used += needed[s]
        table[s, : needed[s]] = ids
        for pool in (k, v):
            x = np.zeros((needed[s] * c.page_size, c.kv_heads, c.head_dim), np.float32)
            x[:n] = rng.standard_normal((n, c.kv_heads, c.head_dim))
            pool[ids] = x.reshape(needed[s], c.page_size, c.kv_heads, c.head_dim)
        flat = np.zeros(needed[s] * c.page_size, bool)
        flat[n:] = True
        dead[ids] = flat.reshape(needed[s], c.page_size)
    owned = np.zeros(num_pages, bool)
    owned[table[:-1][table[:-1] > 0]] = True
    num_real = sum(c.q_lens)
    q = rng.standard_normal((num_real + pad_tokens, c.kv_heads * c.group, c.head_dim))
    if c.poison:
        q[num_real:] = np.nan
    q = jnp.asarray(q, jnp.bfloat16)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(c.q_lens), [num_real]]), jnp.int32)
    lens = jnp.asarray([*seq_lens, 0], jnp.int32)
    nan_slots = jnp.asarray(dead)[:, :, None, None]

    def finish(x):  # kernel-side pool, reference-side f32 values, scales
        if c.kv_dtype == FP8:
            pages, scales = quantize_pages(jnp.asarray(x))
            if c.poison:
                pages = jnp.where(nan_slots, jnp.nan, pages.astype(jnp.float32)).astype(FP8)
                scales = jnp.where(jnp.asarray(owned)[:, None], scales, jnp.nan)
            return pages, dequantize_pages(pages, scales), scales
        pages = jnp.asarray(x, jnp.bfloat16)
        if c.poison:
            pages = jnp.where(nan_slots, jnp.nan, pages)
        return pages, pages.astype(jnp.float32), None

    kp, kf, ks = finish(k)
    vp, vf, vs = finish(v)
    return dict(q=q, k_pages=kp, v_pages=vp, k_f32=kf, v_f32=vf, k_scales=ks, v_scales=vs,
                page_table=jnp.asarray(table), seq_lens=lens, query_start_loc=qsl,
                num_real=num_real)  # fmt: skip


def run_checks(smoke: bool, impls: tuple[str, ...], record) -> None:
    rng = np.random.default_rng(0)
    for c in check_cases(smoke):
        x = make_check_inputs(c, rng)
        max_q_len = max(c.q_lens)
        rest = (x["page_table"], x["seq_lens"], x["query_start_loc"])
        opts = dict(max_q_len=max_q_len, soft_cap=c.soft_cap, sliding_window=c.sliding_window)
        ref = ragged_paged_attention(PagedAttentionInputs(
            x["q"].astype(jnp.float32), x["k_f32"], x["v_f32"], *rest, **opts,
        ))[: x["num_real"]]  # fmt: skip
        inputs = PagedAttentionInputs(x["q"], x["k_pages"], x["v_pages"], *rest, **opts,
                                      k_scales=x["k_scales"], v_scales=x["v_scales"])  # fmt: skip
        for impl in impls:
            backend = {"jaxinfer_pallas": "pallas", "cudnn_paged": "cudnn"}.get(impl)
            if backend is None or (backend == "cudnn" and (max_q_len != 1 or c.soft_cap or
                                   c.sliding_window or c.kv_dtype == FP8)):  # fmt: skip
                continue
            row = {"impl": impl, **dataclasses.asdict(c)}
            try:
                out = jax.jit(functools.partial(paged_attention, backend=backend))(inputs)
                out = out[: x["num_real"]].astype(jnp.float32)
                err = jnp.linalg.norm(out - ref, axis=(1, 2)) / jnp.linalg.norm(ref, axis=(1, 2))
                row.update(rel_err=rel_err(out, ref), max_row_rel_err=float(jnp.max(err)),
                           max_abs_err=float(jnp.max(jnp.abs(out - ref))))  # fmt: skip
            except Exception as e:  # record and go on
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            record(row)


# ---------------------------------------------------------------------------------------------
# Driver


def bench_case(case: Case, impls, args, on_gpu: bool, record, done) -> None:
    todo = [i for i in impls if (i, case) not in done]
    if case.kv_dtype == FP8:
        todo = [i for i in todo if i in FP8_IMPLS]
    if not todo:
        return
    n_sets = kv_sets_for(case)
    key = jax.random.key(zlib.crc32(case.label.encode()))
    if case.kind == "decode":
        inp = make_decode_inputs(case, n_sets, key)
        ref = decode_reference(inp, inp.sets[0])
    else:
        inp = make_prefill_inputs(case, key)
        ref = prefill_reference(inp.q, inp.k, inp.v)
    for impl in todo:
        row = {"impl": impl, "kind": case.kind, "batch": case.batch, "context": case.context,
               "q_heads": case.q_heads, "kv_heads": case.kv_heads, "head_dim": case.head_dim,
               "page_size": case.page_size, "kv_dtype": case.kv_dtype,
               "kv_sets": n_sets, "kv_footprint_MB": round(n_sets * case.kv_bytes / 1e6, 1),
               "l2_resident": n_sets * case.kv_bytes <= L2_BYTES}  # fmt: skip
        prep = None
        try:
            if case.kind == "decode":
                prep = prepare_decode(impl, case, inp, on_gpu)
            else:
                prep = prepare_prefill(impl, case, inp, on_gpu)
            row["params"] = prep.params
            out = jax.jit(prep.op)(prep.q, *prep.operand_sets[0])
            row["rel_err"] = rel_err(prep.to_tokens(out), ref)
            del out
            t = time_op(prep, min_loop_s=args.min_loop_ms / 1e3, repeats=args.repeats)
            row.update(
                time_ms=float(f"{t['time_s'] * 1e3:.5g}"),  # significant digits: tiny smoke
                kv_TBps=float(f"{case.kv_bytes / t['time_s'] / 1e12:.4g}"),  # cases stay > 0
                n_iters=t["n_iters"], loop_ms=t["loop_ms"], first_call_s=t["first_call_s"],
            )  # fmt: skip
            if case.kind == "prefill":
                row["tflops"] = float(f"{case.causal_flops / t['time_s'] / 1e12:.4g}")
        except Exception as e:  # one failing impl must not lose the rest
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        record(row)
        del prep
        gc.collect()
    del inp, ref
    gc.collect()


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def summary_table(result: dict) -> str:
    import pandas as pd

    lines = []
    if result["rows"]:
        df = pd.DataFrame(result["rows"])
        df["case"] = [Case(r["kind"], r["batch"], r["context"], r["q_heads"], r["kv_heads"],
                           r["head_dim"], r["page_size"], r["kv_dtype"]).label
                      for r in result["rows"]]  # fmt: skip
        for col in ("time_ms", "kv_TBps", "tflops", "rel_err", "error"):
            if col not in df:
                df[col] = None
        df["error"] = df["error"].map(lambda e: e[:60] if isinstance(e, str) else "")
        cols = ["case", "impl", "time_ms", "kv_TBps", "tflops", "rel_err", "error"]
        lines.append(df[cols].to_string(index=False, na_rep="-", float_format="{:.4g}".format))
    if result.get("checks"):
        df = pd.DataFrame(result["checks"])
        for col in ("rel_err", "max_row_rel_err", "error"):
            if col not in df:
                df[col] = None
        df["error"] = df["error"].map(lambda e: e[:60] if isinstance(e, str) else "")
        cols = ["name", "impl", "rel_err", "max_row_rel_err", "error"]
        lines.append(df[cols].to_string(index=False, na_rep="-", float_format="{:.3g}".format))
    return "\n\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="a handful of cases (< 3 min)")
    which.add_argument("--full", action="store_true", help="the grid below (split it with filters)")
    which.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--check", action="store_true", help="run the correctness sweep first")
    ap.add_argument("--list", action="store_true", help="print the selected cases and exit")
    ap.add_argument(
        "--out", type=Path, default=Path("experiments/results/h200/paged_attention.json")
    )
    ap.add_argument("--resume", action="store_true", help="keep --out's rows; skip measured ones")
    ap.add_argument("--impls", nargs="+", default=list(dict.fromkeys(DECODE_IMPLS + PREFILL_IMPLS)))
    ap.add_argument("--kinds", nargs="+", default=["decode", "prefill"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--kv-dtypes", nargs="+", default=["bfloat16", FP8])
    ap.add_argument("--max-kv-gb", type=float, default=40.0, help="skip decode cases above this")
    ap.add_argument("--min-loop-ms", type=float, default=None, help="default 20 (smoke: 1)")
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (smoke: 2)")
    args = ap.parse_args(argv)
    if args.min_loop_ms is None:
        args.min_loop_ms = 1.0 if args.smoke else 20.0
    if args.repeats is None:
        args.repeats = 2 if args.smoke else 5
    if not (args.quick or args.full or args.smoke or args.check):
        ap.error("choose --quick, --full, --smoke and/or --check")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.list:
        for case in select_cases(args):
            print(f"{case.label}: {case.kv_bytes / 1e9:.2f} GB K/V, {kv_sets_for(case)} set(s)")
        return {}
    on_gpu = jax.default_backend() == "gpu"
    if not args.smoke:
        require_gpu("bench_paged_attention.py", "--smoke")
    result = {
        **provenance([sys.executable, *(sys.argv if argv is None else [__file__, *argv])]),
        "timing_method": TIMING_METHOD,
        "min_loop_ms": args.min_loop_ms,
        "repeats": args.repeats,
        "reference": (
            "rel_err = ||out - ref|| / ||ref||, ref in fp32 on the same inputs (fp8: dequantized):"
            " decode via ragged_paged_attention; prefill via dense causal attention on the "
            "contiguous K/V the pages hold"
        ),
        "rows": [],
        "checks": [],
    }
    if args.resume and args.out.exists():
        old = json.loads(args.out.read_text())
        result["rows"], result["checks"] = old.get("rows", []), old.get("checks", [])
    done = {
        (r["impl"], Case(r["kind"], r["batch"], r["context"], r["q_heads"], r["kv_heads"],
                         r["head_dim"], r["page_size"], r["kv_dtype"]))
        for r in result["rows"] if "error" not in r
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(_json_safe(result), indent=1) + "\n")

    def recorder(key):
        def record(row):
            result[key] = [r for r in result[key] if not _same_row(r, row)] + [row]
            save()
            shown = {k: row.get(k) for k in ("impl", "time_ms", "kv_TBps", "tflops", "rel_err")}
            print(key, row.get("name", ""), shown, row.get("error", "")[:200], flush=True)

        return record

    if args.check:
        run_checks(args.smoke, ("jaxinfer_pallas", "cudnn_paged"), recorder("checks"))
    for case in select_cases(args):
        impls = [i for i in args.impls if i in (DECODE_IMPLS if case.kind == "decode"
                                                 else PREFILL_IMPLS)]  # fmt: skip
        print(f"== {case.label} ({case.kv_bytes / 1e9:.2f} GB K/V)", flush=True)
        bench_case(case, impls, args, on_gpu, recorder("rows"), done)
    save()
    print(summary_table(result))
    return result


def _same_row(a: dict, b: dict) -> bool:
    keys = ("impl", "kind", "batch", "context", "page_size", "kv_dtype", "name", "head_dim")
    return all(a.get(k) == b.get(k) for k in keys)


if __name__ == "__main__":
    main()
