"""Every weight format on the GPU against the CPU and against plain bf16 (GPU only: `python -m
pytest -m gpu tests/test_gpu_quant.py`, ~1-2 min on an H200).

The CPU suite checks each format's math on XLA:CPU; what it cannot see is XLA:GPU's lowering of
the same graphs: its conversions to e4m3, its reductions and divisions, and the fp8 x fp8 dots of
the W8A8 formats, which on Hopper become fp8 GEMMs (cuBLASLt or Triton) accumulated in the tensor
cores. So, for every format jaxinfer defines (`WEIGHT_FORMATS` less any a test registers), on
weights shaped like a fused `w_qkv` (partial 128-blocks in both K and N) and a two-input-axis
`wo`:

- quantize on the GPU and on the CPU backend: the stored codes and scales agree bit for bit but
  for at most 0.1% of them, each one code step (ulp) off (scales are amax / qmax corrected to the
  true float32 quotient on both backends, `fp8.safe_scale`, though XLA:GPU's own division may be
  2 ulp off; a code can differ only from a value within that of a rounding boundary), and the
  dequantized weights agree to fp32 rounding where the codes do;
- `format.matmul(x, qw)` on the GPU against dequantize-then-dot on the CPU, summed in fp64: the
  W8A8 reference quantizes the activations as the format does (per token, per 128 channels, or
  by the static input scale), so the only differences left are the GEMM's accumulation (Hopper's
  fp8 tensor cores may accumulate in reduced precision: the 2% bound) and bf16 rounding;
- the W8A8 products' optimized HLO holds a dot (or GEMM call) on e4m3 operands: XLA did not
  upcast them to a wider dot.

Then the engine serves the shipped `tiny` model (bf16) with engine.quant.weights=<format>
(`fp8_static` calibrated on random tokens) against the plain bf16 engine: no request fails, no
compile after warm-up, the layers' weights are stored in the format, the engine's greedy tokens
are its own model's (the dense forward of the quantized params, teacher-forced on them, picks
the same token wherever its top-2 gap is not a near tie), and the quantized model's next-token
argmax agrees with the plain model's on the plain run's sequences at >= MIN_AGREEMENT of the
positions (8-bit formats tighter than 4-bit ones).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spine_parts import jaxinfer_formats

from jaxinfer.engine.llm import LLM
from jaxinfer.engine.request import SamplingParams
from jaxinfer.models.dense import forward
from jaxinfer.quant import WEIGHT_FORMATS, QuantizedWeight
from jaxinfer.quant.fp4 import Fp4
from jaxinfer.quant.fp8 import BLOCK, Fp8Block, Fp8Scaled, Fp8Static, expand, quantize_activations
from jaxinfer.quant.fp8 import to_e4m3 as fp8_cast
from jaxinfer.quant.intq import unpack_nibbles

pytestmark = pytest.mark.gpu

FORMATS = jaxinfer_formats()  # not a test's format, registered or leaked
W8A8 = tuple(f for f in FORMATS if isinstance(WEIGHT_FORMATS[f], Fp8Scaled | Fp8Block | Fp8Static))
# (logical shape [*in, *out], in_dims): a fused w_qkv (K = 320: two and a half 128-blocks; N = 64
# per head) and a wo with two input axes (K = 4 x 64); K a multiple of 32 (q8_0, q4_1 blocks)
SHAPES = [((320, 2, 3, 64), 1), ((4, 64, 384), 2)]
MAX_CODE_MISMATCH = 1e-3  # fraction of stored codes allowed one step off between backends
# max |y - ref| / max |ref| of the product: (x dtype, precision) -> bound
MATMUL_TOL = {"weight_only": {("float32", "highest"): 1e-5, ("bfloat16", "default"): 1e-2},
              "w8a8": {("float32", "highest"): 2e-2, ("bfloat16", "default"): 2e-2}}  # fmt: skip


@pytest.fixture(autouse=True)
def _needs_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


# ---------------------------------------------------------------------------------------------
# Helpers (device arguments, so that a CPU can run them against itself)


def random_weight(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Gaussian weights with a few large outliers and one all-zero output column (an all-zero
    block: the formats' `scale = 1` path)."""
    w = rng.standard_normal(shape).astype(np.float32) * 0.02
    flat = w.reshape(-1)
    flat[rng.choice(flat.size, 8, replace=False)] *= 40.0
    w[..., 0] = 0.0
    return w


def quantize_on(device, fmt_name: str, w: np.ndarray, in_dims: int):
    """(stored arrays as numpy, dequantized float32 weight) computed on `device`."""
    fmt = WEIGHT_FORMATS[fmt_name]
    wd = jax.device_put(w, device)
    arrays = jax.jit(functools.partial(fmt.quantize, in_dims=in_dims))(wd)
    deq = jax.jit(fmt.dequantize)(QuantizedWeight(arrays, fmt, in_dims))
    return jax.device_get(arrays), np.asarray(deq, np.float32)


