"""Block manager and scheduler: direct examples plus a host-side engine-loop simulation.

The simulation plays the engine: each step it applies the schedule (writes each fed token into a
fake KV cache at its page slot, advances `num_computed_tokens`), and a sequence whose tokens are
all computed first checks that its whole context is intact in its own pages, then "samples"
`fake_token(seq_id, position)` and finishes at `max_tokens`. Because sampled tokens depend only on
the position, a preempted-and-resumed sequence must produce exactly the no-preemption stream.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxinfer.engine.block_manager import SCRATCH_PAGE, BlockManager
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.request import SamplingParams, SeqStatus, Sequence
from jaxinfer.engine.scheduler import POLICIES, Scheduler

RUNNING, WAITING, PREEMPTED = SeqStatus.RUNNING, SeqStatus.WAITING, SeqStatus.PREEMPTED


def make_seq(seq_id, prompt_len, max_tokens, arrival=0.0, priority=0):
    prompt = [(7 * seq_id + 3 * i) % 101 for i in range(prompt_len)]
    return Sequence(seq_id, prompt, SamplingParams(max_tokens=max_tokens), arrival, priority)


def fake_token(seq_id: int, position: int) -> int:
    return (seq_id * 1_000_003 + position * 7_919) % 50_021


def expected_outputs(seq: Sequence) -> list[int]:
    p = seq.num_prompt_tokens
    return [fake_token(seq.seq_id, p + i) for i in range(seq.sampling.max_tokens)]


def sched_config(scheduler="fcfs", max_num_seqs=32, max_num_batched_tokens=512,
                 chunked_prefill=True, max_model_len=1024, **kw) -> EngineConfig:  # fmt: skip
    """The engine config the scheduler reads (its fields in the scheduler's order)."""
    return EngineConfig(scheduler=scheduler, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens,
                        chunked_prefill=chunked_prefill, max_model_len=max_model_len, **kw)  # fmt: skip


# -- the simulated engine loop ---------------------------------------------------------------------
def simulate(specs, cfg: EngineConfig, num_pages: int, page_size: int, allocation: str):
    """specs: (arrival_step, prompt_len, max_tokens, priority), seq_id = index. Checks every step."""
    bm = BlockManager(num_pages, page_size, allocation)
    sch = Scheduler(cfg, bm)
    policy = POLICIES[cfg.scheduler]
    seqs = [make_seq(i, p, m, float(a), pr) for i, (a, p, m, pr) in enumerate(specs)]
    kv: dict[tuple[int, int], tuple[int, int, int]] = {}  # (page, slot) -> (seq_id, pos, token)
    first_admission: dict[int, float] = {}  # seq_id -> first scheduled step, in admission order
    rejected, step, preemptions = set(), 0, 0
    static_batch: set[int] = set()  # static: the batch formed at the last idle step
    last_arrival = max((a for a, *_ in specs), default=0)
    while step <= last_arrival or sch.has_unfinished():
        assert step < 5_000, "the simulated engine loop did not terminate"
        now = float(step)
        for seq in seqs:
            if seq.arrival_time == now and not sch.add(seq):
                rejected.add(seq.seq_id)
        running_before = [s for s in seqs if s.status is RUNNING]
        waiting_order = sorted(
            (s for s in seqs if s.status in (WAITING, PREEMPTED) and s.arrival_time <= now),
            key=lambda s: (s.status is not PREEMPTED, *policy.key(s)),
        )
        if not running_before:
            static_batch = {s.seq_id for s in waiting_order[: cfg.max_num_seqs]}
        had_work = sch.has_unfinished()
        out = sch.schedule(now)
        preemptions += len(out.preempted)

        # -- properties of this step's schedule ----------------------------------------------------
        bm.check_invariants()
        assert not out.failed  # anything that cannot fit alone was rejected by add()
        assert not had_work or out.scheduled, "no progress while work is pending"
        owned = [p for s in seqs for p in s.page_ids]
        assert len(owned) == len(set(owned)), "a page is owned by two live sequences"
        assert SCRATCH_PAGE not in owned
        for s in seqs:
            assert bool(s.page_ids) == (s.status is RUNNING)
        assert sch.num_running <= cfg.max_num_seqs
        assert len(out.scheduled) <= cfg.max_num_seqs
        ids = [id(x.seq) for x in out.scheduled]
        assert len(ids) == len(set(ids))
        if out.num_batched_tokens > cfg.max_num_batched_tokens:  # the documented exception
            (only,) = out.scheduled
            assert not cfg.chunked_prefill
            assert only.seq.num_computed_tokens == 0 and only.num_new_tokens == only.seq.num_tokens
        for x in out.scheduled:
            seq, n = x.seq, x.num_new_tokens
            assert seq.status is RUNNING and 1 <= n <= seq.num_uncomputed_tokens
            if not cfg.chunked_prefill:
                assert n == seq.num_uncomputed_tokens
            held = (
                seq.num_computed_tokens + n if allocation == "on_demand" else seq.max_total_tokens
            )
            assert len(seq.page_ids) == bm.pages_for(held)
        scheduled_ids = {x.seq.seq_id for x in out.scheduled}
        for s in sch.running:  # decode-first: every running decode got its token
            if s.num_uncomputed_tokens == 1:
                assert s.seq_id in scheduled_ids
        for s in out.preempted:  # victims come last in policy order among the running
            assert s.status is PREEMPTED and s.num_computed_tokens == 0 and not s.page_ids
            assert all(policy.key(r) < policy.key(s) for r in sch.running)
        admitted = [s for s in waiting_order if s.status is RUNNING]
        assert admitted == waiting_order[: len(admitted)], "admission overtook the queue order"
        if out.preempted:
            assert not admitted
        if not policy.admits_while_running:  # only members of the batch formed when idle
            assert {s.seq_id for s in admitted} <= static_batch
        if out.is_decode_only:
            assert all(x.seq.num_uncomputed_tokens == 1 for x in out.scheduled)
        for x in out.scheduled:
            first_admission.setdefault(x.seq.seq_id, now)
            assert x.seq.scheduled_time == first_admission[x.seq.seq_id]

        # -- run the step ----------------------------------------------------------------------------
        for x in out.scheduled:
            seq, start = x.seq, x.seq.num_computed_tokens
            tokens = seq.all_token_ids[start : start + x.num_new_tokens]
            for pos, tok in enumerate(tokens, start):
                kv[(seq.page_ids[pos // page_size], pos % page_size)] = (seq.seq_id, pos, tok)
            seq.num_computed_tokens += x.num_new_tokens
            if seq.num_computed_tokens == seq.num_tokens:
                for pos, tok in enumerate(seq.all_token_ids):  # the whole context is intact
                    slot = (seq.page_ids[pos // page_size], pos % page_size)
                    assert kv.get(slot) == (seq.seq_id, pos, tok)
                seq.output_token_ids.append(fake_token(seq.seq_id, seq.num_tokens))
                if len(seq.output_token_ids) == seq.sampling.max_tokens:
                    sch.finish(seq, "length", now)
        step += 1

    # -- end state ---------------------------------------------------------------------------------
    bm.check_invariants()
    assert bm.num_free_pages == num_pages - 1 and bm.num_used_pages == 0
    for seq in seqs:
        if seq.seq_id in rejected:
            assert seq.status is SeqStatus.FAILED and seq.error and seq.finish_reason == "error"
            assert (
                seq.max_total_tokens > cfg.max_model_len
                or bm.pages_for(seq.max_total_tokens) > num_pages - 1
            )
        else:
            assert seq.status is SeqStatus.FINISHED and seq.finish_reason == "length"
            assert seq.output_token_ids == expected_outputs(seq)
            assert seq.scheduled_time is not None and seq.scheduled_time >= seq.arrival_time
    assert preemptions == sum(s.num_preemptions for s in seqs)
    if cfg.scheduler in ("fcfs", "static"):  # seq_id order == arrival order in `specs`
        assert list(first_admission) == sorted(first_admission)
    return seqs, preemptions


workload = st.lists(
    st.tuples(
        st.integers(0, 6),  # arrival step
        st.integers(1, 16),  # prompt length
        st.integers(1, 12),  # max_tokens
        st.integers(0, 3),  # priority
    ),
    min_size=2,
    max_size=12,
).map(lambda specs: sorted(specs, key=lambda s: s[0]))  # seq_id order == arrival order


def run_case(
    specs,
    policy,
    allocation,
    page_size,
    capacity_scale,
    max_num_seqs,
    budget,
    chunked,
    max_model_len,
):
    largest = max(p + m for _, p, m, _ in specs)
    num_pages = 1 + max(1, math.ceil(largest * capacity_scale / page_size))
    # (lpm needs the cache switched on; this block manager has none, so it orders as fcfs)
    cfg = sched_config(policy, max_num_seqs, budget, chunked, max_model_len,
                       prefix_caching=policy == "lpm")  # fmt: skip
    seqs, preemptions = simulate(specs, cfg, num_pages, page_size, allocation)
    event("preempted" if preemptions else "no preemption")
    event(f"{sum(s.status is SeqStatus.FAILED for s in seqs) * 4 // len(seqs)}/4 rejected")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=workload,
    policy=st.sampled_from(sorted(POLICIES)),
    allocation=st.sampled_from(["on_demand", "reserve_max"]),
    page_size=st.sampled_from([1, 4, 16]),
    # cache size relative to the largest request: < 1 rejects some, ~1-2 forces preemption
    capacity_scale=st.sampled_from([0.7, 1.0, 1.3, 1.6, 2.0, 3.0, 6.0]),
    max_num_seqs=st.integers(1, 6),
    extra_budget=st.integers(0, 40),
    chunked=st.booleans(),
    max_model_len=st.sampled_from([20, 32, 64]),
)
def test_simulated_engine_loop(
    specs,
    policy,
    allocation,
    page_size,
    capacity_scale,
    max_num_seqs,
    extra_budget,
    chunked,
    max_model_len,
):
    run_case(
        specs,
        policy,
        allocation,
        page_size,
        capacity_scale,
        max_num_seqs,
        max_num_seqs + extra_budget,
        chunked,
        max_model_len,
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=workload,
    policy=st.sampled_from(sorted(POLICIES)),
    page_size=st.sampled_from([1, 4, 16]),
    capacity_scale=st.sampled_from([1.0, 1.3, 1.6]),
    max_num_seqs=st.integers(2, 6),
    extra_budget=st.integers(0, 40),
    chunked=st.booleans(),
)
def test_simulated_engine_loop_under_page_pressure(
    specs, policy, page_size, capacity_scale, max_num_seqs, extra_budget, chunked
):
    """Paged allocation with a cache about one request large: preemption is common."""
    run_case(
        specs,
        policy,
        "on_demand",
        page_size,
        capacity_scale,
        max_num_seqs,
        max_num_seqs + extra_budget,
        chunked,
        64,
    )


# -- block manager examples ------------------------------------------------------------------------
def test_scratch_page_matches_kv_cache():
    from jaxinfer.kv import cache

    assert cache.SCRATCH_PAGE == SCRATCH_PAGE


def test_on_demand_grows_page_by_page():
    bm = BlockManager(num_pages=9, page_size=4, policy="on_demand")
    seq = make_seq(0, prompt_len=5, max_tokens=20)
    for n, pages in [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (3, 3)]:  # never shrinks
        assert bm.allocate(seq, n)
        assert len(seq.page_ids) == pages and bm.num_used_pages == pages
        bm.check_invariants()
    assert SCRATCH_PAGE not in seq.page_ids
    bm.free(seq)
    assert seq.page_ids == [] and bm.num_free_pages == 8
    bm.check_invariants()


def test_reserve_max_reserves_at_first_allocation():
    bm = BlockManager(num_pages=9, page_size=4, policy="reserve_max")
    seq = make_seq(0, prompt_len=5, max_tokens=10)  # 15 tokens -> 4 pages
    assert bm.pages_needed(seq, 1) == 4
    assert bm.allocate(seq, 1) and len(seq.page_ids) == 4
    pages = list(seq.page_ids)
    assert bm.allocate(seq, 15) and seq.page_ids == pages  # nothing new later
    assert bm.num_free_pages == 4
    bm.check_invariants()


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_pages=4, page_size=2)  # 3 allocatable pages
    a, b = make_seq(0, 4, 4), make_seq(1, 4, 4)
    assert bm.allocate(a, 4)
    assert not bm.can_allocate(b, 4) and not bm.allocate(b, 4)
    assert b.page_ids == [] and bm.num_free_pages == 1
    assert bm.allocate(b, 2) and bm.num_free_pages == 0
    bm.check_invariants()


def test_wasted_slots_paged_vs_contiguous():
    wasted = {}
    for policy in ("on_demand", "reserve_max"):
        bm = BlockManager(num_pages=64, page_size=4, policy=policy)
        seqs = [make_seq(i, prompt_len=5, max_tokens=30) for i in range(3)]
        for s in seqs:
            assert bm.allocate(s, 6)
            s.num_computed_tokens = 6
        wasted[policy] = bm.wasted_slots(seqs)
        assert wasted[policy] == bm.wasted_slots()  # default: every holder
    assert wasted["on_demand"] == 3 * (8 - 6)
    assert wasted["reserve_max"] == 3 * (36 - 6)


def test_share_refcounts_and_free():
    bm = BlockManager(num_pages=6, page_size=4)
    a, b = make_seq(0, 8, 4), make_seq(1, 8, 4)
    assert bm.allocate(a, 8)
    bm.share(b, a.page_ids[:1])
    assert bm.allocate(b, 8) and len(b.page_ids) == 2 and b.page_ids[0] == a.page_ids[0]
    assert bm.num_used_pages == 3
    bm.check_invariants()
    bm.free(a)  # the shared page stays with b
    assert bm.num_used_pages == 2
    bm.check_invariants()
    bm.free(b)
    assert bm.num_free_pages == 5
    bm.check_invariants()
    with pytest.raises(ValueError, match="not an allocated page"):
        bm.share(b, [1])


def test_check_invariants_catches_corruption():
    bm = BlockManager(num_pages=4, page_size=2)
    a = make_seq(0, 2, 2)
    assert bm.allocate(a, 2)
    a.page_ids.append(a.page_ids[0])  # someone else mutates the page list
    with pytest.raises(AssertionError):
        bm.check_invariants()


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(1, 20))))
def test_block_manager_random_ops(ops):
    """Random allocate / share / free on 4 sequences keep the invariants."""
    bm = BlockManager(num_pages=8, page_size=3)
    seqs = [make_seq(i, 1, 1) for i in range(4)]
    for who, op, n in ops:
        seq = seqs[who]
        if op == 0:
            before = list(seq.page_ids)
            if not bm.allocate(seq, n):
                assert seq.page_ids == before
            else:
                assert len(seq.page_ids) == max(len(before), bm.pages_for(n))
        elif op == 1:
            donor = seqs[(who + 1) % 4]
            pages = [p for p in donor.page_ids if p not in seq.page_ids][:1]
            bm.share(seq, pages)
        else:
            bm.free(seq)
        bm.check_invariants()
        assert bm.num_free_pages + bm.num_used_pages == 7
    for seq in seqs:
        bm.free(seq)
    assert bm.num_free_pages == 7


def test_block_manager_bad_args():
    for kwargs, name in [
        ({"num_pages": 1, "page_size": 4}, "num_pages"),
        ({"num_pages": 8, "page_size": 0}, "page_size"),
        ({"num_pages": 8, "page_size": 4, "policy": "lazy"}, "policy"),
    ]:
        with pytest.raises(ValueError, match=name):
            BlockManager(**kwargs)


# -- scheduler examples ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"scheduler": "lifo"}, "scheduler"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "max_num_batched_tokens"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"chunked_prefill": "yes"}, "chunked_prefill"),
    ],
)
def test_config_validation_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=f"engine.{name}="):
        sched_config(**kwargs)


