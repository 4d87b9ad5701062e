"""The OpenAI-compatible HTTP server over AsyncLLM (FastAPI): routes, admission, errors.

Every request passes the same gates (:mod:`labkit.serve.admission`), cheapest first, and each
refusal is an OpenAI error body:

1. ``Authorization: Bearer KEY``          -> 401 unless it matches a key (constant time); with
   ``--api-key`` set this guards every ``/v1`` route, ``/v1/models`` included, as vLLM's
   middleware does (``/health`` and ``/metrics`` stay open, for probes and scrapers)
2. draining (SIGTERM received)          -> 503 (``/health`` answers 503 too)
3. body larger than ``max_body_bytes``    -> 413 before it is read whole; headers and body
   not in within ``--request-read-timeout`` of the request's first byte -> 408, connection
   closed (by the HTTP protocol, :mod:`labkit.serve.read_timeout`); client gone while its body
   is read -> nothing to answer: counted as an abort (reason ``disconnect_reading_body``), one
   log line
4. JSON and fields                        -> 400 naming the field (a lone surrogate included);
   unknown model -> 404
5. prompt too long for the context        -> 400 ``context_length_exceeded``
6. queue full (``--max-waiting``)         -> 429 + Retry-After
7. the key's token bucket (requests/s, tokens/s; cost = prompt + max_tokens) -> 429 + Retry-After
8. the engine's own checks (``add_request``) -> 400 with its message

Only then is the request accepted; from there its outcome is exactly one of finished, aborted
(client disconnect, cancel by id or message, step error, shutdown) or timed out, so:
``accepted = finished + aborted + timed out`` (``state.counts``; in ``/metrics``,
``request_accepted = request_success + request_aborted`` without reason
``disconnect_reading_body``, timeouts being aborts of reason ``timeout``).

The queue (``--max-waiting N``): a request waits when the running batch's ``max_num_seqs``
slots are taken, so the server holds at most ``max_num_seqs + N`` sequences (``n`` per prompt)
and refuses the next with 429. It counts what it has sent to the engine core and not yet seen
finish (``AsyncLLM.num_seqs_in_flight``), not the engine's waiting queue: that is a snapshot
from the last step, in which a burst that arrived since is not yet, and in which requests the
next step will run still count as waiting. Sixteen requests at once with 4 slots and
``--max-waiting 6``: 10 admitted (4 run, 6 wait), 6 refused, whatever the engine is doing
meanwhile. When KV blocks, not slots, limit the batch, more wait than this count says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from labkit.serve import serving
from labkit.serve.admission import admit as _admit
from labkit.serve.admission import unauthorized as _unauthorized
from labkit.serve.async_llm import AsyncLLM
from labkit.serve.body import ClientGone, ReadTimedOut
from labkit.serve.body import peer as _peer
from labkit.serve.cancel import install_cancel_routes
from labkit.serve.lora_routes import install_lora_routes
from labkit.serve.model_card import model_card
from labkit.serve.protocol import APIError
from labkit.serve.state import ServeConfig, ServerState
from labkit.serve.weight_routes import install_weight_routes
from labkit.serve.ws import install_ws_routes
from labkit.utils import freeze_gc_heap

log = logging.getLogger("uvicorn.error")  # the server's log: uvicorn's handler and --log-level


def error_response(e: APIError, state: ServerState | None = None) -> JSONResponse:
    if state is not None:
        state.metrics.errors.labels(state.config.model_name, str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _finish(state: ServerState, call: serving.Call) -> None:
    """Record the call's single outcome in the counters and histograms."""
    m, name = state.metrics, state.config.model_name
    if call.outcome is None:  # the generator was cancelled (client gone) before we knew
        call.outcome = "aborted:disconnect"
    call.abort_all()
    state.live.remove(call)
    state.loras.finished(call.parsed.extra.get("lora_request"))
    kind, _, why = call.outcome.partition(":")
    if kind == "finished":
        state.counts["finished"] += 1
        reasons = list(call.reasons.values())
        m.request_success.labels(name, request_finish_reason(reasons)).inc()
        for r in reasons:
            m.sequence_success.labels(name, r).inc()
        m.e2e.labels(name).observe(time.monotonic() - call.arrival)
    elif kind == "timeout":
        state.counts["timed_out"] += 1
        m.timeouts.labels(name, why).inc()
        m.aborts.labels(name, "timeout").inc()
    else:
        state.counts["aborted"] += 1
        m.aborts.labels(name, why).inc()
    if call.first_token_time is not None:
        m.ttft.labels(name).observe(call.first_token_time - call.arrival)
        m.queue.labels(name).observe(max(0.0, call.first_step_start - call.arrival))


