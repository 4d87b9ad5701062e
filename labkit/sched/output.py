"""What the scheduler hands the executor, and what a step did to each sequence (vLLM v1's
``sched/output.py``): plain data, read by the executors, the engine and the trace."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from labkit.kv.block_manager import BlockOps
from labkit.sched.request import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    start_pos: int
    is_prefill: bool
    samples: bool  # the chunk reaches the end of the sequence: a token is sampled
    children: list[Sequence] = field(default_factory=list)  # forked at this step (n > 1)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[tuple[Sequence, str]]
    num_batched_tokens: int
    token_budget: int
    block_ops: BlockOps = field(default_factory=BlockOps)  # apply before the forward
    #: a KV connector's loads / saves for this step (its ``build_connector_meta``), else None
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SeqOutput:
    """What one step did to one sequence (``update_from_output``): the tokens it kept, and why
    it finished (``"stop"`` | ``"length"``), if it did."""

    seq: Sequence
    new_token_ids: list[int]
    finish_reason: str | None
