"""Admission policies: a feature's say in who may *start* running, without a branch in the
scheduler's loop.

The scheduler asks its one optional policy ``can_run(seq, running)`` for each waiting request
before admitting it (a refused one is skipped and keeps its place in the queue, so requests
behind it may still start) and for each swapped sequence before it comes back (a refused one
waits at the head of the swap queue). Running sequences are never asked again: a policy limits
entry, it never preempts.

LoRA is the user today (``labkit.lora.executor.LoRAAdmission``): at most ``max_loras`` distinct
adapters may run at once, because one forward can only use the adapters in the device slots.
vLLM hard-codes the same check in its scheduler (a request whose adapter would be one too many
is skipped for this step); here the engine hands the policy in (``Executor.admission_policy``),
so the scheduler stays free of LoRA.
"""

from __future__ import annotations

from typing import Protocol

from labkit.sched.request import Sequence


class AdmissionPolicy(Protocol):
    def can_run(self, seq: Sequence, running: list[Sequence]) -> bool:
        """May ``seq`` join the ``running`` sequences now?"""
        ...
