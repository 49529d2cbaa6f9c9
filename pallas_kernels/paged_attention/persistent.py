"""Persistent decode attention (Mosaic GPU): a fixed set of programs streams all (sequence, KV
head) work items, each program's K/V pipeline running on from one item into the next.

The one-program-per-item launch (`mosaic_gpu._build_kernel`) pays a fixed cost per program: read
its block's metadata and page ids, wait for the first tile, and at the end normalise, stage and
store the output. With two programs per SM that cost is exposed once per wave of programs; on
the H200 a decode of batch 256 x 512 tokens (8B shapes) runs about 7.8 waves, and a context sweep
(`experiments/results/h200/decode_attention_context_sweep.json`) fits ~4 us of it per wave.

Here the grid is `programs_per_sm x SMs` programs; program p takes the work items p, p + P,
p + 2P, ... (items: a decode block and a KV head). Its tile stream is one sequence across items:
the copies for the next item's first tiles are issued while the last tiles of the current one
are computed (a producer cursor runs `num_stages` tiles ahead of the consumer, crossing item
boundaries), and the next item's queries load into the output stage meanwhile (moved to the query
buffer between items: two programs must fit an SM's shared memory, which a second query buffer
broke, `experiments/results/h200/decode_attention_persistent_probe.json`). The output of an
item is staged in shared memory and stored with TMA without waiting for the store; the next
store waits only until the staging buffer has been read.

Scope: decode-only batches (one query per block), bf16 pages, one context split, outputs written
token-major ([T, Hq, D], as `mosaic_gpu`'s token-major decode), the single-warpgroup pipeline.
The work items are the non-empty blocks in order (an XLA prefix sum compacts them); items are
dealt round-robin, not balanced by length (the hardware's block scheduler balances the
one-program-per-item launch dynamically; this launch does not).

Measured on the H200 (`decode_attention_persistent_probe.json`): slower than the default launch in
every case probed, +4 to +24% (batches 32-256, contexts 512 and 2048). Two independent programs
per SM, scheduled by the hardware, already overlap one's start and end with the other's
streaming; this pipeline adds a cursor branch and scalar loads to every tile and a shared-memory
round trip of the queries between items. Kept as an option (`persistent`, off) for ablations.
(Timed at c9bcc46; the query move's load layout changed after, for jax 0.10's Mosaic, and was
checked on the GPU but not timed again.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat
from pallas_kernels._mgpu import ROWS, swizzled_smem, wgmma_dot


def work_list(meta: jax.Array) -> jax.Array:
    """[1 + nb] int32: the number of blocks with a query, then those blocks in order (the rest of
    the list is padding). `meta` is the kernel's [nb, >= 6] block metadata."""
    num_blocks = meta.shape[0]
    busy = meta[:, 2] > 0  # a block with a query (its item reads at least one tile)
    pos = jnp.where(busy, jnp.cumsum(busy) - 1, num_blocks)
    blocks = (
        jnp.zeros((num_blocks,), jnp.int32)
        .at[pos]
        .set(jnp.arange(num_blocks, dtype=jnp.int32), mode="drop")
    )
    return jnp.concatenate([jnp.sum(busy, dtype=jnp.int32)[None], blocks])


