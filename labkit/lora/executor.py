"""LoRAExecutor: the model executor with adapter slots, and the scheduler's admission rule.

Built by the engine through the registered factory ``"lora"`` (``labkit/__init__.py``) when
``LLM(..., enable_lora=True)``; the engine never imports this package. It wraps the
:class:`~labkit.engine.model_runner.ModelExecutor`:

- construction applies :func:`~labkit.lora.layers.apply_lora` to the model and hooks the
  runner (``ModelRunner.step_hooks``): once per forward the hook turns each chunk's owner (the
  scheduled ``Sequence``) into its adapter's slot, repeated per token, on the shared
  :class:`~labkit.lora.layers.LoRAContext`;
- ``add_lora`` (called by ``add_request``) loads and checks an adapter into the CPU cache;
- ``execute`` first makes the step's adapters resident (:meth:`LoRAManager.activate`), then runs
  the base executor unchanged;
- ``admission_policy`` hands the scheduler :class:`LoRAAdmission`, so a step never holds more
  than ``max_loras`` distinct adapters.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from labkit.config import EngineConfig
from labkit.engine.executor import Executor, ModelRunnerOutput
from labkit.engine.model_runner import ModelExecutor
from labkit.errors import LoRAError
from labkit.kv.block_manager import BlockOps
from labkit.lora.layers import apply_lora
from labkit.lora.manager import LoRAManager
from labkit.lora.request import LoRARequest
from labkit.sched.request import Sequence
from labkit.sched.scheduler import SchedulerOutput


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


class LoRAExecutor(Executor):
    supports_logprobs = True
    supports_structured_outputs = True

    def __init__(self, base: ModelExecutor, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int) -> None:
        self.base = base
        self.runner = base.runner
        self.context, layers = apply_lora(base.model, max_loras, max_lora_rank)
        self.manager = LoRAManager(layers, max_loras, max_lora_rank, max_cpu_loras)
        self.runner.step_hooks.append(self._set_token_slots)

    @property
    def model(self) -> torch.nn.Module:
        return self.base.model

    def add_lora(self, lora_request: Any) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise LoRAError(f"lora_request must be a labkit.LoRARequest, got "
                            f"{type(lora_request).__name__}")
        self.manager.add_lora(lora_request)

    def admission_policy(self) -> LoRAAdmission:
        return LoRAAdmission(self.manager.max_loras)

    def apply_block_ops(self, ops: BlockOps) -> None:
        self.base.apply_block_ops(ops)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ids = {sc.seq.request.lora_int_id for sc in scheduler_output.scheduled} - {None}
        self.manager.activate(ids)
        try:
            return self.base.execute(scheduler_output)
        finally:
            self.context.clear()  # a later forward outside a step sees the base model

    def _set_token_slots(self, owners: Seq[Any] | None, query_lens: list[int]) -> None:
        """The runner's step hook: each chunk's adapter slot, once per token."""
        slots: list[int] = []
        for i, n in enumerate(query_lens):
            lid = None if owners is None else owners[i].request.lora_int_id
            slots.extend([self.manager.slot_of(lid)] * n)
        self.context.update_metadata(torch.tensor(slots, dtype=torch.long,
                                                  device=self.runner.device))


def make_lora_executor(base: Executor, config: EngineConfig) -> LoRAExecutor:
    """The engine's factory for ``enable_lora`` (registered by ``labkit/__init__.py``)."""
    if not isinstance(base, ModelExecutor):
        raise LoRAError("LoRA needs the in-process model executor (real tensors)")
    c = config.lora
    return LoRAExecutor(base, c.max_loras, c.max_lora_rank, c.max_cpu_loras)
