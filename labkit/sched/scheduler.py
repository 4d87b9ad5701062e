"""Scheduler: iteration-level (continuous) batching under a per-step token budget.

Each call to ``schedule()`` decides one engine step, the way vLLM's V1 scheduler does (and its V0
scheduler with chunked prefill; V0's default scheduler batched waiting prefills first and ran
decodes only in steps without one):

1. **Running sequences first** (decode-first), in policy order: each gets its next chunk (one
   token when decoding; a slice of the prompt when a chunked prefill is in progress) if the token
   budget ``max_num_batched_tokens`` allows. When the block pool cannot hold the chunk, the worst
   sequence (by policy) is *preempted*: by recompute (free its blocks, requeue; its KV is rebuilt
   by a later prefill; vLLM V1's only mode) or by swap (its blocks are copied to a CPU pool and
   back later, as vLLM V0 did for beam search; V1 moves KV to CPU through its offloading KV
   connector instead, outside preemption).
2. If nothing was preempted: swapped sequences come back first, then waiting requests are admitted
   in policy order while ``max_num_seqs``, the token budget, the pool and the KV watermark allow.
   A new request first picks up its longest prefix-cache hit.

Policies order the waiting queue, the running queue and the choice of preemption victim:
``fcfs`` (arrival), ``priority`` (lower value first, then arrival), ``sjf`` (shortest prompt).

Watermark admission (hysteresis, the textbook technique; neither TGI nor vLLM does this): once
KV usage reaches ``watermark_high`` no new request is admitted until usage falls to
``watermark_low``; running work is never blocked. It trades some batch size for fewer
preemptions. What the servers do instead (the ``watermark`` drill, with sources): vLLM V0 kept a
single watermark, a fraction of the blocks (1%) that must stay free after an admission, and V1
keeps none; TGI admits by token budget, reserving blocks for prompt + ``max_new_tokens`` within
``max_batch_total_tokens``, so it never preempts.

An optional admission policy (:mod:`labkit.sched.admission`) may refuse a waiting request (it is
skipped and keeps its place) or a swapped one (it waits): LoRA's ``max_loras`` rule.
A KV connector (``kv_connector``, :mod:`labkit.kv.connector`) is asked at admission how many
tokens past the prefix-cache hit it can load, is told the blocks allocated for them, builds the
step's metadata at the end of ``schedule()``, and hears of every finished or aborted sequence.

``batching="static"``: take a batch of up to max_num_seqs waiting requests when nothing runs, run
it to completion, then the next — the baseline continuous batching is compared with.

After the forward, ``update_from_output`` books the results: tokens appended up to the one stop
checker (:class:`StopChecker`: EOS, stop ids, max_tokens / context end, stop strings; a
speculative step's extra tokens are checked one by one and dropped after a stop),
``num_computed_tokens`` advanced, finished sequences freed, rejected-draft slots released.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable
from typing import Any

from labkit.config import BATCHING, POLICIES, PREEMPTION_MODES, SchedulerConfig
from labkit.kv.block_manager import BlockManager
from labkit.sched.admission import AdmissionPolicy
from labkit.sched.kv_transfer import commit_external, external_tokens
from labkit.sched.output import ScheduledSeq, SchedulerOutput, SeqOutput
from labkit.sched.policies_fair import FairShare, preempt_for_waiting
from labkit.sched.policy import policy_key
from labkit.sched.quota import TenantQuota, combine
from labkit.sched.request import Request, Sequence, SequenceStatus
from labkit.sched.stop import StopChecker, stop_string_hit
from labkit.utils import cdiv

__all__ = ["AdmissionPolicy", "BATCHING", "POLICIES", "PREEMPTION_MODES", "ScheduledSeq",
           "Scheduler", "SchedulerConfig", "SchedulerOutput", "SeqOutput", "StopChecker",
           "policy_key", "stop_string_hit"]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float], stop_checker: StopChecker | None = None,
                 admission: AdmissionPolicy | None = None, kv_connector: Any = None) -> None:
        self.config = config
        # None: every request may run (see AdmissionPolicy); per-tenant quotas join the
        # executor's policy (labkit.sched.quota)
        self.quota = (TenantQuota(config.tenant_max_running, config.tenant_max_kv_blocks,
                                  block_manager.block_size)
                      if config.tenant_max_running or config.tenant_max_kv_blocks else None)
        self.admission = combine(admission, self.quota)
        self.connector = kv_connector  # its scheduler side, or None (labkit.kv.connector)
        self.bm = block_manager
        self.clock = clock
        self.stop_checker = stop_checker or StopChecker()
        self.finished: list[dict] = []  # finish records since the trace last took them
        self.pending: list[tuple[float, int, Sequence]] = []  # not yet arrived (simulator)
        self.waiting: list[tuple[tuple, Sequence]] = []  # heap by policy key; lazy deletion
        self.num_waiting = 0
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.admitting = True  # watermark hysteresis state
        self.num_preemptions = 0
        self.static_queue: list[Sequence] = []  # static batching: the current batch's waiting
        self.fair = (FairShare(config.tenant_weights) if config.policy == "fair"
                     else None)  # policies_fair.py

    # ---- queues ---------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        seq = req.seqs[0]
        seq.sort_key = policy_key(self.config.policy, req, 0)
        if req.arrival_time > self.clock():
            heapq.heappush(self.pending, (req.arrival_time, req.index, seq))
        else:
            self._push_waiting(seq)

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.num_waiting += 1
        if seq.request.static_batch:
            bisect.insort(self.static_queue, seq, key=lambda s: s.sort_key)
        else:
            heapq.heappush(self.waiting, (seq.sort_key, seq))

    def _peek_waiting(self) -> Sequence | None:
        while self.waiting:
            seq = self.waiting[0][1]
            if seq.status is SequenceStatus.WAITING:
                return seq
            heapq.heappop(self.waiting)  # aborted while waiting
        return None

    def next_arrival(self) -> float | None:
        return self.pending[0][0] if self.pending else None

    def has_unfinished(self) -> bool:
        return bool(self.running or self.swapped or self.num_waiting or self.pending)

    def abort_seq(self, seq: Sequence) -> None:
        """Remove a sequence from whatever queue holds it and free its blocks."""
        if seq.status is SequenceStatus.WAITING:
            n_pending = len(self.pending)
            self.pending = [p for p in self.pending if p[2] is not seq]
            if len(self.pending) == n_pending:  # in the waiting heap (lazily deleted) or batch
                self.num_waiting -= 1
                if seq in self.static_queue:
                    self.static_queue.remove(seq)
            heapq.heapify(self.pending)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self._free_finished(seq)

    def _free_finished(self, seq: Sequence) -> None:
        if self.connector is not None:
            self.connector.request_finished(seq, list(seq.block_table))
        self.bm.free(seq)

    def abort_request(self, req: Request) -> None:
        """Finish every unfinished sample of ``req`` with reason ``"abort"``, wherever it is
        (waiting, running, swapped); all its blocks are released and no fork will follow."""
        for seq in req.seqs:
            if not seq.is_finished:
                self.abort_seq(seq)
                self._record_finish(seq, "abort")
        req.num_pending_forks = 0
        req.finish_time = self.clock()

    def remove_finished(self) -> None:
        """Drop finished sequences from the running list (their blocks are already freed)."""
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]

    def take_finished(self) -> list[dict]:
        """Finish records (request_id, seq_id, reason) since the last call, for the trace."""
        out, self.finished = self.finished, []
        return out

    def _record_finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.finished.append({"request_id": seq.request_id, "seq_id": seq.seq_id,
                              "reason": reason})

    # ---- scheduling -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        now = self.clock()
        while self.pending and self.pending[0][0] <= now:
            self._push_waiting(heapq.heappop(self.pending)[2])
        if self.fair:
            self.fair.rekey(self)
        vip = preempt_for_waiting(self) if cfg.policy in ("priority", "fair") else []
        scheduled: list[ScheduledSeq] = []
        preempted: list[tuple[Sequence, str]] = []
        budget = self._schedule_running(cfg.max_num_batched_tokens, scheduled, preempted)
        # swapped back in, then new admissions, only when nothing had to be preempted
        if not preempted:
            budget = self._swap_in(scheduled, budget)
            if not self.swapped:
                budget = self._admit(scheduled, budget)
        if self.fair:
            self.fair.charge(scheduled)
        self.num_preemptions += len(preempted) + len(vip)
        out = SchedulerOutput(scheduled, vip + preempted, cfg.max_num_batched_tokens - budget,
                              cfg.max_num_batched_tokens, self.bm.take_block_ops())
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _schedule_running(self, budget: int, scheduled: list[ScheduledSeq],
                          preempted: list[tuple[Sequence, str]]) -> int:
        """Running sequences, best first, each its next chunk; when blocks run out, preempt from
        the worst end (possibly the sequence itself). Returns the budget left."""
        cfg, bm = self.config, self.bm
        self.running.sort(key=lambda s: s.sort_key)
        queue = deque(self.running)
        kept: list[Sequence] = []
        self.running = kept
        while queue:
            seq = queue.popleft()
            num_new = seq.num_tokens - seq.num_computed_tokens
            if budget <= 0 or (num_new > budget and not cfg.enable_chunked_prefill):
                kept.append(seq)
                continue
            num_new = min(num_new, budget)
            is_prefill = seq.is_prefill
            lookahead = 0 if is_prefill else cfg.num_lookahead_slots
            ok = bm.allocate_slots(seq, num_new, num_lookahead=lookahead)
            while not ok:
                victim = queue.pop() if queue else seq
                preempted.append((victim, self._preempt(victim)))
                if victim is seq:
                    break
                ok = bm.allocate_slots(seq, num_new, num_lookahead=lookahead)
            if ok:
                kept.append(seq)
                scheduled.append(self._scheduled(seq, num_new, is_prefill))
                budget -= num_new
        return budget

    # ---- after the forward ----------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           now: float | None = None) -> list[SeqOutput]:
        """Book a step's results (vLLM v1's ``update_from_output``). A chunk that did not reach
        its sequence's end only advances ``num_computed_tokens``. A sequence that sampled gets
        its tokens appended up to the first stop condition (a speculative step may bring
        several; the rest are dropped), then every token but the last one has KV; a finished
        sequence is freed; slots reserved for rejected drafts are released. ``now`` stamps the
        tokens (the engine passes the time the forward ended, which the trace records too)."""
        now = self.clock() if now is None else now
        outputs: list[SeqOutput] = []
        for sc in out.scheduled:
            if not sc.samples:
                sc.seq.num_computed_tokens += sc.num_new_tokens
                self.bm.cache_full_blocks(sc.seq)
                continue
            for seq in (sc.seq, *sc.children):
                o = self._append(seq, sampled.get(seq.seq_id, []), now)
                if o.new_token_ids or o.finish_reason:
                    outputs.append(o)
        if any(o.finish_reason for o in outputs):
            self.remove_finished()
        return outputs

    def _append(self, seq: Sequence, new: list[int], now: float) -> SeqOutput:
        added, reason = self.stop_checker.append(seq, new, now)
        if added and seq.logits_processor is not None:
            seq.logits_processor.accept(added)
        seq.num_computed_tokens = len(seq.token_ids) - 1
        self.bm.cache_full_blocks(seq)
        req = seq.request
        if req.first_token_time is None and added:
            req.first_token_time = now
        if reason is not None:
            self._free_finished(seq)
            self._record_finish(seq, reason)
            if req.is_finished:
                req.finish_time = now
        elif len(seq.block_table) > cdiv(seq.num_tokens + self.config.num_lookahead_slots,
                                         self.bm.block_size):
            self.bm.truncate(seq, seq.num_tokens)  # drop the slots of rejected drafts
        return SeqOutput(seq, added, reason)

    def _scheduled(self, seq: Sequence, num_new: int, is_prefill: bool) -> ScheduledSeq:
        start = seq.num_computed_tokens
        samples = start + num_new == seq.num_tokens
        s = ScheduledSeq(seq, num_new, start, is_prefill, samples)
        req = seq.request
        if samples and req.num_pending_forks:
            s.children = req.fork_children()
            for c in s.children:
                self.bm.fork(seq, c)
                self.running.append(c)
        return s

    def _preempt(self, seq: Sequence) -> str:
        if self.config.preemption_mode == "swap" and self.bm.can_swap_out(seq):
            self.bm.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return "swap"
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        self._push_waiting(seq)
        return "recompute"

    def _swap_in(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        cfg, bm = self.config, self.bm
        while self.swapped and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            lookahead = 0 if seq.is_prefill else cfg.num_lookahead_slots
            need = max(len(seq.cpu_block_table),
                       cdiv(seq.num_computed_tokens + num_new + lookahead, bm.block_size))
            if need > bm.pool.num_available or not self._may_run(seq):
                break
            self.swapped.popleft()
            bm.swap_in(seq)
            if not bm.allocate_slots(seq, num_new, num_lookahead=lookahead):  # not an assert:
                raise RuntimeError(f"swap-in of {seq.seq_id} found fewer free blocks than "
                                   "checked")  # python -O would skip the allocation itself
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._scheduled(seq, num_new, seq.is_prefill))
            budget -= num_new
        return budget

    def _may_run(self, seq: Sequence) -> bool:
        return self.admission is None or self.admission.can_run(seq, self.running)

    def _watermark_ok(self) -> bool:
        usage = self.bm.pool.num_used / self.bm.num_blocks
        high = self.config.watermark_high
        if self.admitting and usage >= high and high < 1:
            self.admitting = False
        elif not self.admitting and usage <= self.config.watermark_low:
            self.admitting = True
        return self.admitting

    def _open_static_batch(self) -> None:
        """Static batching: nothing runs, so take the next batch from the waiting queue."""
        cap = self.config.max_num_seqs
        width = 0
        while width < cap:
            seq = self._peek_waiting()
            if seq is None or width + seq.request.n > cap:
                break
            heapq.heappop(self.waiting)
            seq.request.static_batch = True
            self.static_queue.append(seq)
            width += seq.request.n

    def _admit(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        """Waiting requests in policy order while the limits allow; one the admission policy
        refuses is set aside and pushed back in its place afterwards."""
        skipped: list[Sequence] = []
        try:
            return self._admit_loop(scheduled, budget, skipped)
        finally:
            for seq in skipped:
                heapq.heappush(self.waiting, (seq.sort_key, seq))

    def _admit_loop(self, scheduled: list[ScheduledSeq], budget: int,
                    skipped: list[Sequence]) -> int:
        cfg, bm = self.config, self.bm
        static = cfg.batching == "static"
        if static and not self.running and not self.swapped and not self.static_queue:
            self._open_static_batch()
        while budget > 0 and self._watermark_ok():
            if static:
                seq = self.static_queue[0] if self.static_queue else None
            else:
                seq = self._peek_waiting()
            if seq is None:
                break
            req = seq.request
            width = 1 + req.num_pending_forks  # samples it will fork into
            if len(self.running) + width > cfg.max_num_seqs:
                break
            if not self._may_run(seq):
                if static:
                    break
                skipped.append(heapq.heappop(self.waiting)[1])
                continue
            blocks, hashes = bm.find_cached_prefix(seq)
            num_ext = external_tokens(self.connector, seq, len(blocks) * bm.block_size,
                                      bm.block_size)
            num_new = seq.num_tokens - len(blocks) * bm.block_size - num_ext
            if num_new > budget and not cfg.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not bm.allocate_slots(seq, num_ext + num_new, blocks, hashes):
                break
            if self.connector is not None:
                commit_external(self.connector, seq, num_ext, bm.block_size)
            if static:
                self.static_queue.pop(0)
            else:
                heapq.heappop(self.waiting)
            self.num_waiting -= 1
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
                seq.num_cached_tokens = len(blocks) * bm.block_size + num_ext
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._scheduled(seq, num_new, True))
            budget -= num_new
        return budget
