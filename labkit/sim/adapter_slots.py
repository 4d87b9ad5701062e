"""LoRA adapter slots across a fleet: how often replicas copy an adapter in, per routing policy.

A counting simulation, no clocks and no engines: what it measures is *adapter loads per
request*, which depends on which replica sees which adapters, not on how fast anything runs.
Every replica has ``max_loras`` device slots run as ``labkit.lora.manager.LoRAManager`` runs
them (:class:`SlotLRU`): an adapter already resident is a hit; otherwise it is copied into a
free slot, or into the slot of the least recently used adapter that no running request uses;
when every slot's adapter is in use the request waits (the scheduler's LoRA admission rule,
``labkit.lora.executor.LoRAAdmission``) until one frees. The engine touches every running
adapter at every step, so an adapter's recency here is refreshed when it is acquired and when
one of its requests finishes. Time is a tick: one request arrives per
tick and runs for a seeded number of ticks once admitted.

The workload (:func:`adapter_workload`): requests for ``num_adapters`` adapters with Zipf
popularity (adapter k with weight ``1 / (k + 1) ** zipf_s``, the few-hot-many-cold shape of a
multi-tenant adapter service) and a share of base-model requests.

The policy is any object with ``choose(key, replicas)``: the router's own classes
(``labkit.router.policies``), passed in by the caller because the simulator sits below the
router in the layering. It sees each replica's ``name`` and ``outstanding`` (routed, not
finished: waiting for a slot or running), and a key whose ``model`` is the adapter's name.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class AdapterKey:
    """What the router sees of a request here (the shape of ``RouteKey``): the ``model`` it
    names, an adapter's name or None for the base model."""

    model: str | None = None
    token_ids: Sequence[int] | None = None
    text: str | None = None
    user: str | None = None


class SlotLRU:
    """One replica's ``max_loras`` device slots, least recently used evicted first, never an
    adapter that a running request uses; ``loads`` and ``evictions`` count what happened."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.resident: OrderedDict[str, None] = OrderedDict()  # oldest first
        self.loads = self.evictions = 0

    def touch(self, adapter: str | None) -> None:
        """Mark a resident adapter most recently used (a step ran it)."""
        if adapter in self.resident:
            self.resident.move_to_end(adapter)

    def acquire(self, adapter: str, in_use: set[str]) -> bool:
        """Make ``adapter`` resident (a hit touches it); False when every slot holds an
        adapter in ``in_use`` (the request must wait)."""
        if adapter in self.resident:
            self.resident.move_to_end(adapter)
            return True
        if len(self.resident) >= self.max_loras:
            victim = next((a for a in self.resident if a not in in_use), None)
            if victim is None:
                return False
            del self.resident[victim]
            self.evictions += 1
        self.resident[adapter] = None
        self.loads += 1
        return True


@dataclass
class SlotReplica:
    """A replica as the router and the slots see it."""

    name: str
    slots: SlotLRU
    outstanding: int = 0
    running: list[tuple[int, str | None]] = field(default_factory=list)  # (ends at, adapter)
    waiting: deque[tuple[int, str | None, int]] = field(default_factory=deque)
    waited: int = 0  # requests that found no slot on arrival
    wait_ticks: int = 0
    routed: int = 0
    peak_outstanding: int = 0

    def advance(self, t: int) -> None:
        """Finish what ends by ``t``, then admit waiting requests in order (skipping one whose
        adapter finds no slot, as the scheduler does)."""
        done = [r for r in self.running if r[0] <= t]
        self.running = [r for r in self.running if r[0] > t]
        self.outstanding -= len(done)
        for _, adapter in done:  # the engine touches a running adapter every step: its last
            self.slots.touch(adapter)  # use is its request's last step, not its admission
        still: deque[tuple[int, str | None, int]] = deque()
        for arrived, adapter, ticks in self.waiting:
            in_use = {a for _, a in self.running if a is not None}
            if adapter is None or self.slots.acquire(adapter, in_use):
                self.running.append((t + ticks, adapter))
                self.wait_ticks += t - arrived
            else:
                still.append((arrived, adapter, ticks))
        self.waiting = still

    def route(self, t: int, adapter: str | None, ticks: int) -> None:
        self.outstanding += 1
        self.routed += 1
        self.peak_outstanding = max(self.peak_outstanding, self.outstanding)
        self.waiting.append((t, adapter, ticks))
        self.advance(t)
        if self.waiting and self.waiting[-1][0] == t:
            self.waited += 1


def adapter_workload(num_requests: int, num_adapters: int = 8, zipf_s: float = 1.0,
                     base_fraction: float = 0.2, min_ticks: int = 4, max_ticks: int = 12,
                     seed: int = 0) -> list[tuple[str | None, int]]:
    """``(adapter name or None, ticks it runs)`` per request: Zipf adapter popularity, a
    ``base_fraction`` of base-model requests, run lengths uniform in [min_ticks, max_ticks]."""
    if num_adapters < 1 or not 0 <= base_fraction < 1 or not 1 <= min_ticks <= max_ticks:
        raise ValueError("need num_adapters >= 1, 0 <= base_fraction < 1 and "
                         f"1 <= min_ticks <= max_ticks, got {num_adapters}, {base_fraction}, "
                         f"{min_ticks}, {max_ticks}")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_adapters + 1) ** zipf_s
    picks = rng.choice(num_adapters, size=num_requests, p=weights / weights.sum())
    base = rng.random(num_requests) < base_fraction
    ticks = rng.integers(min_ticks, max_ticks + 1, size=num_requests)
    return [(None if b else f"adapter-{int(k)}", int(n)) for k, b, n in zip(picks, base, ticks)]


def simulate_adapter_fleet(policy: Any, workload: Sequence[tuple[str | None, int]],
                           num_replicas: int = 4, max_loras: int = 2) -> dict[str, Any]:
    """Route ``workload`` (one request per tick) over ``num_replicas`` replicas with ``policy``
    and count slot loads. Returns the totals, ``loads_per_request`` (slot loads per adapter
    request) and per-replica counts (which adapters each loaded, its peak load)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    reps = [SlotReplica(f"replica-{i}", SlotLRU(max_loras)) for i in range(num_replicas)]
    seen: list[set[str]] = [set() for _ in reps]
    for t, (adapter, ticks) in enumerate(workload):
        for r in reps:
            r.advance(t)
        r = policy.choose(AdapterKey(model=adapter), reps)
        i = reps.index(r)
        if adapter is not None:
            seen[i].add(adapter)
        r.route(t, adapter, ticks)
    t = len(workload)
    while any(r.outstanding for r in reps):
        for r in reps:
            r.advance(t)
        t += 1
    lora_requests = sum(a is not None for a, _ in workload)
    loads = sum(r.slots.loads for r in reps)
    return {"requests": len(workload), "lora_requests": lora_requests, "slot_loads": loads,
            "slot_evictions": sum(r.slots.evictions for r in reps),
            "loads_per_request": loads / max(lora_requests, 1),
            "waited_for_slot": sum(r.waited for r in reps),
            "mean_wait_ticks": sum(r.wait_ticks for r in reps) / max(len(workload), 1),
            "replicas": [{"name": r.name, "routed": r.routed, "slot_loads": r.slots.loads,
                          "adapters_seen": len(s), "peak_outstanding": r.peak_outstanding}
                         for r, s in zip(reps, seen)]}
