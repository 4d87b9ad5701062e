"""AsyncLLM: the async front over an EngineCore; one async output stream per request.

Why the engine runs off the event loop: ``engine.step()`` is a blocking forward pass
(milliseconds to seconds). Run on the event loop, it would stall every accept, every SSE flush
and every ``/health`` probe for that long. The loop itself (:mod:`labkit.serve.engine_core`)
runs in one of two places, chosen by what is passed in:

- **a thread** (``AsyncLLM(engine)``, the default): the engine object stays inspectable from
  the notebook (``llm.engine``); outputs come back with ``loop.call_soon_threadsafe``, one call
  per step. The cost is the GIL: the engine thread runs Python (scheduler, model code between
  kernels) most of a step, so a loop thread woken by a socket or an output waits for the GIL
  until CPython forces a switch after ``sys.getswitchinterval()`` (5 ms by default), and that
  wait lands on every TTFT, accept and chunk, while the loop's own Python work lands on the
  engine's steps. AsyncLLM lowers the interval to ``switch_interval`` (0.5 ms; restored at
  shutdown) while it runs, which shortens the waits but cannot remove the sharing.
- **a process** (``AsyncLLM(EngineSpec(...))``, ``labkit serve``'s default), as vLLM
  V1's EngineCore: the engine has its own interpreter and GIL; commands go down one pipe,
  each step's outputs come up another, read on the event loop with ``loop.add_reader`` (no
  extra thread here). ``call(fn)`` then needs a picklable ``fn`` (e.g. ``assert_no_leaks``);
  ``llm.engine`` is None. If the process dies, every open stream fails with EngineDeadError.

Either way only the core touches the engine; it drains add / abort / call commands *before
every step*, so "cancel = abort within one step": an abort queued while a step runs is applied
right after it, and the request's KV blocks are free before the next step is scheduled. Once a
request's last output is out (finished, aborted or failed) the core calls
``engine.forget_finished`` for it, so a server that runs for days does not grow with the
number of requests it served.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from labkit.engine.outputs import StepOutput
from labkit.engine.sampling_params import SamplingParams
from labkit.serve.engine_core import (
    SWITCH_INTERVAL,
    EngineCore,
    EngineCoreProc,
    EngineDeadError,
    EngineSpec,
    run_engine_loop,
)

__all__ = ["SWITCH_INTERVAL", "AsyncLLM", "EngineDeadError", "EngineSpec", "RequestStream",
           "StreamItem"]


@dataclass
class StreamItem:
    """One step's news for one request: its sequences' StepOutputs, or an error."""

    outputs: list[StepOutput] = field(default_factory=list)
    finished: bool = False
    error: BaseException | None = None
    step_start: float = 0.0  # time.monotonic() when the step that made these began


class RequestStream:
    """The async side of one engine request: iterate it for StreamItems until ``finished``.

    ``aclose()`` (or leaving an ``async for`` early) aborts the request in the engine."""

    def __init__(self, llm: AsyncLLM, request_id: str, n: int) -> None:
        self.llm, self.request_id, self.n = llm, request_id, n
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self.finished = False
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None

    def _put(self, item: StreamItem) -> None:  # on the event loop
        if self.first_token_time is None and any(o.new_token_ids for o in item.outputs):
            self.first_token_time = time.monotonic()
        self.queue.put_nowait(item)

    async def get(self, timeout: float | None = None) -> StreamItem:
        """The next item; raises TimeoutError after ``timeout`` seconds without one."""
        item = await (self.queue.get() if timeout is None else  # no timer task per token
                      asyncio.wait_for(self.queue.get(), timeout))
        if item.finished or item.error is not None:
            self.finished = True
        return item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamItem:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.llm.abort(self.request_id)


class AsyncLLM:
    """``await llm.add_request(...)`` returns a RequestStream; the engine steps elsewhere.

    ``engine``: an LLMEngine (the loop runs in a thread of this process) or an
    :class:`EngineSpec` (the loop runs in an engine process built from it; started here, so
    ``max_model_len`` / ``vocab_size`` / ``tokenizer`` are known from its handshake).
    ``on_step(stats, outputs)`` (optional) runs on the event loop after every step with
    ``engine.stats()``: the metrics exporter reads it without touching the engine."""

    def __init__(self, engine: Any, *, idle_wait: float = 0.05,
                 on_step: Callable[[dict, list[StepOutput]], None] | None = None,
                 forget_finished: bool = True,
                 switch_interval: float | None = SWITCH_INTERVAL) -> None:
        self.process = isinstance(engine, EngineSpec)
        self.switch_interval = None if self.process else switch_interval
        self._saved_interval: float | None = None
        self.forget_finished = forget_finished
        self.idle_wait = idle_wait
        self.on_step = on_step
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[int, tuple[asyncio.Future, RequestStream | None]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self.dead: BaseException | None = None
        self.num_pending_adds = 0  # sent to the core, not yet added (admission control)
        self.num_step_errors = 0
        self.started = False
        if self.process:
            self.engine = None
            self.core_proc: EngineCoreProc | None = EngineCoreProc(engine)
            hs = self.core_proc.handshake
            self.max_model_len, self.vocab_size = hs["max_model_len"], hs["vocab_size"]
            self.tokenizer, self.stats = hs["tokenizer"], hs["stats"]
            self.engine_threads: int | None = hs["num_threads"]
            self.max_num_seqs: int | None = hs.get("max_num_seqs")
        else:
            self.engine, self.core_proc = engine, None
            self.max_model_len, self.vocab_size = engine.max_model_len, engine.vocab_size
            self.tokenizer = getattr(engine, "tokenizer", None)
            self.stats: dict[str, Any] = dict(engine.stats())
            self.engine_threads = None
            self.max_num_seqs = max_num_seqs_of(engine)

    @property
    def mode(self) -> str:
        return "process" if self.process else "thread"

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> AsyncLLM:
        """Bind to the running event loop and start the engine thread / read the process."""
        if self.started:
            return self
        self._loop = loop = asyncio.get_running_loop()
        self.started = True
        if self.process:
            loop.add_reader(self.core_proc.out_conn.fileno(), self._readable)
            return self
        if self.switch_interval and self.switch_interval < sys.getswitchinterval():
            self._saved_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval)
        self._thread = threading.Thread(target=self._thread_main, name="labkit-engine",
                                        daemon=True)
        self._thread.start()
        return self

    def _thread_main(self) -> None:
        core = EngineCore(self.engine, self._post, forget_finished=self.forget_finished)
        try:
            run_engine_loop(core, self._cmds, self.idle_wait)
        except BaseException as e:  # noqa: BLE001 - a bug in the loop: fail streams, not hang
            self._loop.call_soon_threadsafe(self._on_dead, EngineDeadError(
                f"engine loop crashed: {type(e).__name__}: {e}"))
            raise

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is left, stop the core and wait for it (bounded; a process that
        does not exit in time is terminated, then killed)."""
        if not self.started:
            if self.core_proc is not None:
                self.core_proc.stop(timeout)
            return
        self.started = False
        for rid in list(self._streams):
            self.abort(rid)
        self._send(("stop",))
        loop = asyncio.get_running_loop()
        if self.core_proc is not None:  # keep reading while it winds down (no full pipe)
            await loop.run_in_executor(None, self.core_proc.proc.join, timeout)
            if not self.core_proc.out_conn.closed:
                loop.remove_reader(self.core_proc.out_conn.fileno())
                try:
                    self._drain_pipe()
                except (EOFError, OSError):
                    pass
            self.core_proc.stop(0)
            self._on_dead(EngineDeadError("engine loop shut down"))
        else:
            await loop.run_in_executor(None, self._thread.join, timeout)
            self._thread = None
        if self._saved_interval is not None:
            sys.setswitchinterval(self._saved_interval)
            self._saved_interval = None

    @property
    def is_running(self) -> bool:
        if not self.started or self.dead is not None:
            return False
        if self.core_proc is not None:
            return self.core_proc.alive()
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_seqs_in_flight(self) -> int:
        """Sequences (``n`` per request) sent to the core and not yet finished, counted the
        moment ``add_request(s)`` is called: admission control reads it, so a burst that
        arrives before the core has added (let alone scheduled) anything still counts."""
        return (sum(s.n for s in self._streams.values()) +
                sum(s.n for _, s in self._pending.values() if s is not None))

    # ---- the event-loop side ----------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, priority: int = 0,
                          cache_salt: str | None = None) -> RequestStream:
        """Queue a request; raises the engine's ValueError (bad prompt or params) here."""
        (stream,) = await self.add_requests([(request_id, prompt, params, priority,
                                              cache_salt)])
        return stream

    async def add_requests(self, requests: list[tuple[Any, ...]]) -> list[RequestStream]:
        """Queue several requests ``(request_id, prompt, params, priority, cache_salt)``, each
        optionally with a sixth item, its ``LoRARequest`` (None: the base model), at once:
        all are sent (and counted in :attr:`num_seqs_in_flight`) before the first await, so
        an admission check followed by this call cannot be overtaken by another request.
        All or nothing: if the core refuses one, the others are aborted and the first error
        is raised."""
        if not self.is_running:
            raise EngineDeadError(f"engine loop is not running ({self.dead!r})")
        sent = []
        for request_id, prompt, params, priority, cache_salt, *lora in requests:
            stream = RequestStream(self, request_id, params.n)
            fut, cid = self._future(stream)
            self._send(("add", cid, request_id, prompt, params, priority, cache_salt,
                        lora[0] if lora else None))
            sent.append((fut, stream))
        self.num_pending_adds += len(sent)
        try:
            results = await asyncio.gather(*(f for f, _ in sent), return_exceptions=True)
        finally:
            self.num_pending_adds -= len(sent)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for (_, stream), r in zip(sent, results):
                if not isinstance(r, BaseException):
                    await stream.aclose()
            raise errors[0]
        return [stream for _, stream in sent]

    def abort(self, request_id: str) -> None:
        """Abort from the event loop (idempotent, never waits for the engine)."""
        self._send(("abort", request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` in the core between two steps and return its result (for
        invariant checks: ``await llm.call(assert_no_leaks)``; picklable in process mode)."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop is not running ({self.dead!r})")
        fut, cid = self._future(None)
        self._send(("call", cid, fn))
        return await fut

    def _future(self, stream: RequestStream | None) -> tuple[asyncio.Future, int]:
        cid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[cid] = (fut, stream)
        return fut, cid

    def _send(self, cmd: tuple) -> None:
        if self.core_proc is None:
            self._cmds.put(cmd)
            return
        try:
            self.core_proc.send(cmd)
        except (OSError, ValueError) as e:  # the process is gone (or its pipe closed)
            if cmd[0] in ("add", "call"):
                self._on_dead(EngineDeadError(f"engine process is gone ({e})"))

    # ---- messages from the core (always handled on the event loop) -------------------------
    def _post(self, msg: tuple) -> None:
        """Thread mode: the core's emit; hop onto the event loop (one wake-up per message)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._on_message, msg)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _readable(self) -> None:
        """Process mode: the output pipe has data (or EOF: the process died)."""
        try:
            self._drain_pipe()
        except (EOFError, OSError):
            self._loop.remove_reader(self.core_proc.out_conn.fileno())
            self.core_proc.proc.join(1)
            code = self.core_proc.proc.exitcode
            self._on_dead(EngineDeadError(f"engine process died (exit code {code})"))

    def _drain_pipe(self) -> None:
        conn = self.core_proc.out_conn
        while not conn.closed and conn.poll():
            self._on_message(conn.recv())

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            _, t0, items, stats, outputs = msg
            self.num_step_errors += any(it[3] is not None for it in items)
            for rid, outs, finished, error in items:
                stream = self._streams.get(rid)
                if stream is None:
                    continue
                if finished or error is not None:
                    del self._streams[rid]
                stream._put(StreamItem(outs, finished, error, t0))
            self.stats = stats
            if self.on_step is not None:
                self.on_step(stats, outputs)
        elif kind == "reply":
            _, cid, error, result = msg
            fut, stream = self._pending.pop(cid, (None, None))
            if fut is None or fut.done():
                if error is None and stream is not None:  # added for a caller that left
                    self.abort(stream.request_id)
                return
            if error is not None:
                fut.set_exception(error)
                return
            if stream is not None:
                self._streams[stream.request_id] = stream
            fut.set_result(result)
        elif kind == "dead":
            self._on_dead(msg[1])

    def _on_dead(self, exc: BaseException) -> None:
        """Fail every open stream and every awaited add / call: nothing waits forever."""
        if self.dead is None:
            self.dead = exc
        for stream in self._streams.values():
            stream._put(StreamItem(error=exc))
        self._streams.clear()
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()


def max_num_seqs_of(engine: Any) -> int | None:
    """The engine's running-batch size (``SchedulerConfig.max_num_seqs``), if it has one."""
    sched = getattr(getattr(engine, "config", None), "scheduler", None)
    return getattr(sched, "max_num_seqs", None)