def code_ordinals(fmt_name: str, key: str, a: np.ndarray, in_dims: int) -> np.ndarray:
    """The stored codes of array `key` as integers one apart per representable step: floats
    (fp32, fp16, e4m3) by their sign-magnitude bit patterns, packed 4-bit values unpacked (e2m1
    nibbles sign-magnitude), other integers as they are."""

    def sign_magnitude(bits: np.ndarray, sign_bit: int) -> np.ndarray:
        bits = bits.astype(np.int64)
        mag = bits & ((1 << sign_bit) - 1)
        return np.where(bits >> sign_bit & 1, -mag, mag)

    a = np.asarray(a)
    if a.dtype.kind == "f" or a.dtype == jnp.float8_e4m3fn:
        uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
        return sign_magnitude(a.view(uint), 8 * a.dtype.itemsize - 1)
    if key == "values" and a.dtype == np.uint8:  # two 4-bit codes a byte
        q = np.asarray(unpack_nibbles(jnp.asarray(a), in_dims - 1))
        return sign_magnitude(q, 3) if isinstance(WEIGHT_FORMATS[fmt_name], Fp4) else q
    return a.astype(np.int64)


def compare_quantized(fmt_name: str, in_dims: int, got, ref) -> dict[str, float]:
    """Assert that stored arrays `got` match `ref` (see the module docstring); returns the
    fraction of codes that differ, per array."""
    (got_arrays, got_deq), (ref_arrays, ref_deq) = got, ref
    assert set(got_arrays) == set(ref_arrays)
    mismatch = {}
    for key in ref_arrays:
        g, r = got_arrays[key], ref_arrays[key]
        assert g.shape == r.shape and g.dtype == r.dtype, (fmt_name, key, g.shape, r.shape)
        d = np.abs(code_ordinals(fmt_name, key, g, in_dims) - code_ordinals(fmt_name, key, r,
                                                                            in_dims))  # fmt: skip
        mismatch[key] = float(np.mean(d != 0)) if d.size else 0.0
        assert d.max(initial=0) <= 1, f"{fmt_name}.{key}: codes {d.max()} steps apart"
        assert mismatch[key] <= MAX_CODE_MISMATCH, f"{fmt_name}.{key}: {mismatch[key]:.2%} differ"
    # dequantized: fp32 rounding (a product, or a contracted d * q + m) where the codes agree
    scale = float(np.max(np.abs(ref_deq))) or 1.0
    off = np.abs(got_deq - ref_deq) > 2**-21 * scale + 2**-22 * np.abs(ref_deq)
    assert np.mean(off) <= MAX_CODE_MISMATCH, f"{fmt_name}: {np.mean(off):.2%} dequantized off"
    return mismatch


def reference_matmul(fmt_name: str, x: np.ndarray, arrays: dict, w_deq: np.ndarray,
                     in_dims: int, cpu) -> np.ndarray:  # fmt: skip
    """x @ w in fp64 from the CPU's dequantized weight `w_deq`, the activations first quantized
    as the W8A8 formats do (on the CPU backend)."""
    fmt = WEIGHT_FORMATS[fmt_name]
    k = math.prod(w_deq.shape[:in_dims])
    lead, out = x.shape[: x.ndim - in_dims], w_deq.shape[in_dims:]
    x2 = jax.device_put(x.reshape(-1, k), cpu)
    if isinstance(fmt, Fp8Static):
        s = jax.device_put(arrays["input_scale"], cpu)
        xd = fp8_cast(x2.astype(jnp.float32) / s).astype(jnp.float32) * s
    elif isinstance(fmt, Fp8Scaled | Fp8Block):
        block = BLOCK if isinstance(fmt, Fp8Block) else None
        xq, sx = quantize_activations(x2, block)
        sx = sx if block is None else expand(sx, -1, block, k)
        xd = xq.astype(jnp.float32) * sx
    else:
        xd = x2.astype(jnp.float32)
    y = np.asarray(xd, np.float64) @ w_deq.reshape(k, -1).astype(np.float64)
    return y.reshape(*lead, *out)


def matmul_on(device, fmt_name: str, x: np.ndarray, arrays: dict, in_dims: int,
              precision: str) -> np.ndarray:  # fmt: skip
    fmt = WEIGHT_FORMATS[fmt_name]
    qw = jax.device_put(QuantizedWeight(arrays, fmt, in_dims), device)
    with jax.default_matmul_precision(precision):
        y = jax.jit(fmt.matmul)(jax.device_put(x, device), qw)
    return np.asarray(y.astype(jnp.float32), np.float64)