def step(sch: Scheduler, now: float, finish_at: dict | None = None):
    """Run one step like the engine; returns [(seq_id, num_new_tokens)] and the output."""
    out = sch.schedule(now)
    for x in out.scheduled:
        x.seq.num_computed_tokens += x.num_new_tokens
        if x.seq.num_computed_tokens == x.seq.num_tokens:
            x.seq.output_token_ids.append(fake_token(x.seq.seq_id, x.seq.num_tokens))
            if len(x.seq.output_token_ids) == x.seq.sampling.max_tokens:
                sch.finish(x.seq, "length", now)
    return [(x.seq.seq_id, x.num_new_tokens) for x in out.scheduled], out


def test_add_rejects_what_can_never_run():
    bm = BlockManager(num_pages=5, page_size=4)  # 16 token slots
    sch = Scheduler(sched_config(max_model_len=32), bm)
    too_long, too_big, empty, ok = (
        make_seq(0, 30, 3),
        make_seq(1, 10, 10),
        make_seq(2, 0, 3),
        make_seq(3, 10, 6),
    )
    assert not sch.add(too_long) and "max_model_len=32" in too_long.error
    assert not sch.add(too_big) and "KV pages" in too_big.error
    assert not sch.add(empty) and "empty" in empty.error
    for s in (too_long, too_big, empty):
        assert s.status is SeqStatus.FAILED and s.finish_reason == "error"
    assert sch.add(ok) and sch.num_waiting == 1


