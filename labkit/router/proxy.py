"""The router's HTTP front: an OpenAI-compatible reverse proxy over several replicas.

Each request: pick a replica with the policy (``labkit.router.policies``) among those in
rotation (not draining) whose circuit breaker lets traffic through (``labkit.router.health``),
forward the body, and pass the answer back: ``stream=true`` answers event by event as they
arrive (the client's TTFT is the replica's plus one hop), resumed on another replica if their
replica dies mid-stream; failures before the first byte retried elsewhere with backoff; a
client that leaves cancels the upstream so the replica aborts. That data path is
``labkit.router.relay``; this module is the app around it and the ``labkit router`` command.

Health: the breakers are fed by what real requests see (passive) and, with
``probe_interval_s``, by ``GET /health`` probes of every replica (active), so a dead or draining
replica leaves rotation before a client has to find out, and a recovered one comes back.

Operations (``labkit.router.admin``; loopback, no auth):
``GET /admin/replicas`` (state per replica), ``POST /admin/replicas/{name}/drain`` (out of
rotation; streams in flight finish) and ``/undrain`` (back, breaker reset), ``POST
/admin/policy`` (``{"policy": "round-robin"}``), ``GET /admin/failovers`` (one record per
resumed stream: when, from, to, tokens already sent, the gap). ``/metrics`` serves per-replica
counters in Prometheus text.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest

from labkit.router.admin import add_admin_routes
from labkit.router.admin import router_error as _error
from labkit.router.canary import Canary
from labkit.router.failover import StreamResume, not_resumable
from labkit.router.health import Backoff, HealthTracker
from labkit.router.policies import get_policy, route_key
from labkit.router.relay import Relay, RouterMetrics, Upstream

__all__ = ["Upstream", "create_app", "main", "route_key"]


@dataclass
class _Router:
    """What one router app's routes and background loops share."""

    ups: list[Upstream]
    cands: list[Upstream]
    canary: Canary | None
    health: HealthTracker
    metrics: RouterMetrics
    client: httpx.AsyncClient
    probe_interval_s: float | None
    probe_timeout_s: float
    by_name: dict[str, Upstream] = field(init=False)

    def __post_init__(self) -> None:
        self.by_name = {u.name: u for u in [*self.ups, *self.cands]}

    def in_rotation(self, pool: Sequence[Upstream] | None = None) -> list[Upstream]:
        """The upstreams of ``pool`` (default: the replicas) that may take traffic now."""
        pool = self.ups if pool is None else pool
        return [u for u in self.health.available(pool) if not u.draining]


def create_app(urls: Sequence[str], policy: str | Any = "round-robin",
               health: HealthTracker | None = None, backoff: Backoff | None = None,
               timeout_s: float = 600.0, probe_interval_s: float | None = None,
               max_failovers: int = 2, canary_urls: Sequence[str] = (),
               canary: Canary | None = None, probe_timeout_s: float = 1.0) -> FastAPI:
    """A FastAPI app routing over ``urls`` (``http://127.0.0.1:8001`` ...); ``replica-i`` is
    the i-th URL. ``probe_interval_s``: active ``/health`` probes every so many seconds (None:
    passive only), each allowed ``probe_timeout_s`` (Kubernetes' default, 1 s: a replica busy
    re-prefilling a dead peer's streams answers late, and a probe timeout tied to a short
    interval would open the breaker of the last replica standing). ``max_failovers``: how
    many times one stream may be resumed. With
    ``canary_urls`` (``canary-i``), a candidate set that ``canary`` (``labkit.router.canary``)
    gives a share of the traffic; each request is routed, retried and resumed inside its arm."""
    ups, cands, canary = _upstreams(urls, canary_urls, canary, probe_interval_s,
                                    probe_timeout_s)
    pol = get_policy(policy) if isinstance(policy, str) else policy
    cpol = get_policy(policy) if isinstance(policy, str) else pol  # its own ring for candidates
    health = health or HealthTracker([u.name for u in ups])
    backoff = backoff or Backoff(rng=random.Random(0))
    metrics = RouterMetrics()
    if canary is not None:
        canary.attach(metrics.registry)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
    r = _Router(ups, cands, canary, health, metrics, client, probe_interval_s, probe_timeout_s)
    app = FastAPI(title="labkit router", lifespan=_lifespan(r))
    relay = Relay(client, health, backoff, metrics,
                  lambda pool: cpol if pool is cands else app.state.policy, r.in_rotation, ups,
                  max_failovers)
    app.state.upstreams, app.state.health, app.state.policy = ups, health, pol
    app.state.failovers, app.state.canary, app.state.candidates = relay.failovers, canary, cands
    app.state.model_cards = {}  # replica name -> its /v1/models data (_models_loop)
    _add_completion_routes(app, r, relay)
    _add_status_routes(app, r)
    add_admin_routes(app, r.by_name, health, metrics)
    return app


