"""LLMEngine: requests in, one scheduled step at a time, tokens out (vLLM's shape).

    engine = LLMEngine.from_model(model, tokenizer, block_size=16)
    engine.add_request("r1", "def f(x):", SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished_requests():
        for out in engine.step(): print(out.request_id, out.new_token_ids, out.finished)

One ``step()`` = schedule (Scheduler + BlockManager) -> apply queued block copies -> execute
(one packed forward for the model executor; a cost model for the simulator) -> append tokens,
check stop conditions, free finished sequences -> append one Trace record. The same engine
drives the real model (``ModelExecutor``) and the simulator (``SimExecutor``); they differ
only in ``execute`` and in the clock (wall vs virtual).

Hooks for speculative decoding (labkit.spec builds on these; nothing here is spec-specific):
- Executor results are ``dict[seq_id, list[int]]``: a step may append several tokens to a
  sequence. The engine appends them in order, stops at the first stop condition (dropping the
  rest), then sets ``num_computed_tokens = num_tokens - 1`` for every sequence that sampled
  (all tokens but the last one have KV), and calls ``block_manager.truncate(seq, num_tokens)``
  to release slots reserved for rejected drafts.
- ``SchedulerConfig.num_lookahead_slots``: the scheduler reserves that many extra KV slots per
  decoding sequence, so a verify pass can write k draft tokens' KV.
- ``BlockManager.truncate(seq, num_slots)`` rolls a sequence back (frees emptied tail blocks,
  forgets hashes past the cut; a later write into a published block copies it first).
- ``ModelExecutor.forward_chunks(chunks, logits_rows)`` runs a multi-token chunk for a decoding
  sequence through the prefill attention path and returns logits at any offsets: the verify pass.
- Trace step records carry ``"spec": [{"request_id", "seq_id", "proposed", "accepted"}]``: an
  executor that has a ``pop_spec_records()`` method is asked for them after every step.
- ``LLMEngine(speculative_config=...)`` calls ``labkit.spec.make_spec_executor(engine,
  speculative_config)`` which must return an executor with ``execute(SchedulerOutput)``.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.engine.clock import WallClock
from labkit.engine.detokenizer import stop_string_hit, update_text
from labkit.engine.errors import (
    EngineConfigError,
    EngineStepError,
    InvalidPromptError,
    SamplingParamsError,
)
from labkit.engine.outputs import StepOutput
from labkit.engine.sampling_params import SamplingParams
from labkit.engine.trace import Trace, step_record
from labkit.engine.validate import (
    check_fits,
    check_int,
    check_max_model_len,
    check_request_args,
    prompt_ids,
)
from labkit.kv.block_manager import BlockManager, cdiv
from labkit.sched.request import Request, Sequence, SequenceStatus
from labkit.sched.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


class LLMEngine:
    def __init__(self, executor: Any, *, num_blocks: int, block_size: int = 16,
                 max_model_len: int, vocab_size: int | None = None,
                 eos_token_ids: tuple[int, ...] = (), tokenizer: Any = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 policy: str = "fcfs", max_num_seqs: int = 64,
                 max_num_batched_tokens: int | None = None, batching: str = "continuous",
                 preemption_mode: str = "recompute", num_cpu_blocks: int = 0,
                 watermark_high: float = 1.0, watermark_low: float = 1.0,
                 num_lookahead_slots: int = 0, clock: Any = None, model_name: str = "",
                 speculative_config: Any = None) -> None:
        check_int("block_size", block_size)
        check_int("num_blocks", num_blocks)
        check_int("num_cpu_blocks", num_cpu_blocks, 0)
        check_int("max_model_len", max_model_len, 2)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 512 if enable_chunked_prefill else max_model_len
        check_int("max_num_seqs", max_num_seqs)
        check_int("max_num_batched_tokens", max_num_batched_tokens)
        if preemption_mode == "swap" and num_cpu_blocks < 1:
            raise EngineConfigError("preemption_mode='swap' needs num_cpu_blocks >= 1 "
                                    "(the CPU pool)")
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens,
                                      enable_chunked_prefill, policy, batching, preemption_mode,
                                      watermark_high, watermark_low, num_lookahead_slots)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.clock = clock or WallClock()
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching,
                                          num_cpu_blocks)
        self.scheduler = Scheduler(self.config, self.block_manager, self.clock.now)
        self.executor = executor
        self.requests: dict[str, Request] = {}
        self._num_added = 0
        self.num_steps = 0
        self.trace = Trace({
            "block_size": block_size, "num_blocks": num_blocks, "num_cpu_blocks": num_cpu_blocks,
            "executor": getattr(executor, "kind", "model"), "model": model_name,
            "policy": policy, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "batching": batching,
            "enable_prefix_caching": enable_prefix_caching,
            "enable_chunked_prefill": enable_chunked_prefill, "preemption_mode": preemption_mode,
            "watermark_low": watermark_low, "watermark_high": watermark_high})
        self.record_trace = True
        self.kv_info: dict[str, Any] = {}  # KV dtype and bytes, set by from_model
        self._pending_aborts: list[dict] = []  # aborted between steps: logged with the next step
        self._late_finished: list[dict] = []  # finished by a stop string while detokenizing
        if speculative_config is not None:
            import labkit.spec as spec

            make = getattr(spec, "make_spec_executor", None)
            if make is None:
                raise ValueError("speculative_config given but labkit.spec has no "
                                 "make_spec_executor(engine, config) yet")
            self.executor = make(self, speculative_config)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any = None, *, block_size: int = 16,
                   num_blocks: int | None = None, kv_cache_bytes: int | None = None,
                   num_cpu_blocks: int = 0, attention_backend: str | None = None,
                   max_num_seqs: int = 64, max_model_len: int | None = None,
                   kv_cache_dtype: str = "auto", **kw: Any) -> LLMEngine:
        """An engine on a real model; the KV pool is ``num_blocks`` or sized from
        ``kv_cache_bytes`` (default: enough for max_num_seqs full-length sequences, capped at
        256 MiB). ``kv_cache_dtype="int8"`` stores K/V as int8 with per-(token, head) scales
        (labkit.kv.cache), so the same bytes hold ~2-4x more blocks."""
        from labkit.engine.model_runner import ModelExecutor
        from labkit.kv.attention import get_attention_backend
        from labkit.kv.cache import check_kv_cache_dtype, kv_bytes_per_block, num_blocks_for

        c = model.config
        max_model_len = check_max_model_len(max_model_len, c.max_position_embeddings)
        check_int("block_size", block_size)
        check_int("max_num_seqs", max_num_seqs)
        check_int("num_cpu_blocks", num_cpu_blocks, 0)
        if num_blocks is not None:
            check_int("num_blocks", num_blocks)
        check_kv_cache_dtype(kv_cache_dtype)
        per_block = kv_bytes_per_block(c.num_hidden_layers, block_size, c.num_key_value_heads,
                                       c.head_dim, model.dtype, kv_cache_dtype)
        if num_blocks is None:
            num_blocks = num_blocks_for(per_block, kv_cache_bytes, max_num_seqs, max_model_len,
                                        block_size)
        backend = get_attention_backend(attention_backend)
        ex = ModelExecutor(model, block_size, num_blocks, num_cpu_blocks, backend, kv_cache_dtype)
        eng = cls(ex, num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                  vocab_size=c.vocab_size, eos_token_ids=tuple(c.eos_token_ids),
                  tokenizer=tokenizer, num_cpu_blocks=num_cpu_blocks,
                  max_num_seqs=max_num_seqs, **kw)
        eng.kv_info = {"kv_cache_dtype": kv_cache_dtype, "kv_bytes_per_block": per_block,
                       "kv_cache_bytes": per_block * num_blocks}
        return eng

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    params: SamplingParams | None = None, priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None) -> Request:
        """Validate and queue a request; every bad input raises a ValueError subclass here
        (labkit.engine.errors), never later inside a step."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise SamplingParamsError(f"params must be a SamplingParams, got {type(params)}")
        params.validate()
        check_request_args(request_id, params, self.vocab_size, cache_salt, arrival_time)
        request_id = str(request_id)
        if request_id in self.requests:
            raise InvalidPromptError(f"duplicate request id {request_id!r}: ids must be unique "
                                     "for the engine's lifetime")
        ids = prompt_ids(request_id, prompt, prompt_token_ids, self.tokenizer)
        check_fits(self, request_id, ids, params, priority)
        now = self.clock.now()
        arrival = now if arrival_time is None else float(arrival_time)
        if isinstance(self.clock, WallClock) and arrival - now > 86400:  # step() would sleep
            raise InvalidPromptError(f"arrival_time={arrival_time} is {arrival - now:.0f} s "
                                     "away: it is seconds on the engine clock "
                                     f"(engine.clock.now() = {now:.1f}), not epoch time")
        req = Request(request_id, ids, params, arrival, priority, cache_salt, self._num_added)
        self._num_added += 1
        self._init_generator(req.seqs[0])
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        if self.record_trace:
            self.trace.requests[request_id] = {
                "prompt_token_ids": ids if getattr(self.executor, "kind", "model") != "sim"
                else None, "prompt_len": len(ids), "priority": priority,
                "arrival_time": arrival, "n": params.n, "max_tokens": params.max_tokens}
        return req

    def _init_generator(self, seq: Sequence) -> None:
        p = seq.request.params
        if p.temperature == 0 or getattr(self.executor, "kind", "model") == "sim":
            return
        g = torch.Generator()
        if p.seed is not None:
            g.manual_seed(p.seed + seq.index)
        else:
            g.seed()
        seq.generator = g

    def abort(self, request_id: str | list[str]) -> bool:
        """Stop a request now, wherever it is (waiting, running, swapped); all its blocks are
        released. Like vLLM, unknown or already finished ids are ignored: returns whether
        anything was aborted (a list of ids aborts each)."""
        if isinstance(request_id, (list, tuple, set)):
            return any([self.abort(r) for r in request_id])
        req = self.requests.get(str(request_id))
        if req is None or req.is_finished:
            return False
        now = self.clock.now()
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.abort_seq(seq)
                seq.finish_reason = "abort"
        req.forked = True
        req.finish_time = now
        if self.record_trace:  # aborts between steps are logged with the next step's record
            self._pending_aborts.extend(
                {"request_id": req.request_id, "seq_id": s.seq_id, "reason": "abort"}
                for s in req.seqs if s.finish_reason == "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        sched = self.scheduler
        t0 = self.clock.now()
        out = sched.schedule()
        if out.is_empty and not out.preempted:
            nxt = sched.next_arrival()
            if nxt is not None and not sched.running and not sched.num_waiting:
                self.clock.advance_to(nxt)  # idle until the next request arrives
            elif (sched.num_waiting or sched.swapped) and not sched.running:
                # add_request guarantees each request fits alone; an error beats a silent hang
                raise RuntimeError(f"scheduler stalled with {sched.num_waiting} waiting and "
                                   f"{len(sched.swapped)} swapped requests and nothing running:"
                                   f" {self.stats()}")
            elif self.record_trace and self.block_manager.events:
                self._record(out, t0, 0.0, {}, [], self.block_manager.drain()[0])
            return []
        events, copies, swap_out, swap_in = self.block_manager.drain()
        try:
            for sc in out.scheduled:
                for c in sc.children:
                    self._init_generator(c)
            ex = self.executor
            if hasattr(ex, "apply_block_ops"):
                ex.apply_block_ops(copies, swap_out, swap_in)
            results = ex.execute(out)
            t1 = self.clock.now()
            outputs, finished, appended = self._update(out, results, t1)
        except BaseException as exc:
            self._fail_step(out, t0, events, exc)
            raise
        self.num_steps += 1
        if self.record_trace:
            self._record(out, t0, t1 - t0, appended, finished, events)
        return outputs

    def _fail_step(self, out: SchedulerOutput, t0: float, events: list[dict],
                   exc: BaseException) -> None:
        """A step raised after scheduling. Its block copies / swaps may be half applied and its
        sequences half updated, so retrying could compute on garbage KV: fail (abort) every
        request the step touched -- scheduled, forked, or swapped out -- which frees all their
        blocks; other requests go on. Raises EngineStepError (a KeyboardInterrupt propagates
        as itself after the same cleanup)."""
        touched = {sc.seq.request_id for sc in out.scheduled}
        touched.update(s.request_id for s, mode in out.preempted if mode == "swap")
        ids = sorted(touched)
        self.scheduler.remove_finished()  # sequences _update had already finished
        for rid in ids:
            self.abort(rid)
        self.num_steps += 1
        if self.record_trace:
            self._record(out, t0, self.clock.now() - t0, {}, [], events)
        if isinstance(exc, Exception):
            raise EngineStepError(f"engine step failed ({type(exc).__name__}: {exc}); its "
                                  f"requests {ids} were aborted and freed, the others go on",
                                  ids) from exc

    def _update(self, out: SchedulerOutput, results: dict[str, list[int]],
                now: float) -> tuple[list[StepOutput], list[dict], dict[str, list[int]]]:
        """Append each sequence's new tokens (up to its first stop condition), advance its
        computed count, publish full blocks, free finished sequences. Returns the step outputs,
        the finished records and the tokens actually appended per sequence (for the trace)."""
        bm = self.block_manager
        outputs: list[StepOutput] = []
        finished: list[dict] = []
        bs, lookahead = bm.block_size, self.config.num_lookahead_slots
        appended: dict[str, list[int]] = {}
        for sc in out.scheduled:
            if not sc.samples:
                sc.seq.num_computed_tokens += sc.num_new_tokens
                bm.cache_full_blocks(sc.seq)
                continue
            for seq in (sc.seq, *sc.children) if sc.children else (sc.seq,):
                new = results.get(seq.seq_id, [])
                added, reason = self._append(seq, new, now)
                appended[seq.seq_id] = added
                seq.num_computed_tokens = len(seq.token_ids) - 1
                bm.cache_full_blocks(seq)
                if reason is not None:
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = reason
                    bm.free(seq)
                    finished.append({"request_id": seq.request_id, "seq_id": seq.seq_id,
                                     "reason": reason})
                elif len(seq.block_table) > cdiv(len(seq.token_ids) + lookahead, bs):
                    bm.truncate(seq, len(seq.token_ids))  # drop slots of rejected drafts
                if added or reason:
                    so = self._step_output(seq, added, reason)
                    appended[seq.seq_id] = so.new_token_ids  # may be cut at a stop string
                    outputs.append(so)
                req = seq.request
                if req.first_token_time is None and added:
                    req.first_token_time = now
                if reason is not None and req.is_finished:
                    req.finish_time = now
        if finished:
            self.scheduler.remove_finished()
        return outputs, finished, appended

    def _append(self, seq: Sequence, new: list[int], now: float) -> tuple[list[int], str | None]:
        p = seq.request.params
        tokens, times = seq.token_ids, seq.token_times
        eos = () if p.ignore_eos else self.eos_token_ids
        limit = min(seq.num_prompt_tokens + p.max_tokens, self.max_model_len)
        last = len(new) - 1 if p.stop else -1  # several tokens (spec): check stop strings
        for i, tok in enumerate(new):
            tokens.append(tok)
            times.append(now)
            if tok in eos or tok in p.stop_token_ids:
                return new[: i + 1], "stop"
            if len(tokens) >= limit:
                return new[: i + 1], "length"
            if i < last and stop_string_hit(self.tokenizer, seq):  # the last: _step_output
                return new[: i + 1], "stop"
        return new, None

    def _step_output(self, seq: Sequence, added: list[int], reason: str | None) -> StepOutput:
        delta = ""
        if self.tokenizer is not None and seq.request.params.detokenize:
            delta, hit = update_text(self.tokenizer, seq, finished=reason is not None)
            if hit and reason is None:  # the stop string, not EOS / length, ended it
                reason = "stop"
                self._finish_by_stop_string(seq)
        return StepOutput(seq.request_id, seq.seq_id, seq.index, added, delta,
                          reason is not None, reason)

    def _finish_by_stop_string(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "stop"
        self.block_manager.free(seq)
        self.scheduler.remove_finished()
        self._late_finished.append({"request_id": seq.request_id, "seq_id": seq.seq_id,
                                    "reason": "stop"})
        if seq.request.is_finished:
            seq.request.finish_time = self.clock.now()

    def _record(self, out: SchedulerOutput, t0: float, dur: float,
                results: dict[str, list[int]], finished: list[dict], events: list[dict]) -> None:
        events = events + self.block_manager.drain()[0]
        fin = finished + self._late_finished + self._pending_aborts
        self._late_finished, self._pending_aborts = [], []
        self.trace.steps.append(step_record(self, out, t0, dur, results, fin, events))

    # ---- introspection ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        s = self.block_manager.stats()
        sched = self.scheduler
        s.update({"num_running": len(sched.running), "num_waiting": sched.num_waiting,
                  "num_pending": len(sched.pending), "num_swapped": len(sched.swapped),
                  "num_preemptions": sched.num_preemptions, "num_steps": self.num_steps,
                  "num_requests": len(self.requests), **self.kv_info})
        return s

    def request_timings(self) -> list[dict[str, Any]]:
        """One dict per sequence (sample), for labkit.engine.metrics.compute_metrics."""
        rows = []
        for req in self.requests.values():
            for seq in req.seqs:
                rows.append({
                    "request_id": req.request_id, "seq_id": seq.seq_id,
                    "prompt_len": req.prompt_len, "arrival_time": req.arrival_time,
                    "first_scheduled_time": req.first_scheduled_time,
                    "first_token_time": seq.token_times[0] if seq.token_times else None,
                    "token_times": list(seq.token_times), "finish_time": req.finish_time
                    if seq.is_finished else None, "finish_reason": seq.finish_reason,
                    "num_output_tokens": seq.num_output_tokens,
                    "num_cached_tokens": req.seqs[0].num_cached_tokens})
        return rows