def test_chunked_prefill_splits_a_long_prompt():
    sch = Scheduler(sched_config(max_num_seqs=2, max_num_batched_tokens=8), BlockManager(32, 4))
    sch.add(make_seq(0, 20, 2))
    steps = [step(sch, float(t))[0] for t in range(5)]
    assert steps == [[(0, 8)], [(0, 8)], [(0, 4)], [(0, 1)], []]
    assert not sch.has_unfinished()


def test_unchunked_long_prompt_runs_alone():
    cfg = sched_config(max_num_seqs=4, max_num_batched_tokens=8, chunked_prefill=False)
    sch = Scheduler(cfg, BlockManager(64, 4))
    sch.add(make_seq(0, 3, 3))
    sch.add(make_seq(1, 20, 1))  # longer than the budget
    sch.add(make_seq(2, 2, 1))  # must not overtake seq 1
    got = [step(sch, float(t))[0] for t in range(6)]
    assert got == [[(0, 3)], [(0, 1)], [(0, 1)], [(1, 20)], [(2, 2)], []]


def test_decode_first_then_prefill_under_budget():
    sch = Scheduler(sched_config(max_num_seqs=4, max_num_batched_tokens=6), BlockManager(64, 4))
    sch.add(make_seq(0, 4, 5))
    assert step(sch, 0.0)[0] == [(0, 4)]
    sch.add(make_seq(1, 10, 5))
    ids, out = step(sch, 1.0)
    assert ids == [(0, 1), (1, 5)] and not out.is_decode_only
    ids, out = step(sch, 2.0)
    assert ids == [(0, 1), (1, 5)]
    ids, out = step(sch, 3.0)
    assert ids == [(0, 1), (1, 1)] and out.is_decode_only


