"""Async scheduling's scheduler side: schedule step N+1 before step N's tokens exist.

vLLM's async scheduling (``--async-scheduling``) and SGLang's overlap scheduler run the
scheduler for the next step while the current step's forward is still computing. The scheduler
needs each sequence where ``update_from_output`` will leave it, so :func:`advance` puts it
there ahead of time, with one *placeholder* token per sampling sequence (vLLM's output
placeholders): every sequence of step N is assumed to get exactly one token. When N's sampling
is done, :func:`settle` takes the placeholders back out and books the real tokens through the
ordinary ``Scheduler.update_from_output`` (the one stop checker), so step N+1's chunk for that
sequence, packed later from ``seq.token_ids``, reads the real token in the placeholder's place.

The price is one step of lookahead: a sequence that finishes in step N (EOS, ``max_tokens``,
a stop string) was already given a slot in N+1; :func:`prune` drops it from N+1 before it runs
(its blocks, the extra slot's included, are already freed by the finish).

Preemption is the one decision that cannot be taken on a guess: a sequence preempted in N+1
while its step N token is in flight would need its KV freed and its token booked at once. So
:func:`may_preempt` checks beforehand whether the next ``schedule()`` could preempt at all
(blocks short for the running sequences' next chunks, or a priority / fair policy with
requests waiting); when it could, the engine books step N first and schedules N+1 afterwards,
as the synchronous engine does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from labkit.sched.output import SchedulerOutput, SeqOutput
from labkit.sched.request import Sequence
from labkit.sched.scheduler import Scheduler

#: the id standing for a token still being sampled; never reaches the model or an output
PLACEHOLDER = -1


@dataclass
class Lookahead:
    """What :func:`advance` changed: (sequence, its ``num_computed_tokens`` before, whether a
    placeholder was appended), so :meth:`undo` restores exactly that."""

    changed: list[tuple[Sequence, int, bool]] = field(default_factory=list)

    def undo(self) -> None:
        for seq, computed, placeholder in reversed(self.changed):
            if placeholder:
                if not seq.token_ids or seq.token_ids[-1] != PLACEHOLDER:
                    raise RuntimeError(f"{seq.seq_id}: its placeholder token is gone "
                                       f"({seq.token_ids[-3:]})")
                seq.token_ids.pop()
            seq.num_computed_tokens = computed
        self.changed.clear()


def advance(out: SchedulerOutput) -> Lookahead:
    """Move every sequence of the step in flight to the state booking it will give: a chunk
    that does not sample has its tokens computed; a sampling sequence (and every fork sampling
    from the same row) has one placeholder token appended and all but it computed."""
    ahead = Lookahead()
    for sc in out.scheduled:
        if not sc.samples:
            ahead.changed.append((sc.seq, sc.seq.num_computed_tokens, False))
            sc.seq.num_computed_tokens += sc.num_new_tokens
            continue
        for seq in (sc.seq, *sc.children):
            ahead.changed.append((seq, seq.num_computed_tokens, True))
            seq.token_ids.append(PLACEHOLDER)
            seq.num_computed_tokens = len(seq.token_ids) - 1
    return ahead


def may_preempt(sched: Scheduler) -> bool:
    """Could ``sched.schedule()`` preempt now? Only ``_schedule_running`` preempts (when a
    running sequence's chunk finds the pool short) and, under the priority and fair policies,
    ``preempt_for_waiting``; admission and swap-in wait instead. If every running sequence's
    whole remaining chunk fits in the available blocks together, none of its allocations can
    fail (each takes exactly what ``num_blocks_needed`` counts, and a copy-on-write frees its
    source), so nothing is preempted."""
    cfg, bm = sched.config, sched.bm
    if cfg.policy in ("priority", "fair") and (sched.num_waiting or sched.pending):
        return True
    need = sum(bm.num_blocks_needed(s, s.num_tokens - s.num_computed_tokens,
                                    num_lookahead=0 if s.is_prefill else cfg.num_lookahead_slots)
               for s in sched.running)
    return need > bm.pool.num_available


def settle(sched: Scheduler, out: SchedulerOutput, ahead: Lookahead | None,
           sampled: dict[str, list[int]], now: float) -> list[SeqOutput]:
    """Book step ``out``'s real tokens: undo the lookahead, then the ordinary
    ``update_from_output`` (stop checks, frees of finished sequences, prefix-cache blocks)."""
    if ahead is not None:
        ahead.undo()
    return sched.update_from_output(out, sampled, now)


def prune(out: SchedulerOutput) -> SchedulerOutput:
    """The prepared step without the sequences that finished (or were aborted) since it was
    scheduled: their slot is the one step of lookahead wasted, their blocks already freed.
    Their queued block copies stay: each writes only into a block freed with them, which
    nothing reads before a later allocation writes it."""
    kept = [sc for sc in out.scheduled if not sc.seq.is_finished]
    if len(kept) == len(out.scheduled):
        return out
    return replace(out, scheduled=kept,
                   num_batched_tokens=sum(sc.num_new_tokens for sc in kept))
