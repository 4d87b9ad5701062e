"""Exercise: many LoRA adapters in one batch, and the adapter slots' LRU, checked on a real model.

Two pieces of multi-LoRA serving (``labkit.lora``), each checked against labkit's own code:

* ``lora_delta(y, x, lora_a, lora_b, scalings, token_slots)``: the batched LoRA delta for a batch
  whose rows belong to different adapters (Punica's SGMV / BGMV, ``labkit.lora.ops``): for every
  row t with ``s = token_slots[t] >= 0``, ``y[t] += scalings[s] * (x[t] @ A[s].T) @ B[s].T``;
  rows of slot -1 (the base model) are returned untouched. The check feeds it the real stacked
  slot weights of ``labkit-tiny``'s q/k/gate/down projections after four adapters (ranks 4 to
  16, scalings 0.5 to 8, different target modules) were loaded into the slots by
  ``LoRAManager``, and real activations of a code prompt, and compares with ``bgmv_shrink`` +
  ``bgmv_expand``.
* ``AdapterSlots(num_slots).activate(step_ids)``: make a step's adapters resident in the device
  slots and return ``{adapter id: slot}``, as ``LoRAManager.activate`` does: ids in sorted
  order; a resident one is a hit (it becomes the most recently used); a missing one goes into
  the lowest free slot, else into the slot of the least recently used adapter **not in this
  step**; a step with more adapters than slots is refused with :class:`SlotsFull` and changes
  nothing. ``loads`` / ``evictions`` count copies into slots and adapters pushed out. The check
  replays a seeded step sequence through a real ``LoRAManager`` over ``labkit-tiny``'s layers
  and compares the slots after every step.

The mistakes it names: a row given another slot's adapter (an off-by-one slot), a delta without
the alpha/r scaling, base rows touched, evicting an adapter the step itself uses, a hit that
does not refresh recency (FIFO instead of LRU), and a refusal that is not one.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.exercises.inject import inject as _inject
from labkit.lora.layers import apply_lora
from labkit.lora.manager import LoRAManager
from labkit.lora.ops import bgmv_expand, bgmv_shrink
from labkit.lora.request import LoRARequest
from labkit.lora.writer import random_adapter

MODEL = "labkit-tiny"
PROMPT = 'def read_config(path):\n    """Parse an INI file into a dict."""'
ATTN, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
# (targets, r, alpha): scalings alpha/r = 2, 1, 8, 0.5, so a missing scaling cannot hide
ADAPTERS = [(ATTN, 8, 16), (ATTN + MLP, 16, 16), (MLP, 4, 32), (["q_proj", "v_proj"], 16, 8)]
SLOTS = [-1, 0, 0, 1, 3, -1, 2, 2, 0, 3, -1, 1, 1, 2]  # a mixed batch, token by token


class SlotsFull(RuntimeError):
    """A step needs more adapters than there are slots (the scheduler must not admit it)."""


def inject(name: str, learner: Callable) -> Callable:
    """The reference under ``LABKIT_INJECT_SOLUTIONS=1`` (CI), else the learner's own."""
    return _inject(name, learner, "lora_batching_solutions")


def _model_with_adapters(folder: Path, max_loras: int, adapters: list[tuple[list[str], int, int]]
                         ) -> tuple[Any, Any, dict[str, Any], LoRAManager]:
    """labkit-tiny with LoRA slots, its tokenizer, the wrapped layers and a manager that has
    added ``adapters`` (ids 1, 2, ...; written in PEFT's format into ``folder``)."""
    from labkit.model.loader import load_pretrained

    model, tok = load_pretrained(MODEL, dtype=torch.float32, device="cpu")
    paths = [random_adapter(model, folder / f"a{i}", t, r=r, lora_alpha=alpha, seed=i,
                            b_std=0.1) for i, (t, r, alpha) in enumerate(adapters, 1)]
    _, layers = apply_lora(model, max_loras, 16)
    manager = LoRAManager(layers, max_loras, 16, max_cpu_loras=len(adapters))
    for i, p in enumerate(paths, 1):
        manager.add_lora(LoRARequest(f"a{i}", i, p))
    return model, tok, layers, manager