def request_finish_reason(reasons: list[str]) -> str:
    """The ``finished_reason`` label of a finished request (``request_success``): its
    choices' reason when they agree; else ``length`` if any choice was cut (by max_tokens or
    the context: the answer is incomplete somewhere), else ``stop``."""
    rs = set(reasons)
    if "length" in rs:
        return "length"
    return rs.pop() if len(rs) == 1 else "stop"


async def _generate(state: ServerState, request: Request, kind: str) -> Response:
    try:
        call = await _admit(state, request, kind)
    except APIError as e:
        return error_response(e, state)
    except ReadTimedOut:  # answered (408), counted and logged by the protocol
        return Response(status_code=408)  # the connection is closed: nobody reads this
    except ClientGone as e:  # a client drop, not a server error: no 500, no traceback
        state.counts["client_gone"] += 1
        state.metrics.aborts.labels(state.config.model_name, "disconnect_reading_body").inc()
        log.info("%s: %s %s: client disconnected while sending its body (%s); not admitted",
                 _peer(request.client), request.method, request.url.path, e)
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    itl = state.metrics.itl.labels(state.config.model_name).observe
    watcher = asyncio.create_task(serving.watch_disconnect(request.receive, call))
    if call.parsed.stream:
        async def body():
            try:
                async for b in serving.stream_events(call, itl, state.config.stream_interval):
                    if call.outcome == "aborted:disconnect":
                        break
                    yield b
            finally:
                watcher.cancel()
                _finish(state, call)
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        result = await serving.collect(call, itl)
    except APIError as e:
        return error_response(e, state)
    finally:
        watcher.cancel()
        _finish(state, call)
    return JSONResponse(result)


class V1KeyGuard:
    """ASGI middleware: with API keys configured, every ``/v1`` path (routes and unknown ones
    alike, before routing, as vLLM's ``authentication`` middleware) needs a valid key; other
    paths (``/health``, ``/metrics``) and CORS preflights stay open."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if (scope["type"] == "http" and self.state.auth.enabled and
                scope.get("method") != "OPTIONS" and (path == "/v1" or
                                                      path.startswith("/v1/"))):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if self.state.auth.tenant(given.decode("latin-1") if given else None) is None:
                await error_response(_unauthorized(), self.state)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(llm: AsyncLLM, tokenizer: Any, config: ServeConfig | None = None,
              chat_template: Any = None) -> FastAPI:
    """The FastAPI app; starting it (uvicorn) starts the engine core, stopping it stops it."""
    config = config or ServeConfig()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.start()
        await state.loras.load_modules()
        if config.freeze_gc:  # the app, torch and (in thread mode) the engine
            freeze_gc_heap()
        try:
            yield
        finally:
            await llm.shutdown()

    app = FastAPI(title="labkit serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    state = app.state.serve = ServerState(llm, tokenizer, config, chat_template)
    app.add_middleware(V1KeyGuard, state=state)
    _add_error_handlers(app, state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(config.model_name, state.max_model_len,
                                                      config.features),
                                           *state.loras.cards(state.max_model_len)]}

    install_lora_routes(app, state.loras)
    install_weight_routes(app, llm)  # /v1/admin/update_weights (hot weight swaps)
    install_cancel_routes(app, state, error_response)  # POST /v1/requests/{id}/cancel
    install_ws_routes(app, lambda ws, d, kind: _admit(state, ws, kind, d),
                      lambda call: _finish(state, call),
                      state.metrics.itl.labels(config.model_name).observe, config.stream_interval)
    _add_status_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Framework errors (unknown route, wrong method) and bugs answer OpenAI error bodies too,
    counted like the server's own refusals."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}:"
                                       f" {exc.detail}", "invalid_request_error", None, code),
                              state)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                       "server_error"), state)


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """What probes and scrapers read, open without a key: ``/health`` (503 while draining or
    once the engine stopped) and ``/metrics``."""

    @app.get("/health")
    async def health() -> Response:
        if state.draining or not state.llm.is_running:
            return PlainTextResponse("draining" if state.draining else "engine stopped", 503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")
