"""A bound on how long a client may take to send its request (``--request-read-timeout``).

uvicorn bounds the idle time *between* requests on a kept-alive connection
(``timeout_keep_alive``), but not the time a request takes to arrive: a connection that sends
nothing, half its headers, or a body shorter than its ``Content-Length`` holds a socket (and,
past the headers, a request task) with no reply for ever, with h11 and httptools alike. A few
hundred such connections (slowloris) exhaust a server's file descriptors. Go's ``http.Server``
bounds this with ``ReadHeaderTimeout`` / ``ReadTimeout``, nginx with ``client_header_timeout`` /
``client_body_timeout``; here headers and body share one budget, counted from the request's
first byte (or from the connection's opening, for a connection that sends nothing).

Both phases are bounded here, by a subclass of uvicorn's HTTP protocol (h11 or httptools): a
timer is armed when a connection opens and when the first byte of a next request arrives on a
kept-alive connection, and disarmed once the request is in whole (uvicorn has made its request
cycle and seen the end of its body). Timing it here rather than in the app means a request that
did arrive in time is never refused because the event loop was late to start its handler. When
the timer fires:

- a connection that sent nothing is closed silently (a pre-opened pool socket or a port scan:
  there is no request to answer);
- a request with part of its headers, or its headers but not its whole body, gets ``408
  Request Timeout`` with OpenAI's error body and the connection is closed; the request's scope
  is marked (``READ_TIMED_OUT``), so the app, whose body read then ends in a disconnect, knows
  this was the server's doing and not the client leaving;
- a request the app has already begun to answer (a 413 for a body that was too big) is left
  to finish.

The subclass touches only what every uvicorn HTTP protocol since 0.2x has: ``cycle`` (the
current request's cycle, with ``scope``, ``more_body``, ``response_started`` and
``response_complete``), ``transport``, ``loop`` and ``client``;
``tests/serve/test_hardening.py`` runs the stalls against both h11 and httptools.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

READ_TIMED_OUT = "labkit.read_timed_out"  # ASGI scope key: this request was answered 408


def timeout_message(timeout: float, what: str = "request") -> str:
    return (f"the {what} did not arrive whole within {timeout:g} s of its first byte "
            "(--request-read-timeout)")


def response_408(timeout: float, what: str) -> bytes:
    """A whole HTTP/1.1 408 with OpenAI's error body, closing the connection."""
    body = json.dumps({"error": {"message": timeout_message(timeout, what),
                                 "type": "invalid_request_error", "param": None,
                                 "code": "request_read_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


def _base(http: str | type) -> type:
    if not isinstance(http, str):
        return http
    if http == "auto":
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        return AutoHTTPProtocol
    if http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    raise ValueError(f"http must be auto, h11 or httptools, got {http!r}")


class _ReadTimer:
    """The timer's bookkeeping, the same over h11 and httptools: mixed in before uvicorn's
    protocol class by :func:`read_timeout_protocol`, which sets ``read_timeout`` and
    ``_rt_report``."""

    read_timeout: float

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._rt_timer: asyncio.TimerHandle | None = None
        self._rt_cycle: Any = None  # the timed request's cycle, once its headers are in
        self._rt_began = False  # a byte of the timed request has arrived
        super().connection_made(transport)  # type: ignore[misc]
        self._rt_arm(began=False)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if self._rt_timer is None and (cycle is None or cycle.response_complete):
            self._rt_arm(began=True)  # the first byte of a next request (keep-alive)
        self._rt_began = True
        super().data_received(data)  # type: ignore[misc]
        cycle = self.cycle
        if self._rt_timer is not None and cycle is not None and \
                cycle is not self._rt_cycle_before:
            self._rt_cycle = cycle  # its headers are in
        if self._rt_cycle is not None and not self._rt_cycle.more_body:
            self._rt_disarm()  # and its body: the request is whole

    def connection_lost(self, exc: Exception | None) -> None:
        self._rt_disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _rt_arm(self, began: bool) -> None:
        self._rt_began, self._rt_cycle = began, None
        self._rt_cycle_before = self.cycle  # a cycle made after this is the timed one
        self._rt_timer = self.loop.call_later(self.read_timeout, self._rt_expired)

    def _rt_disarm(self) -> None:
        if self._rt_timer is not None:
            self._rt_timer.cancel()
            self._rt_timer = None
        self._rt_cycle = None

    def _rt_expired(self) -> None:
        self._rt_timer = None
        transport, cycle = self.transport, self._rt_cycle
        if transport is None or transport.is_closing():
            return
        if cycle is not None and cycle.response_started:
            return  # the app is answering already (e.g. 413): let it finish
        before = self._rt_cycle_before
        answered = cycle is None and before is not None and before.more_body
        if self._rt_began and not answered:  # (answered: the rest of a refused body)
            what = "request body" if cycle is not None else "request headers"
            if cycle is not None:
                cycle.scope[READ_TIMED_OUT] = True
            transport.write(response_408(self.read_timeout, what))
            self._rt_report(what)
        transport.close()

    def _rt_report(self, what: str) -> None:
        """Tell the server a 408 was sent (``what``: the part that was late)."""


def read_timeout_protocol(timeout: float, http: str | type = "auto",
                          on_timeout: Callable[[Any, str], None] | None = None) -> type:
    """uvicorn's HTTP protocol class ``http`` (``"auto"``, ``"h11"``, ``"httptools"`` or a
    class), answering 408 and closing the connection when a request is not in whole within
    ``timeout`` s of its first byte; pass it as ``uvicorn.Config(http=...)``.
    ``on_timeout(client, what)`` runs when a 408 is sent (``what``: the part that was late)."""
    base = _base(http)

    class ReadTimeoutProtocol(_ReadTimer, base):  # type: ignore[misc, valid-type]
        read_timeout = timeout

        def _rt_report(self, what: str) -> None:
            if on_timeout is not None:
                on_timeout(self.client, what)

    ReadTimeoutProtocol.__name__ = ReadTimeoutProtocol.__qualname__ = \
        f"ReadTimeout{base.__name__}"
    return ReadTimeoutProtocol
