"""Reference solutions of the multi-LoRA exercise (read only by ``inject`` and the tests).

Written from the contract, independently of ``labkit.lora.ops`` / ``labkit.lora.manager`` (which
the checker compares against): one row at a time, and an explicit recency list.
"""

from __future__ import annotations

import torch

from labkit.exercises.lora_batching import SlotsFull


def lora_delta(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               scalings: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    out = y.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] += scalings[s] * ((x[t] @ lora_a[s].T) @ lora_b[s].T)
    return out


class AdapterSlots:
    def __init__(self, num_slots: int) -> None:
        self.slots: list[int | None] = [None] * num_slots
        self.loads = self.evictions = 0
        self.recency: list[int] = []  # resident ids, least recently used first

    def activate(self, step_ids: set[int]) -> dict[int, int]:
        if len(step_ids) > len(self.slots):
            raise SlotsFull(f"{len(step_ids)} adapters, {len(self.slots)} slots")
        for lid in sorted(step_ids):
            if lid in self.slots:
                self.recency.remove(lid)
            else:
                if None in self.slots:
                    slot = self.slots.index(None)
                else:
                    victim = next(a for a in self.recency if a not in step_ids)
                    self.recency.remove(victim)
                    slot = self.slots.index(victim)
                    self.evictions += 1
                self.slots[slot] = lid
                self.loads += 1
            self.recency.append(lid)
        return {lid: self.slots.index(lid) for lid in step_ids}
