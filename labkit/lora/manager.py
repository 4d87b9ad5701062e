"""Adapter slots and the CPU cache: which adapters are loaded, and which sit in device slots.

Two LRU levels, as vLLM's ``LRUCacheLoRAModelManager`` / ``LRUCacheWorkerLoRAManager``:

- the **CPU cache** holds up to ``max_cpu_loras`` loaded adapters (read from disk, checked).
  Adding one more evicts the least recently used; an evicted adapter is read from disk again
  when a request needs it (its ``LoRARequest`` is remembered, a few bytes).
- the **device slots**, ``max_loras`` of them, hold the adapters one forward can use
  (:class:`~labkit.lora.layers.LoRALinear`'s stacked weights). :meth:`LoRAManager.activate`
  makes a step's adapters resident, evicting the least recently used adapter that is *not* in
  the step. The scheduler's admission policy (:class:`~labkit.lora.executor.LoRAAdmission`)
  guarantees a step never needs more than ``max_loras`` adapters, so a slot can always be
  found without touching an adapter a request uses in this step. (An adapter whose running
  requests sit a step out, for lack of token budget, may be evicted: it is copied back into a
  slot when they next run, an extra copy, never a wrong answer.)

Counters (``stats()``): disk loads, CPU evictions, slot loads and slot evictions, so a test or
a notebook can watch the LRU work under a skewed popularity.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

from labkit.errors import LoRAError
from labkit.lora.adapter import LoRAModel, load_adapter
from labkit.lora.layers import LoRALinear, lora_targets
from labkit.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, layers: dict[str, LoRALinear], max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int) -> None:
        self.layers = layers
        self.targets = lora_targets(layers)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.requests: dict[int, LoRARequest] = {}  # every adapter added, by id (for reloads)
        self.cpu_cache: OrderedDict[int, LoRAModel] = OrderedDict()  # oldest first
        self.slots: list[int | None] = [None] * max_loras  # slot -> adapter id
        self.slot_lru: OrderedDict[int, int] = OrderedDict()  # resident id -> slot, oldest first
        self.counts = {"disk_loads": 0, "cpu_evictions": 0, "slot_loads": 0,
                       "slot_evictions": 0}

    # ---- CPU cache ------------------------------------------------------------------------------
    def add_lora(self, req: LoRARequest) -> LoRAModel:
        """Load (or touch in the cache) ``req``'s adapter; the engine calls this in
        ``add_request``, so every check of :func:`load_adapter` happens before a step."""
        known = self.requests.get(req.lora_int_id)
        if known is not None and Path(known.lora_path) != Path(req.lora_path):
            raise LoRAError(f"lora_int_id {req.lora_int_id} already names adapter "
                            f"{known.lora_name!r} at {known.lora_path}; one id, one adapter "
                            "(give the new one another id)")
        model = self._cpu_get(req)
        self.requests[req.lora_int_id] = req
        return model

    def _cpu_get(self, req: LoRARequest) -> LoRAModel:
        lid = req.lora_int_id
        if lid in self.cpu_cache:
            self.cpu_cache.move_to_end(lid)
            return self.cpu_cache[lid]
        model = load_adapter(lid, req.lora_path, self.targets, self.max_lora_rank)
        self.counts["disk_loads"] += 1
        self.cpu_cache[lid] = model
        while len(self.cpu_cache) > self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)
            self.counts["cpu_evictions"] += 1
        return model

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: its request, its CPU copy and its slot (zeroed, free again);
        False if it was never added. vLLM's ``remove_lora``: the caller (the server's unload)
        makes sure no live request uses it, since its tokens would lose their slot."""
        if self.requests.pop(lora_int_id, None) is None:
            return False
        self.cpu_cache.pop(lora_int_id, None)
        slot = self.slot_lru.pop(lora_int_id, None)
        if slot is not None:
            self.slots[slot] = None
            for layer in self.layers.values():
                layer.set_slot(slot, None, None, 0.0)
        return True

    # ---- device slots ---------------------------------------------------------------------------
    def activate(self, lora_ids: set[int]) -> None:
        """Make every adapter of ``lora_ids`` resident in a slot (a step's adapters)."""
        if len(lora_ids) > self.max_loras:  # the admission policy prevents this
            raise RuntimeError(f"a step needs {len(lora_ids)} adapters, max_loras is "
                               f"{self.max_loras}")
        for lid in sorted(lora_ids):
            if lid in self.slot_lru:
                self.slot_lru.move_to_end(lid)
            else:
                self._load_slot(lid, self._free_slot(lora_ids))

    def _free_slot(self, keep: set[int]) -> int:
        if None in self.slots:
            return self.slots.index(None)
        victim = next(lid for lid in self.slot_lru if lid not in keep)
        slot = self.slot_lru.pop(victim)
        self.slots[slot] = None
        self.counts["slot_evictions"] += 1
        return slot

    def _load_slot(self, lid: int, slot: int) -> None:
        model = self._cpu_get(self.requests[lid])
        for name, layer in self.layers.items():
            a, b = model.weights.get(name, (None, None))
            layer.set_slot(slot, a, b, model.scaling)
        self.slots[slot] = lid
        self.slot_lru[lid] = slot
        self.counts["slot_loads"] += 1

    def slot_of(self, lora_int_id: int | None) -> int:
        """The slot a resident adapter occupies; -1 for the base model."""
        return -1 if lora_int_id is None else self.slot_lru[lora_int_id]

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "resident": list(self.slot_lru), "cpu_cached": list(self.cpu_cache),
                "num_slots": self.max_loras}
