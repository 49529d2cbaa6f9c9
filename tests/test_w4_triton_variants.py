"""experiments/w4_triton_variants.py: the probe's kernel variants match the reference under the
interpreter (every variant but the inline-PTX decode, which has none), the PTX decode lowers
for CUDA, and `kernel_times.py` builds a variant as an op. The GPU times come from the script."""

import json
import sys
from pathlib import Path

import experiment_scripts
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import w4_matmul_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
variants = experiment_scripts.load("w4_triton_variants")
TOL = 1e-2  # relative Frobenius error: every variant rounds a decoded weight to bf16 at most once


def test_smoke_run_times_every_interpretable_variant_close_to_the_reference(tmp_path):
    out = tmp_path / "variants.json"
    variants.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    for key in ("device", "jax", "commit", "date", "command", "timing_method", "source"):
        assert key in result, key
    seen = {(r["fmt"], r.get("trans", False), r.get("fma", False)) for r in result["rows"]}
    assert {
        ("int4_g128_sym", True, False),
        ("int4_g128_sym", False, True),
        ("int8", True, False),
        ("int8", False, True),
        ("q4_1", True, False),
    } <= seen, seen
    for r in result["rows"]:
        assert "error" not in r and r["time_us"] > 0 and r["rel_err"] < TOL, r
        assert not r.get("asm"), r  # no interpreter for inline PTX


@pytest.mark.parametrize("opts", [dict(trans=True), dict(fma=True), dict(trans=True, bn=64)])
@pytest.mark.parametrize("fmt", ["int4_g128_sym", "nvfp4", "q8_0"])
def test_variant_matches_the_reference_on_fresh_inputs(fresh_seed, fmt, opts):
    """Formats the probe's rows leave out, and bn = 64, so the variants stay general."""
    from jaxinfer.quant import WEIGHT_FORMATS

    kx, kw = jax.random.split(jax.random.key(fresh_seed))
    k, n = 512, 256
    w = jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5
    arrays = jax.jit(lambda w: WEIGHT_FORMATS[fmt].quantize(w, 1))(w)
    x = jax.random.normal(kx, (1, k), jnp.float32).astype(jnp.bfloat16)
    y = np.asarray(variants.variant_matmul(x, **arrays, fmt=fmt, num_splits=2, **opts), np.float32)
    ref = np.asarray(w4_matmul_ref(x, **arrays, fmt=fmt))
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err < TOL, f"seed {fresh_seed}: {fmt} {opts} rel err {err}"


@pytest.mark.parametrize("trans", [True, False])
def test_the_ptx_decode_lowers_for_cuda(trans):
    sds = jax.ShapeDtypeStruct
    args = (sds((16, 1024), jnp.bfloat16), sds((512, 256), jnp.uint8), sds((8, 256), jnp.float32))
    call = lambda x, v, s: variants.variant_matmul(  # noqa: E731
        x, v, scales=s, fmt="int4_g128_sym", trans=trans, asm=True, interpret=False, num_splits=2
    )
    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "prmt.b32" in text and "fma.rn.bf16x2" in text


def test_bad_variant_options_name_themselves():
    x = jnp.zeros((2, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="fma one row"):
        variants.variant_matmul(x, jnp.zeros((512, 256), jnp.int8), scales=jnp.ones(256),
                                fmt="int8", fma=True)  # fmt: skip
    with pytest.raises(ValueError, match="multiple of 128 for int4_g128_sym, got 576"):
        variants.variant_matmul(jnp.zeros((1, 576), jnp.bfloat16), jnp.zeros((288, 256), jnp.uint8),
                                scales=jnp.ones((4, 256)), fmt="int4_g128_sym")  # fmt: skip
    with pytest.raises(ValueError, match="'asm=yes'"):
        variants.parse_options("trans=1,asm=yes")
    assert variants.parse_options("trans=1,num_warps=8") == {"trans": True, "num_warps": 8}


def test_kernel_times_builds_a_variant_op():
    import kernel_times

    op, (x, arrays) = kernel_times.make_op("w4_variant:int8:1:256:512:trans=1")
    ref = np.asarray(w4_matmul_ref(x, **arrays, fmt="int8"))
    y = np.asarray(op(x, arrays), np.float32)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < TOL