def delta_cases() -> list[tuple[str, torch.Tensor, Any]]:
    """(projection, its real input [T, H_in], its LoRALinear with 4 adapters in slots 0..3)."""
    with tempfile.TemporaryDirectory() as d:
        model, tok, layers, manager = _model_with_adapters(Path(d), 4, ADAPTERS)
    manager.activate({1, 2, 3, 4})  # sorted ids fill slots 0, 1, 2, 3
    ids = torch.tensor(tok.encode(PROMPT)[:len(SLOTS)])
    layer0, pre = model.model.layers[0], "model.layers.0."
    with torch.no_grad():
        h = layer0.input_layernorm(model.model.embed_tokens(ids))
        gate, up = layers[pre + "mlp.gate_proj"], layers[pre + "mlp.up_proj"]
        act = F.silu(gate.base_layer(h)) * up.base_layer(h)
    return [(name, x, layers[pre + name]) for name, x in
            (("self_attn.q_proj", h), ("self_attn.k_proj", h), ("mlp.gate_proj", h),
             ("mlp.down_proj", act))]


def _reference(y: torch.Tensor, x: torch.Tensor, layer: Any, slots: torch.Tensor
               ) -> torch.Tensor:
    out = y.clone()
    bgmv_expand(out, bgmv_shrink(x, layer.lora_a, slots), layer.lora_b, slots, layer.scalings)
    return out


def _delta_hint(y: torch.Tensor, got: torch.Tensor, x: torch.Tensor, layer: Any,
                slots: torch.Tensor) -> str:
    """Which classic mistake ``got`` shows."""
    base = slots < 0
    if base.any() and not torch.allclose(got[base], y[base], rtol=1e-4, atol=1e-5):
        return ("rows of slot -1 are base-model tokens: leave them exactly as they are (no "
                "A[-1], which Python reads as the LAST slot).")
    d = got - y
    for t in (slots >= 0).nonzero().squeeze(1).tolist():
        s = int(slots[t])
        raw = [(x[t] @ layer.lora_a[k].T) @ layer.lora_b[k].T for k in range(len(layer.scalings))]
        want = raw[s] * layer.scalings[s]
        if torch.allclose(d[t], want, rtol=1e-4, atol=1e-5):
            continue
        if torch.allclose(d[t], raw[s], rtol=1e-4, atol=1e-5):
            return (f"row {t} (slot {s}) got B A x without the scaling: multiply by "
                    f"scalings[slot] = lora_alpha / r = {float(layer.scalings[s]):g} here.")
        for k, rk in enumerate(raw):
            if k != s and torch.allclose(d[t], rk * layer.scalings[k], rtol=1e-4, atol=1e-5):
                return (f"row {t} belongs to slot {s} but got slot {k}'s adapter: index the "
                        "slot weights with token_slots[t] itself (no +1 / -1).")
        return (f"row {t} (slot {s}): the delta is scalings[s] * (x[t] @ A[s].T) @ B[s].T; "
                "A is [r, H_in], B is [H_out, r].")
    return "every row's delta is right; check the shape and dtype you return."


def check_delta(lora_delta: Callable) -> object:
    """``lora_delta`` on four real projections of labkit-tiny = labkit's bgmv_shrink/expand."""

    def body() -> str:
        cases = delta_cases()
        patterns = {"mixed": torch.tensor(SLOTS),
                    "sorted (SGMV segments)": torch.tensor(sorted(SLOTS)),
                    "all base": torch.full((len(SLOTS),), -1)}
        for name, x, layer in cases:
            with torch.no_grad():
                y = layer.base_layer(x)
            for label, slots in patterns.items():
                want = _reference(y, x, layer, slots)
                args = (y.clone(), x.clone(), layer.lora_a.clone(), layer.lora_b.clone(),
                        layer.scalings.clone(), slots.clone())
                got = call(lora_delta, *args, _label=f"lora_delta on {name}, {label} slots")
                where = (f"{name} ({layer.in_features} -> {layer.out_features}), token_slots "
                         f"{slots.tolist()}")
                if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                    raise CheckFailure("lora_delta must return y with the deltas added, shape "
                                       "[T, H_out]", inputs=where, expected=want, actual=got)
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                    raise CheckFailure("wrong LoRA delta", inputs=where, expected=want,
                                       actual=got, hint=_delta_hint(y, got, x, layer, slots))
        return (f"your batched delta equals labkit's SGMV/BGMV reference on {len(cases)} "
                f"projections of {MODEL}, four adapters mixed in one batch.")

    return run_check("lora_delta", body)


def slot_steps(seed: int = 0, n: int = 40, num_adapters: int = 6) -> list[set[int]]:
    """The replayed steps: a prefix that catches an in-use eviction and a refusal, then seeded
    steps of 1 to 3 adapters with Zipf-like popularity."""
    g = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, num_adapters + 1, dtype=torch.float64)
    steps = [{5}, {2}, {3}, {4, 5}, {1, 2, 3, 4}]
    for _ in range(n):
        k = int(torch.randint(1, 4, (1,), generator=g))
        steps.append({int(i) + 1 for i in torch.multinomial(w, k, generator=g)})
    return steps


