"""Reading a request body under the server's limits (gate 3 of :mod:`labkit.serve.api_server`).

Why not ``await request.body()``: it reads whatever the client sends before anything can look
at it, so one client posting gigabytes fills memory, and a client that stops sending holds a
task for ever. Here the declared ``Content-Length`` is refused with 413 before a byte is read,
the running size is checked per chunk, and the two ways a read ends early are told apart: the
client went away (:class:`ClientGone`, nothing to answer) or the HTTP protocol closed a read
that ran past ``--request-read-timeout`` and has already answered 408 (:class:`ReadTimedOut`,
:mod:`labkit.serve.read_timeout`).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from labkit.serve.protocol import APIError
from labkit.serve.read_timeout import READ_TIMED_OUT


def peer(client: Any) -> str:
    """``host:port`` of a connection's client, for log lines."""
    return f"{client[0]}:{client[1]}" if client else "client"


class ReadTimedOut(Exception):
    """The request did not arrive whole in time; the HTTP protocol answered 408 and closed."""


class ClientGone(Exception):
    """The client closed its connection before its request body was read whole."""

    def __init__(self, received: int, expected: str | None) -> None:
        super().__init__(f"{received} of {expected or 'unknown'} body bytes received")
        self.received, self.expected = received, expected


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes. Raises
    ClientGone if the connection closes first (ReadTimedOut if the server closed it: the
    HTTP protocol has answered 408)."""
    cl = request.headers.get("content-length")
    too_big = APIError(413, f"request body exceeds {limit} bytes", "invalid_request_error",
                       None, "request_too_large")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_big
            chunks.append(part)
    except ClientDisconnect:
        if request.scope.get(READ_TIMED_OUT):
            raise ReadTimedOut from None
        raise ClientGone(size, cl) from None
    return b"".join(chunks)
