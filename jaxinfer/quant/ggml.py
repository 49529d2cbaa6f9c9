"""llama.cpp's GGML tensor storage types: each block layout, its components, and dequantization.

A GGML tensor is stored row by row along its innermost axis (GGUF's `ne0`, numpy's last axis),
cut into blocks of `block_size` values, each block `type_size` bytes. `BlockLayout.record` is one
block as a packed little-endian numpy struct, field for field the `block_*` struct in llama.cpp's
`ggml/src/ggml-common.h`, so the raw bytes are read by one `view`. `unpack` turns the records into
*components* (scales as float32, quants as small unsigned integers, grouped by the sub-block each
scale covers) that `formula` combines into values: `dequantize` evaluates the formula, and a
kernel that runs the weights without dequantizing can take the components directly.

Component shapes, for a tensor of numpy shape [..., n] with nb = n // block_size blocks a row:

    F32, F16, BF16  values [..., n]  (float32, float16, float32: BF16 widened exactly)
    Q8_0   d [..., nb]                     q int8  [..., nb, 32]
    Q4_0   d [..., nb]                     q uint8 [..., nb, 32]      0..15
    Q4_1   d, m [..., nb]                  q uint8 [..., nb, 32]      0..15
    Q4_K   d, dmin [..., nb]  scales, mins uint8 [..., nb, 8]  0..63  q uint8 [..., nb, 8, 32]  0..15
    Q6_K   d [..., nb]  scales int8 [..., nb, 16]                     q uint8 [..., nb, 16, 16]  0..63
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Components = dict[str, np.ndarray]


@dataclass(frozen=True)
class BlockLayout:
    """One GGML storage type: `block_size` values stored in `type_size` bytes as a `record`."""

    name: str
    block_size: int
    type_size: int
    record: np.dtype
    components: tuple[str, ...]
    formula: str
    decode: Callable[[np.ndarray], Components] = field(repr=False)
    values: Callable[[Components], np.ndarray] = field(repr=False)

    def __post_init__(self) -> None:
        if self.record.itemsize != self.type_size:
            raise AssertionError(f"{self.name}: record is {self.record.itemsize} bytes")


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., k] -> 4-bit values [..., 2k]: the low nibbles are the first k values."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of 8 6-bit scales and 8 6-bit mins (ggml-common.h `get_scale_min_k4`).

    Bytes 0-3 hold scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits; bytes 8-11 hold the low
    4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the top 2
    bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    lo_sc, lo_m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = np.concatenate([lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    mins = np.concatenate([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return scales, mins


def _q6_k_quants(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """ql [..., 128], qh [..., 64] -> 6-bit values [..., 256].

    Each 128-value half uses 64 bytes of ql and 32 of qh: ql's low nibbles are values 0-63 of the
    half and its high nibbles 64-127; qh byte l holds bits 4-5 of values l, l+32, l+64, l+96 at
    bit offsets 0, 2, 4, 6.
    """
    ql = ql.reshape(*ql.shape[:-1], 2, 64)
    qh = qh.reshape(*qh.shape[:-1], 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03
    q = low | (high.reshape(low.shape) << 4)
    return q.reshape(*q.shape[:-2], 256)


# Per type: its record (the ggml-common.h struct named above it), a decode (records [..., nb] ->
# components) and a values (components -> float32 [..., nb, *sub-block shape]).

_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", 32)])  # block_q8_0: ggml_half d; int8_t qs[32]


def _q8_0(r: np.ndarray) -> Components:
    return {"d": _f32(r["d"]), "q": r["qs"].copy()}


def _q8_0_values(c: Components) -> np.ndarray:
    return c["q"] * c["d"][..., None]


_Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", 16)])  # block_q4_0: ggml_half d; uint8_t qs[16]


def _q4_0(r: np.ndarray) -> Components:
    return {"d": _f32(r["d"]), "q": _nibbles(r["qs"])}


def _q4_0_values(c: Components) -> np.ndarray:
    return c["d"][..., None] * (c["q"].astype(np.int8) - 8)


_Q4_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])  # block_q4_1: d, m; qs[16]


def _q4_1(r: np.ndarray) -> Components:
    return {"d": _f32(r["d"]), "m": _f32(r["m"]), "q": _nibbles(r["qs"])}


def _q4_1_values(c: Components) -> np.ndarray:
    return c["d"][..., None] * c["q"] + c["m"][..., None]


# block_q4_K: ggml_half d, dmin; uint8_t scales[12]; uint8_t qs[128]
_Q4_K = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])


def _q4_k(r: np.ndarray) -> Components:
    scales, mins = _q4_k_scales(r["scales"])
    # qs byte 32*i + l: its low nibble is value l of sub-block 2i, its high nibble of 2i+1
    q = _nibbles(r["qs"].reshape(*r.shape, 4, 32)).reshape(*r.shape, 8, 32)
    return {"d": _f32(r["d"]), "dmin": _f32(r["dmin"]), "scales": scales, "mins": mins, "q": q}


def _q4_k_values(c: Components) -> np.ndarray:
    d = c["d"][..., None] * c["scales"]
    m = c["dmin"][..., None] * c["mins"]
    return d[..., None] * c["q"] - m[..., None]


# block_q6_K: uint8_t ql[128], qh[64]; int8_t scales[16]; ggml_half d (last, unlike the others)
_Q6_K = np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])


def _q6_k(r: np.ndarray) -> Components:
    q = _q6_k_quants(r["ql"], r["qh"]).reshape(*r.shape, 16, 16)
    return {"d": _f32(r["d"]), "scales": r["scales"].copy(), "q": q}


def _q6_k_values(c: Components) -> np.ndarray:
    d = c["d"][..., None] * c["scales"]
    return d[..., None] * (c["q"].astype(np.int8) - 32)


def _float(name: str, record: str, widen: Callable[[np.ndarray], np.ndarray]) -> BlockLayout:
    def decode(r: np.ndarray) -> Components:
        return {"values": widen(r)}

    def values(c: Components) -> np.ndarray:
        return _f32(c["values"])[..., None]

    dt = np.dtype(record)
    return BlockLayout(name, 1, dt.itemsize, dt, ("values",), "x = values", decode, values)


def _bf16_to_f32(r: np.ndarray) -> np.ndarray:
    return (r.astype(np.uint32) << 16).view(np.float32)  # bf16 is the top half of an f32


_LAYOUTS = (
    _float("F32", "<f4", _f32),
    _float("F16", "<f2", lambda r: r.astype(np.float16)),
    _float("BF16", "<u2", _bf16_to_f32),
    BlockLayout("Q8_0", 32, 34, _Q8_0, ("d", "q"), "x = d * q", _q8_0, _q8_0_values),
    BlockLayout("Q4_0", 32, 18, _Q4_0, ("d", "q"), "x = d * (q - 8)", _q4_0, _q4_0_values),
    BlockLayout("Q4_1", 32, 20, _Q4_1, ("d", "m", "q"), "x = d * q + m", _q4_1, _q4_1_values),
    BlockLayout(
        "Q4_K",
        256,
        144,
        _Q4_K,
        ("d", "dmin", "scales", "mins", "q"),
        "x = (d * scales[j]) * q - dmin * mins[j], j the 32-value sub-block",
        _q4_k,
        _q4_k_values,
    ),
    BlockLayout(
        "Q6_K",
        256,
        210,
        _Q6_K,
        ("d", "scales", "q"),
        "x = (d * scales[j]) * (q - 32), j the 16-value sub-block",
        _q6_k,
        _q6_k_values,
    ),
)
GGML_TYPES: dict[str, BlockLayout] = {layout.name: layout for layout in _LAYOUTS}
"""The supported types by GGUF name (`gguf.GGMLQuantizationType(t).name`)."""


def layout_of(type_name: Any) -> BlockLayout:
    """The layout of a type given by name (or a `gguf.GGMLQuantizationType`, by its `.name`)."""
    name = getattr(type_name, "name", type_name)
    if name not in GGML_TYPES:
        raise ValueError(
            f"GGML type {name!r} is not supported; supported types: {', '.join(GGML_TYPES)}"
        )
    return GGML_TYPES[name]


def unpack(raw: np.ndarray, type_name: str, shape: Sequence[int]) -> Components:
    """The components of a tensor of numpy `shape` stored as `type_name` in the bytes of `raw`.

    `raw` is any contiguous-able array holding exactly the tensor's bytes (e.g. a GGUF reader's
    uint8 [rows, bytes_per_row] or float32 [..., n]). Components keep the rows: see the module
    docstring for their names and shapes.
    """
    layout = layout_of(type_name)
    shape = tuple(int(n) for n in shape)
    if not shape:
        raise ValueError(f"{layout.name} tensor needs at least one axis, got shape ()")
    if shape[-1] % layout.block_size:
        raise ValueError(
            f"{layout.name} tensor of shape {shape}: the last axis ({shape[-1]}) must be a "
            f"multiple of the block size {layout.block_size}"
        )
    blocks = (*shape[:-1], shape[-1] // layout.block_size)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    expected = math.prod(blocks) * layout.type_size
    if data.size != expected:
        raise ValueError(
            f"{layout.name} tensor of shape {shape} takes {expected} bytes, got {data.size} bytes"
        )
    return layout.decode(data.view(layout.record).reshape(blocks))


def dequantize(
    raw: np.ndarray, type_name: str, shape: Sequence[int], dtype: Any = np.float32
) -> np.ndarray:
    """The values of a tensor of numpy `shape` stored as `type_name` in `raw`, as `dtype`.

    Computed in float32 in llama.cpp's order of operations, so it matches its reference.
    """
    layout = layout_of(type_name)
    values = layout.values(unpack(raw, type_name, shape))
    return values.reshape(tuple(int(n) for n in shape)).astype(dtype, copy=False)
