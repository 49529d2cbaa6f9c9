"""Grouped GEMM (the MoE expert matmul) on Hopper, in Mosaic GPU (Pallas).

out [M, N] = lhs [M, K] @ rhs[g] [K, N] for the rows of group g (`lax.ragged_dot`'s semantics,
`reference.py`): bf16 or f16 in, fp32 accumulation, lhs's dtype out. `group_sizes` is data: one
compiled kernel serves every routing of the same shapes.

How the work is cut
-------------------
- Row tiles follow the groups, not a fixed grid over M: group g gets the `block_m`-row windows
  from its first row rounded down to a multiple of 8 (Mosaic lowers a TMA load into the swizzled
  tile only from a row offset it can prove is a multiple of 8), the last one clamped to end at
  M. A window holds rows of its own group and, at its edges, rows of its neighbours: those are
  loaded and multiplied but never stored. An empty group gets no tile, so its weights are never
  read: with a few rows per expert (decode) a tile is one expert's rows, and each touched
  expert's weights stream from HBM once per N block. The rows past sum(group_sizes) are one more
  group whose tiles store zeros without a K loop.
- XLA computes the table of tiles from group_sizes (`tile_schedule`: group, window start, rows
  [lo, hi) to store; `max_tiles` entries, a static bound; entries past the real count are empty).
- The kernel is persistent: one program per SM walks the work items (tile, N block) with
  `plgpu.nd_loop`, in `plgpu.planar_snake` order over bands of `grid_block_n` N blocks, so that
  the programs running at once share lhs windows and weight columns in L2.
- K loop: `plgpu.emit_pipeline`, `num_stages` TMA stages of an lhs [block_m, block_k] and an rhs
  [block_k, block_n] tile, one async wgmma a step into an fp32 accumulator. A stage is refilled
  one step after its wgmma was issued (`delay_release=1`), and `wgmma_wait(1)` guarantees that
  wgmma has finished by then.
- Store, masked by rows: the accumulator goes to SMEM in lhs's dtype, then to GMEM by TMA, rows
  [lo, hi) only, as one copy of 2^i rows for each set bit i of hi - lo (a TMA box has a static
  shape). The copies run on while the next item's K loop starts; the SMEM buffer is rewritten
  only once they have read it.

One kernel, two regimes (`default_tiling`): 64-row tiles (one wgmma M) when groups average fewer
than 128 rows (decode: the weights streamed, memory bound), 128-row tiles otherwise (prefill:
tensor-core bound). The tile sizes are options; `experiments/bench_grouped_matmul.py --sweep`
measures them on the GPU.

Not yet done (measure first): warp specialisation (a producer warpgroup feeding two consumer
warpgroups, as jax's hopper_matmul_mgpu), TMA multicast of the weights in a cluster, a swizzled
epilogue in sub-tiles, split-K for decode when few experts are touched.

On CPU the kernel runs under jax's GPU interpreter (`interpret=True`: programs one after
another, so the pipeline's ordering is not exercised there; wgmma a plain dot).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ROW_ALIGN = 8  # window starts (TMA row offsets into the swizzled lhs tile)
SMEM_BYTES = 227 * 1024  # shared memory a Hopper program may take


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static tuning of one launch.

    block_m: rows of a tile (a multiple of 64, wgmma's M, up to 256); block_n, block_k: output
    columns and inputs of one pipeline step (multiples of 64, block_n up to 256); num_stages:
    TMA stages in flight (>= 2: a stage is released one step late); grid_block_n: N blocks of a
    band of the snake (the items of one row tile that run next to each other). One warpgroup
    holds the fp32 accumulator, block_m * block_n / 128 registers a thread: past 192 x 128 it
    spills or does not compile (ptxas, on the GPU only).
    """

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    grid_block_n: int

    def check(self, k: int, n: int, itemsize: int) -> None:
        """ValueError naming the option (or the dimension of the argument) that does not fit."""
        for name, hi in (("block_m", 256), ("block_n", 256), ("block_k", None)):
            v = getattr(self, name)
            if v < 64 or v % 64 or (hi is not None and v > hi):
                bound = f" in 64..{hi}" if hi else ""
                raise ValueError(f"{name} must be a multiple of 64{bound}, got {v}")
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")
        if self.grid_block_n < 1:
            raise ValueError(f"grid_block_n must be >= 1, got {self.grid_block_n}")
        if k % self.block_k:
            raise ValueError(f"lhs, rhs: K must be a multiple of block_k={self.block_k}, got {k}")
        if n % self.block_n:
            raise ValueError(f"rhs: N must be a multiple of block_n={self.block_n}, got {n}")
        if self.smem_bytes(itemsize, k) > SMEM_BYTES:
            raise ValueError(f"{self} takes {self.smem_bytes(itemsize, k)} bytes of shared memory "
                             f"at K={k}, more than {SMEM_BYTES}: lower num_stages or a block "
                             "size")  # fmt: skip

    def smem_bytes(self, itemsize: int, k: int) -> int:
        """Pipeline stages (no more than the K steps: emit_pipeline trims them) and the output
        tile."""
        stages = min(self.num_stages, k // self.block_k)
        stage = (self.block_m * self.block_k + self.block_k * self.block_n) * itemsize
        return stages * stage + self.block_m * self.block_n * itemsize


DECODE = Tiling(block_m=64, block_n=128, block_k=64, num_stages=6, grid_block_n=8)
PREFILL = Tiling(block_m=128, block_n=128, block_k=64, num_stages=4, grid_block_n=8)
OPTIONS = tuple(f.name for f in dataclasses.fields(Tiling))


def default_tiling(m: int, num_groups: int, n: int) -> Tiling:
    """DECODE when the groups average fewer than 128 rows, PREFILL otherwise; block_n 64 where
    N is not a multiple of 128."""
    tiling = DECODE if m < 128 * num_groups else PREFILL
    if n % tiling.block_n:
        tiling = dataclasses.replace(tiling, block_n=64)
    return tiling


def check_inputs(lhs, rhs, group_sizes) -> None:
    """ValueError naming the argument whose shape or dtype does not fit (every backend)."""
    if lhs.ndim != 2 or lhs.dtype not in DTYPES:
        raise ValueError(f"lhs must be bf16 or f16 [M, K], got {lhs.dtype} {tuple(lhs.shape)}")
    if rhs.ndim != 3 or rhs.dtype != lhs.dtype:
        raise ValueError(f"rhs must be {lhs.dtype} (lhs's dtype) [G, K, N], got {rhs.dtype} "
                         f"{tuple(rhs.shape)}")  # fmt: skip
    if rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs: K must match lhs's K = {lhs.shape[1]}, got rhs "
                         f"{tuple(rhs.shape)}")  # fmt: skip
    if group_sizes.shape != rhs.shape[:1] or group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes must be int32 [G] with G = {rhs.shape[0]} (rhs's groups), "
                         f"got {group_sizes.dtype} {tuple(group_sizes.shape)}")  # fmt: skip


