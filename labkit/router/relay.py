"""How a request reaches a replica and its answer reaches the client: the router's data path.

``Relay.connect`` picks a replica with the policy among those in rotation whose breaker lets
traffic through, and retries failures before the first byte (connection refused, timeout, 5xx)
on another replica after an exponential backoff with full jitter, counting each against the
replica's breaker. Then one of three relays:

- ``stream`` passes bytes through as they arrive (a request that cannot be resumed);
- ``resumable`` relays a stream event by event, and when its replica dies mid-stream (connection
  cut, or the body ends without ``[DONE]``) continues it on another replica by re-prefilling the
  prompt + the tokens already sent (``labkit.router.failover``: what, and why greedy streams come
  out byte-identical);
- ``buffered`` reads a non-streamed answer whole before the client gets a byte, so one whose
  replica dies after the headers is simply sent again elsewhere; while it reads, it watches the
  client and closes the upstream (the replica aborts) if the client leaves.

Every relay closes its upstream response when it ends or the client goes away (cancelled), so
the replica sees its own client disconnect and aborts the request (freeing its KV blocks)
instead of generating for nobody. The app around it (routes, probes, admin) is
``labkit.router.proxy``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge

from labkit.router.admin import router_error as _error
from labkit.router.canary import Canary
from labkit.router.failover import SSEBuffer, StreamResume
from labkit.router.health import Backoff, HealthTracker
from labkit.router.policies import NoReplicaError, RouteKey

# Any transport failure before the headers is retried elsewhere. A replica killed while it
# generates a non-streamed answer (it sends headers and body together, at the end) surfaces as
# RemoteProtocolError when its socket closed cleanly (FIN) and as ReadError when the kernel reset
# it (RST: the dead process still had unread bytes in its receive buffer); which one a client
# sees is a race, so naming only some of them lost requests as 500s (issue 27).
RETRYABLE = (httpx.TransportError,)


@dataclass
class Upstream:
    """A replica as the router sees it."""

    name: str
    url: str
    outstanding: int = 0
    draining: bool = False


class RouterMetrics:
    """The router's own per-replica counters (served at ``/metrics``)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        lab = ["replica"]
        self.requests = Counter("labkit_router_requests", "requests forwarded", lab, registry=r)
        self.failures = Counter("labkit_router_failures", "failed before the first byte", lab,
                                registry=r)
        self.failovers = Counter("labkit_router_failovers", "streams this replica broke "
                                 "mid-stream (then resumed, finished or failed)", lab,
                                 registry=r)
        self.probe_failures = Counter("labkit_router_probe_failures", "failed /health probes",
                                      lab, registry=r)
        self.outstanding = Gauge("labkit_router_outstanding", "requests in flight", lab,
                                 registry=r)
        self.open = Gauge("labkit_router_breaker_open", "1 while the replica's breaker is not "
                          "closed", lab, registry=r)
        self.draining = Gauge("labkit_router_draining", "1 while the replica is out of "
                              "rotation for a drain", lab, registry=r)


