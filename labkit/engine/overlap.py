"""Async scheduling (``LLM(..., async_scheduling=True)``): hide the CPU work between forwards.

Why: at small batch a decode step's forward is short, and the Python around it -- scheduling,
packing, booking tokens, detokenising -- is pure overhead the accelerator (or, on a CPU, the
BLAS threads) waits through. SGLang's zero-overhead (overlap) scheduler and vLLM's async
scheduling (``--async-scheduling``) run that work *while* the forward runs. Here the forward of
step N runs on the calling thread, as in the synchronous engine, and a host thread meanwhile

1. detokenises and builds the outputs of step N-1 (booked at the end of the previous call), and
2. schedules step N+1, assuming every sequence of step N gets exactly one token: placeholders
   stand for those tokens (:mod:`labkit.sched.lookahead`) and are replaced by the real ones when
   N's sampling is done, before N+1's inputs are packed.

What it costs: one step of lookahead. A sequence that finishes in step N (EOS, ``max_tokens``,
a stop string) already holds a slot in N+1; that slot is discarded before N+1 runs, and a
request waiting for the finished one's room is admitted a step later. Outputs come out one
``step()`` later than the synchronous engine's (step N's tokens are returned by the call that
runs N+1), and a step where the next ``schedule()`` could preempt runs synchronously (preemption
cannot be decided on a guess). Greedy tokens are the synchronous engine's, token for token.

Why the forward stays on the calling thread: a hand-off between threads wakes the one that
waits, and waking an idle core costs tens of microseconds (on a VM up to 0.1 ms), more than a
batch-1 step has to hide. A forward handed to a worker pays two wake-ups on the step's path
(the worker's to start, the caller's to get the result). Here the host thread's wake-up runs
beside the forward, and by the time the forward is done its work usually is too: the caller
collects it without waiting.

When does the host thread start? Both threads run Python, and Python runs one thread at a time
(the GIL). Started once the step's inputs are packed (a ``ModelRunner`` step hook: the block
tables and token lists it changes have been copied by then), it would take turns with the
forward's Python up to the graph; so with ``compile=True`` it starts when the forward enters its
first compiled graph (:func:`labkit.engine.graph_capture.on_launch`), which runs without the GIL
(the full graphs' C++ wrapper; eager PyTorch ops release it too). An eager model starts it at
packing: its forward is Python between every op, there is no better moment.

The loop knows the engine's parts only by their contracts: ``Executor.execute``, the runner's
step hook, and the scheduler's ``schedule`` / ``update_from_output``. ``LLMEngine.step`` hands
each call here.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from labkit.engine.executor import ModelRunnerOutput
from labkit.engine.graph_capture import on_launch
from labkit.engine.outputs import StepOutput
from labkit.errors import AsyncSchedulingError
from labkit.sched.lookahead import Lookahead, advance, may_preempt, prune, settle
from labkit.sched.output import SchedulerOutput, SeqOutput


class OverlapStepLoop:
    """``LLMEngine.step`` with async scheduling: each call runs one forward and returns the
    outputs of the step before it (see the module doc)."""

    def __init__(self, engine: Any) -> None:  # the LLMEngine (no import: it imports this)
        runner = getattr(engine.executor, "runner", None)
        if runner is None or not hasattr(runner, "step_hooks"):
            raise AsyncSchedulingError(
                f"async_scheduling needs the model executor's forward to overlap; "
                f"{type(engine.executor).__name__} has none (the simulator)")
        self.engine = engine
        runner.step_hooks.append(self._on_packed)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="labkit-host")
        self._running: SchedulerOutput | None = None  # the step whose forward runs now
        self._host: Future | None = None  # its host work: (ready, lookahead, error)
        self._next: SchedulerOutput | None = None  # step N+1, scheduled, blocks allocated
        self._booked: list[tuple[list[SeqOutput], ModelRunnerOutput]] = []  # to detokenise
        self._ready: list[StepOutput] = []  # detokenised, not yet returned (a failed step)

    @contextmanager
    def _on_packed(self, owners: Any, query_lens: list[int]) -> Any:
        if self._compiled():  # start the host work at the graph (see the module doc)
            with on_launch(self._start_host):
                yield
        else:
            self._start_host()
            yield

    def _compiled(self) -> bool:
        forward = vars(self.engine.executor.runner.model).get("forward")
        report = getattr(forward, "report", None)  # a PiecewiseForward's CompileReport
        return bool(getattr(report, "compiled", False))

    def _start_host(self) -> None:
        if self._host is None and self._running is not None:
            self._host = self._pool.submit(self._host_work, self._running)

    def has_pending(self) -> bool:
        """Booked outputs not yet returned, or a prepared step: the engine is not done."""
        return bool(self._booked or self._ready) or self._next is not None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    # ---- one call ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        eng = self.engine
        t0 = eng.clock.now()
        out = self._take_next()
        if out.is_empty and not out.preempted:
            ready = self._detokenize()
            eng._idle(out, t0)
            return ready
        try:
            eng.executor.apply_block_ops(out.block_ops)
        except BaseException as exc:
            eng._fail_step(out, t0, exc)
            raise
        ready, seq_outputs, result, t1 = self._overlap(out, t0)
        eng.num_steps += 1
        self._booked.append((seq_outputs, result))
        appended = {o.seq.seq_id: o.new_token_ids for o in seq_outputs}
        eng.observer.on_step(eng.scheduler, out, t0, t1 - t0, appended, result.spec_records,
                             result.collectives)
        return ready

    def _host_work(self, out: SchedulerOutput
                   ) -> tuple[list[StepOutput], Lookahead | None, BaseException | None]:
        """On the host thread, while ``out``'s forward runs: detokenise the step before it,
        schedule the one after it."""
        ready: list[StepOutput] = []
        try:
            ready = self._detokenize()
            return ready, self._prepare(out), None
        except BaseException as exc:  # handed to the caller, which fails the step
            return ready, None, exc

    def _overlap(self, out: SchedulerOutput, t0: float
                 ) -> tuple[list[StepOutput], list[SeqOutput], ModelRunnerOutput, float]:
        """Run ``out``'s forward here while the host thread works (started by the step hook,
        or now if the forward packed nothing or never entered a compiled graph: an eager step
        of a compiled model); then book ``out``'s tokens. A failure
        on either side waits for the other, then fails the step (its requests and the
        prepared step's are aborted)."""
        self._running, self._host, error = out, None, None
        try:
            result = self.engine.executor.execute(out)
        except BaseException as exc:
            error = exc
        t1 = self.engine.clock.now()
        self._start_host()
        ready, ahead, host_error = self._host.result()
        self._running = self._host = None
        try:
            if error is not None or host_error is not None:
                raise error if error is not None else host_error
            seq_outputs = settle(self.engine.scheduler, out, ahead, result.sampled_token_ids,
                                 t1)
            self.engine._carry_prompt_logprobs(result)  # now: the request may be forgotten
        except BaseException as exc:
            self._ready = ready  # returned by the next call, not lost
            self._fail(out, ahead, t0, exc)
            raise
        return ready, seq_outputs, result, t1

    def _prepare(self, out: SchedulerOutput) -> Lookahead | None:
        """Schedule step N+1 on placeholders (``self._next``), unless it could preempt."""
        sched = self.engine.scheduler
        ahead = advance(out)
        if may_preempt(sched):
            ahead.undo()
            return None
        self._next = sched.schedule()
        return ahead

    def _take_next(self) -> SchedulerOutput:
        nxt, self._next = self._next, None
        if nxt is not None:
            nxt = prune(nxt)  # finished in the step before, or aborted between calls
            if not nxt.is_empty or nxt.preempted:
                return nxt
        # nothing prepared (a step that could preempt, the first step), or nothing left of
        # it: a request waiting for the finished ones' room is admitted now
        return self.engine.scheduler.schedule()

    def _detokenize(self) -> list[StepOutput]:
        eng = self.engine
        ready, self._ready = self._ready, []
        for seq_outputs, result in self._booked:
            ready += [eng._step_output(o, result) for o in seq_outputs]
        self._booked = []
        return ready

    def _fail(self, out: SchedulerOutput, ahead: Lookahead | None, t0: float,
              exc: BaseException) -> None:
        """Undo the placeholders, abort the prepared step's requests, then fail ``out`` as
        the synchronous engine does (``LLMEngine._fail_step``: EngineStepError)."""
        if ahead is not None:
            ahead.undo()
        nxt, self._next = self._next, None
        if nxt is not None:
            self.engine.abort(sorted({sc.seq.request_id for sc in nxt.scheduled}))
        self.engine._fail_step(out, t0, exc)
