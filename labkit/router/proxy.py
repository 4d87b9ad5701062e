"""The router's HTTP front: an OpenAI-compatible reverse proxy over several replicas.

Each request: pick a replica with the policy (``labkit.router.policies``) among those whose
circuit breaker lets traffic through (``labkit.router.health``), forward the body unchanged, and
pass the answer back. For ``stream=true`` the replica's Server-Sent Events are relayed chunk by
chunk as they arrive (``aiter_raw``: no re-parsing, no buffering), so the client's TTFT is the
replica's plus one hop. When the client goes away, the relay is cancelled and the upstream
response closed, so the replica sees its own client disconnect and aborts the request (freeing
its KV blocks) instead of generating for nobody.

Failures before the first byte (connection refused, timeout, 5xx) are retried on another replica
after an exponential backoff with full jitter, and counted against the replica's breaker. After
the first byte the client has seen output: resuming mid-stream (failover by re-prefilling prompt
+ tokens sent so far) is not done here yet.

The router counts what it sees per replica (requests, failures, in flight) and serves them at
``/metrics`` in Prometheus text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from labkit.router.canary import CANDIDATE, Canary
from labkit.router.health import Backoff, HealthTracker
from labkit.router.policies import NoReplicaError, RouteKey, get_policy

RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout,
             httpx.RemoteProtocolError)


@dataclass
class Upstream:
    """A replica as the router sees it."""

    name: str
    url: str
    outstanding: int = 0


def route_key(body: dict[str, Any]) -> RouteKey:
    """The text a policy hashes: the prompt, or the chat messages' contents in order (the
    system prompt first, which is what requests share)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return RouteKey(token_ids=prompt, user=body.get("user"))
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
    if prompt is None and isinstance(body.get("messages"), list):
        prompt = "".join(str(m.get("content", "")) for m in body["messages"]
                         if isinstance(m, dict))
    return RouteKey(text=prompt if isinstance(prompt, str) else None, user=body.get("user"))


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("labkit_router_requests", "requests forwarded", ["replica"],
                                registry=self.registry)
        self.failures = Counter("labkit_router_failures", "failed before the first byte",
                                ["replica"], registry=self.registry)
        self.outstanding = Gauge("labkit_router_outstanding", "requests in flight",
                                 ["replica"], registry=self.registry)
        self.open = Gauge("labkit_router_breaker_open", "1 while the replica's breaker is not "
                          "closed", ["replica"], registry=self.registry)


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "router_error", "param": None,
                                   "code": code}}, status_code=status)