def _state(s: Any) -> tuple[list, int, int]:
    return list(s.slots), int(s.loads), int(s.evictions)


def _slots_hint(before: list, step: set[int], got: list, want: list) -> str:
    for lid in step:
        if lid in before and lid in got and got.index(lid) != before.index(lid):
            return (f"adapter {lid} was resident in slot {before.index(lid)} and this step uses "
                    f"it, yet it moved to slot {got.index(lid)}: it was evicted while in use. "
                    "Pick the victim among adapters NOT in this step.")
    for lid in sorted(a for a in step if a not in before):
        slot_got, slot_want = got.index(lid), want.index(lid)
        if slot_got == slot_want:
            continue
        if before[slot_want] is None:
            return ("a new adapter goes into the lowest-numbered free slot "
                    "(slots.index(None)).")
        return (f"adapter {lid} should replace adapter {before[slot_want]} (slot {slot_want}), "
                f"the least recently used adapter not in this step at that point; yours "
                f"replaced {before[slot_got]} (slot {slot_got}). A hit counts as a use: it must "
                "move to the most recent end (an LRU, not the order adapters were loaded in).")
    return "compare your slots with the expected ones step by step."


def check_slots(adapter_slots: type) -> object:
    """``AdapterSlots`` replays :func:`slot_steps` as labkit's ``LoRAManager`` (3 slots, six
    real adapters on labkit-tiny): same slot of every adapter and same counts after each step,
    and a step of 4 adapters refused with :class:`SlotsFull` without a change."""

    def body() -> str:
        adapters = [ADAPTERS[i % len(ADAPTERS)] for i in range(6)]
        with tempfile.TemporaryDirectory() as d:
            *_, manager = _model_with_adapters(Path(d), 3, adapters)
            ours = call(adapter_slots, 3, _label="AdapterSlots(3)")
            steps = slot_steps()
            for i, step in enumerate(steps):
                before = _state(ours)
                where = f"step {i} of {steps[:i + 1]}, slots before {before[0]}"
                if len(step) > manager.max_loras:
                    _expect_refusal(ours, step, before, where)
                    continue
                manager.activate(set(step))
                got = call(ours.activate, set(step), _label=f"activate({step}) at step {i}")
                want = {lid: manager.slot_of(lid) for lid in step}
                if _state(ours)[0] != manager.slots or got != want:
                    raise CheckFailure("wrong slots after a step", inputs=where,
                                       expected=f"slots {manager.slots}, returned {want}",
                                       actual=f"slots {ours.slots}, returned {got}",
                                       hint=_slots_hint(before[0], step, ours.slots,
                                                        manager.slots))
                counts = (manager.counts["slot_loads"], manager.counts["slot_evictions"])
                if _state(ours)[1:] != counts:
                    raise CheckFailure("wrong loads / evictions count", inputs=where,
                                       expected=counts, actual=_state(ours)[1:],
                                       hint="a hit loads nothing; a load into a free slot "
                                       "evicts nothing; a load into a full set evicts one.")
        return (f"your slot LRU matches labkit's LoRAManager over {len(steps)} steps "
                f"({manager.counts['slot_loads']} loads, {manager.counts['slot_evictions']} "
                "evictions).")

    return run_check("lora_slots", body)


def _expect_refusal(ours: Any, step: set[int], before: tuple, where: str) -> None:
    try:
        got = ours.activate(set(step))
    except SlotsFull:
        if _state(ours) != before:
            raise CheckFailure("a refused step changed the slots or counts", inputs=where,
                               expected=before, actual=_state(ours),
                               hint="check len(step_ids) > num_slots before touching "
                               "anything.") from None
        return
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - a learner's wrong exception, named
        raise CheckFailure(f"a step of {len(step)} adapters over {len(before[0])} slots must "
                           f"raise SlotsFull, got {type(e).__name__}: {e}", inputs=where,
                           show_values=False, hint="raise SlotsFull (from labkit.exercises."
                           "lora_batching import SlotsFull).") from None
    raise CheckFailure("a step with more adapters than slots must be refused", inputs=where,
                       expected="SlotsFull raised", actual=f"returned {got}",
                       hint="one slot per adapter of the step: with more adapters than slots "
                       "one of them would be evicted while in use; the scheduler waits instead.")
