"""Cancelling a request by its id: ``POST /v1/requests/{id}/cancel`` (``labkit serve``).

A client that wants to stop an answer it no longer needs has three ways: close the connection
(the disconnect watcher in :mod:`labkit.serve.serving`), send ``{"type": "cancel"}`` on the
WebSocket route (:mod:`labkit.serve.ws`), or, from anywhere (another connection, a proxy, an
operator), this route, as SGLang's ``/abort_request`` and OpenAI's ``POST
/v1/responses/{id}/cancel``. The id is the one the client sees: the completion's ``id``
(``cmpl-...`` / ``chatcmpl-...``) in the first SSE chunk or the response. One HTTP request is
``n`` x prompts engine requests (``srv-N`` each); a cancel aborts all of them.

What a cancel frees, and when: the abort is queued to the engine core, which applies queued
commands before its next step, so within one step (the one running now finishes first) the
request's sequences leave the scheduler and their KV blocks return to the pool (blocks shared
through the prefix cache stay cached, no longer referenced: ``kv_cache_usage_perc`` counts only
blocks in use). Tokens of the step already running are computed and discarded.

What the client of the cancelled request sees: a stream ends cleanly, each unfinished choice's
last chunk with ``finish_reason: "abort"`` (the tokens generated so far came before it), then
``data: [DONE]``, no usage chunk. (A non-streamed request's id reaches its client only with
the answer, so that client cancels by closing the connection; cancelled by id from elsewhere,
it gets its partial text with ``finish_reason: "abort"``.) It is counted once in
``labkit:request_aborted_total{reason="cancel"}``. An id that is unknown, already finished, or
another tenant's (with ``--api-key``) is a 404 with OpenAI's error body; cancelling twice is a
404 the second time.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from labkit.serve.protocol import APIError


class LiveCalls:
    """The server's running calls by their client-visible id (added at admission, removed
    when the call's outcome is recorded)."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[Any, str | None]] = {}  # id -> (Call, tenant)

    def add(self, call: Any, tenant: str | None) -> None:
        self.calls[call.id] = (call, tenant)

    def remove(self, call: Any) -> None:
        self.calls.pop(call.id, None)

    def cancel(self, call_id: str, tenant: str | None, reason: str = "cancel") -> Any:
        """Abort the call's engine requests; returns the call, or None when there is no such
        running call for this tenant (unknown, finished, cancelled already, another key's)."""
        call, owner = self.calls.get(call_id, (None, None))
        if call is None or owner != tenant or call.outcome is not None or \
                all(s.finished for s in call.streams):
            return None
        cancel_call(call, reason)
        return call


def cancel_call(call: Any, reason: str) -> None:
    """Mark the call's outcome (``aborted:<reason>``, what ``_finish`` counts) and queue the
    aborts; the engine frees the blocks before its next step."""
    if call.outcome is None:
        call.outcome = f"aborted:{reason}"
    call.abort_all()


def not_found(call_id: str) -> APIError:
    return APIError(404, f"no running request with id {call_id!r} (unknown, finished or "
                    "cancelled already)", "invalid_request_error", "request_id", "not_found")


def install_cancel_routes(app: FastAPI, state: Any, error_response: Any) -> None:
    """``POST /v1/requests/{request_id}/cancel`` on ``app`` over the server's ``state``
    (``state.live``, and ``state.auth`` names the caller's tenant: the key guard has checked
    the key); ``error_response(APIError, state)`` answers and counts an error."""

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request_id: str, request: Request) -> Response:
        tenant = state.auth.tenant(request.headers.get("authorization"))
        call = state.live.cancel(request_id, tenant)
        if call is None:
            return error_response(not_found(request_id), state)
        return JSONResponse({"id": request_id, "object": "request.cancelled",
                             "cancelled": True, "num_engine_requests": len(call.streams)})
