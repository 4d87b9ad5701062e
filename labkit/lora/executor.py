"""LoRAExecutor: the model executor with adapter slots, and the scheduler's admission rule.

Built by the engine through the registered factory ``"lora"`` (``labkit/__init__.py``) when
``LLM(..., enable_lora=True)``; the engine never imports this package. It is the
:class:`~labkit.engine.model_runner.ModelExecutor` on the same runner, plus:

- construction applies :func:`~labkit.lora.layers.apply_lora` to the model and adds a step
  hook to the runner (``ModelRunner.step_hooks``): around every forward it makes the adapters
  of the chunks' owners (the scheduled ``Sequence`` s) resident (:meth:`LoRAManager.activate`)
  and sets each token's slot on the shared :class:`~labkit.lora.layers.LoRAContext`, then
  clears it. Being a hook on the runner, not code in ``execute``, it also serves the
  speculative executor's verify forward, which calls the runner directly;
- ``add_lora`` (called by ``add_request``) loads and checks an adapter into the CPU cache;
- ``admission_policy`` hands the scheduler :class:`LoRAAdmission`, so a step never holds more
  than ``max_loras`` distinct adapters.

With speculative decoding the draft (a draft model, an EAGLE head, n-grams) knows nothing of
adapters: it proposes what the base model would say, so an adapter's requests accept fewer
drafts than the base model's; verification keeps every output exactly the target's.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from typing import Any

import torch

from labkit.config import EngineConfig
from labkit.engine.executor import Executor
from labkit.engine.model_runner import ModelExecutor
from labkit.errors import LoRAError
from labkit.lora.layers import LoRAContext, apply_lora
from labkit.lora.manager import LoRAManager
from labkit.lora.punica import TorchPunica, TritonPunica
from labkit.lora.request import LoRARequest
from labkit.sched.request import Sequence


class LoRAAdmission:
    """The scheduler's admission policy for LoRA (vLLM's check in its scheduler): a request may
    start when it runs the base model, when its adapter is already running, or when fewer than
    ``max_loras`` distinct adapters are running (so a slot can be freed for it)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras

    def can_run(self, seq: Sequence, running: list[Sequence]) -> bool:
        lid = seq.request.lora_int_id
        if lid is None:
            return True
        ids = {s.request.lora_int_id for s in running} - {None}
        return lid in ids or len(ids) < self.max_loras


class LoRAExecutor(ModelExecutor):
    def __init__(self, base: ModelExecutor, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, punica: Any = None) -> None:
        super().__init__(base.runner)
        self.context, layers = apply_lora(base.model, max_loras, max_lora_rank,
                                          LoRAContext(punica=punica))
        self.manager = LoRAManager(layers, max_loras, max_lora_rank, max_cpu_loras)
        self.runner.step_hooks.append(self.lora_step)

    def add_lora(self, lora_request: Any) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise LoRAError(f"lora_request must be a labkit.LoRARequest, got "
                            f"{type(lora_request).__name__}")
        self.manager.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.manager.remove_lora(lora_int_id)

    def stats(self) -> dict[str, Any]:
        """The manager's counters under ``lora_`` names (``engine.stats()``: /metrics)."""
        s = self.manager.stats()
        return {"lora_resident": len(s["resident"]), "lora_num_slots": s["num_slots"],
                "lora_cpu_cached": len(s["cpu_cached"]),
                **{f"lora_{k}": s[k] for k in ("disk_loads", "cpu_evictions", "slot_loads",
                                                "slot_evictions")}}

    def admission_policy(self) -> LoRAAdmission:
        return LoRAAdmission(self.manager.max_loras)

    @contextmanager
    def lora_step(self, owners: Seq[Any] | None, query_lens: list[int]) -> Iterator[None]:
        """The runner's step hook: the chunks' adapters resident, each token's slot set for
        this forward, cleared after it (a later forward outside a step is the base model)."""
        ids = ([o.request.lora_int_id for o in owners] if owners is not None
               else [None] * len(query_lens))
        self.manager.activate(set(ids) - {None})
        slots: list[int] = []
        for lid, n in zip(ids, query_lens):
            slots.extend([self.manager.slot_of(lid)] * n)
        self.context.update_metadata(torch.tensor(slots, dtype=torch.long,
                                                  device=self.runner.device), list(query_lens))
        try:
            yield
        finally:
            self.context.clear()


def make_lora_executor(base: Executor, config: EngineConfig) -> LoRAExecutor:
    """The engine's factory for ``enable_lora`` (registered by ``labkit/__init__.py``). The
    kernels follow the engine's kernel choice: with ``attention_backend="triton"`` the deltas
    run through ``kernels/lora_ops.py`` (:class:`~labkit.lora.punica.TritonPunica`: SGMV for
    steps with prefill chunks, BGMV for decode steps), otherwise through
    :class:`~labkit.lora.punica.TorchPunica` (the same plan in PyTorch)."""
    if not isinstance(base, ModelExecutor):
        raise LoRAError("LoRA needs the in-process model executor (real tensors)")
    c = config.lora
    punica = TritonPunica() if config.model.attention_backend == "triton" else TorchPunica()
    return LoRAExecutor(base, c.max_loras, c.max_lora_rank, c.max_cpu_loras, punica)