def gemm_operand_dtypes(hlo: str) -> list[tuple[str, set[str]]]:
    """(instruction, its operands' element types) of every dot and custom call (cuBLAS GEMMs are
    custom calls) in HLO text; operands are named (their types looked up where they are defined,
    `name = type[shape] ...`) or, in some printings, typed inline."""
    name = r"%?([\w.\-]+)"
    dtype = dict(re.findall(rf"^\s*(?:ROOT )?{name} = \(?(\w+)\[", hlo, re.MULTILINE))
    found = []
    for m in re.finditer(rf"{name} = .*? (dot|custom-call)\(([^)]*)\)", hlo):
        operands = m.group(3)
        types = {dtype[o] for o in re.findall(name, operands) if o in dtype}
        found.append((m.group(0)[:200], types | set(re.findall(r"(\w+)\[", operands))))
    return found


def matmul_gemms(device, fmt_name: str, x: np.ndarray, arrays: dict, in_dims: int):
    """`gemm_operand_dtypes` of the compiled `matmul` of a format on `device`."""
    fmt = WEIGHT_FORMATS[fmt_name]
    qw = jax.device_put(QuantizedWeight(arrays, fmt, in_dims), device)
    compiled = jax.jit(fmt.matmul).lower(jax.device_put(x, device), qw).compile()
    return gemm_operand_dtypes(compiled.as_text())


def check_format_on(device, cpu, fmt_name: str, seed: int) -> dict:
    """Part (a) for one format on `device` against `cpu`; returns what it measured."""
    rng = np.random.default_rng(seed)
    fmt = WEIGHT_FORMATS[fmt_name]
    measured = {}
    for shape, in_dims in SHAPES:
        w = random_weight(rng, shape)
        got, ref = quantize_on(device, fmt_name, w, in_dims), quantize_on(cpu, fmt_name, w, in_dims)
        measured[str(shape)] = {"code_mismatch": compare_quantized(fmt_name, in_dims, got, ref)}
        arrays = dict(ref[0])
        x32 = rng.standard_normal((2, 7, *shape[:in_dims])).astype(np.float32)
        if isinstance(fmt, Fp8Static):  # a calibrated input scale, not quantize's 1
            arrays["input_scale"] = np.float32(np.abs(x32).max() / 448)
        for (dtype, precision), tol in MATMUL_TOL["w8a8" if fmt_name in W8A8 else
                                                  "weight_only"].items():  # fmt: skip
            x = x32.astype(jnp.dtype(dtype))
            y = matmul_on(device, fmt_name, x, arrays, in_dims, precision)
            r = reference_matmul(fmt_name, x, arrays, ref[1], in_dims, cpu)
            assert y.shape == r.shape, (fmt_name, y.shape, r.shape)
            err = float(np.max(np.abs(y - r)) / np.max(np.abs(r)))
            measured[str(shape)][f"matmul_{dtype}"] = err
            assert err <= tol, f"{fmt_name} {shape} x {dtype} ({precision}): error {err:.3g}"
    return measured


# ---------------------------------------------------------------------------------------------
# The engine on the tiny model

PROMPTS = [
    "def read_config(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "    for i in range(len(items)):\n        if items[i] is None:\n",
    '"""Utilities for parsing command lines."""\n\nimport re\n',
    "def fib(n):\n    if n < 2:\n        return n\n",
]
MAX_TOKENS = 16
# one 16-token mixed bucket and one 8-row decode bucket: few compiles, and prompts are chunked
ENGINE = dict(dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=16, page_size=16,
              max_model_len=256, num_pages=1 + 48, decode_steps=8, decode_buckets=[8],
              num_logprobs=2)  # fmt: skip
CALIBRATION = {"num_tokens": 256, "seq_len": 64}
# Teacher-forced next-token argmax agreement with the plain bf16 model on its own sequences.
MIN_AGREEMENT = {"8bit": 0.9, "4bit": 0.8}  # seen on the CPU: 0.97-0.99 and 0.93-0.97
FOUR_BIT = ("int4_g128_sym", "int4_g128_asym", "nvfp4", "mxfp4", "q4_1")
# The top-2 logit gap of the dense forward under which the engine may pick the other token: the
# paged and dense paths round differently in bf16 (spacing 1/16 at |logit| in [8, 16); on the CPU
# their log-probabilities differed by at most 0.06), so 8 ulps is a near tie.
NEAR_TIE = 8 / 16


