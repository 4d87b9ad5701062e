"""Two scheduling additions for serving many tenants: ``fair`` and priority preemption.

**fair: weighted fair queueing over tokens served per tenant** (the Virtual Token Counter of
Sheng et al., *Fairness in Serving Large Language Models*, OSDI 2024). FCFS serves whoever
arrived first, so a tenant that sends ten times the load gets ten times the service and a light
tenant's requests queue behind the flood. ``fair`` keeps, per tenant, a counter of tokens served
(prefill and decode tokens the scheduler gave it, divided by the tenant's weight) and orders the
waiting queue by that counter, so the least-served tenant goes next. Running work is ordered the
same way, so when blocks run out the most-served tenant is preempted first. A tenant that was
idle is lifted, when it comes back, to the smallest counter among the active tenants minus
``credit`` tokens: with no lift, idling would bank unbounded credit and let it starve the others
later (VTC lifts to exactly the minimum); the bounded ``credit`` is what lets a light tenant's
occasional request go first at once instead of queueing behind the flood.

A waiting request of a less-served tenant also preempts running work of a more-served one when
the batch is full (below), but only if that tenant is ahead by more than the victim's computed
tokens: preemption by recompute redoes them, so a smaller imbalance is not worth the work, and
two equally busy tenants do not preempt each other back and forth.

The weights are ``SchedulerConfig.tenant_weights`` (``labkit serve --tenant-weights a=2,b=1``;
a tenant not listed weighs 1): under contention each tenant's share of the tokens served is
proportional to its weight (tests/serve/test_tenant_weights.py measures it).

The tenant is the request's ``cache_salt``: ``labkit serve`` sets it to the API key's tenant,
which also keeps tenants from sharing prefix-cache blocks (the timing side channel vLLM's
cache_salt exists to close). Requests without one share the tenant ``""``.

**preemption for a waiting request** (``priority`` and ``fair``): the scheduler otherwise
admits a waiting request only into free blocks and free sequence slots, so a VIP request waits
for a batch job to finish. ``preempt_for_waiting`` runs before each step: when the best waiting
request cannot fit (KV pool or ``max_num_seqs`` full) and running sequences that give way to it
(``priority``: strictly lower priority, a larger value; ``fair``: of a tenant ahead by more than
the victim's computed tokens) would make room, it preempts the fewest of the worst of them by
recompute (their blocks are freed and they go back to the waiting queue in policy order), so
the request is admitted in this very step. It preempts nothing when even all of them would not
make room.
"""

from __future__ import annotations

import heapq
from typing import Any

from labkit.kv.block_manager import cdiv
from labkit.sched.request import Sequence, SequenceStatus

DEFAULT_CREDIT = 256.0  # tokens of head start an idle tenant keeps (about one long prompt)


def tenant_of(seq: Sequence) -> str:
    return seq.request.cache_salt or ""


class FairShare:
    """Per-tenant served-token counters and the sort keys they give."""

    def __init__(self, weights: dict[str, float] | None = None,
                 credit: float = DEFAULT_CREDIT) -> None:
        self.weights: dict[str, float] = dict(weights or {})
        self.credit = credit
        self.served: dict[str, float] = {}
        self.active: set[str] = set()

    def key(self, seq: Sequence) -> tuple:
        req = seq.request
        return (self.served.get(tenant_of(seq), 0.0), req.arrival_time, req.index, seq.index)

    def rekey(self, sched: Any) -> None:
        """Before a step: lift tenants that just became active, then re-sort the waiting heap
        and give running sequences their current keys (the policy order the scheduler uses)."""
        waiting = [s for _, s in sched.waiting if s.status is SequenceStatus.WAITING]
        live = {tenant_of(s) for s in (*waiting, *sched.running, *sched.swapped)}
        staying = live & self.active
        if staying:
            floor = min(self.served.get(t, 0.0) for t in staying)
            for t in live - self.active:
                self.served[t] = max(self.served.get(t, 0.0), floor - self.credit)
        self.active = live
        for s in (*waiting, *sched.running, *sched.swapped):
            s.sort_key = self.key(s)
        sched.waiting = [(s.sort_key, s) for s in waiting]
        heapq.heapify(sched.waiting)

    def charge(self, scheduled: list) -> None:
        """After a step is scheduled: each tenant pays for the tokens it was given."""
        for sc in scheduled:
            t = tenant_of(sc.seq)
            self.served[t] = self.served.get(t, 0.0) + sc.num_new_tokens / \
                self.weights.get(t, 1.0)


def _blocks_needed(seq: Sequence, block_size: int) -> int:
    """Fresh blocks ``seq`` needs for its next step (ignoring prefix-cache hits)."""
    return max(0, cdiv(seq.num_tokens, block_size) - len(seq.block_table))


def gives_way(sched: Any, vip: Sequence, victim: Sequence) -> bool:
    """May ``victim`` (running) be preempted for ``vip`` (waiting)?"""
    if sched.fair is None:
        return victim.request.priority > vip.request.priority
    served = sched.fair.served
    gap = served.get(tenant_of(victim), 0.0) - served.get(tenant_of(vip), 0.0)
    return gap > victim.num_computed_tokens


def preempt_for_waiting(sched: Any) -> list[tuple[Sequence, str]]:
    """Make room for the best waiting request by preempting running sequences that give way
    to it (``gives_way``), worst first; returns the preempted ``(seq, "recompute")`` pairs."""
    vip = sched._peek_waiting()
    if vip is None or not sched.running:
        return []
    bm, cfg, bs = sched.bm, sched.config, sched.bm.block_size
    req = vip.request
    width = 1 + req.num_pending_forks  # samples it will fork into
    need = cdiv(min(vip.num_tokens, cfg.max_num_batched_tokens), bs)
    running = sorted(sched.running, key=lambda s: s.sort_key)
    free = bm.pool.num_available - sum(_blocks_needed(s, bs) for s in running)
    slots = cfg.max_num_seqs - len(running)
    victims: list[Sequence] = []
    while free < need or slots < width:
        if not running or not gives_way(sched, vip, running[-1]):
            return []  # never a partial clear-out that would not admit the request
        v = running.pop()
        victims.append(v)
        free += _blocks_needed(v, bs) + sum(1 for b in v.block_table
                                             if b >= 0 and bm.pool.ref_counts[b] == 1)
        slots += 1
    for v in victims:  # recompute (as Scheduler._preempt): free, requeue in priority order
        sched.running.remove(v)
        bm.free(v)
        v.num_computed_tokens = 0
        sched._push_waiting(v)
    return [(v, "recompute") for v in victims]
