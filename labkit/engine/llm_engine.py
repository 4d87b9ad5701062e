"""LLMEngine: requests in, one scheduled step at a time, tokens out (vLLM v1's shape).

    engine = LLMEngine.from_model(model, tokenizer, block_size=16)
    engine.add_request("r1", "def f(x):", SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished_requests():
        for out in engine.step(): print(out.request_id, out.new_token_ids, out.finished)

One ``step()``::

    scheduler_output = scheduler.schedule()          # who runs, which chunk, block decisions
    executor.apply_block_ops(scheduler_output.block_ops)
    runner_output = executor.execute(scheduler_output)          # tokens per sequence
    seq_outputs = scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
    trace.on_step(...)                                          # one record, an observer
    return [detokenized StepOutput for each]

Everything about a sequence's state (appending tokens, the stop checker, freeing blocks,
``num_computed_tokens``) lives in the scheduler; the engine validates requests, runs that loop,
detokenizes, and fails a step cleanly if anything inside it raises. It knows executors only by
their contract (:mod:`labkit.engine.executor`): the real model (``ModelExecutor``), the
simulator (``labkit.sim``) and speculative decoding (``labkit.spec``) plug in the same way.
Detokenization is :func:`labkit.engine.detokenizer.update_text`. With ``async_scheduling``
``step()`` is :class:`labkit.engine.overlap.OverlapStepLoop`'s: the same parts, with step N+1
scheduled while step N's forward runs.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from labkit.config import EngineConfig
from labkit.engine.clock import WallClock
from labkit.engine.detokenizer import update_text
from labkit.engine.executor import Executor, ModelRunnerOutput, executor_factory
from labkit.engine.logprobs import decode_tokens
from labkit.engine.model_setup import load_draft, moe_experts, size_kv_pool, window_to_free
from labkit.engine.outputs import StepOutput
from labkit.engine.overlap import OverlapStepLoop
from labkit.engine.sampling_params import SamplingParams
from labkit.engine.structured_output import StructuredOutputManager
from labkit.engine.trace import Trace, TraceObserver
from labkit.engine.validate import check_fits, check_request_args, prompt_ids
from labkit.errors import (
    EngineConfigError,
    EngineStepError,
    InvalidPromptError,
    SamplingParamsError,
    StructuredOutputsError,
)
from labkit.kv.block_manager import BlockManager
from labkit.kv.hybrid_manager import KVCacheCoordinator
from labkit.sched.request import Request
from labkit.sched.scheduler import Scheduler, SchedulerOutput, SeqOutput
from labkit.sched.stop import StopChecker

FINISHED_RECORDS = 4096  # sequences whose timings a forgetting engine keeps (request_timings)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor, tokenizer: Any = None,
                 clock: Any = None, kv_connector: Any = None, block_manager: Any = None
                 ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.clock = clock or WallClock()
        # one block table per sequence, or a hybrid model's per-group tables (from_model)
        self.block_manager = block_manager or BlockManager.from_config(config.cache)
        stop = StopChecker(config.model.eos_token_ids, config.max_model_len, tokenizer)
        # the KV connector's scheduler side; its worker side is the executor's (from_model)
        if config.kv_transfer is not None and kv_connector is None:
            raise EngineConfigError("kv_transfer_config is set but no connector was handed to "
                                    "LLMEngine: build it with LLMEngine.from_model / LLM, or "
                                    "pass kv_connector= (and the executor's) yourself")
        self.kv_connector = kv_connector
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.clock.now, stop,
                                   admission=executor.admission_policy(),
                                   kv_connector=kv_connector)
        self.executor = executor
        self.structured_output_manager = StructuredOutputManager(
            tokenizer, config.model.vocab_size, tuple(config.model.eos_token_ids))
        self.requests: dict[str, Request] = {}  # live ones, and finished ones until forgotten
        # timings of forgotten requests, newest last (forget_finished; bounded, so flat memory)
        self.finished_timings: deque[dict[str, Any]] = deque(maxlen=FINISHED_RECORDS)
        self.num_forgotten = 0
        self._num_added = 0  # add order (Request.index): len(requests) shrinks when forgetting
        self.num_steps = 0
        self.trace = Trace(config.trace_meta(executor.name))
        self.observer = TraceObserver(self.trace, executor.real_tokens)
        # async scheduling: step() overlaps the CPU work with the forward (engine/overlap.py)
        self.step_loop = OverlapStepLoop(self) if config.scheduler.async_scheduling else None

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any = None, **kw: Any) -> LLMEngine:
        """An engine on a real model. ``kw`` are the flat settings of :class:`EngineConfig`
        (``block_size``, ``num_blocks`` or ``kv_cache_bytes``, ``max_num_seqs``, ``policy``,
        ``kv_cache_dtype``, ``attention_backend``, ``speculative_config``, ...). Without
        ``num_blocks`` the pool is sized from ``kv_cache_bytes`` (default: enough for
        max_num_seqs full-length sequences, capped at 256 MiB). An MoE model's trace also
        records each step's expert load (``expert_load``, :class:`labkit.model.moe.
        ExpertLoadProbe`), read by a probe of the observer, not by the step; its experts run
        through the fused MoE Triton kernel with ``attention_backend="triton"`` and the loop
        over experts otherwise (``model_setup.moe_experts``). ``kv_transfer_config`` (or
        ``kv_connector``) plugs a KV connector into both the scheduler and the executor."""
        from labkit.engine.model_runner import ModelExecutor, ModelRunner
        from labkit.kv.attention import get_attention_backend
        from labkit.kv.cache import PagedKVCache
        from labkit.model.moe import ExpertLoadProbe

        c = model.config
        config = EngineConfig.from_kwargs(
            max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size,
            eos_token_ids=tuple(c.eos_token_ids), **kw)
        cache = config.cache
        layout = size_kv_pool(c, config, model.dtype)  # per-group block tables, or None
        connector = None
        if config.kv_transfer is not None:  # EngineConfig allows it with this executor only
            from labkit.kv.connector import create_kv_connector

            connector = create_kv_connector(config.kv_transfer)
        if config.parallel.uses_workers:  # N worker processes, one shard each
            executor: Executor = executor_factory("tensor_parallel")(model, config)
        else:
            backend = get_attention_backend(config.model.attention_backend)
            kv = PagedKVCache.for_model(c, cache, model.dtype, model.device, backend, layout)
            executor = ModelExecutor(ModelRunner(model, kv), connector)
        if config.lora is not None:  # adapter slots on the model's linears (labkit.lora)
            executor = executor_factory("lora")(executor, config)
        if config.speculative is not None:
            load_draft(config, model)
            executor = executor_factory("speculative")(executor, config)
        bm = None if layout is None else KVCacheCoordinator(cache, layout)
        engine = cls(config, executor, tokenizer, kv_connector=connector, block_manager=bm)
        engine.block_manager.sliding_window = window_to_free(c, config)
        if getattr(c, "moe_layers", None) and isinstance(model, torch.nn.Module):
            engine.trace.meta["moe_layers"] = c.moe_layers  # the rows of each expert_load
            engine.observer.probes["expert_load"] = ExpertLoadProbe(model)
            moe_experts(model, config.model.attention_backend)
        return engine

    # ---- shortcuts into the config --------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def vocab_size(self) -> int | None:
        return self.config.model.vocab_size

    @property
    def record_trace(self) -> bool:
        return self.observer.enabled

    @record_trace.setter
    def record_trace(self, on: bool) -> None:
        self.observer.enabled = on

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    params: SamplingParams | None = None, priority: int = 0,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None,
                    lora_request: Any = None) -> Request:
        """Validate and queue a request; every bad input raises a ValueError subclass here
        (labkit.errors), never later inside a step. A ``lora_request`` (labkit.LoRARequest) is
        loaded and checked by the executor first (:meth:`Executor.add_lora`)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise SamplingParamsError(f"params must be a SamplingParams, got {type(params)}")
        params.validate()
        check_request_args(request_id, params, self.vocab_size, cache_salt, arrival_time)
        if (params.logprobs is not None or params.prompt_logprobs is not None) \
                and not self.executor.supports_logprobs:
            raise SamplingParamsError(f"logprobs / prompt_logprobs are not computed by the "
                                      f"{type(self.executor).__name__} (speculative decoding, "
                                      "the simulator): run without them")
        request_id = str(request_id)
        if request_id in self.requests:
            raise InvalidPromptError(f"duplicate request id {request_id!r}: ids must be unique "
                                     "among the requests the engine holds (live, or finished "
                                     "and not yet forgotten)")
        ids = prompt_ids(request_id, prompt, prompt_token_ids, self.tokenizer)
        check_fits(self.config, request_id, ids, params, priority, self.tokenizer is not None)
        arrival = self._arrival(arrival_time)
        factory = self._logits_processor_factory(params)
        if lora_request is not None:
            self.executor.add_lora(lora_request)
        req = Request(request_id, ids, params, arrival, priority, cache_salt, self._num_added,
                      factory, lora_request)
        self._num_added += 1
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        self.observer.on_request(request_id, ids, params, priority, arrival)
        return req

    def _logits_processor_factory(self, params: SamplingParams) -> Any:
        """Compile a structured-output constraint now (cached), so an invalid schema or a
        missing xgrammar is an add_request error, never a failed step."""
        if params.structured_outputs is None:
            return None
        if not self.executor.supports_structured_outputs:
            raise StructuredOutputsError(
                f"structured outputs are not applied by the {type(self.executor).__name__} "
                "(speculative decoding, the simulator) in this version: run without them")
        return self.structured_output_manager.logits_processor_factory(
            params.structured_outputs)

    def _arrival(self, arrival_time: float | None) -> float:
        now = self.clock.now()
        if arrival_time is None:
            return now
        if isinstance(self.clock, WallClock) and arrival_time - now > 86400:  # step() would sleep
            raise InvalidPromptError(f"arrival_time={arrival_time} is {arrival_time - now:.0f} s "
                                     "away: it is seconds on the engine clock "
                                     f"(engine.clock.now() = {now:.1f}), not epoch time")
        return float(arrival_time)

    def abort(self, request_id: str | list[str]) -> bool:
        """Stop a request now, wherever it is (waiting, running, swapped); all its blocks are
        released. Like vLLM, unknown or already finished ids are ignored: returns whether
        anything was aborted (a list of ids aborts each)."""
        if isinstance(request_id, (list, tuple, set)):
            return any([self.abort(r) for r in request_id])
        req = self.requests.get(str(request_id))
        if req is None or req.is_finished:
            return False
        self.scheduler.abort_request(req)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or \
            (self.step_loop is not None and self.step_loop.has_pending())

    def forget_finished(self, request_ids: list[str] | None = None) -> int:
        """Drop finished requests (all of them, or those of ``request_ids``) from
        ``self.requests``; returns how many. A server calls this once a request's last output
        is delivered (vLLM frees a request's state then): without it ``requests`` keeps every
        request ever served and a long-running server's memory grows with its request count.
        Their timings stay readable through :meth:`request_timings`, but only the newest
        ``finished_timings.maxlen`` sequences (a bounded record: flat memory). Unfinished ids
        are left alone; a forgotten id may be used again."""
        ids = list(self.requests) if request_ids is None else [str(r) for r in request_ids]
        n = 0
        for rid in ids:
            req = self.requests.get(rid)
            if req is not None and req.is_finished:
                self.finished_timings.extend(_timings(req))
                del self.requests[rid]
                n += 1
        self.num_forgotten += n
        return n

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        if self.step_loop is not None:
            return self.step_loop.step()
        t0 = self.clock.now()
        out = self.scheduler.schedule()
        if out.is_empty and not out.preempted:
            self._idle(out, t0)
            return []
        try:
            self.executor.apply_block_ops(out.block_ops)
            result = self.executor.execute(out)
            t1 = self.clock.now()
            seq_outputs = self.scheduler.update_from_output(out, result.sampled_token_ids, t1)
            self._carry_prompt_logprobs(result)
            outputs = [self._step_output(o, result) for o in seq_outputs]
        except BaseException as exc:
            self._fail_step(out, t0, exc)
            raise
        self.num_steps += 1
        appended = {o.seq.seq_id: o.new_token_ids for o in seq_outputs}
        self.observer.on_step(self.scheduler, out, t0, t1 - t0, appended, result.spec_records,
                              result.collectives)
        return outputs

    def _idle(self, out: SchedulerOutput, t0: float) -> None:
        """Nothing to run: wait for the next arrival, or fail loudly if nothing ever could."""
        sched = self.scheduler
        nxt = sched.next_arrival()
        if nxt is not None and not sched.running and not sched.num_waiting:
            self.clock.advance_to(nxt)  # idle until the next request arrives
        elif (sched.num_waiting or sched.swapped) and not sched.running:
            # add_request guarantees each request fits alone; an error beats a silent hang
            raise RuntimeError(f"scheduler stalled with {sched.num_waiting} waiting and "
                               f"{len(sched.swapped)} swapped requests and nothing running:"
                               f" {self.stats()}")
        elif self.block_manager.events:  # aborts freed blocks since the last step: log them
            self.observer.on_step(sched, out, t0, 0.0, {}, [])

    def _step_output(self, o: SeqOutput, result: ModelRunnerOutput) -> StepOutput:
        seq, reason = o.seq, o.finish_reason
        delta = ""
        detok = self.tokenizer is not None and seq.request.params.detokenize
        if detok:
            delta, _ = update_text(self.tokenizer, seq, finished=reason is not None)
        lps = result.logprobs.get(seq.seq_id)
        if lps is not None:  # carried as sampled; only the tokens the stop checker kept
            lps = lps[:len(o.new_token_ids)]
            decode_tokens(lps, self.tokenizer if detok else None)
            seq.logprobs.extend(lps)
        plps = seq.request.prompt_logprobs
        if plps is not None and seq.num_output_tokens > len(o.new_token_ids):
            plps = None  # sent with this sequence's first output already
        return StepOutput(seq.request_id, seq.seq_id, seq.index, o.new_token_ids, delta,
                          reason is not None, reason, lps, plps)

    def _carry_prompt_logprobs(self, result: ModelRunnerOutput) -> None:
        for rid, entries in result.prompt_logprobs.items():
            req = self.requests[rid]
            decode_tokens(entries, self.tokenizer if req.params.detokenize else None)
            req.prompt_logprobs.extend(entries)

    def _fail_step(self, out: SchedulerOutput, t0: float, exc: BaseException) -> None:
        """A step raised after scheduling. Its block copies / swaps may be half applied and its
        sequences half updated, so retrying could compute on garbage KV: fail (abort) every
        request the step touched -- scheduled, forked, or swapped out -- which frees all their
        blocks; other requests go on. Raises EngineStepError (a KeyboardInterrupt propagates
        as itself after the same cleanup)."""
        touched = {sc.seq.request_id for sc in out.scheduled}
        touched.update(s.request_id for s, mode in out.preempted if mode == "swap")
        ids = sorted(touched)
        self.scheduler.remove_finished()  # sequences update_from_output had already finished
        for rid in ids:
            self.abort(rid)
        self.num_steps += 1
        self.observer.on_step(self.scheduler, out, t0, self.clock.now() - t0, {}, [])
        if isinstance(exc, Exception):
            raise EngineStepError(f"engine step failed ({type(exc).__name__}: {exc}); its "
                                  f"requests {ids} were aborted and freed, the others go on",
                                  ids) from exc

    def update_weights(self, weights: Any, version: str,
                       key_by_version: bool = True) -> dict[str, Any]:
        """Swap in new weights (a state dict or a checkpoint folder) between two steps, as
        weight ``version``: checked first (WeightUpdateError leaves the old ones serving),
        requests in flight recomputed under the new weights, the prefix cache keyed by the
        version (``key_by_version=False``: the stale-KV bug, for demonstrations only).
        :mod:`labkit.engine.weight_update`."""
        from labkit.engine.weight_update import update_engine_weights

        return update_engine_weights(self, weights, version, key_by_version)

    # ---- introspection --------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, e.g. after the weights changed in place: the cache keys
        are token ids, not weights, so a stale hit would serve KV the old model computed. As
        vLLM's, it refuses (returns False, changes nothing) while any request holds blocks:
        those blocks' keys would survive the reset and their KV is the old model's. A KV
        connector's stored blocks (CPU / disk tiers) are forgotten too, for the same reason."""
        pool = self.block_manager.pool
        if pool.num_used:
            return False
        pool.reset_prefix_cache()
        if self.kv_connector is not None:
            self.kv_connector.reset_cache()
        return True

    def stats(self) -> dict[str, Any]:
        s = self.block_manager.stats()
        sched = self.scheduler
        s.update({"num_running": len(sched.running), "num_waiting": sched.num_waiting,
                  "num_pending": len(sched.pending), "num_swapped": len(sched.swapped),
                  "num_preemptions": sched.num_preemptions, "num_steps": self.num_steps,
                  "num_requests": len(self.requests), "num_forgotten": self.num_forgotten,
                  "weight_version": self.block_manager.weight_version})
        if self.kv_connector is not None:  # per tier: hits, loads, bytes, evictions
            s["kv_connector"] = self.kv_connector.stats()
        s.update(self.executor.stats())
        c = self.config.cache
        if c.bytes_per_block is not None:  # a real KV pool (not the simulator's)
            s.update({"kv_cache_dtype": c.kv_cache_dtype, "kv_bytes_per_block": c.bytes_per_block,
                      "kv_cache_bytes": c.bytes_per_block * c.num_blocks})
        return s

    def request_timings(self) -> list[dict[str, Any]]:
        """One dict per sequence (sample), for labkit.engine.metrics.compute_metrics: the
        requests the engine holds, after the bounded record of forgotten ones
        (:meth:`forget_finished`)."""
        return [*self.finished_timings,
                *(t for req in self.requests.values() for t in _timings(req))]


def _timings(req: Request) -> list[dict[str, Any]]:
    return [{"request_id": req.request_id, "seq_id": seq.seq_id,
             "prompt_len": req.prompt_len, "arrival_time": req.arrival_time,
             "first_scheduled_time": req.first_scheduled_time,
             "first_token_time": seq.token_times[0] if seq.token_times else None,
             "token_times": list(seq.token_times),
             "finish_time": req.finish_time if seq.is_finished else None,
             "finish_reason": seq.finish_reason, "num_output_tokens": seq.num_output_tokens,
             "num_cached_tokens": req.seqs[0].num_cached_tokens}
            for seq in req.seqs]
