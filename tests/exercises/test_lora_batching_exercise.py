"""The multi-LoRA exercise on labkit-tiny: the reference solutions pass; an off-by-one slot, a
delta without the alpha/r scaling, base rows touched, an eviction of an adapter the step uses, a
FIFO instead of an LRU, and a step of too many adapters not refused are each rejected with a
message naming the mistake. The untouched stubs are "not implemented yet", not a failure."""

import pytest

from labkit.exercises import lora_batching as M
from labkit.exercises import lora_batching_solutions as S


@pytest.fixture(autouse=True)
def _progress(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))


def off_by_one_slot(y, x, lora_a, lora_b, scalings, token_slots):
    """Slot s reads adapter s + 1 (mod S): every LoRA row gets its neighbour's adapter."""
    out = y.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            k = (s + 1) % lora_a.shape[0]
            out[t] += scalings[k] * ((x[t] @ lora_a[k].T) @ lora_b[k].T)
    return out


def no_scaling(y, x, lora_a, lora_b, scalings, token_slots):
    out = y.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T
    return out


def base_rows_get_last_slot(y, x, lora_a, lora_b, scalings, token_slots):
    """No `if s >= 0`: slot -1 indexes the LAST slot in Python."""
    out = y.clone()
    for t, s in enumerate(token_slots.tolist()):
        out[t] += scalings[s] * ((x[t] @ lora_a[s].T) @ lora_b[s].T)
    return out


class EvictsInUse(S.AdapterSlots):
    """Plain LRU: the victim is the least recently used, even if this step uses it."""

    def activate(self, step_ids):
        if len(step_ids) > len(self.slots):
            raise M.SlotsFull("too many")
        for lid in sorted(step_ids):
            if lid in self.slots:
                self.recency.remove(lid)
            else:
                if None in self.slots:
                    slot = self.slots.index(None)
                else:
                    victim = self.recency.pop(0)
                    slot = self.slots.index(victim)
                    self.evictions += 1
                self.slots[slot] = lid
                self.loads += 1
            self.recency.append(lid)
        return {lid: self.slots.index(lid) for lid in step_ids}


class Fifo(S.AdapterSlots):
    """A hit does not refresh recency: the victim is the oldest *loaded*, not least used."""

    def activate(self, step_ids):
        before = list(self.recency)
        got = super().activate(step_ids)
        self.recency = [a for a in before if a in self.slots] + [
            a for a in self.recency if a not in before]
        return got


class NeverRefuses(S.AdapterSlots):
    def activate(self, step_ids):
        if len(step_ids) > len(self.slots):
            return {}
        return super().activate(step_ids)


def test_reference_solutions_pass(capsys):
    assert M.check_delta(S.lora_delta).passed
    assert M.check_slots(S.AdapterSlots).passed
    out = capsys.readouterr().out
    assert "4 projections of labkit-tiny" in out and "over 45 steps" in out


@pytest.mark.parametrize("fn,words", [
    (off_by_one_slot, ["wrong LoRA delta", "got slot", "no +1 / -1"]),
    (no_scaling, ["without the scaling", "lora_alpha / r"]),
    (base_rows_get_last_slot, ["slot -1", "leave them exactly as they are"]),
], ids=["off-by-one-slot", "no-scaling", "base-rows"])
def test_wrong_deltas_rejected(fn, words):
    result = M.check_delta(fn)
    assert not result.passed
    for w in words:
        assert w in result.message, result.message


@pytest.mark.parametrize("cls,words", [
    (EvictsInUse, ["evicted while in use", "NOT in this step"]),
    (Fifo, ["least recently used", "A hit counts as a use"]),
    (NeverRefuses, ["must be refused", "SlotsFull"]),
], ids=["evicts-in-use", "fifo", "no-refusal"])
def test_wrong_slot_caches_rejected(cls, words):
    result = M.check_slots(cls)
    assert not result.passed
    for w in words:
        assert w in result.message, result.message


def test_untouched_stubs_are_not_attempts():
    def stub(*a):
        raise NotImplementedError("write lora_delta")

    class Stub:
        def __init__(self, n):
            self.slots, self.loads, self.evictions = [None] * n, 0, 0

        def activate(self, step_ids):
            raise NotImplementedError("write activate")

    for result in (M.check_delta(stub), M.check_slots(Stub)):
        assert not result.passed and "not implemented yet" in result.message