def _upstreams(urls: Sequence[str], canary_urls: Sequence[str], canary: Canary | None,
               probe_interval_s: float | None, probe_timeout_s: float,
               ) -> tuple[list[Upstream], list[Upstream], Canary | None]:
    """The replicas and the canary's candidates (a canary by default when candidates are
    given), refusing settings that cannot work before anything starts."""
    if not urls:
        raise ValueError("give at least one replica URL")
    if probe_interval_s is not None and probe_interval_s <= 0:
        raise ValueError(f"probe_interval_s must be > 0 (or None), got {probe_interval_s}")
    if not probe_timeout_s > 0:
        raise ValueError(f"probe_timeout_s must be > 0, got {probe_timeout_s}")
    ups = [Upstream(f"replica-{i}", u.rstrip("/")) for i, u in enumerate(urls)]
    cands = [Upstream(f"canary-{i}", u.rstrip("/")) for i, u in enumerate(canary_urls)]
    if cands and canary is None:
        canary = Canary()
    if canary is not None and not cands:
        raise ValueError("a canary needs at least one candidate replica URL (canary_urls)")
    return ups, cands, canary


async def _probe_loop(r: _Router) -> None:
    """Active ``GET /health`` probes into the breakers: a dead or draining replica leaves
    rotation before a client has to find out, and a recovered one comes back."""
    while True:
        for u in r.by_name.values():
            try:
                ok = (await r.client.get(u.url + "/health",
                                         timeout=r.probe_timeout_s)).status_code == 200
            except httpx.TransportError:
                ok = False
            if not ok:
                r.metrics.probe_failures.labels(u.name).inc()
            r.health.probe(u.name, ok)
            r.metrics.open.labels(u.name).set(r.health.breakers[u.name].state != "closed")
        await asyncio.sleep(r.probe_interval_s)


async def _models_loop(app: FastAPI, r: _Router) -> None:
    """Read each replica's ``/v1/models`` once (retrying until it answers): which names
    are base models, for a policy that tells adapters apart (``adapter-affinity``)."""
    while len(app.state.model_cards) < len(r.by_name):
        for u in r.by_name.values():
            if u.name in app.state.model_cards:
                continue
            with contextlib.suppress(httpx.TransportError, ValueError, KeyError):
                resp = await r.client.get(u.url + "/v1/models", timeout=r.probe_timeout_s)
                if 400 <= resp.status_code < 500:  # no such route, or it needs a key
                    app.state.model_cards[u.name] = []
                elif resp.status_code == 200:
                    app.state.model_cards[u.name] = resp.json()["data"]
                    if hasattr(app.state.policy, "observe_models"):
                        app.state.policy.observe_models(app.state.model_cards[u.name])
        await asyncio.sleep(r.probe_interval_s or 1.0)


def _lifespan(r: _Router) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's background loops run while it serves: started with it, stopped (and the
    client closed) when it stops."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        prober = asyncio.create_task(_probe_loop(r)) if r.probe_interval_s else None
        models = asyncio.create_task(_models_loop(app, r))
        analysis = None  # the canary's PromQL analysis loop, when it reads Prometheus
        if r.canary is not None and r.canary.promql is not None:
            analysis = asyncio.create_task(r.canary.promql_loop())
        yield
        for task in (prober, analysis, models):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await r.client.aclose()

    return lifespan


