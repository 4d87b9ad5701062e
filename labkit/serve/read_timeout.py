"""A bound on how long a client may take to send its request (``--request-read-timeout``).

uvicorn bounds the idle time *between* requests on a kept-alive connection
(``timeout_keep_alive``), but not the time a request takes to arrive: a connection that sends
nothing, half its headers, or a body shorter than its ``Content-Length`` holds a socket (and,
past the headers, a request task) with no reply for ever, with h11 and httptools alike. A few
hundred such connections (slowloris) exhaust a server's file descriptors. Go's ``http.Server``
bounds this with ``ReadHeaderTimeout`` / ``ReadTimeout``, nginx with ``client_header_timeout`` /
``client_body_timeout``; here headers and body share one budget, counted from the request's
first byte (or from the connection's opening, for a connection that sends nothing):

- the header phase is bounded in this module, by a subclass of uvicorn's HTTP protocol (h11 or
  httptools). A timer is armed when a connection opens and when the first byte of a next
  request arrives on a kept-alive connection, and disarmed once the request's headers are in
  (uvicorn has then made a request cycle for it). When it fires, a connection that sent nothing
  is closed silently (a pre-opened pool socket or a port scan: there is no request to answer);
  one that sent part of a request gets ``408 Request Timeout`` with OpenAI's error body and is
  closed.
- the body phase is bounded by the app (:func:`labkit.serve.api_server.read_body`), against
  the deadline this protocol leaves in the request's ASGI scope under ``READ_DEADLINE`` (the
  event loop's clock), so the app answers 408 itself and closes the connection.

The subclass touches only what every uvicorn HTTP protocol since 0.2x has: ``cycle`` (the
current request's cycle, with ``scope`` and ``response_complete``), ``transport``, ``loop``
and ``client``. ``tests/serve/test_hardening.py`` runs the stalls against both h11 and
httptools.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

READ_DEADLINE = "labkit.read_deadline"  # ASGI scope key: loop time by which the body is in


def timeout_message(timeout: float, what: str = "request") -> str:
    return (f"the {what} did not arrive whole within {timeout:g} s of its first byte "
            "(--request-read-timeout)")


def response_408(timeout: float) -> bytes:
    """A whole HTTP/1.1 408 with OpenAI's error body, closing the connection."""
    body = json.dumps({"error": {"message": timeout_message(timeout, "request headers"),
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


def read_timeout_protocol(timeout: float, http: str | type = "auto",
                          on_timeout: Callable[[Any], None] | None = None) -> type:
    """uvicorn's HTTP protocol class ``http`` (``"auto"``, ``"h11"``, ``"httptools"`` or a
    class), closing connections whose request headers are not in within ``timeout`` s; pass
    it as ``uvicorn.Config(http=...)``. ``on_timeout(client)`` runs when a 408 is sent."""
    base = _base(http)

    class ReadTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        read_timeout = timeout

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._rt_timer: asyncio.TimerHandle | None = None
            self._rt_cycle: Any = None  # the last cycle whose headers were seen complete
            self._rt_began = False  # a byte of the timed request has arrived
            self._rt_deadline = 0.0
            super().connection_made(transport)
            self._rt_arm(began=False)

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if self._rt_timer is None and (cycle is None or cycle.response_complete):
                self._rt_arm(began=True)  # the first byte of a next request (keep-alive)
            self._rt_began = True
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and cycle is not self._rt_cycle:  # its headers are in
                self._rt_cycle = cycle
                cycle.scope[READ_DEADLINE] = self._rt_deadline  # the app bounds the body
                self._rt_disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._rt_disarm()
            super().connection_lost(exc)

        def _rt_arm(self, began: bool) -> None:
            self._rt_began = began
            self._rt_deadline = self.loop.time() + self.read_timeout
            self._rt_timer = self.loop.call_at(self._rt_deadline, self._rt_expired)

        def _rt_disarm(self) -> None:
            if self._rt_timer is not None:
                self._rt_timer.cancel()
                self._rt_timer = None

        def _rt_expired(self) -> None:
            self._rt_timer = None
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            if self._rt_began:
                transport.write(response_408(self.read_timeout))
                if on_timeout is not None:
                    on_timeout(self.client)
            transport.close()

    ReadTimeoutProtocol.__name__ = ReadTimeoutProtocol.__qualname__ = \
        f"ReadTimeout{base.__name__}"
    return ReadTimeoutProtocol
