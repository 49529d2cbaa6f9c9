"""The weight-only matmul kernel (Pallas Triton; 4-bit and 8-bit formats) against the fp32
reference.

On CPU the kernel runs under Pallas's interpreter (its semantics: the K steps and split-K, the
even/odd split of x for 4 bits, each format's arithmetic decode, rows masked into a 16-row tile)
on tiny shapes with fresh random codes and scales; lowering for CUDA checks that Triton takes
every format's decode and the inline-PTX decodes are in place (no GPU needed); the `-m gpu`
tests run it compiled at Llama-3-8B and SmolLM2 shapes, the only check of the PTX decodes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import PARTS, dequantize, w4_matmul, w4_matmul_ref
from pallas_kernels.matmul.reference import BITS
from pallas_kernels.matmul.w4_decode import DECODERS
from pallas_kernels.matmul.w4_triton import PTX_AFFINE, PTX_E2M1, PTX_MINUS, w4_matmul_triton

TOL = 1e-2  # relative Frobenius error: the kernel rounds each decoded weight to bf16 once


def make_weight(rng: np.random.Generator, fmt: str, k: int, n: int) -> dict:
    """Random codes and per-group parts of a [k, n] weight in `fmt` (values included)."""
    dec = DECODERS[fmt]
    g = (k // (dec.group or k), n)
    if dec.bits == 8:
        arrays = {"values": jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)}
    else:
        arrays = {"values": jnp.asarray(rng.integers(0, 256, (k // 2, n)), jnp.uint8)}
    if fmt == "int8":
        arrays["scales"] = jnp.asarray(rng.uniform(1e-4, 1e-3, n), jnp.float32)  # per output
    elif fmt == "q8_0":
        arrays["d"] = jnp.asarray(rng.uniform(1e-4, 1e-3, g), jnp.float16)
    elif fmt == "int4_g128_sym":
        arrays["scales"] = jnp.asarray(rng.uniform(0.005, 0.05, g), jnp.float32)
    elif fmt == "nvfp4":
        arrays["block_scales"] = jnp.asarray(rng.uniform(0.05, 400, g), jnp.float8_e4m3fn)
        arrays["tensor_scale"] = jnp.asarray(rng.uniform(1e-4, 1e-3, n), jnp.float32)  # per output
    elif fmt == "mxfp4":
        arrays["scales"] = jnp.asarray(rng.integers(118, 128, g), jnp.uint8)
    else:
        arrays["d"] = jnp.asarray(rng.uniform(0.002, 0.02, g), jnp.float16)
        arrays["m"] = jnp.asarray(rng.uniform(-0.15, 0.0, g), jnp.float16)
    return arrays


@pytest.mark.parametrize("fmt", list(PARTS))
def test_decoders_give_every_code_the_reference_value(fresh_seed, fmt):
    """The kernel's decode (the format's `W4Decode`: value, group rows, step and output scales)
    of every code (0..15, or -128..127) under random group parts is exactly the reference's
    dequantized weight."""
    rng = np.random.default_rng(fresh_seed)
    dec = DECODERS[fmt]
    k, n = (128, 64) if dec.bits == 4 else (128, 256)  # every code appears (in both nibbles)
    w = make_weight(rng, fmt, k, n)
    ref = np.asarray(dequantize(**w, fmt=fmt))
    v = w["values"].astype(jnp.int32)
    codes = v if dec.bits == 8 else jnp.stack([v & 0xF, v >> 4], axis=1).reshape(k, n)
    rows = {name: jnp.repeat(dec.to_f32(name, w[name]), dec.group, axis=0)
            for name, _ in dec.grouped}  # fmt: skip
    got = dec.value(codes, {n_: r for n_, r in rows.items() if n_ != dec.step_scale})
    if dec.step_scale is not None:
        got = got * rows[dec.step_scale]
    if dec.output_scale is not None:
        got = got * w[dec.output_scale]
    assert set(np.unique(np.asarray(codes))) == (set(range(16)) if dec.bits == 4
                                                 else set(range(-128, 128)))  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6, atol=0,
                               err_msg=f"{fmt}: seed {fresh_seed}")  # fmt: skip


def check_case(seed: int, fmt: str, m: int, k: int, n: int, **kw) -> None:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = make_weight(rng, fmt, k, n)
    out = w4_matmul_triton(x, **w, fmt=fmt, **kw)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    ref = np.asarray(w4_matmul_ref(x, **w, fmt=fmt))
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), f"non-finite output (seed {seed})"
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL, f"{fmt} m={m} k={k} n={n} {kw}: rel err {err:.2e} (seed {seed})"


# Tokens 1, 5 (rows masked in a
# 16-row tile), 16 and 33 (a 48-row tile); one split or several (partials summed after); K and N
# in 128s and in 64s (64-input steps, 64-output blocks: SmolLM2's sizes).
@pytest.mark.parametrize("fmt", list(PARTS))
@pytest.mark.parametrize(
    "m,k,n,splits",
    [(1, 256, 128, 1), (5, 512, 256, 2), (16, 384, 128, 3), (33, 192, 320, None)],
)
def test_triton_kernel_matches_reference_in_interpreter(fresh_seed, fmt, m, k, n, splits):
    if fmt == "int4_g128_sym" and k % 128:
        k += 64  # its scale's group spans 128 inputs
    check_case(fresh_seed, fmt, m, k, n, interpret=True, num_splits=splits)


def test_triton_kernel_refuses_a_split_of_uneven_steps():
    rng = np.random.default_rng(0)
    w = make_weight(rng, "q4_1", 384, 128)
    x = jnp.zeros((2, 384), jnp.bfloat16)
    with pytest.raises(ValueError, match="num_splits must divide K's 3 steps of 128"):
        w4_matmul_triton(x, **w, fmt="q4_1", num_splits=2, interpret=True)
    with pytest.raises(ValueError, match="x must be bf16"):
        w4_matmul_triton(x.astype(jnp.float32), **w, fmt="q4_1", interpret=True)


def test_triton_default_splits_fill_the_sms():
    """About PROGRAMS_PER_SM programs an SM, at least 2 steps a split, a power of two dividing
    the steps; the 8B shapes' splits are the probe's best. A weight too small for any such split
    to fill the SMs (SmolLM2's) takes the fewest splits of any size that do, else one step each."""
    from pallas_kernels.matmul.w4_triton import PROGRAMS_PER_SM, default_num_splits

    assert default_num_splits(32, 112, 132) == 8 and default_num_splits(112, 32, 132) == 16
    pow2 = (1, 2, 4, 8, 16, 32, 64)
    for steps, blocks in [(112, 32), (32, 112), (16, 64), (64, 40)]:
        s = default_num_splits(steps, blocks, 132)
        assert steps % s == 0 and steps // s >= 2 and s in pow2 and blocks * s >= 132, (steps, s)
        others = [t for t in pow2 if steps % t == 0 and steps // t >= 2]
        assert all(abs(blocks * s - PROGRAMS_PER_SM * 132) <= abs(blocks * t - PROGRAMS_PER_SM * 132)
                   for t in others), (steps, blocks, s)  # fmt: skip
    # SmolLM2 (576 inputs in 9 steps of 64, 1536 in 12 of 128): q/k/v 15 blocks, o 9,
    # gate/up 24, down 9
    assert default_num_splits(9, 15, 132) == 9 and default_num_splits(9, 9, 132) == 9
    assert default_num_splits(9, 24, 132) == 9 and default_num_splits(12, 9, 132) == 12
    assert default_num_splits(9, 48, 132) == 3  # the fewest that fill
    assert default_num_splits(28, 7, 132) == 28 and default_num_splits(96, 3, 132) == 48
    assert default_num_splits(1, 8, 132) == 1


def test_triton_splits_are_capped_by_their_partials_bytes_but_fill_every_sm():
    """More rows make split-K's fp32 partials (S x M x N) grow: the cap keeps them within a
    quarter of the weight's bytes, unless that leaves an SM without a program."""
    from pallas_kernels.matmul.w4_triton import default_num_splits, max_splits_for

    assert [max_splits_for(m, 4096, 4) for m in (1, 16, 32, 64)] == [128, 8, 4, 2]
    assert max_splits_for(64, 4096, 8) == 4 and max_splits_for(4096, 64, 4) == 1
    # 14336 x 4096 (112 blocks of 128 outputs, 32 steps): 8 splits uncapped, 2 at m = 64
    assert default_num_splits(32, 112, 132, max_splits_for(1, 4096, 4)) == 8
    assert default_num_splits(32, 112, 132, max_splits_for(64, 4096, 4)) == 2
    # 4096 x 14336 (32 blocks): a cap of 7 -> 4 splits, 128 programs < 132 SMs -> 8
    assert default_num_splits(112, 32, 132, max_splits_for(64, 14336, 4)) == 8
    # no split under the cap nor any power of two fills the SMs: one step a split
    assert default_num_splits(4, 3, 132, 1) == default_num_splits(4, 3, 132) == 4


@pytest.mark.parametrize("fmt", list(PARTS))
@pytest.mark.parametrize("m,k,n", [(1, 4096, 512), (64, 576, 960), (128, 1024, 256)])
def test_triton_kernel_lowers_for_cuda(fmt, m, k, n):
    """Pallas's Triton lowering accepts every format's decode, the pair split of x and the
    group rows' broadcast, at an 8B-like size, at SmolLM2's (in 64s) and at 128 rows."""
    if fmt == "int4_g128_sym" and k % 128:
        k = 640
    sds = jax.ShapeDtypeStruct
    dec = DECODERS[fmt]
    parts = {name: sds((n,) if name == dec.output_scale else (k // dec.group, n), dtype)
             for name, dtype in PARTS[fmt].items()}  # fmt: skip
    values = sds((k // 2, n), jnp.uint8) if BITS[fmt] == 4 else sds((k, n), jnp.int8)
    call = lambda x, v, p: w4_matmul_triton(x, v, fmt=fmt, interpret=False, **p)  # noqa: E731
    text = jax.jit(call).trace(sds((m, k), jnp.bfloat16), values, parts).lower(
        lowering_platforms=("cuda",)).as_text()  # fmt: skip
    assert "triton" in text.lower()
    # int4_g128_sym, nvfp4, mxfp4 and q4_1 decode by inline PTX on a GPU (no interpreter for it: the
    # CPU tests run `W4Decode.value`; the -m gpu cases compare the PTX decode with the reference)
    ptx = fmt in PTX_MINUS or fmt in PTX_E2M1 or fmt in PTX_AFFINE
    assert ("prmt.b32" in text and "fma.rn." in text) == ptx, fmt


@pytest.mark.parametrize("fmt", list(PARTS))
def test_reference_reads_jaxinfer_layouts(fresh_seed, fmt):
    """The reference dequantizes a weight quantized by jaxinfer's format to jaxinfer's values."""
    from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight

    rng = np.random.default_rng(fresh_seed)
    w = jnp.asarray(rng.standard_normal((256, 64)) * 0.05, jnp.float32)
    wf = WEIGHT_FORMATS[fmt]
    arrays = wf.quantize(w, 1)
    ours = dequantize(fmt=fmt, **arrays)
    theirs = wf.dequantize(QuantizedWeight(arrays, wf, 1))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6, atol=1e-7,
                               err_msg=f"seed {fresh_seed}")  # fmt: skip


def test_arguments_are_validated_by_name():
    rng = np.random.default_rng(0)
    w = make_weight(rng, "int4_g128_sym", 256, 128)
    x = jnp.zeros((4, 256), jnp.bfloat16)
    bad = [
        (dict(x=jnp.zeros((4, 256), jnp.float32)), "x must be bf16"),
        (dict(x=jnp.zeros((200, 256), jnp.bfloat16)), "M (tokens) must be in 1..128"),
        (
            dict(
                x=jnp.zeros((4, 192), jnp.bfloat16), values=w["values"][:96], scales=w["scales"][:1]
            ),
            "K must be a multiple of 128 for fmt 'int4_g128_sym'",
        ),
        (dict(x=jnp.zeros((4, 160), jnp.bfloat16)), "K must be a multiple of 64 and at least"),
        (dict(values=w["values"].astype(jnp.int8)), "values must be uint8 [K/2, N]"),
        (dict(values=w["values"][:64]), "values: 64 rows hold 128 inputs"),
        (dict(scales=w["scales"][:, :32]), "scales must be float32 [2, 128]"),
        (dict(scales=w["scales"].astype(jnp.bfloat16)), "scales must be float32"),
        (dict(fmt="int3"), "fmt must be one of"),
        (dict(block_scales=w["scales"]), "takes parts ['scales']"),
    ]
    for change, message in bad:
        args = dict(x=x, fmt="int4_g128_sym", **w) | change
        with pytest.raises(ValueError, match=re.escape(message)):
            w4_matmul(**args, backend="triton", interpret=True)
    nv = make_weight(rng, "nvfp4", 256, 128) | {"tensor_scale": jnp.ones(32, jnp.float32)}
    with pytest.raises(ValueError, match=re.escape("tensor_scale must be float32 [] or [128]")):
        w4_matmul(x, **nv, fmt="nvfp4", backend="triton", interpret=True)
    i8 = make_weight(rng, "int8", 256, 128)
    with pytest.raises(ValueError, match=re.escape("values must be int8 [K, N] for fmt 'int8'")):
        w4_matmul(x, **(i8 | {"values": w["values"]}), fmt="int8", backend="triton", interpret=True)
    with pytest.raises(ValueError, match=re.escape("scales must be float32 [] or [128]")):
        w4_matmul(x, **(i8 | {"scales": w["scales"]}), fmt="int8", backend="triton",
                  interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match="num_splits must divide"):
        w4_matmul(x, **w, fmt="int4_g128_sym", backend="triton", interpret=True, num_splits=3)
    with pytest.raises(ValueError, match="apply to the kernel only"):
        w4_matmul(x, **w, fmt="int4_g128_sym", backend="xla", num_stages=2)


def test_dispatcher_picks_xla_on_cpu_and_matches_reference(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.bfloat16)
    w = make_weight(rng, "q4_1", 128, 128)
    out = w4_matmul(x, **w, fmt="q4_1")
    ref = w4_matmul_ref(x, **w, fmt="q4_1").astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref), err_msg=f"seed {fresh_seed}")


def test_benchmark_smoke_run_writes_rows_with_provenance(tmp_path):
    """experiments/bench_quant_matmul.py --smoke: every impl timed, close to the reference."""
    import json

    import experiment_scripts

    bench = experiment_scripts.load("bench_quant_matmul")
    out = tmp_path / "quant_matmul.json"
    bench.main(["--smoke", "--formats", "int4_g128_sym", "--out", str(out)])
    result = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "timing_method"):
        assert key in result, key
    assert {r["impl"] for r in result["rows"]} == set(bench.IMPLS)
    for r in result["rows"]:
        assert "error" not in r and r["time_us"] > 0 and r["weight_TBps"] > 0, r
        assert r["rel_err"] < TOL, r


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(PARTS))
@pytest.mark.parametrize("n,k", [(14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_compiled_kernel_on_gpu(fresh_seed, fmt, n, k, m):
    """The same check, compiled, at Llama-3-8B's FFN shapes (run on the device: `pytest -m gpu`)."""
    check_case(fresh_seed, fmt, m, k, n, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 64])
def test_compiled_kernel_at_smollm2_sizes_on_gpu(fresh_seed, fmt, n, k, m):
    """SmolLM2's q/k/v and down products from its GGUF formats: 64-input steps, 64-output blocks."""
    check_case(fresh_seed, fmt, m, k, n, interpret=False)


def test_a_forced_kernel_leaves_steps_above_its_rows_to_xla(fresh_seed):
    """A step of more tokens than the kernel takes (a prefill: `bench_e2e.py --weight-backend`
    forces every product of the run) gets the format's XLA product, bit for bit, not an error."""
    import dataclasses

    from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight
    from pallas_kernels.matmul.w4_triton import MAX_M

    rng = np.random.default_rng(fresh_seed)
    x = jnp.asarray(rng.standard_normal((MAX_M + 1, 128)), jnp.bfloat16)
    wf = WEIGHT_FORMATS["q4_1"]
    qw = QuantizedWeight(wf.quantize(jnp.asarray(rng.standard_normal((128, 64)), jnp.float32), 1),
                         wf, 1)  # fmt: skip
    got, want = (dataclasses.replace(wf, backend=b).matmul(x, qw) for b in ("triton", "xla"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {fresh_seed}")


@pytest.mark.parametrize("fmt", list(PARTS))
def test_formats_products_run_on_the_kernel_as_their_xla_product(fresh_seed, fmt):
    """jaxinfer's 4-bit formats wired to the kernel (`intq.w4_kernel_product`): a weight with two
    input and two output axes (flattened as the format lays it out) gives the format's own XLA
    product; "auto" keeps XLA's on a CPU; the kernel's limits are refused by name. The two output
    parts differ 10x in size, so nvfp4's tensor scales (one per logical output, applied per
    column after the kernel) differ too; a weight with one output axis has a single one."""
    import dataclasses

    from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight

    rng = np.random.default_rng(fresh_seed)
    x = jnp.asarray(rng.standard_normal((3, 5, 2, 128)), jnp.bfloat16)
    wf = WEIGHT_FORMATS[fmt]
    for shape in [(2, 128, 2, 64), (2, 128, 128)]:
        w = rng.standard_normal(shape) * 0.05
        w[..., 1, :] *= 10.0
        qw = QuantizedWeight(wf.quantize(jnp.asarray(w, jnp.float32), 2), wf, 2)

        def product(backend, qw=qw):
            f = dataclasses.replace(wf, backend=backend)
            return f.matmul(x, dataclasses.replace(qw, format=f))

        want = product("xla")
        got = product("triton")
        assert got.shape == want.shape == (3, 5, *shape[2:])
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=2e-2, atol=2e-2 * np.max(np.abs(np.asarray(want, np.float32))),
                                   err_msg=f"{shape}, seed {fresh_seed}")  # fmt: skip
        np.testing.assert_array_equal(np.asarray(product("auto")), np.asarray(want))
    with pytest.raises(ValueError, match="triton backend takes"):
        f = dataclasses.replace(wf, backend="triton")
        f.matmul(x.astype(jnp.float32), dataclasses.replace(qw, format=f))
    with pytest.raises(ValueError, match="backend must be one of"):
        f = dataclasses.replace(wf, backend="cuda")
        f.matmul(x, dataclasses.replace(qw, format=f))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "int8", "mxfp4"])
def test_products_in_64s_run_on_the_kernel_as_their_xla_product(fresh_seed, fmt):
    """A [192, 320] weight (K and N multiples of 64, not of 128: SmolLM2's kind) through
    jaxinfer's format on the kernel gives its XLA product; int4_g128_sym, whose groups span a
    whole K step, is refused there by name."""
    import dataclasses

    from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight

    rng = np.random.default_rng(fresh_seed)
    x = jnp.asarray(rng.standard_normal((4, 192)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((192, 320)) * 0.05, jnp.float32)

    def product(name, backend):
        f = dataclasses.replace(WEIGHT_FORMATS[name], backend=backend)
        return f.matmul(x, QuantizedWeight(f.quantize(w, 1), f, 1))

    want = np.asarray(product(fmt, "xla"), np.float32)
    got = np.asarray(product(fmt, "triton"), np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max(),
                               err_msg=f"{fmt}, seed {fresh_seed}")  # fmt: skip
    with pytest.raises(ValueError, match="triton backend takes"):
        product("int4_g128_sym", "triton")
