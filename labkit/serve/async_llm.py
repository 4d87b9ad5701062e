"""AsyncLLM: the engine loop in its own thread, one async output stream per request.

Why a thread: ``engine.step()`` is a blocking forward pass (milliseconds to seconds). Run on the
event loop, it would stall every accept, every SSE flush and every ``/health`` probe for that
long. vLLM moves the loop into a separate process (EngineCore); one thread is enough here (torch
releases the GIL inside its kernels) and keeps the engine object inspectable from the notebook.

The engine is not thread-safe, so only the engine thread touches it. The event loop talks to it
through a command queue (add, abort, call) that the thread drains *before every step*; outputs go
back with ``loop.call_soon_threadsafe``, one call per step for all its requests (each call
writes the loop's self-pipe, a syscall that lets the loop thread take the GIL; one per request
per step made the engine thread queue for the GIL that many times a step). Hence "cancel =
abort within one step": an abort queued while a step runs is applied right after that step,
before the next one is scheduled, and the request's KV blocks are free from then on.

The GIL: the engine thread runs Python (scheduler, model code between PyTorch kernels) most of
a step. A loop thread woken by a socket or an output then waits for the GIL until the engine
thread blocks or CPython forces a switch after ``sys.getswitchinterval()`` (5 ms by default),
and that wait lands on every TTFT, every accepted request and every chunk. While it runs,
AsyncLLM lowers the interval to ``switch_interval`` (0.5 ms; restored at shutdown): the loop's
work is small and bounded, so handing it the GIL sooner costs the engine little. vLLM avoids
the question by running the engine in another process.

Only the engine's public API is used: ``add_request``, ``step``, ``abort``,
``has_unfinished_requests``, ``forget_finished``, ``stats`` (plus ``StepOutput`` /
``SamplingParams``).

Flat memory: once a request's last output is handed to its stream (finished, aborted or failed),
the thread calls ``engine.forget_finished`` for it, as vLLM frees a request's state when its
output is returned. The engine then holds only live requests plus a bounded record of recent
finished ones (``engine.request_timings()`` still answers "how did request X end" for those),
so a server that runs for days does not grow with the number of requests it served.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from labkit.engine.errors import EngineStepError
from labkit.engine.outputs import StepOutput
from labkit.engine.sampling_params import SamplingParams

SWITCH_INTERVAL = 0.0005  # s; CPython's default is 0.005 (sys.getswitchinterval)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or an unrecoverable step error)."""


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
        self.finish_reasons: dict[int, str] = {}

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


def _deliver(deliveries: list[tuple[RequestStream, StreamItem]]) -> None:
    """On the event loop: hand one step's items to their streams."""
    for stream, item in deliveries:
        stream._put(item)


