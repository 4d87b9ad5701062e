"""Completions over a WebSocket: ``/v1/completions/ws`` and ``/v1/chat/completions/ws``.

One socket is one request. The client sends the completion request's JSON (the same fields as
the POST route; ``stream`` is implied), then receives one text message per event: the chunks
the SSE route would send (same JSON, same ids, ``--stream-interval`` applies), then
``{"type": "done"}``, and the server closes the socket (code 1000). Why a socket beside SSE:
the client can talk back on the same connection, so a cancel needs no second request and no
id, and a proxy that buffers or times out long-lived HTTP bodies is not in the way.

Stopping an answer, both free the KV blocks within one engine step (as the cancel route,
:mod:`labkit.serve.cancel`):

- ``{"type": "cancel"}``: the engine requests are aborted; the events still arrive up to each
  choice's ``finish_reason: "abort"`` chunk, then ``done`` and the close. Counted as
  ``labkit:request_aborted_total{reason="cancel"}``.
- closing the socket: the same abort, counted as ``reason="disconnect"`` (as an HTTP client
  that leaves).

A request refused before admission (the same gates as the POST route: key, draining, fields,
queue, rate limit) is answered with OpenAI's error body as one message and the socket closed
with code ``4000 + HTTP status`` (4400, 4401, 4429, 4503 ...; WebSocket's private range). A
message that is neither JSON nor a known ``type`` gets an error message; the request goes on.
With ``--api-key`` the key comes in the handshake's ``Authorization`` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from labkit.serve import protocol, serving
from labkit.serve.cancel import cancel_call
from labkit.serve.protocol import APIError, bad
from labkit.serve.stream_interval import TokenBatcher

Admit = Callable[[WebSocket, dict, str], Awaitable[Any]]  # (socket, body, kind) -> Call


def _identity(payload: Any) -> Any:
    return payload


async def _listen(ws: WebSocket, call: Any) -> None:
    """The client's side while the answer streams: cancel, close, or a mistake."""
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            cancel_call(call, "disconnect")
            return
        try:
            kind = json.loads(msg.get("text") or msg.get("bytes") or b"").get("type")
        except (ValueError, AttributeError):
            kind = None
        if kind == "cancel":
            cancel_call(call, "cancel")
        else:
            await ws.send_json(bad('expected {"type": "cancel"} while the answer streams',
                                   "type", "invalid_message").body())


async def _refuse(ws: WebSocket, e: APIError) -> None:
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        await ws.send_json(e.body())
        await ws.close(4000 + e.status, e.code or e.type)


async def serve_socket(ws: WebSocket, kind: str, admit: Admit, finish: Callable[[Any], None],
                       itl: Callable[[float], None], interval: int) -> None:
    """Accept, read the request, admit it, stream its events until done, cancel or close."""
    await ws.accept()
    try:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return
        call = await admit(ws, protocol.parse_json(msg.get("text") or msg.get("bytes") or b""),
                           kind)
    except APIError as e:
        await _refuse(ws, e)
        return
    except (WebSocketDisconnect, RuntimeError):  # gone meanwhile
        return
    listener = asyncio.create_task(_listen(ws, call))
    try:
        events = serving.stream_events(call, itl, interval, encode=_identity)
        async with contextlib.aclosing(events):
            async for payload in events:
                if call.outcome == "aborted:disconnect":
                    break
                await ws.send_json({"type": "done"} if payload == "[DONE]" else payload)
        if call.outcome != "aborted:disconnect":
            await ws.close(1000)
    except (WebSocketDisconnect, RuntimeError, OSError):  # closed under us while sending
        cancel_call(call, "disconnect")
    finally:
        listener.cancel()
        finish(call)


def install_ws_routes(app: FastAPI, admit: Admit, finish: Callable[[Any], None],
                      itl: Callable[[float], None], interval: int = 1) -> None:
    """``/v1/completions/ws`` and ``/v1/chat/completions/ws`` on ``app``: ``admit`` runs the
    POST route's gates on the first message, ``finish`` records the outcome."""
    TokenBatcher(interval)  # a bad --stream-interval is refused here, when the app is built

    @app.websocket("/v1/completions/ws")
    async def completions_ws(ws: WebSocket) -> None:
        await serve_socket(ws, "completion", admit, finish, itl, interval)

    @app.websocket("/v1/chat/completions/ws")
    async def chat_ws(ws: WebSocket) -> None:
        await serve_socket(ws, "chat", admit, finish, itl, interval)
