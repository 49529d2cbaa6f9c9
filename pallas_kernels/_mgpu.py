"""Building blocks the Mosaic GPU kernels share: swizzled shared-memory buffers, a wgmma dot, and
the warp-specialised persistent GEMM (`ws_gemm`, its launch `ws_launch` and tile store
`store_tile`) that the block-scaled FP8 and the batch-invariant GEMMs run."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat

ROWS = 64  # wgmma M


def swizzled_smem(shape, dtype):
    """A shared-memory buffer in the layout TMA and wgmma want: (8 rows, swizzle bytes) tiles."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, shape[-1] * itemsize)
    return plgpu.SMEM(
        shape,
        dtype,
        transforms=(
            plgpu.TilingTransform((8, swizzle // itemsize)),
            plgpu.SwizzleTransform(swizzle),
        ),
    )


def wgmma_dot(a, b_ref, *, interpret: bool, transpose_b: bool = False) -> jax.Array:
    """a [64, k] @ b (or a @ b.T) into a fresh fp32 [64, n] accumulator with wgmma; `a` a ref or
    an array, `b_ref` a shared-memory ref.

    The GPU interpreter's wgmma takes neither register operands nor transposed refs, so under it
    the product is a plain dot of the same values (everything around it is interpreted).
    """
    cols = b_ref.shape[0] if transpose_b else b_ref.shape[1]
    if interpret:
        av = a[...] if not isinstance(a, jax.Array) else a
        dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
        return lax.dot_general(av, b_ref[...], dims, preferred_element_type=jnp.float32)
    b = plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((ROWS, cols), jnp.float32))


def store_tile(acc, o_s, out, m0, n0, k_blk, *, split: bool, dtype) -> None:
    """A consumer's [rows, cols] fp32 result `acc` through its staging buffer `o_s` into `out` at
    (m0, n0): as `dtype`, or with `split` as fp32 partials into `out[k_blk]`. The store is not
    waited for: the next tile's waits only until its previous store read `o_s`, and `ws_gemm`
    waits for the last."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous store from o_s read it
    o_s[...] = acc if split else acc.astype(dtype)
    plgpu.commit_smem()
    tile = (pl.ds(m0, o_s.shape[0]), pl.ds(n0, o_s.shape[1]))
    plgpu.copy_smem_to_gmem(o_s, out.at[(k_blk, *tile) if split else tile])


# ---- The warp-specialised persistent GEMM loop.

CONSUMERS = 2  # consumer warpgroups per program
GROUP_M = 8  # token tiles per band of the programs' tile order (see `tile_coords`)


@dataclasses.dataclass(frozen=True)
class WsPlan:
    """The static shape of a `ws_gemm` launch: mt x nt output tiles (each cut among the
    CONSUMERS as the kernel says) times `k_splits` K ranges of `steps` pipeline steps each, over
    `programs` persistent programs and a `num_stages`-deep stage ring."""

    mt: int
    nt: int
    k_splits: int
    steps: int
    num_stages: int
    programs: int

    @property
    def tiles(self) -> int:
        return self.mt * self.nt * self.k_splits


@dataclasses.dataclass(frozen=True)
class Tile:
    """One output tile of a program: its token tile, output tile, K split and first K step."""

    m_blk: jax.Array
    n_blk: jax.Array
    k_blk: jax.Array
    b0: jax.Array  # the split's range of K steps is [b0, b0 + steps)


def tile_coords(t, *, mt: int, nt: int):
    """Tile `t`'s (token tile, output tile, K split) in the programs' order: splits slowest,
    then bands of GROUP_M token tiles, each band walked token tile fastest across all of N (so
    the tiles in flight at once share a few token tiles and a few weight tiles in L2)."""
    per_split = mt * nt
    k_blk, r = lax.div(t, per_split), lax.rem(t, per_split)
    band, i = lax.div(r, GROUP_M * nt), lax.rem(r, GROUP_M * nt)
    rows = jnp.minimum(jnp.int32(GROUP_M), mt - band * GROUP_M)  # token tiles in this band
    return band * GROUP_M + lax.rem(i, rows), lax.div(i, rows), k_blk


def ws_gemm(plan: WsPlan, *, full, free, issue: Callable, step: Callable, finish: Callable,
            acc_shape: tuple[int, int], interpret: bool) -> None:  # fmt: skip
    """The body of a warp-specialised persistent GEMM program (under `plgpu.kernel` with
    CONSUMERS + 1 threads named "wg"; grid ("p",) of `plan.programs`).

    Program p takes tiles p, p + P, ... (`tile_coords` order). Its producer warpgroup (the last,
    40 registers) runs `issue(tile, i, slot)`: the TMA copies of step i of `tile` into stage
    `slot`, each arriving on `full.at[slot]` (whose arrivals are the copies per step); it refills
    a slot once every consumer arrived on `free.at[slot]`. Consumer warpgroup w (232 registers)
    waits for each step's stage, runs `acc = step(w, slot, acc)` (which must have read all it
    needs of the stage when it returns; the stage is then released) from fp32 zeros of
    `acc_shape` over the tile's steps, and ends the tile with `finish(w, tile, acc)`. The ring
    and its barrier phases run on across a program's tiles: the producer fills the next tile's
    stages while the consumers finish the last, so a tile's fill and store are hidden."""
    pid = lax.axis_index("p")
    steps, stages = plan.steps, plan.num_stages
    my_tiles = lax.div(plan.tiles - pid + plan.programs - 1, jnp.int32(plan.programs))

    def tile_at(j) -> Tile:
        m_blk, n_blk, k_blk = tile_coords(pid + j * plan.programs, mt=plan.mt, nt=plan.nt)
        return Tile(m_blk, n_blk, k_blk, k_blk * steps)

    def producer():
        plgpu.set_max_registers(40, action="decrease")

        def tile(j, carry):
            t = tile_at(j)

            def one(i, carry):
                g = j * steps + i  # the program's step count: the slot and its phase
                slot = lax.rem(g, jnp.int32(stages))

                @pl.when(g >= stages)
                def _():  # the slot's last use, once every consumer read it
                    plgpu.barrier_wait(free.at[slot])

                issue(t, i, slot)
                return carry

            return lax.fori_loop(0, steps, one, carry)

        lax.fori_loop(0, my_tiles, tile, 0)
        total = my_tiles * steps

        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _drain(g):  # observe the last releases too, so every barrier phase is consumed
            plgpu.barrier_wait(free.at[lax.rem(g, jnp.int32(stages))])

    def consumer(w: int):
        plgpu.set_max_registers(232, action="increase")

        def tile(j, carry):
            def one(i, acc):
                slot = lax.rem(j * steps + i, jnp.int32(stages))
                plgpu.barrier_wait(full.at[slot])
                acc = step(w, slot, acc)
                plgpu.barrier_arrive(free.at[slot])
                return acc

            zeros = jnp.zeros(acc_shape, jnp.float32)
            acc0 = zeros if interpret else plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
            finish(w, tile_at(j), lax.fori_loop(0, steps, one, acc0))
            return carry

        lax.fori_loop(0, my_tiles, tile, 0)
        plgpu.wait_smem_to_gmem(0)  # the last tile's store

    wg = lax.axis_index("wg")
    for w in range(CONSUMERS):
        pl.when(wg == w)(functools.partial(consumer, w))
    pl.when(wg == CONSUMERS)(producer)


def ws_launch(body, plan: WsPlan, *, m_pad: int, n: int, out_dtype, scratch, interpret: bool,
              compiler_params=None):  # fmt: skip
    """`plgpu.kernel` of a `ws_gemm` body over `plan.programs` programs (axis "p") of CONSUMERS + 1
    warpgroups (axis "wg"): one output [m_pad, n] of `out_dtype`, or with split-K fp32 partials
    [k_splits, m_pad, n] (one per split); under the GPU interpreter when `interpret`."""
    out_shape = (m_pad, n) if plan.k_splits == 1 else (plan.k_splits, m_pad, n)
    out_dtype = out_dtype if plan.k_splits == 1 else jnp.float32
    kwargs = dict(out_type=(jax.ShapeDtypeStruct(out_shape, out_dtype),), scratch_types=scratch,
                  grid=(plan.programs,), grid_names=("p",), num_threads=CONSUMERS + 1,
                  thread_name="wg")  # fmt: skip
    if compiler_params is not None:
        kwargs["compiler_params"] = compiler_params
    if interpret:
        kwargs["interpret"] = _compat.gpu_interpret_params()
    return plgpu.kernel(body, **kwargs)
