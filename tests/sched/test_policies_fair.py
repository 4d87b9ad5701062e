"""``fair`` (weighted fair queueing over tokens served per tenant) and priority preemption,
against orderings computed by hand. A bare scheduler with a hand-written driver (no model):
each sampled token is 7; a request finishes at max_tokens."""

from __future__ import annotations

from types import SimpleNamespace

from labkit.engine.invariants import check_kv_invariants
from labkit.kv.block_manager import BlockManager
from labkit.sched.request import Request, SequenceStatus
from labkit.sched.scheduler import Scheduler, SchedulerConfig


class Driver:
    def __init__(self, num_blocks=64, block_size=4, **kw):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.s = Scheduler(SchedulerConfig(**kw), self.bm, clock=lambda: 0.0)
        self.reqs: list[Request] = []
        self.admitted: list[str] = []
        self.finished: list[str] = []
        self.outs = []

    def add(self, rid, prompt_len, tenant="", max_tokens=2, priority=0):
        req = Request(rid, [1] * prompt_len, SimpleNamespace(n=1, max_tokens=max_tokens), 0.0,
                      priority, cache_salt=tenant, index=len(self.reqs))
        self.reqs.append(req)
        self.s.add_request(req)
        return req

    def step(self):
        s, bm = self.s, self.bm
        out = s.schedule()
        bm.drain()
        self.outs.append(out)
        for sc in out.scheduled:
            seq = sc.seq
            if seq.request_id not in self.admitted:
                self.admitted.append(seq.request_id)
            if sc.samples:
                seq.token_ids.append(7)
                seq.num_computed_tokens = seq.num_tokens - 1
            else:
                seq.num_computed_tokens += sc.num_new_tokens
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                seq.status = SequenceStatus.FINISHED
                bm.free(seq)
                self.finished.append(seq.request_id)
        s.remove_finished()
        check_kv_invariants(SimpleNamespace(block_manager=bm, scheduler=s,
                                            requests={r.request_id: r for r in self.reqs}))
        return out

    def run(self, max_steps=200):
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                return self.admitted
            self.step()
        raise AssertionError("did not finish")


def _six(policy, weights=None):
    d = Driver(max_num_seqs=1, policy=policy)
    if weights:
        d.s.fair.weights.update(weights)
    for rid in ("A1", "A2", "A3"):
        d.add(rid, 4, "A")
    for rid in ("B1", "B2", "B3"):
        d.add(rid, 4, "B")
    return d.run()


def test_fair_alternates_tenants_where_fcfs_serves_arrival_order():
    # each request costs 4 prefill + 1 decode = 5 tokens; ties go to the earlier arrival
    assert _six("fcfs") == ["A1", "A2", "A3", "B1", "B2", "B3"]
    assert _six("fair") == ["A1", "B1", "A2", "B2", "A3", "B3"]


def test_fair_weights():
    # A has weight 2: pays 2.5 per request. A1 (A=2.5); B1 (0 < 2.5; B=5); A2 (A=5);
    # A3 (5, earlier index than B2's 5; A=7.5); B2; B3
    assert _six("fair", {"A": 2.0}) == ["A1", "B1", "A2", "A3", "B2", "B3"]


def _returning_tenant(credit):
    d = Driver(max_num_seqs=1, policy="fair")
    d.s.fair.credit = credit
    d.add("A1", 4, "A")
    d.add("A2", 4, "A")
    while len(d.admitted) < 2 or d.s.running:
        d.step()
    assert d.s.fair.served == {"A": 10.0}
    for rid, t in (("B1", "B"), ("B2", "B"), ("A3", "A"), ("A4", "A")):
        d.add(rid, 4, t)
    return d.run()[2:]


def test_fair_lifts_a_returning_tenant_instead_of_banking_credit():
    # credit 0 (VTC): B is lifted to A's 10; B1 (B=15), A3 (A=15), B2 (tie, earlier), A4
    assert _returning_tenant(0) == ["B1", "A3", "B2", "A4"]
    # credit 6: B starts at 4; B1 (B=9), B2 (9 < 10; B=14), A3, A4
    assert _returning_tenant(6) == ["B1", "B2", "A3", "A4"]
    # no lift at all would be B=0: the same order as credit >= 10
    assert _returning_tenant(256) == ["B1", "B2", "A3", "A4"]


def test_fair_preempts_a_tenant_far_ahead():
    for credit, preempted in ((256, ["A2"]), (0, [])):
        d = Driver(max_num_seqs=1, policy="fair")
        d.s.fair.credit = credit
        d.add("A1", 4, "A")
        while d.s.has_unfinished():
            d.step()
        d.add("A2", 4, "A", max_tokens=20)
        d.step()
        d.step()  # A2 computed 5 tokens, A has been served 5 + 5 = 10
        assert d.s.fair.served["A"] == 10.0
        d.add("B1", 4, "B")
        out = d.step()
        # credit 256: B starts at 0, A is 10 ahead, more than A2's 5 computed tokens: B1 goes
        # now; credit 0: B starts level with A, no reason to redo A2's work
        assert [s.request_id for s, _ in out.preempted] == preempted
        assert ("B1" in [sc.seq.request_id for sc in out.scheduled]) == bool(preempted)
        d.run()


def _two_low_running(vip_priority, vip_len, low=(5, 5), policy="priority"):
    d = Driver(num_blocks=4, max_num_seqs=8, policy=policy)
    d.add("L1", 6, max_tokens=6, priority=low[0])  # 2 blocks, 7 tokens after prefill
    d.add("L2", 2, max_tokens=6, priority=low[1])  # 1 block, 3 tokens
    d.step()
    assert d.bm.pool.num_available == 1
    d.add("VIP", vip_len, max_tokens=3, priority=vip_priority)
    return d, d.step()


def test_vip_preempts_the_worst_lower_priority_running_request():
    d, out = _two_low_running(0, 5)  # VIP needs 2 blocks; 1 free; L2 (latest) frees 1
    assert [(s.request_id, m) for s, m in out.preempted] == [("L2", "recompute")]
    assert {sc.seq.request_id for sc in out.scheduled} == {"L1", "VIP"}
    assert d.s.num_preemptions == 1
    d.run()
    assert d.finished.index("VIP") < d.finished.index("L2")  # L2 comes back and finishes


def test_no_preemption_for_equal_priority_fcfs_or_when_it_would_not_help():
    for kw in ({"vip_priority": 5, "vip_len": 5},  # not strictly better
               {"vip_priority": 0, "vip_len": 5, "policy": "fcfs"},
               {"vip_priority": 0, "vip_len": 13, "low": (0, 5)}):  # L2 alone frees too few
        d, out = _two_low_running(**kw)
        assert out.preempted == [] and "VIP" not in [sc.seq.request_id for sc in out.scheduled]
        d.run()