def _add_completion_routes(app: FastAPI, r: _Router, relay: Relay) -> None:
    """The OpenAI routes the router forwards to a replica (``_forward``)."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(r, relay, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _forward(r, relay, request, "/v1/chat/completions")


async def _forward(r: _Router, relay: Relay, request: Request, path: str) -> Response:
    """One client request through the relay, inside its canary arm's pool: buffered, or
    streamed (resumable on another replica when the stream allows it)."""
    canary = r.canary
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        return _error(400, "request body is not valid JSON", "invalid_json")
    if not isinstance(body, dict):
        return _error(400, "request body must be a JSON object", "invalid_json")
    key = route_key(body)
    arm, pool, t0 = None, r.ups, time.monotonic()
    if canary is not None:
        try:
            arm, pool = canary.pick(key.user, request.headers, r.ups, r.cands)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_canary_header")
    headers = {k: v for k, v in request.headers.items()
               if k.lower() in ("authorization", "content-type", "x-request-id")}
    chat = path.endswith("/chat/completions")
    if not body.get("stream"):
        return await relay.buffered(request, path, raw, key, headers, pool, canary, arm, t0)
    state = None if not_resumable(body, chat) else StreamResume(body, chat)
    got = await relay.connect(path, raw if state is None else state.upstream_body(),
                              key, headers, set(), pool)
    if isinstance(got, Response):
        if arm is not None:
            canary.record(arm, False)
        return got
    resp, up = got
    media = resp.headers.get("content-type", "application/json")
    out_headers = {"x-labkit-replica": up.name, **({"x-labkit-canary": arm} if arm else {})}
    if state is None or resp.status_code != 200 or not media.startswith("text/event-stream"):
        body_iter, status = relay.stream(resp, up), resp.status_code
    else:
        body_iter = relay.resumable(state, resp, up, key, headers, pool)
        status = 200
        out_headers["Cache-Control"] = "no-cache"
    if arm is not None:
        body_iter = canary.watch(body_iter, arm, t0, status)
    return StreamingResponse(body_iter, status_code=status, media_type=media,
                             headers=out_headers)


def _add_status_routes(app: FastAPI, r: _Router) -> None:
    """What probes, operators and scrapers read: health, the canary's state, the metrics."""

    @app.get("/health")
    async def healthz() -> Response:
        ok = r.in_rotation()
        return JSONResponse({"replicas": r.health.states()}, status_code=200 if ok else 503)

    @app.get("/canary")
    async def canary_status() -> Response:
        if r.canary is None:
            return _error(404, "no canary configured (labkit router --canary URL)", "no_canary")
        return JSONResponse(r.canary.status())

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(generate_latest(r.metrics.registry), media_type="text/plain")


def main(argv: list[str] | None = None) -> int:
    """``labkit router --replica URL --replica URL [--policy P] [--host H] [--port P]``;
    with ``--prefill URL --decode URL`` the disaggregated proxy (:mod:`labkit.router.disagg`);
    with ``--gateway CONFIG.json`` the model gateway (:mod:`labkit.router.gateway`)."""
    import sys

    if "--prefill" in (sys.argv[1:] if argv is None else argv):
        from labkit.router.disagg import main as pd_main

        return pd_main(argv)
    if "--gateway" in (sys.argv[1:] if argv is None else argv):  # labkit.router.gateway
        from labkit.router.gateway import main as gateway_main

        return gateway_main(argv)

    import uvicorn

    from labkit.router.canary_cli import canary_from_args
    from labkit.utils import freeze_gc_heap

    p = _parser()
    args = p.parse_args(argv)
    if args.probe_interval < 0 or args.max_failovers < 0 or not args.probe_timeout > 0:
        p.error("--probe-interval and --max-failovers must be >= 0, --probe-timeout > 0")
    try:
        health = HealthTracker(failure_threshold=args.failure_threshold,
                               recovery_s=args.recovery)
        kw = _policy_kwargs(args.policy_arg)
        app = create_app(args.replica, get_policy(args.policy, **kw), health=health,
                         probe_interval_s=args.probe_interval or None,
                         probe_timeout_s=args.probe_timeout,
                         max_failovers=args.max_failovers, canary_urls=args.canary or (),
                         canary=canary_from_args(args))
    except (ValueError, TypeError) as e:
        p.error(str(e))
    freeze_gc_heap()  # this process is the router's alone: no full collections of startup
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The ``labkit router`` command line (the plain router's flags and the canary's)."""
    from labkit.router.canary_cli import add_canary_args
    from labkit.router.policies import POLICIES

    p = argparse.ArgumentParser(prog="labkit router", description=__doc__.splitlines()[0])
    p.add_argument("--replica", action="append", required=True, metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat)")
    p.add_argument("--policy", default="prefix-affinity", choices=list(POLICIES))
    p.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a keyword argument of the policy, e.g. min_load=4 or eps=0.5 (repeat)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--probe-interval", type=float, default=1.0, metavar="S",
                   help="active /health probe period in seconds (0: passive checks only)")
    p.add_argument("--probe-timeout", type=float, default=1.0, metavar="S",
                   help="how long one /health probe may take before it counts as a failure")
    p.add_argument("--max-failovers", type=int, default=2, metavar="N",
                   help="how many times one stream may be resumed on another replica")
    p.add_argument("--failure-threshold", type=int, default=3,
                   help="consecutive failures that open a replica's breaker")
    p.add_argument("--recovery", type=float, default=5.0, metavar="S",
                   help="how long an open breaker waits before a trial request")
    add_canary_args(p)
    return p


def _policy_kwargs(pairs: list[str]) -> dict[str, Any]:
    """``--policy-arg KEY=VALUE`` flags as the policy's keyword arguments (values in JSON)."""
    kw = {}
    for a in pairs:
        k, sep, v = a.partition("=")
        if not sep:
            raise ValueError(f"--policy-arg takes KEY=VALUE, got {a!r}")
        kw[k.replace("-", "_")] = json.loads(v)
    return kw
