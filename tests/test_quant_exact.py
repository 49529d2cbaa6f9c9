"""Bit-exactness of the quantizers' scales and codes against their documented formulas.

The references below restate llama.cpp's `quantize_row_q8_0_ref` / `quantize_row_q4_1_ref` in
numpy: every step in float32, d = span / qmax by a division, fp16 by numpy's round to nearest
even, the codes from the float32 1/d.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.quant.fp8 import E4M3_MAX, FP8_CHANNEL, corrected_quotient
from jaxinfer.quant.gguf_formats import Q4_1, Q8_0
from jaxinfer.quant.intq import INT8, unpack_nibbles

F32 = np.float32


def _inv(d):
    return np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)


def ref_q8_0(b):
    """b [G, 32, N] float32 -> (codes, fp16 d)."""
    d = (np.abs(b).max(axis=1) / F32(127)).astype(F32)
    x = (b * _inv(d)[:, None]).astype(F32)
    q = np.sign(x) * np.floor(np.abs(x.astype(np.float64)) + 0.5)  # roundf, exact in float64
    return q.astype(np.int8), d.astype(np.float16)


def ref_q4_1(b):
    lo, hi = b.min(axis=1), b.max(axis=1)
    d = ((hi - lo) / F32(15)).astype(F32)
    x = ((b - lo[:, None]) * _inv(d)[:, None]).astype(F32) + F32(0.5)
    return np.minimum(15, np.trunc(x)).astype(np.uint8), d.astype(np.float16), lo.astype(np.float16)


def _ours(fmt, w):
    out = jax.jit(lambda w: fmt.quantize(w, 1))(jnp.asarray(w))  # jitted, as the transform does
    b_shape = (w.shape[0] // 32, 32, w.shape[1])
    if fmt is Q4_1:
        q = np.asarray(unpack_nibbles(out["values"], 0)).reshape(b_shape)
        return q, np.asarray(out["d"]), np.asarray(out["m"])
    return np.asarray(out["values"]).reshape(b_shape), np.asarray(out["d"])


@pytest.mark.parametrize(
    "fmt, v, d",
    [(Q4_1, 0.44734954833984375, 0.0298156738281250), (Q8_0, 63.531009674072266, 0.50048828125)],
)
def test_gguf_d_is_the_fp16_of_the_f32_division(fmt, v, d):
    w = np.zeros((32, 2), np.float32)
    w[1] = [v, 0]
    assert _ours(fmt, w)[1][0, 0] == np.float16(d)


def _near_fp16_midpoints(rng, qmax, g):
    """Block spans whose span / qmax lands within a few float32 ulps of an fp16 midpoint."""
    h = rng.uniform(2**-10, 2**4, g).astype(np.float16)
    mid = (h.astype(F32) + np.nextafter(h, np.float16(np.inf)).astype(F32)) / 2
    span = mid * F32(qmax)
    for _ in range(int(rng.integers(0, 3))):
        span = np.nextafter(span, F32(np.inf if rng.random() < 0.5 else -np.inf))
    return span.astype(F32)


def test_gguf_blocks_match_the_reference(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    g, n = 64, 3
    b = (rng.standard_normal((g, 32, n)) * rng.uniform(1e-3, 1e2, (g, 1, n))).astype(F32)
    b[0, :, 0] = 0  # a flat block: d = 0, codes 0
    b[1, :, 0] = [127, 0.49999997] + [0] * 30  # d = 1: roundf(0.49999997) is 0, not 1
    for fmt, qmax, ref in [(Q8_0, 127, ref_q8_0), (Q4_1, 15, ref_q4_1)]:
        t = b.copy()
        t[2:34, 0, 1] = _near_fp16_midpoints(rng, qmax, 32)  # amax, and max - min with min 0
        t[2:34, 1:, 1] = rng.uniform(0, 1, (32, 31)) * t[2:34, :1, 1]
        w = t.reshape(g * 32, n)
        for got, want in zip(_ours(fmt, w), ref(t), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"{fmt.name}, seed {fresh_seed}")


@pytest.mark.parametrize("fmt, qmax", [(INT8, 127), (FP8_CHANNEL, 448)])
def test_scales_are_amax_over_qmax(fmt, qmax, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    w = (rng.standard_normal((64, 512)) * rng.uniform(1e-3, 1e3, 512)).astype(F32)
    want = (np.abs(w).max(axis=0) / F32(qmax)).astype(F32)
    for quantize in (fmt.quantize, jax.jit(fmt.quantize, static_argnums=1)):
        got = np.asarray(quantize(jnp.asarray(w), 1)["scales"]).reshape(-1)
        np.testing.assert_array_equal(got, want, err_msg=f"{fmt.name}, seed {fresh_seed}")


@pytest.mark.parametrize("qmax", [E4M3_MAX, 127.0, 15.0, 7.0, 6.0 * E4M3_MAX])
def test_a_quotient_a_few_ulp_off_is_corrected_to_the_true_one(qmax, fresh_seed):
    """What safe_scale relies on where the backend's own division is off (XLA:GPU's div.full
    is within 2 ulp; XLA's reciprocal multiply within 1): from any quotient up to 3 ulp from
    amax / qmax, over amaxes from 2^-80 to 2^100, the correction lands on the
    correctly rounded quotient (numpy's float32 division)."""
    rng = np.random.default_rng(fresh_seed)
    a = (rng.uniform(1, 2, 20000) * np.exp2(rng.integers(-80, 100, 20000))).astype(F32)
    want = (a / F32(qmax)).astype(F32)
    fix = jax.jit(lambda a, q: corrected_quotient(a, q, qmax))
    for steps in (-3, -2, -1, 0, 1, 2, 3):
        q = want.view(np.int32) + np.int32(steps)
        got = np.asarray(fix(a, q.view(F32)))
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (
            f"qmax {qmax}, quotient {steps} ulp off: {bad.size} wrong, e.g. amax {a[bad[0]]!r}"
            f" -> {got[bad[0]]!r} not {want[bad[0]]!r}; seed {fresh_seed}"
        )
