"""The Mosaic GPU paged-attention kernel, run under jax's GPU interpreter, against the reference.

Every case draws fresh random inputs (the seed is in the failure message). `make_case` hands pages
out in a shuffled order and fills every slot no sequence owns, the scratch page, the spare
page-table column and the padding query rows with NaN: an output that reads outside its own
sequence's pages, or multiplies NaN by zero, fails.

What only the GPU run checks. The interpreter runs the kernel's semantics, not its concurrency:
`commit_smem`, `wgmma_wait` and the barriers are no-ops or sequential there, so a memory-ordering
bug (a tile read before its copy landed, a slot refilled while a consumer still reads it, a page
store racing the load of its tile) passes here. Nor does it run wgmma's operand layouts (its
wgmma is a plain dot) or TMA swizzles. `tests/test_kernels_lower_for_cuda.py` checks every
pipeline's lowering (Mosaic's layout inference, register layouts, shared-memory planning); the
`-m gpu` tests (`test_compiled_kernel_on_gpu` below, `tests/test_gpu*.py`) check the compiled
kernel on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention_reference import make_case

from pallas_kernels.paged_attention import (
    PagedAttentionInputs,
    paged_attention,
    ragged_paged_attention,
)
from pallas_kernels.paged_attention.mosaic_gpu import KernelOptions, ragged_paged_attention_mgpu

E4M3_MAX = 448.0


@contextlib.contextmanager
def interpreter_compiles_each_thread_once():
    """Under this, jax's GPU interpreter compiles each thread's program of a kernel launch once,
    not once per grid point: the same outputs, bit for bit, in a fraction of the time.

    A kernel with several warpgroups (the warp-specialised pipelines) runs each grid point's
    threads as XLA programs of their own, and `thread_map._run_jaxpr` lowers and compiles the
    thread's program afresh at every grid point (~1 s each on the CI's cores: 80-90% of those
    tests' time), though only its arguments (the thread id, the grid point) change. This keeps
    one jitted program per (program, thread id); one program shared by the threads deadlocked.
    The interpreter's semantics (barriers, copies, races, errors) are its callbacks inside that
    program, untouched. Without that function (another jax) this leaves the interpreter as is."""
    try:
        from jax._src.core import eval_jaxpr
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # pragma: no cover - another jax layout: run as is
        yield
        return
    run = getattr(thread_map, "_run_jaxpr", None)
    if run is None or list(inspect.signature(run).parameters) != ["jaxpr", "consts", "args"]:
        yield  # pragma: no cover
        return

    def evaluate(jaxpr, consts, *args):
        eval_jaxpr(jaxpr, consts, *args)

    @functools.lru_cache(maxsize=64)
    def program(jaxpr, thread):
        return jax.jit(functools.partial(evaluate, jaxpr))

    def run_jaxpr(jaxpr, consts, *args):  # args[0]: the thread id
        program(jaxpr, int(args[0]))(consts, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(thread_map, "_run_jaxpr", run_jaxpr)
        try:
            yield
        finally:
            program.cache_clear()


@pytest.fixture(scope="module", autouse=True)
def _interpreter_compiles_each_thread_once():
    with interpreter_compiles_each_thread_once():
        yield


def quantize_e4m3(pages: np.ndarray):
    """Per-(page, kv head) amax scaling to e4m3; NaN slots stay NaN. Returns (fp8, scales, f32)."""
    finite = np.where(np.isnan(pages), 0.0, pages)
    scales = np.maximum(np.abs(finite).max(axis=(1, 3)) / E4M3_MAX, 1e-12).astype(np.float32)
    q8 = jnp.asarray(pages / scales[:, None, :, None]).astype(jnp.float8_e4m3fn)
    deq = np.asarray(q8.astype(jnp.float32)) * scales[:, None, :, None]
    return q8, jnp.asarray(scales), deq


def interleave(k, v):
    """K and V pools [P, ...] as one pool [2P, ...]: K of page p at 2p, V at 2p + 1 (the model's
    cache layout, read with table * 2 and v_page_offset=1)."""
    return jnp.stack([jnp.asarray(k), jnp.asarray(v)], axis=1).reshape(-1, *k.shape[1:])


def run_case(*, q_lens, ctx_lens, page_size, num_kv_heads, group, head_dim, fp8=False,
             interpret=True, shared_pool=False, pad_tokens=3, soft_cap=None, sliding_window=None,
             device=None, **options):  # fmt: skip
    """The kernel with `KernelOptions(**options)` against the reference on a `make_case` batch."""
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    q, k_pages, v_pages, table, lens, qsl, _, _ = make_case(
        rng, q_lens=q_lens, ctx_lens=ctx_lens, page_size=page_size,
        num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, pad_tokens=pad_tokens,
    )  # fmt: skip
    qb = jnp.asarray(q, jnp.bfloat16)
    if fp8:
        k_in, k_scales, k_ref = quantize_e4m3(k_pages)
        v_in, v_scales, v_ref = quantize_e4m3(v_pages)
        extra = dict(k_scales=k_scales, v_scales=v_scales)
    else:
        k_in, v_in = jnp.asarray(k_pages, jnp.bfloat16), jnp.asarray(v_pages, jnp.bfloat16)
        k_ref, v_ref = np.asarray(k_in, np.float32), np.asarray(v_in, np.float32)
        extra = {}
    common = dict(max_q_len=max(q_lens), soft_cap=soft_cap, sliding_window=sliding_window)
    tab, sl, loc = jnp.asarray(table), jnp.asarray(lens), jnp.asarray(qsl)
    if shared_pool:  # one pool, K and V of a page side by side
        k_in = v_in = interleave(k_in, v_in)
        if fp8:
            extra = dict.fromkeys(("k_scales", "v_scales"), interleave(k_scales, v_scales))
        x = PagedAttentionInputs(qb, k_in, v_in, tab * 2, sl, loc, v_page_offset=1, **common,
                                 **extra)  # fmt: skip
    else:
        x = PagedAttentionInputs(qb, k_in, v_in, tab, sl, loc, **common, **extra)
    out = ragged_paged_attention_mgpu(x, KernelOptions(**options), interpret=interpret,
                                      device=device)  # fmt: skip
    ref = ragged_paged_attention(PagedAttentionInputs(
        qb.astype(jnp.float32), jnp.asarray(k_ref), jnp.asarray(v_ref), tab, sl, loc, **common,
    ))  # fmt: skip
    out, ref = np.asarray(out, np.float32), np.asarray(ref)
    n = sum(q_lens)
    assert out.shape == q.shape and out.dtype == np.float32
    assert np.isfinite(out).all(), f"non-finite output (seed {seed})"
    err = np.linalg.norm(out[:n] - ref[:n]) / np.linalg.norm(ref[:n])
    assert err < 1e-2, f"rel err {err:.2e} (seed {seed})"
    assert np.all(out[n:] == 0), f"padding rows written (seed {seed})"
    return err


# Decode batches: lengths of 1, exact page multiples, partial last pages, long enough to split.
@pytest.mark.parametrize(
    "page_size,ctx_lens,num_splits",
    [
        (16, [0, 15, 31, 200], None),
        (16, [63, 300, 5], 3),
        (32, [31, 64, 150], None),
        (64, [63, 64, 129], 2),
        (128, [127, 128, 300], None),
    ],
)
def test_decode_page_sizes_and_splits(page_size, ctx_lens, num_splits):
    run_case(q_lens=[1] * len(ctx_lens), ctx_lens=ctx_lens, page_size=page_size,
             num_kv_heads=2, group=4, head_dim=64, num_splits=num_splits,
             warp_specialized=False)  # fmt: skip


class FakeGpu:
    """What the kernel's defaults read of a `jax.Device`: its platform and SM count."""

    platform = "gpu"

    def __init__(self, core_count: int):
        self.core_count = core_count