def max_tiles(m: int, num_groups: int, block_m: int) -> int:
    """A bound on the tiles of any routing: each of the G + 1 groups (the last: the rows past the
    others) of s rows spans at most (s + 7 + block_m - 1) // block_m windows."""
    return (m + (num_groups + 1) * (block_m + ROW_ALIGN - 2)) // block_m


def tile_schedule(group_sizes: jax.Array, m: int, m_pad: int, block_m: int) -> jax.Array:
    """int32 [4, max_tiles(m_pad, G, block_m)]: for each tile its group (G: the rows past the
    groups, stored as zeros), window start row0 (a multiple of 8, row0 + block_m <= m_pad) and
    the rows [lo, hi) it stores, row0 <= lo <= hi <= row0 + block_m; lo == hi: an empty tile.
    The tiles' [lo, hi) partition [0, m_pad). Groups are cut at row m (lax.ragged_dot's
    semantics); rows [m, m_pad) are padding (zeros)."""
    g = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), m)
    ends = jnp.append(ends, m_pad).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    origin = starts // ROW_ALIGN * ROW_ALIGN
    count = jnp.where(ends > starts, (ends - origin + block_m - 1) // block_m, 0)
    tiles_end = jnp.cumsum(count)
    t = jnp.arange(max_tiles(m_pad, g, block_m), dtype=jnp.int32)
    group = jnp.sum(tiles_end[None, :] <= t[:, None], axis=1, dtype=jnp.int32)  # G + 1: no tile
    live = group <= g
    group = jnp.minimum(group, g)
    row0 = origin[group] + (t - tiles_end[group] + count[group]) * block_m
    lo = jnp.where(live, jnp.maximum(row0, starts[group]), 0)
    hi = jnp.where(live, jnp.minimum(row0 + block_m, ends[group]), 0)
    row0 = jnp.where(live, jnp.minimum(row0, m_pad - block_m), 0)
    return jnp.stack([group, row0, lo, hi]).astype(jnp.int32)


def grouped_matmul_mgpu(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_stages: int | None = None,
    grid_block_n: int | None = None,
    num_sms: int | None = None,
    interpret: bool | None = None,
    device: jax.Device | None = None,
) -> jax.Array:
    """lhs [M, K] @ rhs [G, K, N] by group (rows sorted by group, `group_sizes` int32 [G]) ->
    [M, N] in lhs's dtype. Tuning options (static) override `default_tiling`'s fields; `num_sms`
    is the persistent grid (default: `device`'s SMs; 2 when interpreted). `interpret` runs the
    GPU interpreter (default: when `device`, None for `jax.devices()[0]`, is not a GPU)."""
    check_inputs(lhs, rhs, group_sizes)
    m, k = lhs.shape
    g, _, n = rhs.shape
    given = dict(block_m=block_m, block_n=block_n, block_k=block_k, num_stages=num_stages,
                 grid_block_n=grid_block_n)  # fmt: skip
    tiling = dataclasses.replace(default_tiling(m, g, n),
                                 **{key: int(v) for key, v in given.items() if v is not None})  # fmt: skip
    tiling.check(k, n, lhs.dtype.itemsize)
    interpret = _compat.default_interpret(device) if interpret is None else bool(interpret)
    if num_sms is None:
        num_sms = 2 if interpret else _compat.num_sms(device)
    if num_sms < 1:
        raise ValueError(f"num_sms must be >= 1, got {num_sms}")
    # Windows start on 8-row boundaries and end by M: pad M up to that (a copy of lhs only then).
    m_pad = max(tiling.block_m, -(-m // ROW_ALIGN) * ROW_ALIGN)
    x = lhs if m_pad == m else jnp.pad(lhs, ((0, m_pad - m), (0, 0)))
    tiles = tile_schedule(group_sizes, m, m_pad, tiling.block_m)
    kernel = _build_kernel(m=m_pad, k=k, n=n, g=g, dtype=lhs.dtype, tiling=tiling,
                           num_sms=int(num_sms), interpret=interpret)  # fmt: skip
    out = kernel(tiles, x, rhs)
    return out if m_pad == m else out[:m]


# ---- The kernel.


def _store_rows(src, dst, row0, lo, hi, col0) -> None:
    """TMA-store rows [lo, hi) of the tile in `src` (SMEM rows from lo - row0) to the same rows of
    `dst`, columns [col0, col0 + block_n): one copy of 2^i rows for each set bit i of hi - lo."""
    block_m, block_n = src.shape
    count, at = hi - lo, lo - row0
    rows = 1 << (block_m.bit_length() - 1)
    while rows:

        @pl.when(count & rows != 0)
        def _copy(at=at, rows=rows):
            plgpu.copy_smem_to_gmem(src.at[pl.ds(at, rows)],
                                    dst.at[pl.ds(row0 + at, rows), pl.ds(col0, block_n)])  # fmt: skip

        at = at + (count & rows)
        rows //= 2


@functools.cache
def _build_kernel(*, m: int, k: int, n: int, g: int, dtype, tiling: Tiling, num_sms: int,
                  interpret: bool):  # fmt: skip
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    n_blocks = n // bn
    n_tiles = max_tiles(m, g, bm)

    def body(tiles_ref, lhs_ref, rhs_ref, out_ref, out_smem):
        @plgpu.nd_loop((n_tiles * n_blocks,), collective_axes="sm")
        def _item(info):
            t, nb = plgpu.planar_snake(info.index[0], (n_tiles, n_blocks), 1, tiling.grid_block_n)
            group, lo, hi = tiles_ref[0, t], tiles_ref[2, t], tiles_ref[3, t]
            row0 = pl.multiple_of(tiles_ref[1, t], ROW_ALIGN)

            @pl.when(hi > lo)
            def _tile():
                def k_loop(acc_ref):
                    @pl.when(group < g)  # else the rows past the groups: zeros
                    def _():
                        def step(_, lhs_smem, rhs_smem):
                            plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
                            plgpu.wgmma_wait(1)  # the previous step's stage is released next

                        lhs_spec = plgpu.BlockSpec((pl.Element(bm), bk), lambda kk: (row0, kk),
                                                   delay_release=1)  # fmt: skip
                        rhs_spec = plgpu.BlockSpec((bk, bn), lambda kk: (kk, nb), delay_release=1)
                        plgpu.emit_pipeline(step, grid=(k // bk,), in_specs=[lhs_spec, rhs_spec],
                                            max_concurrent_steps=tiling.num_stages)(
                            lhs_ref, rhs_ref.at[group])  # fmt: skip

                    return acc_ref[...]

                acc = pl.run_scoped(k_loop, plgpu.ACC((bm, bn), jnp.float32))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's store read it
                out_smem[...] = acc.astype(dtype)
                plgpu.commit_smem()
                _store_rows(out_smem, out_ref, row0, lo, hi, nb * bn)

        plgpu.wait_smem_to_gmem(0)

    kwargs = dict(
        out_type=jax.ShapeDtypeStruct((m, n), dtype),
        scratch_types=[plgpu.SMEM((bm, bn), dtype)],
        grid=(num_sms,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )  # fmt: skip
    if interpret:
        kwargs["interpret"] = _compat.gpu_interpret_params()
    return plgpu.kernel(body, **kwargs)