def test_preemption_victim_is_last_in_policy_order_and_resumes():
    # 4 pages of 2 tokens; two sequences of 3-token prompts grow until they collide.
    cfg = sched_config(scheduler="priority", max_num_seqs=2, max_num_batched_tokens=8)
    bm = BlockManager(5, 2)
    sch = Scheduler(cfg, bm)
    low, high = make_seq(0, 3, 4, priority=5), make_seq(1, 3, 4, priority=1)
    sch.add(low)
    sch.add(high)
    assert step(sch, 0.0)[0] == [(1, 3), (0, 3)]  # priority order; 2 pages each
    assert step(sch, 1.0)[0] == [(1, 1), (0, 1)]  # 4 tokens still fit in 2 pages
    ids, out = step(sch, 2.0)  # both need a third page: none free -> low is preempted
    assert out.preempted == [low] and ids == [(1, 1)]
    assert low.status is PREEMPTED and low.num_computed_tokens == 0 and low.num_preemptions == 1
    assert low.output_token_ids == [fake_token(0, 3), fake_token(0, 4)]  # it keeps its outputs
    assert sch.waiting == [low]
    t = 3.0
    while sch.has_unfinished():
        step(sch, t)
        bm.check_invariants()
        t += 1
    for s in (low, high):
        assert s.status is SeqStatus.FINISHED and s.output_token_ids == expected_outputs(s)
    assert bm.num_free_pages == 4