def test_device_decides_interpretation_backend_and_default_splits(monkeypatch):
    from pallas_kernels import _compat
    from pallas_kernels.paged_attention import mosaic_gpu, resolve_backend

    cpu = jax.devices("cpu")[0]
    assert _compat.num_sms(FakeGpu(20)) == 20 and _compat.num_sms(cpu) == 132  # (CPU: default)
    assert not _compat.default_interpret(FakeGpu(20)) and _compat.default_interpret(cpu)
    assert resolve_backend("auto", device=FakeGpu(20)) == "pallas"
    assert resolve_backend("auto", device=cpu) == "xla"
    splits = []
    build = mosaic_gpu._build_kernel

    def spy(**kw):
        splits.append(kw["num_splits"])
        return build(**kw)

    monkeypatch.setattr(mosaic_gpu, "_build_kernel", spy)
    # 3 decode blocks (2 sequences + the padding row) x 2 KV heads = 6 programs: one split fills
    # 2 SMs, ceil(2 * 9 / 6) = 3 splits fill 9
    for sms in (2, 9):
        run_case(q_lens=[1, 1], ctx_lens=[300, 200], page_size=64, num_kv_heads=2, group=4,
                 head_dim=64, device=FakeGpu(sms))  # fmt: skip
    assert splits == [1, 3], splits