@functools.cache
def build_persistent_decode_kernel(
    *,
    num_programs,
    num_blocks,
    num_kv_heads,
    num_tokens,
    q_rows,
    group,
    head_dim,
    page_size,
    num_stages,
    block_kv,
    soft_cap,
    sliding_window,
    v_page_offset,
    interpret,
):
    """kernel(meta [nb, 7], work [1 + nb], page_table, q [Hkv, rows, D], k_pages, v_pages) ->
    ([T * Hq, D] bf16,). `meta` as `mosaic_gpu._query_blocks` (+ the padding token each block
    zeroes, column 6); `work` from `work_list`."""
    from pallas_kernels.paged_attention.mosaic_gpu import (
        NEG,
        _apply_soft_cap,
        _causal_mask,
        _kv_tile_range,
        _online_softmax,
    )

    bk = block_kv
    num_progs = num_programs
    copies = max(1, bk // page_size)  # TMA copies (pages) per tile
    num_q_heads = num_kv_heads * group
    cdt = jnp.bfloat16
    layout = plgpu.Layout.WGMMA
    mma = functools.partial(wgmma_dot, interpret=interpret)

    def cast(x, lay):  # register layouts mean nothing to the GPU interpreter
        return x if interpret else plgpu.layout_cast(x, lay)

    def iota(shape, dim):
        return cast(lax.broadcasted_iota(jnp.int32, shape, dim), layout)

    def body(meta_ref, work_ref, pt_ref, q_ref, k_ref, v_ref, o_ref,
             q_smem, k_smem, v_smem, o_smem, q_bar, k_bar, v_bar):  # fmt: skip
        prog = lax.axis_index("prog")
        n_items = work_ref[0] * num_kv_heads  # busy blocks x KV heads
        # this program's items: prog, prog + P, ... below n_items
        my_items = lax.div(jnp.maximum(n_items - prog, 0) + num_progs - 1, jnp.int32(num_progs))

        def item(j):
            """Block metadata of this program's item j (clamped into the list: always readable)."""
            k = jnp.minimum(prog + j * num_progs, num_blocks * num_kv_heads - 1)
            blk = work_ref[1 + lax.div(k, jnp.int32(num_kv_heads))]
            head = lax.rem(k, jnp.int32(num_kv_heads))
            q_pos0, n_valid, kv_len = meta_ref[blk, 1], meta_ref[blk, 2], meta_ref[blk, 3]
            t_lo, t_hi = _kv_tile_range(q_pos0, n_valid, kv_len, bk, sliding_window)
            # (>= 1: a query without keys reads one tile, all masked, and outputs zeros)
            n_tiles = jnp.maximum(t_hi - t_lo, 1)
            last_page = jnp.maximum(lax.div(kv_len - 1, jnp.int32(page_size)), 0)
            return dict(head=head, seq=meta_ref[blk, 0], q_pos0=q_pos0, kv_len=kv_len,
                        q_row0=meta_ref[blk, 4], shift=meta_ref[blk, 5], t_lo=t_lo,
                        n_tiles=n_tiles, last_page=last_page)  # fmt: skip

        # The producer cursor: (item j, its tile i, and what the copies need of item j).
        def cursor_at(j):
            it = item(j)
            return (j, jnp.int32(0), it["seq"], it["head"], it["t_lo"], it["n_tiles"],
                    it["last_page"])  # fmt: skip

        def advance(cur):
            j, i, *rest = cur
            n_tiles = cur[5]
            return lax.cond(i + 1 >= n_tiles, lambda: cursor_at(j + 1),
                            lambda: (j, i + 1, *rest))  # fmt: skip

        def issue(cur, slot):
            """The copies of the cursor's tile into `slot` (if it has one), then the next cursor."""
            j, i, seq, head, t_lo, _, last_page = cur

            @pl.when(j < my_items)
            def _():
                tile = t_lo + i
                for c in range(copies):
                    idx = lax.div(tile * bk + c * page_size, jnp.int32(page_size))
                    page = pt_ref[seq, jnp.minimum(idx, last_page)]
                    for src, dst, bar, off in ((k_ref, k_smem, k_bar, 0),
                                               (v_ref, v_smem, v_bar, v_page_offset)):  # fmt: skip
                        if page_size > bk:  # a tile is a slice of one page
                            start = pl.multiple_of(lax.rem(tile * bk, jnp.int32(page_size)), bk)
                            src_ref = src.at[page + off, pl.ds(start, bk), head]
                        else:
                            src_ref = src.at[page + off, :, head]
                        dst_ref = dst.at[slot]
                        if copies > 1:
                            dst_ref = dst.at[slot, pl.ds(c * page_size, page_size)]
                        plgpu.copy_gmem_to_smem(src_ref, dst_ref, bar.at[slot])

            return advance(cur)

        def issue_q(j, dst):
            it = item(j)
            plgpu.copy_gmem_to_smem(
                q_ref.at[it["head"], pl.ds(pl.multiple_of(it["q_row0"], 8), q_rows)],
                dst.at[pl.ds(0, q_rows)],
                q_bar.at[0],
            )

        def run_item(j, carry):
            g, cur = carry  # tiles consumed so far (slot of the next: g % num_stages), cursor
            it = item(j)
            q_w = q_smem
            has_next = j + 1 < my_items

            @pl.when(has_next)
            def _():  # the next item's queries land in the output stage once it has been read
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                issue_q(j + 1, o_smem)

            q_pos0, kv_len, shift = it["q_pos0"], it["kv_len"], it["shift"]
            n_tiles, t_lo = it["n_tiles"], it["t_lo"]

            def make_step(masked):
                def step(i, c):
                    acc, m_i, l_i, cur = c
                    slot = lax.rem(g + i, jnp.int32(num_stages))
                    base = (t_lo + i) * bk
                    shape = (ROWS, bk)
                    plgpu.barrier_wait(k_bar.at[slot])
                    s = _apply_soft_cap(mma(q_w, k_smem.at[slot], transpose_b=True), soft_cap)
                    mask = None
                    if masked:
                        mask = _causal_mask(iota, shape, row0=-shift, base=base, q_pos0=q_pos0,
                                            kv_len=kv_len, group=group,
                                            sliding_window=sliding_window)  # fmt: skip
                    p, acc, m_new, l_i = _online_softmax(s, acc, m_i, l_i, mask)
                    plgpu.barrier_wait(v_bar.at[slot])
                    v_tile = v_smem.at[slot]
                    if masked:

                        @pl.when(base + bk > kv_len)
                        def _zero_tail():  # slots past the sequence may hold anything (NaN)
                            vrow = iota((bk, head_dim), 0)
                            v = v_tile[...]
                            v_tile[...] = jnp.where(base + vrow < kv_len, v, jnp.zeros_like(v))
                            plgpu.commit_smem()

                    acc = acc + mma(p.astype(cdt), v_tile)
                    # the slot is free: refill it with the cursor's tile (maybe the next item's)
                    return acc, m_new, l_i, issue(cur, slot)

                return step

            acc = cast(jnp.zeros((ROWS, head_dim), jnp.float32), layout)
            m_i = cast(jnp.full((ROWS,), NEG, jnp.float32), layout.reduce(1))
            l_i = cast(jnp.zeros((ROWS,), jnp.float32), layout.reduce(1))
            carry = (acc, m_i, l_i, cur)
            if sliding_window is None:  # leading tiles the (one) query sees whole: no masking
                seen = jnp.minimum(q_pos0 + 1, kv_len)
                n_full = jnp.clip(lax.div(seen, jnp.int32(bk)) - t_lo, 0, n_tiles)
            else:
                n_full = jnp.int32(0)
            carry = lax.fori_loop(0, n_full, make_step(False), carry)
            acc, m_i, l_i, cur = lax.fori_loop(n_full, n_tiles, make_step(True), carry)

            @pl.when(has_next)
            def _():  # the next item's queries move from the output stage to the query buffer
                plgpu.barrier_wait(q_bar.at[0])
                # (in the wgmma layout: jax 0.10's Mosaic cannot store its default strided
                # layout of an unswizzled load into the swizzled buffer)
                q_smem[...] = (
                    o_smem[...]
                    if interpret
                    else plgpu.load(o_smem, (), layout=layout, optimized=False)
                )
                plgpu.commit_smem()

            l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
            out = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(cdt)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (the last item: its store's read)
            o_smem[...] = out
            plgpu.commit_smem()
            token = lax.div(it["q_row0"] + shift, jnp.int32(group))
            dst = pl.ds(token * num_q_heads + it["head"] * group, group)
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(shift, group)], o_ref.at[dst])
            return g + n_tiles, cur

        @pl.when(my_items > 0)
        def _():
            issue_q(0, q_smem)
            cur = cursor_at(0)
            for st in range(num_stages):
                cur = issue(cur, st)
            plgpu.barrier_wait(q_bar.at[0])
            lax.fori_loop(0, my_items, run_item, (jnp.int32(0), cur))

        # Padding tokens' outputs are zeros: (block, head) pairs prog, prog + P, ... write those
        # of the padding token their block names (meta column 6), from a zeroed stage.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_smem[...] = cast(jnp.zeros((ROWS, head_dim), cdt), layout)
        plgpu.commit_smem()

        @pl.loop(prog, num_blocks * num_kv_heads, step=num_progs)
        def _(k):
            blk = lax.div(k, jnp.int32(num_kv_heads))
            head = lax.rem(k, jnp.int32(num_kv_heads))
            zero_row = meta_ref[blk, 6]

            @pl.when(zero_row >= 0)
            def _():
                dst = pl.ds(zero_row * num_q_heads + head * group, group)
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], o_ref.at[dst])

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = [
        swizzled_smem((ROWS, head_dim), cdt),  # queries
        swizzled_smem((num_stages, bk, head_dim), cdt),
        swizzled_smem((num_stages, bk, head_dim), cdt),
        # output stage, unswizzled (rows from any offset), which also receives the next item's
        # queries while the current item runs
        plgpu.SMEM((ROWS, head_dim), cdt),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
    ]
    kwargs = dict(
        out_type=(jax.ShapeDtypeStruct((num_tokens * num_q_heads, head_dim), cdt),),
        scratch_types=scratch,
        grid=(num_programs,),
        grid_names=("prog",),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    if interpret:
        kwargs["interpret"] = _compat.gpu_interpret_params()
    return plgpu.kernel(body, **kwargs)
