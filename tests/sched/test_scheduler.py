"""Scheduler behaviour with a hand-written driver (no model): budgets, policies, preemption."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.engine.invariants import assert_no_leaks, check_kv_invariants
from labkit.kv.block_manager import BlockManager
from labkit.sched.request import Request, SequenceStatus
from labkit.sched.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=64, block_size=4, **kw):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=kw.pop("caching", True),
                      num_cpu_blocks=kw.pop("cpu", 0))
    return Scheduler(SchedulerConfig(**kw), bm, clock=lambda: 0.0), bm


def add(s, rid, prompt, max_tokens=4, n=1, priority=0):
    req = Request(rid, prompt, SimpleNamespace(n=n, max_tokens=max_tokens), 0.0, priority,
                  index=s.num_waiting + len(s.running))
    s.add_request(req)
    return req


def engine_view(s, bm, reqs):
    """What labkit.engine.invariants reads from an engine, for a bare scheduler."""
    return SimpleNamespace(block_manager=bm, scheduler=s, stats=bm.stats,
                           requests={r.request_id: r for r in reqs},
                           has_unfinished_requests=s.has_unfinished)


def run(s, bm, reqs, max_steps=500, check=None):
    """Drive to completion: each sampled token is 7; finish at max_tokens. Returns the steps."""
    steps = []
    while s.has_unfinished():
        pre = (bm.pool.num_used / bm.num_blocks, s.admitting)
        out = s.schedule()
        bm.drain()
        assert out.num_batched_tokens <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        if check:
            check(out, pre)
        for sc in out.scheduled:
            for seq in [sc.seq, *sc.children]:
                if sc.samples:
                    seq.token_ids.append(7)
                    seq.num_computed_tokens = seq.num_tokens - 1
                else:
                    seq.num_computed_tokens += sc.num_new_tokens
                bm.cache_full_blocks(seq)
                if seq.num_output_tokens >= seq.request.params.max_tokens:
                    seq.status = SequenceStatus.FINISHED
                    bm.free(seq)
        s.remove_finished()
        check_kv_invariants(engine_view(s, bm, reqs))
        steps.append(out)
        assert len(steps) < max_steps, "scheduler made no progress"
    for r in reqs:
        assert [q.num_output_tokens for q in r.seqs] == [r.params.max_tokens] * r.n
    assert_no_leaks(engine_view(s, bm, reqs))
    return steps


def test_decode_first_and_chunked_prefill_budget():
    s, bm = make(max_num_batched_tokens=8, max_num_seqs=4)
    reqs = [add(s, "a", list(range(3))), add(s, "b", list(range(20)))]
    steps = run(s, bm, reqs)
    first = steps[0].scheduled
    assert [(x.seq.seq_id, x.num_new_tokens) for x in first] == [("a", 3), ("b", 5)]
    second = steps[1].scheduled  # a decodes first, b's prefill continues in the rest of the budget
    assert [(x.seq.seq_id, x.num_new_tokens, x.is_prefill) for x in second] == [
        ("a", 1, False), ("b", 7, True)]


def test_no_chunking_waits_for_budget():
    s, bm = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    reqs = [add(s, "a", list(range(10))), add(s, "b", list(range(1, 11)))]
    steps = run(s, bm, reqs)
    assert [x.seq.seq_id for x in steps[0].scheduled] == ["a"]
    assert all(x.num_new_tokens in (1, 10) for st in steps for x in st.scheduled)


@pytest.mark.parametrize("policy,order", [("fcfs", ["a", "b", "c"]), ("priority", ["c", "b", "a"]),
                                          ("sjf", ["b", "c", "a"])])
def test_policies_admission_order(policy, order):
    s, bm = make(max_num_seqs=1, policy=policy, caching=False)
    reqs = [add(s, "a", list(range(9)), priority=5), add(s, "b", list(range(2)), priority=3),
            add(s, "c", list(range(5)), priority=1)]
    steps = run(s, bm, reqs)
    admitted = [x.seq.seq_id for st in steps for x in st.scheduled if x.start_pos == 0]
    assert admitted == order


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_preempts_and_finishes(mode):
    s, bm = make(num_blocks=6, block_size=2, preemption_mode=mode, cpu=16, caching=False)
    reqs = [add(s, f"r{i}", list(range(3)), max_tokens=6) for i in range(4)]
    steps = run(s, bm, reqs)
    modes = [m for st in steps for _, m in st.preempted]
    assert modes and set(modes) == {mode}


def test_n_forks_share_prompt_blocks():
    s, bm = make(block_size=4)
    req = add(s, "r", list(range(6)), n=3, max_tokens=3)
    out = s.schedule()
    assert [c.seq_id for c in out.scheduled[0].children] == ["r:1", "r:2"]
    shared = req.seqs[0].block_table
    assert all(c.block_table == shared for c in req.seqs[1:])
    assert [bm.pool.ref_counts[b] for b in shared] == [3, 3]
    run(s, bm, [req])


def test_static_batching_waits_for_whole_batch():
    s, bm = make(max_num_seqs=2, batching="static")
    reqs = [add(s, "a", [1, 2], max_tokens=1), add(s, "b", [1, 2], max_tokens=5),
            add(s, "c", [1, 2], max_tokens=1)]
    steps = run(s, bm, reqs)
    ids = [{x.seq.seq_id for x in st.scheduled} for st in steps]
    c_start = next(i for i, st in enumerate(ids) if "c" in st)
    b_end = max(i for i, st in enumerate(ids) if "b" in st)
    assert c_start > b_end  # c waits for the whole first batch although a slot freed early


def test_watermark_hysteresis_blocks_admission():
    s, bm = make(num_blocks=10, block_size=2, watermark_high=0.5, watermark_low=0.2, caching=False)
    seen_closed = []

    def check(out, pre):
        usage, admitting = pre
        if any(x.start_pos == 0 for x in out.scheduled):  # admitted only when open or drained
            assert (admitting and usage < 0.5) or usage <= 0.2
        seen_closed.append((usage, s.admitting))

    reqs = [add(s, f"r{i}", list(range(4)), max_tokens=3) for i in range(5)]
    run(s, bm, reqs, check=check)
    assert any(not open_ for _, open_ in seen_closed)


def test_abort_waiting_running_swapped_frees_all():
    s, bm = make(num_blocks=6, block_size=2, preemption_mode="swap", cpu=8)
    reqs = [add(s, f"r{i}", list(range(3)), max_tokens=8) for i in range(4)]
    for _ in range(4):
        s.schedule()
        bm.drain()
        for seq in list(s.running):
            seq.num_computed_tokens = seq.num_tokens
            seq.token_ids.append(1)
            seq.num_computed_tokens = seq.num_tokens - 1
    for r in reqs:
        for seq in r.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                s.abort_seq(seq)
    assert not s.has_unfinished()
    assert_no_leaks(engine_view(s, bm, reqs))


@settings(max_examples=60, deadline=None)
@given(cfg=st.fixed_dictionaries({
    "policy": st.sampled_from(["fcfs", "priority", "sjf"]),
    "batching": st.sampled_from(["continuous", "static"]),
    "preemption_mode": st.sampled_from(["recompute", "swap"]),
    "enable_chunked_prefill": st.booleans(),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.integers(24, 40),
    "caching": st.booleans(),
    "watermark_high": st.sampled_from([1.0, 0.7]),
}), reqs=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6), st.integers(1, 2),
                            st.integers(0, 2), st.integers(0, 3)), min_size=1, max_size=8),
    block_size=st.integers(1, 5))
def test_scheduler_invariants_random(cfg, reqs, block_size):
    """Random configs and requests: every step respects the budget and max_num_seqs, no
    sequence is in two queues, scheduled chunks fit their block tables, all requests finish with
    their max_tokens and the pools end empty."""
    cfg = dict(cfg)
    cfg["watermark_low"] = min(0.5, cfg["watermark_high"])
    num_blocks = max(-(-(12 + 6) // block_size) * 2, 4)
    s, bm = make(num_blocks=num_blocks, block_size=block_size, cpu=64, **cfg)
    made = [add(s, f"r{i}", [t] * plen, max_tokens=mt, n=min(n, cfg["max_num_seqs"]),
                priority=pr) for i, (plen, mt, n, pr, t) in enumerate(reqs)]

    def check(out, pre):
        ids = [id(x) for x in s.running]
        assert len(ids) == len(set(ids))
        assert not set(ids) & {id(x) for x in s.swapped}
        for x in out.scheduled:
            seq = x.seq
            assert seq.status is SequenceStatus.RUNNING
            assert x.start_pos == seq.num_computed_tokens
            assert len(seq.block_table) * block_size >= x.start_pos + x.num_new_tokens

    run(s, bm, made, max_steps=2000, check=check)
