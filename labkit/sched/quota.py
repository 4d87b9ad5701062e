"""Per-tenant quotas: a cap on each tenant's running sequences and on the KV blocks they hold.

Why beside ``fair``: weighted fair queueing (``policy="fair"``) orders who goes *next*, but a
tenant that got in early can still fill the batch and the KV pool, and a light tenant's request
then waits for blocks however fairly the queue is ordered. A quota is the hard partition: tenant
t may hold at most ``tenant_max_running`` running sequences and ``tenant_max_kv_blocks`` blocks,
whatever the others do, so part of the engine is always left for someone else (the admission
side of the deployment notes' "per-tenant quota"; vLLM has no such knob, a gateway usually
enforces it in front of the engine).

How it plugs in: an :class:`~labkit.sched.admission.AdmissionPolicy`, asked before a waiting
request starts or a swapped one returns. A refused request keeps its queue place while requests
of other tenants behind it start. It limits entry only: running sequences grow their blocks as
they decode and are never preempted by it, so the block cap bounds what a tenant holds when its
next sequence starts (its running sequences' blocks plus the new prompt's), not at every step.
A tenant with nothing running may always start one sequence, so a request larger than the cap
is served alone rather than starved. The tenant is the request's ``cache_salt`` (as for ``fair``:
``labkit serve`` sets it to the API key's tenant).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.sched.admission import AdmissionPolicy
from labkit.sched.policies_fair import tenant_of
from labkit.sched.request import Sequence
from labkit.utils import cdiv


@dataclass
class TenantQuota:
    """``can_run`` refuses a sequence whose tenant is at its cap (None: no cap)."""

    max_running: int | None = None
    max_kv_blocks: int | None = None
    block_size: int = 16
    refused: int = 0  # admissions refused so far (a gauge for dashboards and tests)

    def can_run(self, seq: Sequence, running: list[Sequence]) -> bool:
        tenant = tenant_of(seq)
        mine = [s for s in running if tenant_of(s) == tenant]
        if not mine:
            return True  # progress: one sequence per tenant always may run
        ok = self.max_running is None or len(mine) < self.max_running
        if ok and self.max_kv_blocks is not None:
            held = sum(sum(b >= 0 for b in s.block_table) for s in mine)  # -1: freed
            ok = held + cdiv(seq.num_tokens, self.block_size) <= self.max_kv_blocks
        self.refused += not ok
        return ok


@dataclass
class AllOf:
    """Several admission policies at once: a sequence runs when every one of them agrees."""

    policies: tuple[AdmissionPolicy, ...]

    def can_run(self, seq: Sequence, running: list[Sequence]) -> bool:
        return all(p.can_run(seq, running) for p in self.policies)


def combine(*policies: AdmissionPolicy | None) -> AdmissionPolicy | None:
    """The policies given (Nones dropped) as one: None, the only one, or :class:`AllOf`."""
    given = tuple(p for p in policies if p is not None)
    if not given:
        return None
    return given[0] if len(given) == 1 else AllOf(given)