def test_preempted_goes_to_front_of_waiting():
    cfg = sched_config(scheduler="fcfs", max_num_seqs=2, max_num_batched_tokens=16)
    sch = Scheduler(cfg, BlockManager(5, 2))
    a, b, c = make_seq(0, 3, 4, 0.0), make_seq(1, 3, 4, 0.0), make_seq(2, 1, 1, 2.0)
    sch.add(a)
    sch.add(b)
    step(sch, 0.0)
    step(sch, 1.0)
    sch.add(c)
    _, out = step(sch, 2.0)
    assert out.preempted == [b]  # b arrived after a
    assert sorted(sch.waiting, key=sch._waiting_key) == [b, c]


def test_static_admits_only_when_idle():
    cfg = sched_config(scheduler="static", max_num_seqs=2, max_num_batched_tokens=64)
    sch = Scheduler(cfg, BlockManager(64, 4))
    sch.add(make_seq(0, 4, 1))
    sch.add(make_seq(1, 4, 3))
    sch.add(make_seq(2, 4, 1))
    assert step(sch, 0.0)[0] == [(0, 4), (1, 4)]  # batch {0, 1}; 0 finishes at once
    assert step(sch, 1.0)[0] == [(1, 1)]  # 2 waits although a slot is free
    assert step(sch, 2.0)[0] == [(1, 1)]
    assert step(sch, 3.0)[0] == [(2, 4)]


