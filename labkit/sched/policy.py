"""The order a scheduling policy puts sequences in: one sort key serves every queue.

The waiting queue (who is admitted next), the running queue (who gets the token budget first)
and the choice of preemption victim (the worst key) all read the same key, so a policy is one
function here, not three rules in the scheduler. ``fcfs``: arrival; ``priority``: lower value
first, then arrival; ``sjf``: shortest prompt; ``fair``: the tenant's served-token counter,
which :class:`labkit.sched.policies_fair.FairShare` writes into the key every step.
"""

from __future__ import annotations

from labkit.sched.request import Request


def policy_key(policy: str, req: Request, seq_index: int) -> tuple:
    """The sort key of a request's ``seq_index``-th sequence under ``policy`` (smaller first;
    ties broken by arrival, then submission order, so the order is total and deterministic)."""
    if policy == "priority":
        return (req.priority, req.arrival_time, req.index, seq_index)
    if policy == "sjf":
        return (req.prompt_len, req.arrival_time, req.index, seq_index)
    if policy == "fair":  # served-token counter first: FairShare.rekey sets it every step
        return (0.0, req.arrival_time, req.index, seq_index)
    return (req.arrival_time, req.index, seq_index)