class Relay:
    """The data path over one router's upstreams (module doc). ``policy_for(pool)`` is the
    policy that picks in ``pool`` (read per request: the admin route switches it live);
    ``in_rotation(pool)`` the upstreams of ``pool`` that may take traffic now."""

    def __init__(self, client: httpx.AsyncClient, health: HealthTracker, backoff: Backoff,
                 metrics: RouterMetrics, policy_for: Callable[[Sequence[Upstream]], Any],
                 in_rotation: Callable[[Sequence[Upstream]], list[Upstream]],
                 upstreams: Sequence[Upstream], max_failovers: int = 2) -> None:
        self.client, self.health, self.backoff, self.metrics = client, health, backoff, metrics
        self.policy_for, self.in_rotation = policy_for, in_rotation
        self.upstreams, self.max_failovers = upstreams, max_failovers
        self.failovers: list[dict[str, Any]] = []  # one record per resumed or retried request
        self._model_len: list[int] = []  # the replicas' max_model_len, fetched once if needed

    def _done(self, up: Upstream) -> None:
        up.outstanding -= 1
        self.metrics.outstanding.labels(up.name).dec()

    def _failed(self, up: Upstream) -> None:
        self.health.record(up.name, False)
        self.metrics.failures.labels(up.name).inc()
        self.metrics.open.labels(up.name).set(self.health.breakers[up.name].state != "closed")

    async def connect(self, path: str, raw: bytes, key: RouteKey, headers: dict[str, str],
                      tried: set[str], pool: Sequence[Upstream],
                      ) -> tuple[httpx.Response, Upstream] | JSONResponse:
        """Send to a replica chosen by the policy, retrying elsewhere with backoff until one
        answers with headers (status < 500); the answer is the open response, or an error."""
        delays = self.backoff.delays()
        chooser = self.policy_for(pool)
        while True:
            rot = self.in_rotation(pool)
            try:
                up = chooser.choose(key, [u for u in rot if u.name not in tried] or rot)
            except NoReplicaError as exc:
                return _error(503, str(exc), "no_replica")
            if not self.health.breakers[up.name].allow():
                tried.add(up.name)
                continue
            req = self.client.build_request("POST", up.url + path, content=raw, headers=headers)
            up.outstanding += 1
            self.metrics.outstanding.labels(up.name).inc()
            self.metrics.requests.labels(up.name).inc()
            try:
                resp = await self.client.send(req, stream=True)
                if resp.status_code >= 500:
                    await resp.aclose()
                    raise httpx.RemoteProtocolError(f"{up.name} answered {resp.status_code}")
            except RETRYABLE as exc:
                self._done(up)
                self._failed(up)
                tried.add(up.name)
                wait = next(delays, None)
                if wait is None:
                    return _error(502, f"every attempt failed before the first byte; last: "
                                  f"{up.name}: {exc}", "upstream_failed")
                await asyncio.sleep(wait)
                continue
            except BaseException:  # cancelled (client gone): release the slot
                self._done(up)
                raise
            self.health.record(up.name, True)
            self.metrics.open.labels(up.name).set(0)
            return resp, up

    async def buffered(self, request: Request, path: str, raw: bytes, key: RouteKey,
                       headers: dict[str, str], pool: Sequence[Upstream],
                       canary: Canary | None, arm: str | None, t0: float) -> Response:
        """A non-streamed request: read the whole answer, and if the replica dies before the
        end of it, send the request again elsewhere (nothing reached the client yet)."""
        tried: set[str] = set()
        retried: list[dict[str, Any]] = []  # failover records, completed once one succeeds
        for _ in range(self.max_failovers + 1):
            got = await self.connect(path, raw, key, headers, tried, pool)
            if isinstance(got, Response):
                break
            resp, up = got
            try:
                content = await _read_unless_gone(request, resp)
            except httpx.TransportError as exc:
                self._failed(up)
                self.metrics.failovers.labels(up.name).inc()
                tried.add(up.name)
                retried.append({"time": time.time(), "id": None, "from": up.name,
                                "tokens_sent": 0, "whole": True,
                                "error": f"{type(exc).__name__}: {exc}"})
                got = _error(502, f"{up.name} failed while answering ({exc}); tried "
                             f"{len(tried)} replica(s)", "upstream_failed")
                continue
            finally:
                await resp.aclose()
                self._done(up)
            if content is None:
                return Response(status_code=499)  # nobody to answer: the client left
            self.failovers.extend({**f, "to": up.name} for f in retried)
            got = Response(content, status_code=resp.status_code,
                           media_type=resp.headers.get("content-type", "application/json"),
                           headers={"x-labkit-replica": up.name,
                                    **({"x-labkit-canary": arm} if arm else {})})
            break
        if canary is not None and arm is not None:
            canary.record(arm, got.status_code < 500, time.monotonic() - t0)
        return got

    async def stream(self, resp: httpx.Response, up: Upstream) -> AsyncIterator[bytes]:
        """The replica's bytes as they come (a request the router does not resume)."""
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:  # normal end, or the client left (cancelled): close the upstream too
            await resp.aclose()
            self._done(up)

    async def resumable(self, state: StreamResume, resp: httpx.Response, up: Upstream,
                        key: RouteKey, headers: dict[str, str],
                        pool: Sequence[Upstream]) -> AsyncIterator[bytes]:
        """Relay events; when the replica dies mid-stream, continue on another one."""
        for attempt in range(self.max_failovers + 1):
            err = None
            buf = SSEBuffer()
            try:
                async for chunk in resp.aiter_raw():
                    for ev in buf.feed(chunk):
                        out = state.on_event(ev)
                        if out:
                            yield out
                        if state.done:
                            break
                    if state.done:
                        break
                if not state.done:
                    err = "the stream ended without [DONE]"
            except httpx.TransportError as exc:
                err = f"{type(exc).__name__}: {exc}"
            finally:
                await resp.aclose()
                self._done(up)
            if err is None:
                return
            self._failed(up)
            self.metrics.failovers.labels(up.name).inc()
            mml = await self.max_model_len() if state.needs_max_model_len() else None
            tail = state.tail_if_finished(mml)
            if tail is not None:
                yield tail
                return
            why = state.cannot_resume()
            if why or attempt == self.max_failovers:
                yield state.error_tail(f"{up.name} failed mid-stream ({err}); " + (
                    f"not resumed: {why}" if why else
                    f"the stream failed on {self.max_failovers + 1} replicas; giving up"))
                return
            got = await self._resume_elsewhere(state, mml, up.name, err, key, headers, pool)
            if isinstance(got, bytes):
                yield got
                return
            resp, up = got

    async def _resume_elsewhere(self, state: StreamResume, mml: int | None, dead: str, err: str,
                                key: RouteKey, headers: dict[str, str], pool: Sequence[Upstream],
                                ) -> tuple[httpx.Response, Upstream] | bytes:
        """Send the continuation to another replica than ``dead``: its open response (the
        failover recorded), or the error tail that ends the client's stream if none answers."""
        t0, sent = time.monotonic(), len(state.sent_ids)
        cont = state.resume_body(mml)
        got = await self.connect(state.path("/v1/chat/completions" if state.chat else
                                            "/v1/completions"), cont, key, headers, {dead}, pool)
        if isinstance(got, Response):
            return state.error_tail(f"{dead} failed mid-stream ({err}) and no replica could "
                                    f"continue it: {json.loads(got.body)['error']['message']}")
        resp, up = got
        self.failovers.append({"time": time.time(), "id": (state.head or {}).get("id"),
                               "from": dead, "to": up.name, "tokens_sent": sent,
                               "error": err, "reconnect_s": time.monotonic() - t0})
        return resp, up

    async def max_model_len(self) -> int | None:
        """The replicas' context length (``/v1/models``), asked once: a chat continuation
        without ``max_tokens`` has the rest of the context as its budget."""
        for u in [*self.in_rotation(self.upstreams), *self.upstreams]:
            if self._model_len:
                break
            with suppress(httpx.HTTPError, KeyError, ValueError, IndexError):
                r = await self.client.get(u.url + "/v1/models", timeout=2.0)
                self._model_len.append(int(r.json()["data"][0]["max_model_len"]))
        return self._model_len[0] if self._model_len else None


async def _read_unless_gone(request: Request, resp: httpx.Response) -> bytes | None:
    """The whole body, or None if the client disconnects first (the caller then closes the
    upstream, so the replica sees its own client leave and aborts)."""
    read = asyncio.ensure_future(resp.aread())
    try:
        while not (await asyncio.wait({read}, timeout=0.25))[0]:
            if await request.is_disconnected():
                return None
        return read.result()
    finally:
        read.cancel()