def serve(fmt_name: str | None) -> tuple[LLM, list]:
    quant = {} if fmt_name is None else {"quant": {"weights": fmt_name, "calibration": CALIBRATION}}
    llm = LLM("tiny", **ENGINE, **quant)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, sampling)
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    assert llm.engine.compiles_after_warmup == 0
    return llm, outs


def dense_logits(llm: LLM, seqs: list[list[int]]) -> list[np.ndarray]:
    """float32 logits [len(s), V] of each token sequence under the engine's own params (the
    dense, unpaged forward; the batch right-padded, which causal attention never reads)."""
    length = max(map(len, seqs))
    tokens = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    run = jax.jit(functools.partial(forward, cfg=llm.engine.model_config))
    logits = np.asarray(run(llm.engine.runner.params, tokens=jnp.asarray(tokens)), np.float32)
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]


def engine_report(fmt_name: str, plain: tuple[LLM, list, list]) -> dict:
    """Part (b) for one format against `plain` (the plain engine, its outputs, and its dense
    logits on them); returns what it measured."""
    llm, outs = serve(fmt_name)
    layer = llm.engine.runner.params["layers"][0]
    stored = {k: v.format.name for k, v in layer.items() if isinstance(v, QuantizedWeight)}
    assert stored == dict.fromkeys(("w_qkv", "wo", "w_gate_up", "w_down"), fmt_name), stored
    # the engine's tokens are its model's: teacher-forced dense argmax, up to near ties
    _, plain_outs, plain_logits = plain
    own = [o.prompt_token_ids + o.token_ids for o in outs]
    theirs = [o.prompt_token_ids + o.token_ids for o in plain_outs]
    logits = dense_logits(llm, own + theirs)  # (one compile for both)
    confident_misses, misses = [], 0
    for o, logits_of_own in zip(outs, logits[: len(own)], strict=True):
        n = len(o.prompt_token_ids)
        for j, tok in enumerate(o.token_ids):
            row = logits_of_own[n - 1 + j]
            if int(np.argmax(row)) != tok:
                misses += 1
                top = np.sort(row)[-2:]
                if top[1] - top[0] >= NEAR_TIE:
                    confident_misses.append((o.request_id, j, tok, int(np.argmax(row)), top))
    assert not confident_misses, (fmt_name, confident_misses[:3])
    # next-token agreement with the plain model on the plain run's sequences
    agree = total = 0
    for ours, plain_row in zip(logits[len(own) :], plain_logits, strict=True):
        agree += int(np.sum(np.argmax(ours[:-1], -1) == np.argmax(plain_row[:-1], -1)))
        total += len(ours) - 1
    agreement = agree / total
    prefix = [next((j for j, (a, b) in enumerate(zip(o.token_ids, p.token_ids, strict=True))
                    if a != b), MAX_TOKENS) for o, p in zip(outs, plain_outs, strict=True)]  # fmt: skip
    bound = MIN_AGREEMENT["4bit" if fmt_name in FOUR_BIT else "8bit"]
    assert agreement >= bound, (f"{fmt_name}: next-token agreement {agreement:.3f} < {bound} "
                                f"(greedy tokens equal to plain's for the first {prefix})")  # fmt: skip
    return {"agreement": round(agreement, 4), "greedy_prefix": prefix, "engine_vs_dense": misses}


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_format_quantizes_as_on_the_cpu_and_multiplies_as_its_reference(fmt_name, fresh_seed):
    check_format_on(jax.devices()[0], jax.devices("cpu")[0], fmt_name, fresh_seed)


@pytest.mark.parametrize("fmt_name", W8A8)
def test_w8a8_product_is_an_fp8_dot_on_the_gpu(fmt_name):
    shape, in_dims = SHAPES[0]
    rng = np.random.default_rng(0)
    w = random_weight(rng, shape)
    arrays, _ = quantize_on(jax.devices()[0], fmt_name, w, in_dims)
    x = rng.standard_normal((16, *shape[:in_dims])).astype(jnp.bfloat16)
    gemms = matmul_gemms(jax.devices()[0], fmt_name, x, arrays, in_dims)
    assert any("f8e4m3fn" in dtypes for _, dtypes in gemms), (
        f"{fmt_name}: no dot or GEMM call reads e4m3 operands (XLA upcast them): {gemms}"
    )


def plain_run() -> tuple[LLM, list, list]:
    """The plain bf16 engine, its outputs, and its dense logits on them."""
    llm, outs = serve(None)
    return llm, outs, dense_logits(llm, [o.prompt_token_ids + o.token_ids for o in outs])


@pytest.fixture(scope="module")
def plain_engine():
    return plain_run()


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_engine_serves_format_close_to_plain_bf16(fmt_name, plain_engine):
    engine_report(fmt_name, plain_engine)