def test_static_batch_fills_over_several_steps_of_the_token_budget():
    # 4 prompts of 6 tokens under an 8-token budget: the batch of max_num_seqs=3 needs 3 steps to
    # admit; the 4th request waits for the whole batch although slots and budget are free.
    cfg = sched_config(scheduler="static", max_num_seqs=3, max_num_batched_tokens=8)
    sch = Scheduler(cfg, BlockManager(64, 4))
    for i in range(4):
        sch.add(make_seq(i, 6, 2 if i == 0 else 4))
    assert step(sch, 0.0)[0] == [(0, 6), (1, 2)]
    assert sch.can_admit_waiting  # the batch is still forming
    assert step(sch, 1.0)[0] == [(0, 1), (1, 4), (2, 3)]  # 0 finishes
    assert step(sch, 2.0)[0] == [(1, 1), (2, 3)]
    assert not sch.can_admit_waiting  # batch {0, 1, 2} admitted: 3 waits for all of it
    assert step(sch, 3.0)[0] == [(1, 1), (2, 1)]
    assert step(sch, 4.0)[0] == [(1, 1), (2, 1)]  # 1 finishes
    assert step(sch, 5.0)[0] == [(2, 1)]  # 2 finishes
    assert step(sch, 6.0)[0] == [(3, 6)]


def test_static_batch_member_aborted_before_admission_is_dropped():
    cfg = sched_config(scheduler="static", max_num_seqs=3, max_num_batched_tokens=8)
    sch = Scheduler(cfg, BlockManager(64, 4))
    seqs = [make_seq(i, 6, 3) for i in range(4)]
    for s in seqs:
        sch.add(s)
    assert step(sch, 0.0)[0] == [(0, 6), (1, 2)]
    sch.abort(seqs[2], 0.5)  # a member of the forming batch, still waiting
    assert step(sch, 1.0)[0] == [(0, 1), (1, 4)]  # 3 is not a member: it waits
    assert not sch.can_admit_waiting


def test_abort_and_fail_free_pages():
    bm = BlockManager(16, 4)
    sch = Scheduler(sched_config(), bm)
    a, b, c = make_seq(0, 5, 5), make_seq(1, 5, 5), make_seq(2, 5, 5)
    for s in (a, b, c):
        sch.add(s)
    step(sch, 0.0)
    sch.abort(a, 1.0)
    sch.fail(b, "device error", 1.0)
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "abort" and not a.page_ids
    assert b.status is SeqStatus.FAILED and b.error == "device error" and b.finish_time == 1.0
    assert sch.num_running == 1 and bm.num_used_pages == 2
    bm.check_invariants()


def test_forced_preemption_keeps_the_token_stream():
    specs = [(0, 6, 10, 0), (0, 7, 10, 0), (1, 5, 10, 0), (2, 9, 8, 0)]
    cfg = sched_config("fcfs", 4, 16, True, 64)
    seqs, preemptions = simulate(specs, cfg, num_pages=9, page_size=4, allocation="on_demand")
    assert preemptions > 0 and any(s.num_preemptions for s in seqs)
    roomy, none = simulate(specs, cfg, num_pages=64, page_size=4, allocation="on_demand")
    assert none == 0
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in roomy]
