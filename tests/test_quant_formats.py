"""The number formats of `jaxinfer.quant` (fp8, intq, fp4, gguf_formats): code points, scales,
packing, round-trip error bounds, products, fused-weight blocks, and a model run end to end."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.generate import greedy_generate
from jaxinfer.models.presets import preset
from jaxinfer.models.spec import init_params, param_specs
from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight, ggml
from jaxinfer.quant.fp4 import E2M1_VALUES, e2m1_decode, e2m1_encode, e8m0_decode
from jaxinfer.quant.fp8 import E4M3, quantize_activations, to_e4m3
from jaxinfer.quant.gguf_formats import from_gguf_components
from jaxinfer.quant.intq import pack_nibbles, unpack_nibbles
from jaxinfer.quant.transform import quantize_params

FORMATS = ("fp8_tensor", "fp8_channel", "fp8_block", "int8", "int4_g128_sym", "int4_g128_asym",
           "nvfp4", "mxfp4", "q8_0", "q4_1")  # fmt: skip
W8A8 = {"fp8_tensor": None, "fp8_channel": None, "fp8_block": 128}  # activation block


def quantized(name: str, w, in_dims: int = 1) -> QuantizedWeight:
    """`quantize` jitted, as `quantize_params` runs it (one compile, not one per op)."""
    fmt = WEIGHT_FORMATS[name]
    return QuantizedWeight(_jit_quantize(fmt, in_dims)(jnp.asarray(w)), fmt, in_dims)


@functools.cache
def _jit_quantize(fmt, in_dims: int):
    return jax.jit(functools.partial(fmt.quantize, in_dims=in_dims))


@jax.jit
def _dequantize(qw: QuantizedWeight) -> jax.Array:
    return qw.format.dequantize(qw)


def deq(qw: QuantizedWeight) -> np.ndarray:
    return np.asarray(_dequantize(qw), np.float64)


# -- code points ---------------------------------------------------------------------------------


def test_every_e4m3_code_point_round_trips_exactly():
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.isfinite(values)
    assert finite.sum() == 254  # S.1111.111 is NaN, no infinities
    back = np.asarray(to_e4m3(jnp.asarray(values[finite]))).view(np.uint8)
    np.testing.assert_array_equal(back, codes[finite])
    # and off-grid values round as ml_dtypes does (nearest, ties to even), saturating at 448
    mid = (values[finite][1:127] + values[finite][2:128]) / 2  # positive midpoints incl. ties
    x = np.concatenate([mid, -mid, [500.0, -1e4, 2.0**-11]]).astype(np.float32)
    want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(to_e4m3(jnp.asarray(x))).view(np.uint8), want)


def test_every_e2m1_code_point_encodes_and_decodes_exactly():
    table = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), np.float32)
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32), table)
    np.testing.assert_array_equal(np.asarray(e2m1_decode(jnp.asarray(codes))), table)
    np.testing.assert_array_equal(np.asarray(e2m1_encode(jnp.asarray(table))), codes)
    # ties go to the even code, and everything in range rounds as ml_dtypes does
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1_encode(jnp.asarray(ties))), [0, 2, 2, 4, 4, 6, 6])
    x = np.concatenate([np.linspace(-6, 6, 4801), ties, -ties]).astype(np.float32)
    want = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(e2m1_encode(jnp.asarray(x))), want)


def test_every_e8m0_code_mxfp4_writes_decodes_exactly():
    codes = np.arange(1, 255, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(e8m0_decode(jnp.asarray(codes))), want)


def test_nibble_packing_round_trips_with_the_low_nibble_first(fresh_seed):
    q = np.random.default_rng(fresh_seed).integers(0, 16, (6, 8, 5))
    for axis in (0, 1):
        p = np.asarray(pack_nibbles(jnp.asarray(q), axis))
        assert p.dtype == np.uint8 and p.shape[axis] == q.shape[axis] // 2
        np.testing.assert_array_equal(np.asarray(unpack_nibbles(jnp.asarray(p), axis)), q)
    np.testing.assert_array_equal(p[:, 0] & 0x0F, q[:, 0])  # input 2i low, 2i+1 high
    np.testing.assert_array_equal(p[:, 0] >> 4, q[:, 1])


# -- scales --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
def test_all_zero_blocks_quantize_to_zero_with_finite_scales(name):
    w = np.zeros((256, 2, 64), np.float32)
    w[:, 1, :32] = np.random.default_rng(0).standard_normal((256, 32))  # other blocks nonzero
    qw = quantized(name, w)
    for a in jax.tree.leaves(qw.arrays):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
    np.testing.assert_array_equal(deq(qw)[:, 0], 0.0)
    np.testing.assert_array_equal(deq(quantized(name, np.zeros_like(w))), 0.0)  # tensor amax 0


@pytest.mark.parametrize("name", FORMATS)
def test_inf_or_nan_in_a_weight_is_refused_by_name(name):
    for bad in (np.inf, -np.inf, np.nan):
        w = np.ones((128, 32), np.float32)
        w[3, 5] = bad
        with pytest.raises(ValueError, match=f"{name}: the weight holds inf or NaN"):
            WEIGHT_FORMATS[name].quantize(jnp.asarray(w), 1)
    # under jit (as `quantize_params` runs it) the error still names the format and the problem
    with pytest.raises(Exception, match=f"{name}: the weight holds inf or NaN"):
        jax.block_until_ready(quantized(name, w).arrays)


@pytest.mark.parametrize("name", FORMATS)
def test_a_single_outlier_only_coarsens_its_own_block(name, fresh_seed):
    """Blocked formats keep the rest of the weight as fine as without the outlier."""
    rng = np.random.default_rng(fresh_seed)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    w_out = w.copy()
    w_out[0, 0] = 1e3
    err, err_out = np.abs(deq(quantized(name, w)) - w), np.abs(deq(quantized(name, w_out)) - w_out)
    rel = 0.25 if name.endswith("fp4") else 0.07  # e2m1's step (mxfp4 saturates 7.8 to 6)
    assert np.abs(deq(quantized(name, w_out))[0, 0] - 1e3) <= 1e3 * rel, f"seed {fresh_seed}"
    if name in ("fp8_tensor", "nvfp4"):  # one (tensor) scale per logical output: not local
        return
    far = slice(128, None)  # another input block and another output block
    assert err_out[far, far].max() <= err[far, far].max() * 1.001 + 1e-7, f"seed {fresh_seed}"


def test_subnormal_scales_and_values_stay_within_their_bounds():
    # fp8: a block whose small values are e4m3 subnormals relative to its scale
    w = np.full((128, 8), 2.0**-8, np.float32)  # scale 1: e4m3's subnormal 2^-8 (normals >= 2^-6)
    w[0] = 448.0
    qw = quantized("fp8_channel", w)
    assert np.asarray(qw.arrays["values"]).astype(np.float32)[0, 1] == 2.0**-8  # K-major [N, K]
    np.testing.assert_array_equal(deq(qw), w)  # 2^-8 is exact in e4m3 (a subnormal)
    # nvfp4: a block far smaller than the tensor's amax gets an e4m3-subnormal block scale
    w = np.full((32, 4), 0.02, np.float32)  # block scale 0.02 / 6 (tensor scale 1): subnormal
    w[16:] = 6.0 * 448
    qw = quantized("nvfp4", w)
    bs = np.asarray(qw.arrays["block_scales"]).astype(np.float32)
    assert 0 < bs[0].max() < 2.0**-6  # subnormal
    s2 = float(qw.arrays["tensor_scale"])
    assert np.abs(deq(qw) - w)[:16].max() <= 6 * s2 * 2.0**-10 + 0.02 / 4
    # fp32 subnormal weights: no NaN or inf anywhere
    for name in FORMATS:
        d = deq(quantized(name, np.full((128, 32), 1e-40, np.float32)))
        assert np.all(np.isfinite(d)) and np.abs(d).max() <= 1e-37, name


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_fp4_codes_are_nearest_to_the_weight_over_its_stored_scale(name, fresh_seed):
    """Each code is the nearest e2m1 value of w / (the scale as stored: an e4m3 block scale times
    the tensor scale, or a power of two), recomputed here outside the quantizer's program. XLA:GPU
    once chose nvfp4's codes by the block scales before their e4m3 rounding (`results/h200/
    archive/gpu_tests_quant_0f5764b.json`); tests/test_gpu_quant.py checks the GPU against this CPU result."""
    w = np.random.default_rng(fresh_seed).normal(size=(256, 48)).astype(np.float32) * 0.02
    qw = quantized(name, w)
    fmt = WEIGHT_FORMATS[name]
    block, tensor = (np.asarray(a, np.float32) for a in fmt._scales(qw.arrays, 256))
    v = np.clip(w / (block * tensor), -6.0, 6.0)  # float32 IEEE division, as on the CPU
    want = np.asarray(e2m1_encode(jnp.asarray(v)))
    got = np.asarray(unpack_nibbles(qw.arrays["values"], 0))
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"seed {fresh_seed}: {len(bad)} codes, first at {bad[0].tolist()}"


# -- round-trip error bounds ----------------------------------------------------------------------


# fp32 arithmetic in the formats' quantize and dequantize: each rounding moves its result by at
# most half an ulp, 2^-24 of the result's magnitude (or 2^-150 absolute in fp32's subnormal
# range). The bounds take a whole ulp per rounding: the spare half covers the products of two
# rounding errors (e.g. of w / s times its own rounding) and the float64 arithmetic of the bound.
FP32_ULP = 2.0**-23
FP32_TINY = 2.0**-149
FP16_HALF_ULP = 2.0**-11  # GGUF's d and m are float16: relative, normals
FP16_TINY = 2.0**-25  # float16 subnormals: absolute


def _fp32(magnitude, n: int = 1) -> np.ndarray:
    """What `n` fp32 roundings of a value of this magnitude can add to the error."""
    return n * (FP32_ULP * np.abs(magnitude) + FP32_TINY)


def _bound(name: str, qw: QuantizedWeight, w: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The largest |w - d| a format allows, elementwise ([K, N] weights, d = dequantize(quantize
    (w))): the format's rounding of w / scale to its grid, in exact arithmetic, plus the fp32
    roundings of the quantizer's w / scale (a rounding of magnitude |w / scale| times the scale,
    so |w|) and of the dequantized product (|d|)."""
    a = qw.arrays
    k = w.shape[0]
    fp32 = _fp32(w) + _fp32(d)  # w / s and q * s, each rounded once

    def per_k(s, block):  # [G, N] -> [K, N]
        return np.repeat(np.asarray(s, np.float64), block, axis=0)[:k]

    if name.startswith("fp8"):  # e4m3: half an ulp, 2^-4 relative (normals) or 2^-10 * s
        s = np.asarray(a["scales"], np.float64)
        s = s.T if s.ndim == 2 else s  # fp8_block: [NB, KB] -> [KB, NB]
        s = np.repeat(np.repeat(s, 128, 0)[:k], 128, 1)[:, : w.shape[1]] if s.ndim == 2 else s
        return 2.0**-4 * np.abs(w) + 2.0**-10 * s + fp32
    if name == "int8":  # half a step
        return np.asarray(a["scales"], np.float64) / 2 + fp32
    if name == "int4_g128_sym":
        return per_k(a["scales"], 128) / 2 + fp32
    if name == "int4_g128_asym":  # half a step, plus half a step of zero-point rounding
        return per_k(a["scales"], 128) + fp32
    if name in ("nvfp4", "mxfp4"):  # half the e2m1 step at |v| <= 2 is 0.25, above it <= |v|/4
        if name == "mxfp4":
            s = per_k(np.ldexp(1.0, np.asarray(a["scales"], np.int64) - 127), 32)
        else:  # the scale block * tensor is rounded too before w is divided by it
            bs = np.asarray(a["block_scales"]).astype(np.float64)
            s = per_k(bs * float(a["tensor_scale"]), 16)
            fp32 = fp32 + _fp32(w)
        return np.maximum(0.25 * s, np.abs(w) / 4) + fp32
    # GGUF: the quants are computed from the fp32 d (and min), which are then stored as float16:
    # the bound adds the quants times that float16 rounding; d32 is at most the stored d over
    # (1 - 2^-11), so d16 * (1 + 2^-10), plus a float16 subnormal's half step
    d16 = per_k(np.asarray(a["d"], np.float64), 32)
    d32 = d16 * (1 + 2 * FP16_HALF_ULP) + FP16_TINY
    if name == "q8_0":  # q = roundf(w * (1 / d)): two roundings of |w / d| before the half step
        return 0.5 * d32 + 127 * (FP16_HALF_ULP * d32 + FP16_TINY) + _fp32(w, 2) + _fp32(d)
    # q4_1: q = trunc((w - m) * (1 / d) + 0.5), d = (max - min) / 15: w - m, 1 / d and the product
    # round (|w| + |m|), the + 0.5 rounds a value up to 16 steps; d * q + m rounds twice
    m16 = per_k(np.asarray(a["m"], np.float64), 32)
    m32 = np.abs(m16) * (1 + 2 * FP16_HALF_ULP) + FP16_TINY
    return (0.5 * d32 + 15 * (FP16_HALF_ULP * d32 + FP16_TINY) + FP16_HALF_ULP * m32 + FP16_TINY
            + _fp32(np.abs(w) + m32, 3) + _fp32(16 * d32) + _fp32(15 * d16) + _fp32(d))  # fmt: skip


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dist", ["normal", "student_t3"])
def test_round_trip_error_is_within_the_formats_bound(name, dist, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    shape = (320, 136)  # partial 128-blocks on both axes
    w = rng.standard_normal(shape) if dist == "normal" else rng.standard_t(3, shape)
    w = (w * 0.05).astype(np.float32)
    qw = quantized(name, w)
    d = deq(qw)
    err = np.abs(d - w)
    # a bound per output channel (int8's scales, [N]) holds for each element of its column
    bound = np.broadcast_to(_bound(name, qw, w, d), shape)
    worst = tuple(int(i) for i in np.unravel_index(np.argmax(err - bound), shape))
    assert np.all(err <= bound), (
        f"seed {fresh_seed}: {name} error {err[worst]:.6g} > bound {bound[worst]:.6g} "
        f"(by {err[worst] - bound[worst]:.3g}) at {worst}"
    )


def test_gguf_quantizers_follow_llama_cpps_rules():
    x = np.zeros((32, 1), np.float32)
    x[:4, 0] = [127.0, 0.5, -0.5, 1.5]  # d = 1: roundf takes ties away from zero
    np.testing.assert_array_equal(np.asarray(quantized("q8_0", x).arrays["values"])[:4, 0],
                                  [127, 1, -1, 2])  # fmt: skip
    x = np.linspace(-1, 2, 32, dtype=np.float32)[:, None]  # q4_1: d = 3/15, m = -1
    qw = quantized("q4_1", x)
    q = np.asarray(unpack_nibbles(qw.arrays["values"], 0))[:, 0]
    np.testing.assert_array_equal(q, np.minimum(15, np.trunc((x[:, 0] + 1) * (15 / 3) + 0.5)))
    assert float(qw.arrays["m"][0, 0]) == -1.0 and float(qw.arrays["d"][0, 0]) == np.float16(0.2)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_gguf_tensor_becomes_the_format_bit_for_bit(type_name, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    layout = ggml.GGML_TYPES[type_name]
    shape = (64, 2, 3)  # [K, *out]; GGUF stores it [6, 64]
    raw = rng.integers(0, 256, 6 * 2 * layout.type_size, dtype=np.uint8)
    rec = raw.view(layout.record)
    for f in ("d", "m")[: 1 + (type_name == "Q4_1")]:
        rec[f] = rng.standard_normal(rec.shape).astype(np.float16)
    qw = from_gguf_components(ggml.unpack(raw, type_name, (6, 64)), type_name, shape)
    assert qw.format.name == type_name.lower()
    want = ggml.dequantize(raw, type_name, (6, 64)).T.reshape(shape)
    np.testing.assert_array_equal(deq(qw), want, err_msg=f"seed {fresh_seed}")


# -- products ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("in_dims", [1, 2])
def test_matmul_equals_the_product_with_the_dequantized_weight(name, in_dims, fresh_seed):
    """Weight-only: x @ dequantize(qw). W8A8: the dequantized fp8 activations times it."""
    rng = np.random.default_rng(fresh_seed)
    in_shape = (256,) if in_dims == 1 else (4, 64)
    w = rng.standard_normal((*in_shape, 3, 40)).astype(np.float32)
    x = rng.standard_normal((2, 5, *in_shape)).astype(np.float32)
    qw = quantized(name, w, in_dims)
    got = np.asarray(jax.jit(qw.format.matmul)(jnp.asarray(x), qw))
    wd = deq(qw).reshape(256, -1)
    x2 = x.reshape(-1, 256)
    if name in W8A8:
        xq, sx = jax.jit(quantize_activations, static_argnums=1)(jnp.asarray(x2), W8A8[name])
        sx = np.repeat(np.asarray(sx), 128 if W8A8[name] else 256, axis=1)[:, :256]
        x2 = np.asarray(xq).astype(np.float64) * sx
        assert np.abs(x2 - x.reshape(-1, 256)).max() > 0  # the activations were quantized
    want = (x2 @ wd).reshape(got.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                               err_msg=f"seed {fresh_seed}")  # fmt: skip


def test_fp8_block_activation_scales_are_per_token_per_128_channels(fresh_seed):
    x = np.random.default_rng(fresh_seed).standard_normal((3, 300)).astype(np.float32)
    x[1, 130] = 100.0
    xq, s = quantize_activations(jnp.asarray(x), 128)
    assert s.shape == (3, 3) and xq.dtype == E4M3
    np.testing.assert_allclose(np.asarray(s)[1, 1], 100.0 / 448, rtol=1e-6)
    amax = np.abs(np.pad(x, ((0, 0), (0, 84))).reshape(3, 3, 128)).max(-1)
    np.testing.assert_allclose(np.asarray(s), amax / 448, rtol=1e-6, err_msg=f"seed {fresh_seed}")


def test_fp8_formats_multiply_fp8_operands_in_one_dot_general():
    """The W8A8 product is an e4m3 x e4m3 dot accumulated in fp32 (cuBLASLt's FP8 GEMM on
    Hopper), not a dequantized one."""
    w = np.random.default_rng(0).standard_normal((256, 48)).astype(np.float32)
    for name in W8A8:
        qw = quantized(name, w)
        jaxpr = jax.make_jaxpr(qw.format.matmul)(jnp.ones((3, 256)), qw).jaxpr
        dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
        assert len(dots) == 1, name
        assert [v.aval.dtype for v in dots[0].invars] == [E4M3, E4M3], name
        assert dots[0].outvars[0].aval.dtype == jnp.float32, name


def test_int8_xla_product_is_a_dot_of_the_stored_values_scaled_after():
    """int8's XLA product ("auto", on a GPU too) reads the int8 values
    themselves, scales applied to the dot's output: XLA's GEMM then converts the int8 weight as
    it loads it instead of reading a dequantized copy (h100/quant_matmul_native.json)."""
    w = np.random.default_rng(0).standard_normal((256, 48)).astype(np.float32)
    qw = quantized("int8", w)
    jaxpr = jax.make_jaxpr(qw.format.matmul)(jnp.ones((3, 256), jnp.bfloat16), qw).jaxpr
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1
    weight = dots[0].invars[1]
    made = [e for e in jaxpr.eqns if weight in e.outvars]
    assert made and made[0].primitive.name == "convert_element_type", made
    assert made[0].invars[0].aval.dtype == jnp.int8, made[0]
    assert dots[0].outvars[0].aval.dtype == jnp.float32


# -- specs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
def test_part_specs_describe_exactly_what_quantize_returns(name):
    """Random init, loading targets and orbax restore use the specs; quantize must fill them."""
    cfg = preset("tiny", weight_format=name)
    plain = param_specs(cfg.replace(weight_format=None))["layers"][0]
    for key, spec in param_specs(cfg)["layers"][0].items():
        if not isinstance(spec, QuantizedWeight):
            continue
        w = jax.ShapeDtypeStruct(plain[key].shape, plain[key].dtype)
        got = jax.eval_shape(partial_quantize(spec.format, spec.in_dims), w)
        want = {k: (s.shape, jnp.dtype(s.dtype)) for k, s in spec.arrays.items()}
        assert {k: (a.shape, a.dtype) for k, a in got.items()} == want, (name, key)
        for s in spec.arrays.values():
            assert len(s.axes) == len(s.shape), (name, key)


def partial_quantize(fmt, in_dims):
    return functools.partial(fmt.quantize, in_dims=in_dims)


# -- fused weights -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
def test_a_block_never_mixes_q_k_and_v(name, fresh_seed):
    """w_qkv-like [E, Hkv, G + 2, D]: changing one logical output (kv head 1's value head, made
    the weight's largest) leaves every other output's stored arrays and dequantized values
    unchanged: no array holds a scale shared by two logical outputs."""
    rng = np.random.default_rng(fresh_seed)
    w = rng.standard_normal((256, 2, 3, 128)).astype(np.float32)
    w2 = w.copy()
    w2[:, 1, 2] = rng.standard_normal((256, 128)) * 30
    qw, qw2 = quantized(name, w), quantized(name, w2)
    for part, a in qw.arrays.items():
        a, b = np.asarray(a).astype(np.float32), np.asarray(qw2.arrays[part]).astype(np.float32)
        # per logical output: [..., Hkv, G + 2, per-D] or, one per output, [Hkv, G + 2]
        if a.shape == (2, 3):
            a, b = a[..., None], b[..., None]
        if name.startswith("fp8") and (part == "values" or name == "fp8_block"):
            # K-major: the output axes lead ([Hkv, G + 2, D, E]; fp8_block's scales too)
            a, b = np.moveaxis(a, (0, 1), (-3, -2)), np.moveaxis(b, (0, 1), (-3, -2))
        assert a.shape[-3:-1] == (2, 3), (name, part, a.shape)
        same = np.ones(a.shape[-3:-1], bool)
        same[1, 2] = False
        np.testing.assert_array_equal(a[..., same, :], b[..., same, :],
                                      err_msg=f"seed {fresh_seed}: {name}.{part}")  # fmt: skip
    d, d2 = deq(qw), deq(qw2)
    assert not np.array_equal(d[:, 1, 2], d2[:, 1, 2])
    d[:, 1, 2] = d2[:, 1, 2] = 0
    np.testing.assert_array_equal(d, d2, err_msg=f"seed {fresh_seed}")


# -- a model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8_channel", "nvfp4"])  # W8A8; weight-only, two-level
def test_formatted_tiny_model_generates_the_dequantized_models_tokens(name):
    seed = 7
    plain_cfg = preset("tiny", num_layers=1)  # one layer: compile time is most of this test
    cfg = plain_cfg.replace(weight_format=name)
    plain = init_params(plain_cfg, jax.random.key(seed))
    params = quantize_params(cfg, plain)
    assert isinstance(params["layers"][0]["w_qkv"], QuantizedWeight)
    # the model whose weights are dequantize(quantize(w))
    one = lambda w: w.format.dequantize(w) if isinstance(w, QuantizedWeight) else w  # noqa: E731
    ref = jax.jit(lambda p: jax.tree.map(one, p, is_leaf=lambda x: isinstance(x, QuantizedWeight)))(
        params
    )
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 11)]
    got = greedy_generate(params, cfg, prompts, 8)
    want = greedy_generate(ref, plain_cfg, prompts, 8)
    if name in W8A8:  # activations quantized too: the first tokens agree, most of the rest
        assert [g[:2] for g in got] == [w[:2] for w in want], f"seed {seed}"
        agree = np.mean(np.array(got) == np.array(want))
        assert agree >= 0.75, f"seed {seed}: {agree:.0%} of tokens agree"
    else:
        assert got == want, f"seed {seed}"
