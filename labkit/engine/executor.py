"""The executor contract: what ``LLMEngine.step()`` asks of whatever runs a step.

Every step the engine hands the executor the scheduler's decisions twice:

1. ``apply_block_ops(ops)``: the block copies the block manager queued (copy-on-write, swap out,
   swap in). The model executor moves KV tensors; the simulator charges their time.
2. ``execute(scheduler_output) -> ModelRunnerOutput``: run the scheduled chunks and return the
   sampled token(s) per sequence id. One token per sampling sequence normally; a speculative
   executor may return several (the scheduler keeps them up to the first stop) and adds one
   record per speculating sequence for the trace.

Three executors implement it: ``ModelExecutor`` (the real model through a ``ModelRunner``,
:mod:`labkit.engine.model_runner`), ``SpecDecodeExecutor`` (draft, then verify in one target
forward, :mod:`labkit.spec.executor`) and ``SimExecutor`` (no tensors, a roofline clock,
:mod:`labkit.sim.executor`). The engine knows only this class; the others live above it and are
handed to it (``LLMEngine(config, executor)``), or built by a registered factory
(:func:`register_executor_factory`, for ``speculative_config`` given to ``LLM``).

A KV connector (:mod:`labkit.kv.connector`) adds no method here: the scheduler puts its
per-step metadata on ``SchedulerOutput.kv_connector_metadata`` and ``ModelExecutor.execute``
runs the connector's worker side around its forward (loads before each layer, saves after).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from labkit.errors import EngineConfigError, LoRAError, WeightUpdateError

if TYPE_CHECKING:  # annotations only: this module stays light (labkit/__init__ imports it)
    from labkit.kv.block_manager import BlockOps
    from labkit.sched.scheduler import SchedulerOutput


@dataclass
class ModelRunnerOutput:
    """One step's results: sampled token ids per sequence id, and the speculative records
    (``{"request_id", "seq_id", "proposed", "accepted"}``) the trace stores."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_records: list[dict[str, Any]] = field(default_factory=list)
    #: tensor parallelism: this step's collectives, ``{kind: {"count", "bytes"}}`` (rank 0's)
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    #: per seq id, one ``{token_id: Logprob}`` per sampled token (requests with ``logprobs``)
    logprobs: dict[str, list[Any]] = field(default_factory=dict)
    #: per request id, the prompt tokens this step scored (requests with ``prompt_logprobs``)
    prompt_logprobs: dict[str, list[Any]] = field(default_factory=dict)


class Executor(ABC):
    #: the trace's ``meta["executor"]``: "model" (real tensors) or "sim"
    name: ClassVar[str] = "model"
    #: False when token ids are placeholders (the simulator): the trace then stores no prompt ids
    real_tokens: ClassVar[bool] = True
    #: True when ``execute`` fills ``logprobs`` / ``prompt_logprobs`` for requests that ask
    supports_logprobs: ClassVar[bool] = False
    #: True when sampling applies each sequence's ``logits_processor`` (structured outputs)
    supports_structured_outputs: ClassVar[bool] = False

    @abstractmethod
    def apply_block_ops(self, ops: BlockOps) -> None:
        """Apply (or charge) the step's queued block copies before ``execute``."""

    @abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step; return the sampled token(s) per sequence id."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what outlives a step (worker processes of a parallel executor)."""

    def add_lora(self, lora_request: Any) -> None:
        """vLLM's ``add_lora``: load (or find cached) the adapter a request names, checked
        against the model, so a bad adapter fails ``add_request``, never a step. Only the LoRA
        executor (``labkit.lora``, ``enable_lora=True``) serves adapters."""
        raise LoRAError(f"request asks for LoRA adapter {lora_request!r} but the engine was "
                        "built without LoRA: LLM(..., enable_lora=True, max_loras=...)")

    def remove_lora(self, lora_int_id: int) -> bool:
        """vLLM's ``remove_lora``: forget an adapter (its slot, its cached weights); False if
        it was not loaded. The caller makes sure no live request uses it."""
        raise LoRAError("this engine was built without LoRA: there is no adapter to remove")

    def update_weights(self, state: dict[str, Any]) -> None:
        """Check ``state`` (parameter name -> tensor) against the model and copy it in place,
        between two steps (:mod:`labkit.engine.weight_update`); raise WeightUpdateError before
        touching anything if it does not fit. Only the single-process model executor can."""
        raise WeightUpdateError(f"the {type(self).__name__} cannot update weights in place "
                                "(tensor-parallel workers, LoRA, speculative decoding and the "
                                "simulator do not): restart the replica with the new weights")

    def stats(self) -> dict[str, Any]:
        """Counters of the executor's own, merged into ``LLMEngine.stats()`` (LoRA: slot
        loads and evictions, resident adapters); none by default."""
        return {}

    def admission_policy(self) -> Any:
        """The scheduler's :class:`~labkit.sched.admission.AdmissionPolicy` this executor
        needs (LoRA: at most ``max_loras`` adapters running), or None."""
        return None


# ---- factories for executors that live above the engine (dependency injection) ----------------
ExecutorFactory = Callable[[Any, Any, Any], Executor]  # (base ModelExecutor, config, scheduler)
_FACTORIES: dict[str, ExecutorFactory] = {}


def register_executor_factory(name: str, factory: ExecutorFactory) -> None:
    """Let a package above the engine (``labkit.spec``) wrap the model executor. ``labkit``'s
    ``__init__`` registers the shipped ones, so the engine never imports upward."""
    _FACTORIES[name] = factory


def executor_factory(name: str) -> ExecutorFactory:
    if name not in _FACTORIES:
        raise EngineConfigError(f"no executor registered for {name!r} (registered: "
                                f"{sorted(_FACTORIES)}); import the package that provides it")
    return _FACTORIES[name]
