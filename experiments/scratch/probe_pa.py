"""GPU probe: does the Mosaic paged-attention kernel lower, is it right, how fast (first look)."""

import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.paged_attention.mosaic_gpu import ragged_paged_attention_mgpu
from pallas_kernels.paged_attention.reference import ragged_paged_attention

OUT = os.environ.get("OUT", "/tmp")
res = {"jax": jax.__version__, "device": str(jax.devices()[0]), "checks": [], "timing": []}


def make(rng, q_lens, ctx, ps, hkv, g, d, dtype=jnp.bfloat16, poison=True):
    S = len(q_lens)
    lens = np.array([c + q for c, q in zip(ctx, q_lens, strict=True)], np.int32)
    need = -(-lens // ps)
    pps = int(need.max()) + 1
    P = int(need.sum()) + 3
    perm = rng.permutation(np.arange(1, P))
    tab = np.zeros((S, pps), np.int32)
    u = 0
    for s in range(S):
        tab[s, : need[s]] = perm[u : u + need[s]]
        u += need[s]
    kp = rng.standard_normal((P, ps, hkv, d), np.float32)
    vp = rng.standard_normal((P, ps, hkv, d), np.float32)
    if poison:
        owned = np.zeros((P, ps), bool)
        for s in range(S):
            for pos in range(lens[s]):
                owned[tab[s, pos // ps], pos % ps] = True
        kp[~owned] = np.nan
        vp[~owned] = np.nan
    T = sum(q_lens) + 2
    q = rng.standard_normal((T, hkv * g, d), np.float32)
    qsl = np.array([0, *np.cumsum(q_lens)], np.int32)
    return q, kp, vp, tab, lens, qsl


def check(name, q_lens, ctx, ps, hkv, g, d, fp8=False, **kw):
    rng = np.random.default_rng(hash(name) % 2**31)
    q, kp, vp, tab, lens, qsl = make(rng, q_lens, ctx, ps, hkv, g, d)
    qb = jnp.asarray(q, jnp.bfloat16)
    extra = {}
    if fp8:

        def quant(p):
            amax = np.nanmax(np.abs(np.where(np.isnan(p), 0, p)), axis=(1, 3))
            sc = np.maximum(amax / 448.0, 1e-8).astype(np.float32)
            q8 = jnp.asarray(p / sc[:, None, :, None]).astype(jnp.float8_e4m3fn)
            return q8, jnp.asarray(sc), np.asarray(q8.astype(jnp.float32)) * sc[:, None, :, None]

        k8, ks, kd = quant(kp)
        v8, vs, vd = quant(vp)
        ka, va, kr, vr = k8, v8, kd, vd
        extra = dict(k_scales=ks, v_scales=vs)
    else:
        ka, va = jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16)
        kr, vr = np.asarray(ka, np.float32), np.asarray(va, np.float32)
    mq = max(q_lens)
    row = dict(name=name)
    try:
        t = time.time()
        out = ragged_paged_attention_mgpu(
            qb,
            ka,
            va,
            jnp.asarray(tab),
            jnp.asarray(lens),
            jnp.asarray(qsl),
            max_q_len=mq,
            **kw,
            **extra,
        )
        out = np.asarray(out, np.float32)
        row["first_call_s"] = round(time.time() - t, 2)
        ref = np.asarray(
            ragged_paged_attention(
                qb.astype(jnp.float32),
                jnp.asarray(kr),
                jnp.asarray(vr),
                jnp.asarray(tab),
                jnp.asarray(lens),
                jnp.asarray(qsl),
                max_q_len=mq,
                sliding_window=kw.get("sliding_window"),
                soft_cap=kw.get("soft_cap"),
            )
        )
        n = sum(q_lens)
        row["rel_err"] = float(np.linalg.norm(out[:n] - ref[:n]) / np.linalg.norm(ref[:n]))
        row["finite"] = bool(np.isfinite(out).all())
    except Exception as e:
        row["error"] = "".join(traceback.format_exception_only(e))[-1500:]
    print(row, flush=True)
    res["checks"].append(row)


check("decode_ps16_d128_g4", [1] * 5, [17, 100, 2047, 5, 600], 16, 8, 4, 128)
check("decode_ps16_split4", [1] * 2, [3000, 777], 16, 8, 4, 128, num_splits=4)
check("decode_ps32", [1] * 3, [31, 500, 64], 32, 2, 4, 128)
check("decode_ps64_d64", [1] * 3, [63, 500, 65], 64, 4, 2, 64)
check("decode_ps128_d256", [1] * 3, [127, 300, 129], 128, 2, 4, 256)
check("ragged_mixed", [1, 37, 5, 130], [100, 0, 50, 300], 16, 8, 4, 128)
check(
    "softcap_window", [1, 20, 3], [400, 100, 60], 16, 2, 4, 128, soft_cap=30.0, sliding_window=128
)
check("fp8_decode", [1] * 4, [100, 1000, 33, 2048], 16, 8, 4, 128, fp8=True)
check("fp8_ragged_d64", [1, 40], [100, 70], 16, 2, 4, 64, fp8=True)
check("nows_ragged", [1, 37, 5, 130], [100, 0, 50, 300], 16, 8, 4, 128, warp_specialized=False)
check("nows_fp8", [1] * 4, [100, 1000, 33, 2048], 16, 8, 4, 128, fp8=True, warp_specialized=False)
check("prefill_1k", [1024], [0], 16, 8, 4, 128)


def bench(name, B, L, ps, fp8=False, N=None, **kw):
    rng = np.random.default_rng(0)
    hkv, g, d = 8, 4, 128
    P = B * L // ps + 1
    tab = (rng.permutation(np.arange(1, P)).reshape(B, L // ps)).astype(np.int32)
    k = jax.random.normal(jax.random.key(1), (P, ps, hkv, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(2), (P, ps, hkv, d), jnp.bfloat16)
    extra = {}
    if fp8:
        k = k.astype(jnp.float8_e4m3fn)
        v = v.astype(jnp.float8_e4m3fn)
        extra = dict(
            k_scales=jnp.ones((P, hkv), jnp.float32), v_scales=jnp.ones((P, hkv), jnp.float32)
        )
    q = jax.random.normal(jax.random.key(3), (B, hkv * g, d), jnp.bfloat16)
    lens = jnp.full((B,), L, jnp.int32)
    qsl = jnp.arange(B + 1, dtype=jnp.int32)
    tab = jnp.asarray(tab)
    kvbytes = B * L * hkv * d * 2 * k.dtype.itemsize
    N = N or max(20, int(0.05 / (kvbytes / 3.5e12)))

    def op(q, k, v, **ex):
        return ragged_paged_attention_mgpu(q, k, v, tab, lens, qsl, max_q_len=1, **kw, **ex)

    @jax.jit
    def loop(q, k, v, ex):
        return lax.fori_loop(0, N, lambda i, q: q + (1e-3 * op(q, k, v, **ex)).astype(q.dtype), q)

    row = dict(name=name, batch=B, context=L, page_size=ps, fp8=fp8, N=N, **kw)
    try:
        loop(q, k, v, extra).block_until_ready()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            loop(q, k, v, extra).block_until_ready()
            ts.append(time.perf_counter() - t)
        ms = float(np.median(ts)) / N * 1e3
        row.update(time_ms=ms, kv_TBps=kvbytes / (ms * 1e-3) / 1e12)
    except Exception as e:
        row["error"] = "".join(traceback.format_exception_only(e))[-1500:]
    print(row, flush=True)
    res["timing"].append(row)


for ws, st in [(True, 2), (True, 3), (True, 4), (True, 6), (False, 2)]:
    bench(f"B64_L2048_ws{int(ws)}_st{st}", 64, 2048, 16, warp_specialized=ws, num_stages=st)
for ws, st in [(True, 4), (False, 2)]:
    bench(f"B1_L32768_ws{int(ws)}_st{st}", 1, 32768, 16, warp_specialized=ws, num_stages=st)
    bench(f"B8_L8192_ws{int(ws)}_st{st}", 8, 8192, 16, warp_specialized=ws, num_stages=st)
    bench(f"B256_L2048_ws{int(ws)}_st{st}", 256, 2048, 16, warp_specialized=ws, num_stages=st)
    bench(f"B64_L2048_p64_ws{int(ws)}_st{st}", 64, 2048, 64, warp_specialized=ws, num_stages=st)
    bench(
        f"B64_L2048_fp8_ws{int(ws)}_st{st}",
        64,
        2048,
        16,
        fp8=True,
        warp_specialized=ws,
        num_stages=st,
    )
bench("B1_L32768_ws1_st4_sp66", 1, 32768, 16, num_splits=66)
bench("B1_L32768_ws1_st4_sp16", 1, 32768, 16, num_splits=16)
bench("B64_L2048_fp8_wgmma8", 64, 2048, 16, fp8=True, fp8_load="wgmma8")
check("fp8_wgmma8", [1] * 4, [100, 1000, 33, 2048], 16, 8, 4, 128, fp8=True, fp8_load="wgmma8")


def bench_prefill(name, ps=16, **kw):
    B, L, hkv, g, d = 4, 4096, 8, 4, 128
    P = B * L // ps + 1
    tab = jnp.asarray(
        np.random.default_rng(0).permutation(np.arange(1, P)).reshape(B, L // ps).astype(np.int32)
    )
    k = jax.random.normal(jax.random.key(1), (P, ps, hkv, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(2), (P, ps, hkv, d), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(3), (B * L, hkv * g, d), jnp.bfloat16)
    lens = jnp.full((B,), L, jnp.int32)
    qsl = jnp.arange(B + 1, dtype=jnp.int32) * L
    N = 10

    @jax.jit
    def loop(q, k, v):
        return lax.fori_loop(
            0,
            N,
            lambda i, q: (
                q
                + (
                    1e-3 * ragged_paged_attention_mgpu(q, k, v, tab, lens, qsl, max_q_len=L, **kw)
                ).astype(q.dtype)
            ),
            q,
        )

    row = dict(name=name, **kw)
    try:
        loop(q, k, v).block_until_ready()
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            loop(q, k, v).block_until_ready()
            ts.append(time.perf_counter() - t)
        ms = float(np.median(ts)) / N * 1e3
        flops = 4 * B * hkv * g * d * L * (L + 1) / 2
        row.update(time_ms=ms, kv_TBps=flops / (ms * 1e-3) / 1e12)
    except Exception as e:
        row["error"] = "".join(traceback.format_exception_only(e))[-1500:]
    print(row, flush=True)
    res["timing"].append(row)


bench_prefill("prefill_4x4096_TFLOPs_ws1")
bench_prefill("prefill_4x4096_TFLOPs_ws0", warp_specialized=False)
with open(f"{OUT}/probe.json", "w") as f:
    json.dump(res, f, indent=1)
for r in res["checks"]:
    print(r.get("name"), r.get("rel_err"), r.get("error", "")[:300])
for r in res["timing"]:
    print(r.get("name"), r.get("time_ms"), r.get("kv_TBps"), r.get("error", "")[:300])