class AsyncLLM:
    """``await llm.add_request(...)`` returns a RequestStream; the engine steps in a thread.

    ``on_step(stats, outputs)`` (optional) runs on the engine thread after every step with
    ``engine.stats()``: the metrics exporter reads it without touching the engine."""

    def __init__(self, engine: Any, *, idle_wait: float = 0.05,
                 on_step: Callable[[dict, list[StepOutput]], None] | None = None,
                 forget_finished: bool = True,
                 switch_interval: float | None = SWITCH_INTERVAL) -> None:
        self.engine = engine
        self.switch_interval = switch_interval
        self._saved_interval: float | None = None
        self.forget_finished = forget_finished
        self.idle_wait = idle_wait
        self.on_step = on_step
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        self.stats: dict[str, Any] = dict(engine.stats())
        self.num_pending_adds = 0  # queued to the thread, not yet added (admission control)
        self.num_step_errors = 0

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> AsyncLLM:
        """Bind to the running event loop and start the engine thread."""
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            if self.switch_interval and self.switch_interval < sys.getswitchinterval():
                self._saved_interval = sys.getswitchinterval()
                sys.setswitchinterval(self.switch_interval)
            self._thread = threading.Thread(target=self._run, name="labkit-engine", daemon=True)
            self._thread.start()
        return self

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is left, stop the thread and wait for it (bounded)."""
        if self._thread is None:
            return
        for rid in list(self._streams):
            self.abort(rid)
        self._stop.set()
        self._cmds.put(("wake",))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        self._thread = None
        if self._saved_interval is not None:
            sys.setswitchinterval(self._saved_interval)
            self._saved_interval = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- the event-loop side ----------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, priority: int = 0,
                          cache_salt: str | None = None) -> RequestStream:
        """Queue a request; raises the engine's ValueError (bad prompt or params) here."""
        if not self.is_running:
            raise EngineDeadError(f"engine loop is not running ({self.dead!r})")
        stream = RequestStream(self, request_id, params.n)
        fut = asyncio.get_running_loop().create_future()
        self.num_pending_adds += 1
        self._cmds.put(("add", request_id, prompt, params, priority, cache_salt, stream, fut))
        try:
            await fut
        finally:
            self.num_pending_adds -= 1
        return stream

    def abort(self, request_id: str) -> None:
        """Abort from the event loop (thread-safe, idempotent, never blocks)."""
        self._cmds.put(("abort", request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result
        (for invariant checks: ``await llm.call(assert_no_leaks)``)."""
        fut = asyncio.get_running_loop().create_future()
        self._cmds.put(("call", fn, fut))
        return await fut

    def _post(self, fn: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _resolve(self, fut: asyncio.Future, result: Any = None,
                 exc: BaseException | None = None) -> None:
        def done() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        self._post(done)

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:  # idle: sleep until a command comes; busy: only take what is already queued
                cmd = self._cmds.get_nowait() if eng.has_unfinished_requests() else \
                    self._cmds.get(timeout=self.idle_wait)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._apply(cmd)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stop.is_set() or not eng.has_unfinished_requests():
                continue
            self._step()
        self._fail_all(EngineDeadError("engine loop shut down"))

    def _apply(self, cmd: tuple) -> None:
        eng, kind = self.engine, cmd[0]
        if kind == "add":
            _, rid, prompt, params, priority, salt, stream, fut = cmd
            try:
                if isinstance(prompt, list):
                    eng.add_request(rid, None, params, priority=priority, cache_salt=salt,
                                    prompt_token_ids=prompt)
                else:
                    eng.add_request(rid, prompt, params, priority=priority, cache_salt=salt)
            except Exception as e:  # noqa: BLE001 - the caller gets it as its answer
                self._resolve(fut, exc=e)
                return
            self._streams[rid] = stream
            self._resolve(fut, stream)
        elif kind == "abort":
            rid = cmd[1]
            stream = self._streams.pop(rid, None)
            if eng.abort(rid) and stream is not None:
                outs = [StepOutput(rid, "", i, [], "", True, "abort") for i in range(stream.n)
                        if i not in stream.finish_reasons]
                self._post(stream._put, StreamItem(outs, finished=True))
            self._forget([rid])
            self.stats = dict(eng.stats())
        elif kind == "call":
            _, fn, fut = cmd
            try:
                self._resolve(fut, fn(eng))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                self._resolve(fut, exc=e)

    def _step(self) -> None:
        eng = self.engine
        t0 = time.monotonic()
        try:
            outputs = eng.step()
        except EngineStepError as e:  # those requests were aborted and freed; others go on
            self.num_step_errors += 1
            for rid in e.request_ids:
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    self._post(stream._put, StreamItem(error=e))
            self._forget(e.request_ids)
            outputs = []
        except Exception as e:  # noqa: BLE001 - the engine cannot go on: fail everything
            self.dead = e
            self._stop.set()
            for rid in list(self._streams):
                eng.abort(rid)
            return
        by_req: dict[str, list[StepOutput]] = {}
        for o in outputs:
            by_req.setdefault(o.request_id, []).append(o)
        done_ids, deliveries = [], []
        for rid, outs in by_req.items():
            stream = self._streams.get(rid)
            if stream is None:
                continue
            for o in outs:
                if o.finished:
                    stream.finish_reasons[o.index] = o.finish_reason or "stop"
            done = len(stream.finish_reasons) >= stream.n
            if done:
                del self._streams[rid]
                done_ids.append(rid)
            deliveries.append((stream, StreamItem(outs, finished=done, step_start=t0)))
        if deliveries:  # one wake-up of the event loop per step, not one per request
            self._post(_deliver, deliveries)
        self._forget(done_ids)
        self.stats = dict(eng.stats())
        if self.on_step is not None:
            self.on_step(self.stats, outputs)

    def _forget(self, request_ids: list[str]) -> None:
        """Their last output is on its way to the stream: the engine may drop them."""
        if self.forget_finished and request_ids:
            self.engine.forget_finished(list(request_ids))

    def _fail_all(self, exc: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            self._post(stream._put, StreamItem(error=exc))
        self._streams.clear()
        while True:  # answer adds / calls that will never run
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] in ("add", "call"):
                self._resolve(cmd[-1], exc=exc)
        self.stats = dict(self.engine.stats())
