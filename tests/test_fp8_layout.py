"""FP8 weights are read as stored: a decode scan of an FP8 model neither transposes nor converts
any weight-sized FP8 array, and every FP8 dot contracts its weight's last (K-major) axis.

The CPU test reads the lowered program of the engine's own decode scan (`decode_loop`, as the
engine warms it up), which is what our code asks XLA for; the `-m gpu` test reads the H200's
optimized HLO, where XLA's layout assignment could still add a copy (it did, per call, when the
formats stored [K, N]: `jaxinfer/quant/fp8.py`).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params
from jaxinfer.quant import QuantizedWeight
from jaxinfer.quant.transform import quantize

FP8 = ("fp8_tensor", "fp8_channel", "fp8_block", "fp8_static")
_TENSOR = r"tensor<([0-9x]*)x?(f8E4M3FN)>"


def _elements(dims: str) -> int:
    return math.prod(int(d) for d in dims.split("x") if d) if dims else 1


def fp8_weight_misuse(text: str, min_elements: int) -> list[str]:
    """The lines of a lowered (StableHLO) program that transpose or convert an e4m3 array of at
    least `min_elements` elements, or run a dot on an e4m3 operand of that size whose last axis
    is not contracted."""
    bad = []
    for line in text.splitlines():
        op = re.search(r"stablehlo\.(\w+)", line)
        if op is None or "f8E4M3FN" not in line:
            continue
        sig = line.rsplit(" : ", 1)[-1]
        operands = sig.split("->")[0]
        big = [m for m in re.finditer(_TENSOR, operands) if _elements(m[1]) >= min_elements]
        if not big:
            continue
        if op[1] in ("transpose", "convert", "copy"):
            bad.append(line.strip())
        elif op[1] == "dot_general":
            rhs = re.findall(r"tensor<[^>]*>", operands)[1]
            rank = rhs.count("x")
            contracted = re.search(r"contracting_dims = \[[\d, ]*\] x \[([\d, ]*)\]", line)
            if contracted is None or str(rank - 1) not in contracted[1].split(", "):
                bad.append(line.strip())
    return bad


def test_the_check_finds_a_transposed_or_converted_weight():
    """The check can fail: [K, N] weights transposed for the dot, or dequantized, are found."""
    x = jax.ShapeDtypeStruct((4, 256), jnp.float8_e4m3fn)
    w = jax.ShapeDtypeStruct((256, 512), jnp.float8_e4m3fn)  # [K, N]
    dot = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),  # noqa: E731
                                           preferred_element_type=jnp.float32)  # fmt: skip
    transposed = jax.jit(lambda x, w: dot(x, w.T)).lower(x, w).as_text()
    converted = jax.jit(lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32))
    wrong_axis = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                                          preferred_element_type=jnp.float32))  # fmt: skip
    assert fp8_weight_misuse(transposed, 4096)
    assert fp8_weight_misuse(converted.lower(x, w).as_text(), 4096)
    assert fp8_weight_misuse(wrong_axis.lower(x, w).as_text(), 4096)
    k_major = jax.ShapeDtypeStruct((512, 256), jnp.float8_e4m3fn)
    assert fp8_weight_misuse(jax.jit(dot).lower(x, k_major).as_text(), 4096) == []


def fp8_engine(fmt: str, max_num_seqs: int = 4) -> Engine:
    cfg = preset("tiny", num_layers=2)
    params = init_params(cfg, jax.random.key(0))
    calibration = [np.zeros((1, 8), np.int32)] if fmt == "fp8_static" else None
    qcfg, qparams = quantize(cfg, params, weights=fmt, calibration=calibration)
    config = EngineConfig(model="preset:tiny", max_num_seqs=max_num_seqs, max_model_len=64,
                          page_size=8, num_pages=64, max_num_batched_tokens=16, decode_steps=4)  # fmt: skip
    return Engine(config, qcfg, qparams, None)


def smallest_fp8_weight(engine: Engine) -> int:
    sizes = [w.arrays["values"].size for layer in engine.runner.params["layers"]
             for w in layer.values() if isinstance(w, QuantizedWeight)]  # fmt: skip
    return min(sizes)


@pytest.mark.parametrize("fmt", FP8)
def test_a_decode_scan_reads_every_fp8_weight_as_stored(fmt):
    engine = fp8_engine(fmt)
    n = smallest_fp8_weight(engine)
    assert n > 4 * 128, "the model's weights must outsize its decode activations"
    calls = [c for c in engine.runner._warmup_calls() if c[0][0] == "decode"]
    assert calls
    _, fn, args, static = calls[0]
    text = fn.lower(*args, **static).as_text()
    assert "dot_general" in text and "f8E4M3FN" in text
    bad = fp8_weight_misuse(text, n)
    assert bad == [], f"{fmt}: {len(bad)} weight-sized fp8 ops, first: {bad[0][:300]}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP8)
def test_the_gpus_decode_scan_copies_no_fp8_weight(fmt):
    """On the GPU: the optimized decode scan has no transpose, copy or convert of a weight-sized
    e4m3 array (its dots read them as they are, on cuBLASLt or XLA's own GEMM emitter)."""
    engine = fp8_engine(fmt)
    n = smallest_fp8_weight(engine)
    _, fn, args, static = next(c for c in engine.runner._warmup_calls() if c[0][0] == "decode")
    hlo = fn.lower(*args, **static).compile().as_text()
    bad = []
    for line in hlo.splitlines():
        m = re.search(r"= f8e4m3fn\[([\d,]*)\][^ ]* (transpose|copy|convert)\(", line)
        src = re.search(r" (transpose|copy|convert)\(f8e4m3fn\[([\d,]*)\]", line)
        for dims in (m and m[1], src and src[2]):
            if dims is not None and math.prod(int(d) for d in dims.split(",") if d) >= n:
                bad.append(line.strip())
    assert bad == [], f"{fmt}: {len(bad)} weight-sized fp8 moves, first: {bad[0][:300]}"
    assert "f8e4m3fn" in hlo, f"{fmt}: no fp8 array in the optimized decode scan"


@pytest.mark.gpu
def test_the_gpus_decode_scan_copies_no_fp8_kv_pool():
    """FP8 KV pages: the optimized decode scan writes the pool in place, no pool-sized copy (the
    requantizing write's gather, fused into its scatter, made XLA copy the pool twice a layer)."""
    cfg = preset("tiny", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                 head_dim=64, dtype="bfloat16", param_dtype="bfloat16")  # fmt: skip
    config = EngineConfig(model="preset:tiny", max_num_seqs=8, max_model_len=256, page_size=16,
                          num_pages=512, max_num_batched_tokens=64, decode_steps=4,
                          kv_dtype="float8_e4m3fn")  # fmt: skip
    engine = Engine(config, cfg, init_params(cfg, jax.random.key(0)), None)
    _, fn, args, static = next(c for c in engine.runner._warmup_calls() if c[0][0] == "decode")
    hlo = fn.lower(*args, **static).compile().as_text()
    pool = engine.runner.kv.pages.size
    copies = [line.strip()[:200] for line in hlo.splitlines()
              if (m := re.search(r"= f8e4m3fn\[([\d,]*)\][^ ]* copy\(", line))
              and math.prod(int(d) for d in m[1].split(",")) >= pool // 4]  # fmt: skip
    assert copies == [], f"{len(copies)} pool-sized copies, first: {copies[0]}"