# Decode-only batches with one split write token-major outputs from the kernel when there are no
# more tokens than sequences (the engine's decode scans): sequences without a token (q_len 0) in
# the middle and at the end, padding tokens (NaN queries) whose rows must come out zero, real
# blocks past the real token count (which also zero a padding row), and GQA groups whose rows
# start at every offset within an 8-row tile (group 3) or always aligned (8).
@pytest.mark.parametrize(
    "q_lens,ctx_lens,group,warp_specialized",
    [
        ([1, 1, 0, 1, 1, 0], [40, 0, 7, 130, 63, 5], 4, False),
        ([0, 0, 1, 1], [9, 9, 100, 17], 3, False),
        ([1, 1, 1, 0], [200, 1, 64, 0], 8, True),
        ([1, 0, 1, 1, 1], [3, 3, 50, 16, 129], 1, False),
    ],
)
def test_token_major_decode_outputs(monkeypatch, q_lens, ctx_lens, group, warp_specialized):
    from pallas_kernels.paged_attention import mosaic_gpu

    launches = []
    launch = mosaic_gpu._launch

    def spy(*a, **kw):
        launches.append(kw.get("token_major", 0))
        return launch(*a, **kw)

    monkeypatch.setattr(mosaic_gpu, "_launch", spy)
    num_tokens = sum(q_lens) + 2
    run_case(q_lens=q_lens, ctx_lens=ctx_lens, page_size=16, num_kv_heads=2, group=group,
             head_dim=64, num_splits=1, warp_specialized=warp_specialized,
             pad_tokens=2)  # fmt: skip
    assert launches == [num_tokens], launches  # the token-major launch ran, once
    if group != 4:
        return
    # off, or with more than one split, the per-block layout and gather serve the same batch
    launches.clear()
    run_case(q_lens=q_lens, ctx_lens=ctx_lens, page_size=16, num_kv_heads=2, group=group,
             head_dim=64, num_splits=2, pad_tokens=2)  # fmt: skip
    run_case(q_lens=q_lens, ctx_lens=ctx_lens, page_size=16, num_kv_heads=2, group=group,
             head_dim=64, num_splits=1, token_major_decode=False, pad_tokens=2)  # fmt: skip
    assert launches == [0, 0], launches