def create_app(urls: Sequence[str], policy: str | Any = "round-robin",
               health: HealthTracker | None = None, backoff: Backoff | None = None,
               timeout_s: float = 600.0, canary_urls: Sequence[str] = (),
               canary: Canary | None = None) -> FastAPI:
    """A FastAPI app routing over ``urls`` (``http://127.0.0.1:8001`` ...); with
    ``canary_urls``, a candidate set that ``canary`` (``labkit.router.canary``) gives a share."""
    if not urls:
        raise ValueError("give at least one replica URL")
    ups = [Upstream(f"replica-{i}", u.rstrip("/")) for i, u in enumerate(urls)]
    cands = [Upstream(f"canary-{i}", u.rstrip("/")) for i, u in enumerate(canary_urls)]
    if cands and canary is None:
        canary = Canary()
    if canary is not None and not cands:
        raise ValueError("a canary needs at least one candidate replica URL (canary_urls)")
    pol = get_policy(policy) if isinstance(policy, str) else policy
    cpol = get_policy(policy) if isinstance(policy, str) else pol  # its own ring for candidates
    health = health or HealthTracker([u.name for u in ups])
    backoff = backoff or Backoff(rng=random.Random(0))
    metrics = _Metrics()
    if canary is not None:
        canary.attach(metrics.registry)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = None  # the canary's PromQL analysis loop, when it reads Prometheus
        if canary is not None and canary.promql is not None:
            task = asyncio.create_task(canary.promql_loop())
        yield
        if task:
            task.cancel()
        await client.aclose()

    app = FastAPI(title="labkit router", lifespan=lifespan)
    app.state.upstreams, app.state.health, app.state.policy = ups, health, pol
    app.state.canary, app.state.candidates = canary, cands

    async def forward(request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "request body is not valid JSON", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_json")
        key = route_key(body)
        arm, pool, t0 = None, ups, time.monotonic()
        if canary is not None:
            try:
                arm, pool = canary.pick(key.user, request.headers, ups, cands)
            except ValueError as exc:
                return _error(400, str(exc), "invalid_canary_header")
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type", "x-request-id")}
        tried: set[str] = set()
        delays = backoff.delays()
        while True:
            avail = [u for u in health.available(pool) if u.name not in tried] or \
                [u for u in health.available(pool)]
            try:
                up = (cpol if arm == CANDIDATE else pol).choose(key, avail)
            except NoReplicaError as exc:
                if arm is not None:
                    canary.record(arm, False)
                return _error(503, str(exc), "no_replica")
            if not health.breakers[up.name].allow():
                tried.add(up.name)
                continue
            req = client.build_request("POST", up.url + path, content=raw, headers=headers)
            up.outstanding += 1
            metrics.outstanding.labels(up.name).inc()
            metrics.requests.labels(up.name).inc()
            try:
                resp = await client.send(req, stream=True)
                if resp.status_code >= 500:
                    await resp.aclose()
                    raise httpx.RemoteProtocolError(f"{up.name} answered {resp.status_code}")
            except RETRYABLE as exc:
                _done(up)
                health.record(up.name, False)
                metrics.failures.labels(up.name).inc()
                metrics.open.labels(up.name).set(health.breakers[up.name].state != "closed")
                tried.add(up.name)
                wait = next(delays, None)
                if wait is None:
                    if arm is not None:
                        canary.record(arm, False)
                    return _error(502, f"every attempt failed before the first byte; last: "
                                  f"{up.name}: {exc}", "upstream_failed")
                await asyncio.sleep(wait)
                continue
            health.record(up.name, True)
            metrics.open.labels(up.name).set(0)
            out = _relay(resp, up)
            if arm is not None:
                out.body_iterator = canary.watch(out.body_iterator, arm, t0, resp.status_code)
                out.headers["x-labkit-canary"] = arm
            return out

    def _done(up: Upstream) -> None:
        up.outstanding -= 1
        metrics.outstanding.labels(up.name).dec()

    def _relay(resp: httpx.Response, up: Upstream) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:  # normal end, or the client left (cancelled): close the upstream too
                await resp.aclose()
                _done(up)

        media = resp.headers.get("content-type", "application/json")
        return StreamingResponse(chunks(), status_code=resp.status_code, media_type=media,
                                 headers={"x-labkit-replica": up.name})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/health")
    async def healthz() -> Response:
        ok = health.available(ups)
        return JSONResponse({"replicas": health.states()}, status_code=200 if ok else 503)

    @app.get("/canary")
    async def canary_status() -> Response:
        if canary is None:
            return _error(404, "no canary configured (labkit router --canary URL)", "no_canary")
        return JSONResponse(canary.status())

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain")

    return app


def main(argv: list[str] | None = None) -> int:
    """``labkit router --replica URL --replica URL [--policy P] [--host H] [--port P]``."""
    import argparse

    import uvicorn

    from labkit.router.canary_cli import add_canary_args, canary_from_args
    from labkit.router.policies import POLICIES

    p = argparse.ArgumentParser(prog="labkit router", description=__doc__.splitlines()[0])
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat)")
    p.add_argument("--policy", default="prefix-affinity", choices=list(POLICIES))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_canary_args(p)
    args = p.parse_args(argv)
    try:
        canary = canary_from_args(args)
    except ValueError as e:
        p.error(str(e))
    uvicorn.run(create_app(args.replica, args.policy, canary_urls=args.canary or (),
                           canary=canary), host=args.host, port=args.port, log_level="warning")
    return 0