def run_write_case(*, q_lens, ctx_lens, page_size=16, num_kv_heads=2, group=4, head_dim=64,
                   shared_pool=True, interpret=True, pad_tokens=2, **options):  # fmt: skip
    """Decode with `new_kv`: the kernel writes each token's K/V into its slot, then attends
    (several tokens a sequence: blocks of `max(q_lens)` tokens).

    The new tokens' slots are NaN on input (a tile loaded before the write lands, or from the
    wrong slot, poisons the output); the returned pages must equal the inputs with exactly those
    slots filled (every other slot, NaN ones included, untouched). Padding tokens' K/V are NaN and
    must be written nowhere."""
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    q, k_pages, v_pages, table, lens, qsl, _, _ = make_case(
        rng, q_lens=q_lens, ctx_lens=ctx_lens, page_size=page_size, num_kv_heads=num_kv_heads,
        group=group, head_dim=head_dim, pad_tokens=pad_tokens,
    )  # fmt: skip
    bf = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # noqa: E731
    k_pages, v_pages = bf(k_pages), bf(v_pages)
    k_new = np.full((q.shape[0], num_kv_heads, head_dim), np.nan, np.float32)
    v_new = k_new.copy()
    k_in, v_in = k_pages.copy(), v_pages.copy()
    for s, n in enumerate(q_lens):
        for j in range(n):
            t, pos = qsl[s] + j, lens[s] - n + j
            page, slot = table[s, pos // page_size], pos % page_size
            k_new[t], v_new[t] = k_pages[page, slot], v_pages[page, slot]
            k_in[page, slot] = v_in[page, slot] = np.nan
    max_q_len = max(q_lens)
    qb = jnp.asarray(q, jnp.bfloat16)
    rest = (jnp.asarray(lens), jnp.asarray(qsl))
    kw = dict(new_kv=(jnp.asarray(k_new, jnp.bfloat16), jnp.asarray(v_new, jnp.bfloat16)),
              interpret=interpret)  # fmt: skip
    if shared_pool:
        pool = interleave(jnp.asarray(k_in, jnp.bfloat16), jnp.asarray(v_in, jnp.bfloat16))
        x = PagedAttentionInputs(qb, pool, pool, jnp.asarray(table) * 2, *rest,
                                 max_q_len=max_q_len, v_page_offset=1)  # fmt: skip
        out, k_out, v_out = ragged_paged_attention_mgpu(x, KernelOptions(**options), **kw)
        assert k_out is v_out
        both = np.asarray(k_out, np.float32).reshape(-1, 2, *k_pages.shape[1:])
        k_out, v_out = both[:, 0], both[:, 1]
    else:
        x = PagedAttentionInputs(qb, jnp.asarray(k_in, jnp.bfloat16),
                                 jnp.asarray(v_in, jnp.bfloat16), jnp.asarray(table), *rest,
                                 max_q_len=max_q_len)  # fmt: skip
        out, k_out, v_out = ragged_paged_attention_mgpu(x, KernelOptions(**options), **kw)
        k_out, v_out = np.asarray(k_out, np.float32), np.asarray(v_out, np.float32)
    assert np.array_equal(k_out, k_pages, equal_nan=True), f"K pages (seed {seed})"
    assert np.array_equal(v_out, v_pages, equal_nan=True), f"V pages (seed {seed})"
    ref = ragged_paged_attention(PagedAttentionInputs(
        qb.astype(jnp.float32), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(table),
        *rest, max_q_len=max_q_len))  # fmt: skip
    out, ref = np.asarray(out, np.float32), np.asarray(ref)
    n = sum(q_lens)
    assert np.isfinite(out[:n]).all(), f"non-finite output (seed {seed})"
    err = np.linalg.norm(out[:n] - ref[:n]) / np.linalg.norm(ref[:n])
    assert err < 1e-2, f"rel err {err:.2e} (seed {seed})"
    assert np.all(out[n:] == 0), f"padding rows written (seed {seed})"


# The new token's slot at a page start, mid-page and a page's end; its tile in the prologue (the
# deferred copy) or loaded by a refill; one split (token-major outputs) and several (only the
# last split writes); GQA groups whose rows sit at every offset in an 8-row tile; K and V in one
# pool or two arrays.
@pytest.mark.parametrize(
    "q_lens,ctx_lens,group,kw",
    [
        ([1, 1, 0, 1], [40, 0, 7, 130], 4, dict(num_splits=1)),
        ([1, 1, 0, 1], [40, 15, 7, 300], 4, dict(num_splits=3)),
        ([1, 0, 1, 1, 1], [3, 3, 50, 16, 129], 1, dict(num_splits=1)),
        ([1, 1, 1, 0], [200, 1, 64, 0], 8, {}),
        ([1, 1, 1], [10, 90, 33], 3, dict(num_splits=1, token_major_decode=False)),
        ([1, 1, 1], [63, 64, 129], 4, dict(num_splits=2, shared_pool=False, page_size=64)),
        # one sequence (a decode bucket of one row): the default splits, one tile each
        ([1], [600], 4, dict(page_size=64)),
    ],
)
def test_kernel_writes_new_kv(q_lens, ctx_lens, group, kw):
    run_write_case(q_lens=q_lens, ctx_lens=ctx_lens, group=group, **kw)


@pytest.fixture
def launched_plans(monkeypatch):
    """The `_Plan` of every kernel launch the test makes."""
    from pallas_kernels.paged_attention import mosaic_gpu

    plans = []
    launch = mosaic_gpu._launch

    def spy(plan, *a, **kw):
        plans.append(plan)
        return launch(plan, *a, **kw)

    monkeypatch.setattr(mosaic_gpu, "_launch", spy)
    return plans


# Verification-shaped batches (a few new tokens per sequence): decode blocks of max_q_len
# tokens. The new tokens inside one tile, across two tiles, across two context splits
# (130 keys in 3 splits of one 64-key tile: positions 126-127 and 128-129 go to different
# programs); sequences with fewer tokens (1, 0) beside; GQA groups whose rows sit at every offset;
# a sliding window (each token's own) and a soft cap.
@pytest.mark.parametrize(
    "q_lens,ctx_lens,group,kw",
    [
        ([5, 5, 3, 1, 0], [40, 60, 125, 300, 9], 4, {}),
        ([4], [126], 4, dict(num_splits=3)),
        ([3, 6, 2], [17, 250, 0], 3, dict(num_splits=2)),
        ([8, 8], [70, 64], 1, dict(num_splits=1)),
        ([5, 3], [200, 60], 4, dict(num_splits=2, sliding_window=24, soft_cap=5.0)),
    ],
)
def test_multi_token_decode_blocks(launched_plans, q_lens, ctx_lens, group, kw):
    run_case(q_lens=q_lens, ctx_lens=ctx_lens, page_size=16, num_kv_heads=2, group=group,
             head_dim=64, **kw)  # fmt: skip
    assert [(p.decode, p.bq) for p in launched_plans] == [(True, max(q_lens))], launched_plans


# With the new K/V written in the kernel, each split writes the new tokens in its own tiles and
# defers their loads: both of a single split's tiles deferred in the prologue (60 + 5 keys), one
# tile loaded by a refill after the writes (200 + 5, 190 + 5: the first new tile a refill, the
# next too), the new tokens split between two programs (126 + 4 in 3 splits), a sequence with
# fewer tokens, K and V in two arrays.
@pytest.mark.parametrize(
    "q_lens,ctx_lens,group,kw",
    [
        ([5, 5, 5, 2, 0], [60, 200, 190, 7, 3], 4, dict(num_splits=1)),
        ([4, 1], [126, 40], 4, dict(num_splits=3)),
        ([3, 5], [250, 61], 3, dict(shared_pool=False)),
        ([9, 9], [30, 100], 4, dict(page_size=64, num_splits=2)),
    ],
)
def test_kernel_writes_new_kv_of_several_tokens(launched_plans, q_lens, ctx_lens, group, kw):
    run_write_case(q_lens=q_lens, ctx_lens=ctx_lens, group=group, **kw)
    assert [(p.decode, p.bq) for p in launched_plans] == [(True, max(q_lens))], launched_plans


def test_decode_blocks_hold_what_fits_one_warpgroup(launched_plans):
    # group 8 with the K/V rows: 10 rows a token and up to 6 of shift fill 64 rows at 5 tokens,
    # so 6 take no new_kv; without them 8 rows a token: 9 go to prefill blocks (and the single
    # tokens beside them to their own decode launch)
    from pallas_kernels.paged_attention.mosaic_gpu import (
        decode_block_tokens,
        fused_kv_write_reason,
    )

    assert decode_block_tokens(8, 10) == 5 and decode_block_tokens(4, 6) == 9
    assert decode_block_tokens(4) == 15 and decode_block_tokens(3, 5) == 11
    assert fused_kv_write_reason(5, jnp.bfloat16, group=8) is None
    assert "up to 5 tokens" in fused_kv_write_reason(6, jnp.bfloat16, group=8)
    assert "up to 9 tokens" in fused_kv_write_reason(10, jnp.bfloat16, group=4)
    assert decode_block_tokens(8) == 8
    run_case(q_lens=[9, 1], ctx_lens=[20, 3], page_size=16, num_kv_heads=1, group=8, head_dim=64,
             warp_specialized=False)  # fmt: skip
    assert [(p.decode, p.bq) for p in launched_plans] == [(True, 1), (False, 8)], launched_plans


def test_new_kv_is_validated():
    q = jnp.zeros((4, 8, 64), jnp.bfloat16)
    pages = jnp.zeros((6, 16, 2, 64), jnp.bfloat16)
    table, lens, qsl = jnp.ones((3, 2), jnp.int32), jnp.ones((3,), jnp.int32), jnp.arange(4)
    kv = (jnp.zeros((4, 2, 64), jnp.bfloat16),) * 2
    x = PagedAttentionInputs(q, pages, pages, table, lens, qsl, max_q_len=1)
    call = functools.partial(ragged_paged_attention_mgpu, interpret=True)
    with pytest.raises(ValueError, match="up to 9 tokens a sequence"):
        call(dataclasses.replace(x, max_q_len=10), new_kv=kv)
    with pytest.raises(ValueError, match="warp_specialized=False"):
        call(x, KernelOptions(warp_specialized=True), new_kv=kv)
    with pytest.raises(ValueError, match=r"new_kv must be \(k, v\)"):
        call(x, new_kv=(kv[0][:, :1], kv[1]))
    p8 = pages.astype(jnp.float8_e4m3fn)
    scales = jnp.ones((6, 2), jnp.float32)
    with pytest.raises(ValueError, match="fp8 pages"):
        call(dataclasses.replace(x, k_pages=p8, v_pages=p8, k_scales=scales, v_scales=scales),
             new_kv=kv)  # fmt: skip
    with pytest.raises(ValueError, match="only the pallas backend"):
        paged_attention(x, backend="xla", new_kv=kv)
    with pytest.raises(ValueError, match=r"block_kv=96 is invalid: must be 64 or 128"):
        KernelOptions(block_kv=96)
    with pytest.raises(ValueError, match=r"num_splits=0 is invalid: must be an int >= 1"):
        KernelOptions(num_splits=0)
    with pytest.raises(ValueError, match=r"split_decode_rows=1 is invalid: must be a bool"):
        KernelOptions(split_decode_rows=1)


@pytest.mark.parametrize("head_dim,group,num_kv_heads", [(128, 8, 1), (256, 2, 2), (64, 1, 4)])
def test_head_dims_and_gqa_ratios(head_dim, group, num_kv_heads):
    run_case(q_lens=[1, 1, 3], ctx_lens=[40, 100, 17], page_size=16, num_kv_heads=num_kv_heads,
             group=group, head_dim=head_dim, warp_specialized=False)  # fmt: skip


@pytest.mark.parametrize("split_decode_rows", [True, False])
@pytest.mark.parametrize("group", [4, 3])
def test_ragged_prefill_chunks_mixed_with_decodes(split_decode_rows, group):
    # a chunk longer than a query block, one starting mid-context, fresh prompts, single tokens;
    # the single tokens go through the decode launch (split) or take a prefill block each
    run_case(q_lens=[1, 37, 5, 20, 1], ctx_lens=[100, 0, 50, 33, 0], page_size=16,
             num_kv_heads=2, group=group, head_dim=64, warp_specialized=False,
             split_decode_rows=split_decode_rows)  # fmt: skip


def test_sliding_window_and_soft_cap():
    run_case(q_lens=[1, 20, 3], ctx_lens=[200, 60, 9], page_size=16, num_kv_heads=1, group=4,
             head_dim=64, sliding_window=24, soft_cap=5.0, warp_specialized=False)  # fmt: skip


def test_fp8_pages_match_reference_on_dequantized_values():
    # (page 64 with fp8 pages: test_compiled_kernel_on_gpu, and page 32 test_warp_specialized_fp8;
    # a second page size here cost 50-100 s of interpret mode on the CI's two cores)
    run_case(q_lens=[1, 1, 9], ctx_lens=[90, 130, 40], page_size=16, num_kv_heads=2,
             group=4, head_dim=64, fp8=True, warp_specialized=False)  # fmt: skip


def test_warp_specialized_pipeline():
    # producer warpgroup feeding a consumer through free/full barriers: fewer, slower cases
    run_case(q_lens=[1, 12, 1], ctx_lens=[150, 20, 63], page_size=16, num_kv_heads=1, group=4,
             head_dim=64, num_stages=2, num_splits=2)  # fmt: skip


def test_two_consumer_prefill():
    # prefill blocks of 128 query rows: two consumer warpgroups share 128-key tiles
    run_case(q_lens=[40, 1, 70], ctx_lens=[100, 30, 0], page_size=16, num_kv_heads=1, group=4,
             head_dim=64)  # fmt: skip


def test_warp_specialized_fp8():
    run_case(q_lens=[1, 1], ctx_lens=[130, 64], page_size=32, num_kv_heads=1, group=4,
             head_dim=64, fp8=True)  # fmt: skip


@pytest.mark.parametrize(
    "fp8,warp_specialized,q_lens,ctx_lens",
    [
        (False, False, [1, 1, 1], [70, 15, 200]),  # decode, context splits
        (False, False, [1, 30, 1], [40, 50, 0]),  # mixed: decode launch + prefill blocks
        (True, False, [1, 1, 9], [90, 31, 40]),  # fp8 scales follow V's page
        (True, True, [1, 1], [130, 64]),  # fp8 converted by the producer warpgroup
    ],
)
def test_k_and_v_in_one_pool_with_v_page_offset(fp8, warp_specialized, q_lens, ctx_lens):
    """The model's cache layout: one pool, V's page = K's + 1. Reading K's page for V (or V's
    scale for K) is wrong on every random case; the NaN-poisoned neighbours catch reads of
    anything else."""
    run_case(q_lens=q_lens, ctx_lens=ctx_lens, page_size=16, num_kv_heads=2, group=4,
             head_dim=64, fp8=fp8, warp_specialized=warp_specialized, shared_pool=True,
             num_splits=2 if max(q_lens) == 1 else None)  # fmt: skip


def test_dispatcher_routes_to_the_kernel_and_validates(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    q, k, v, table, lens, qsl, _, _ = make_case(rng, q_lens=[1, 1], ctx_lens=[20, 5], page_size=16,
                                                num_kv_heads=1, group=2, head_dim=64)  # fmt: skip
    x = PagedAttentionInputs(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16),
                             jnp.asarray(v, jnp.bfloat16), jnp.asarray(table), jnp.asarray(lens),
                             jnp.asarray(qsl), max_q_len=1)  # fmt: skip
    out = paged_attention(x, backend="pallas")  # (interpreted: the default on a CPU)
    ref = paged_attention(x, backend="xla")
    np.testing.assert_allclose(np.asarray(out[:2], np.float32), np.asarray(ref[:2], np.float32),
                               atol=3e-2, rtol=3e-2)  # fmt: skip
    with pytest.raises(ValueError, match="attention backend"):
        paged_attention(x, backend="triton")
    with pytest.raises(NotImplementedError, match="page_size"):
        bad = jnp.zeros((4, 8, 1, 64), jnp.bfloat16)
        ragged_paged_attention_mgpu(
            dataclasses.replace(x, k_pages=bad, v_pages=bad), interpret=True
        )
    with pytest.raises(ValueError, match="k_scales"):
        k8 = x.k_pages.astype(jnp.float8_e4m3fn)
        ragged_paged_attention_mgpu(dataclasses.replace(x, k_pages=k8, v_pages=k8), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_compiled_kernel_on_gpu(head_dim, fp8, fresh_seed):
    """The same checks, compiled for the GPU (run on the device machine: `pytest -m gpu`)."""
    run_case(q_lens=[1, 1, 37, 130], ctx_lens=[2000, 15, 100, 0], page_size=16, num_kv_heads=8,
             group=4, head_dim=head_dim, fp8=fp8, interpret=False)  # fmt: skip
    run_case(q_lens=[1] * 3, ctx_lens=[5000, 64, 300], page_size=64, num_kv_heads=2, group=8,
             head_dim=head_dim, fp8=fp8, interpret=False)  # fmt: skip
    # pages longer than a K/V tile (a tile is a slice of a page), group 3 (rows shifted by 1-7)
    run_case(q_lens=[1, 45, 1], ctx_lens=[700, 31, 129], page_size=128, num_kv_heads=2, group=3,
             head_dim=head_dim, fp8=fp8, interpret=False)  # fmt: skip
    # a decode scan's batch: 40 sequences x 8 KV heads fill the GPU, so one split and token-major
    # outputs (with a sequence without a token and padding rows that must come out zero)
    rng = np.random.default_rng(fresh_seed)  # the contexts; run_case draws its own inputs
    run_case(q_lens=[1] * 20 + [0] + [1] * 20, ctx_lens=list(rng.integers(0, 700, 41)),
             page_size=64, num_kv_heads=8, group=4, head_dim=head_dim, fp8=fp8, interpret=False,
             pad_tokens=1)  # fmt: skip
    if fp8:
        return
    # the kernel writes the new K/V itself (decode steps' default): one split (token-major) and
    # several, the new slot's tile deferred in the prologue or loaded by a refill
    ctx = list(rng.integers(0, 700, 41))
    run_write_case(q_lens=[1] * 20 + [0] + [1] * 20, ctx_lens=ctx, page_size=64, num_kv_heads=8,
                   head_dim=head_dim, interpret=False, pad_tokens=1)  # fmt: skip
    run_write_case(q_lens=[1, 1, 1], ctx_lens=[5000, 64, 0], page_size=16, num_kv_heads=2,
                   group=3, head_dim=head_dim, interpret=False, shared_pool=False)  # fmt: skip
    # one sequence alone (a decode bucket of one row): ~33 splits of one tile
    run_write_case(q_lens=[1], ctx_lens=[int(rng.integers(1500, 2100))], page_size=64,
                   num_kv_heads=8, group=4, head_dim=head_dim, interpret=False)  # fmt: skip
    # verification's decode blocks of several tokens: written by the kernel at one split and
    # many, the new tokens split between two programs; group 3 without new_kv
    run_write_case(q_lens=[5] * 8 + [0] + [3] * 8, ctx_lens=list(rng.integers(0, 700, 17)),
                   page_size=64, num_kv_heads=8, head_dim=head_dim, interpret=False,
                   pad_tokens=1)  # fmt: skip
    run_write_case(q_lens=[5], ctx_lens=[int(rng.integers(1500, 2100))], page_size=64,
                   num_kv_heads=8, head_dim=head_dim, interpret=False)  # fmt: skip
    run_write_case(q_lens=[4, 2], ctx_lens=[126, 300], num_kv_heads=2, head_dim=head_dim,
                   interpret=False, num_splits=3)  # fmt: skip
    run_case(q_lens=[9, 4, 1], ctx_lens=[1000, 63, 5], page_size=16, num_kv_heads=2, group=3,
             head_dim=head_dim, interpret=False)  # fmt: skip
