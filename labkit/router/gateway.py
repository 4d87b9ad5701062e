"""A model gateway: route by the request's ``model`` and the API key's tier, with per-tier rate
limits and fallback between tiers (``labkit router --gateway CONFIG.json``).

One address in front of several deployments of several models, as LiteLLM's proxy or an
inference provider's front door does. The config says (:meth:`GatewayConfig.from_dict`)::

    {"keys":  {"sk-alice": "premium", "sk-bob": "standard"},
     "tiers": {"premium":  {"rps": 20, "burst": 40, "fallback": ["standard"]},
               "standard": {"rps": 5,  "burst": 10, "fallback": []}},
     "pools": {"labkit-tiny": {"premium":  ["http://127.0.0.1:8001"],     # fp32 replicas
                               "standard": ["http://127.0.0.1:8002"]}}}   # INT8 replicas

Each request passes, in order (every refusal an OpenAI error body):

1. ``Authorization: Bearer KEY`` -> its tier; a missing or unknown key is a 401;
2. the key's token bucket (the tier's ``rps`` and ``burst``; one bucket per key, so one busy
   premium customer does not use up another's share) -> 429 + ``Retry-After``;
3. ``model`` -> the pool of (model, tier); a model no pool serves is a 404 ``model_not_found``;
4. the pool's replicas in rotation (breaker lets traffic through, :mod:`labkit.router.health`,
   fed by ``/health`` probes and by what requests see; not drained). None: the tier's
   ``fallback`` tiers in order (same model), counted in
   ``labkit_gateway_fallbacks_total{model, from_tier, to_tier}``; still none: 503
   ``no_replica``;
5. the router's own data path (:mod:`labkit.router.relay`) inside that pool: the pool's policy,
   retries before the first byte, resumable streams, all inside the pool.

Downgrading to a cheaper tier when the premium pool is down keeps premium customers served (at
the standard tier's quality); the other way round (``standard -> premium``) is a business
decision the config can also express. Replica names are ``MODEL/TIER-i`` in ``/metrics`` and
``/admin/replicas`` (drain / undrain work as on the plain router).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter, generate_latest

from labkit.router.admin import add_admin_routes, router_error
from labkit.router.failover import StreamResume, not_resumable
from labkit.router.health import Backoff, HealthTracker
from labkit.router.policies import get_policy, route_key
from labkit.router.relay import Relay, RouterMetrics, Upstream
from labkit.serve.limits import TokenBucket


class GatewayConfigError(ValueError):
    """The gateway config is malformed: the message names the field."""


@dataclass
class Tier:
    name: str
    rps: float | None = None  # requests per second per key (None: unlimited)
    burst: float | None = None
    fallback: list[str] = field(default_factory=list)


@dataclass
class GatewayConfig:
    keys: dict[str, str]  # API key -> tier name
    tiers: dict[str, Tier]
    pools: dict[tuple[str, str], list[str]]  # (model, tier) -> replica URLs

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GatewayConfig:
        """Parse and check the JSON shape in the module docstring."""
        if not isinstance(d, dict) or not {"keys", "tiers", "pools"} <= set(d):
            raise GatewayConfigError("the gateway config needs 'keys', 'tiers' and 'pools'")
        tiers = {n: _tier(n, t) for n, t in _obj(d["tiers"], "tiers").items()}
        keys = {str(k): v for k, v in _obj(d["keys"], "keys").items()}
        for k, t in keys.items():
            if t not in tiers:
                raise GatewayConfigError(f"keys: {k[:6]}... names tier {t!r}, not in tiers")
        pools: dict[tuple[str, str], list[str]] = {}
        for model, by_tier in _obj(d["pools"], "pools").items():
            for tier, urls in _obj(by_tier, f"pools.{model}").items():
                if tier not in tiers:
                    raise GatewayConfigError(f"pools.{model}: unknown tier {tier!r}")
                if not isinstance(urls, list) or not urls or \
                        not all(isinstance(u, str) for u in urls):
                    raise GatewayConfigError(f"pools.{model}.{tier}: a non-empty list of "
                                             "replica URLs")
                pools[(model, tier)] = [u.rstrip("/") for u in urls]
        for t in tiers.values():
            bad = [f for f in t.fallback if f not in tiers or f == t.name]
            if bad:
                raise GatewayConfigError(f"tiers.{t.name}.fallback: {bad} are not other tiers")
        if not pools:
            raise GatewayConfigError("pools: at least one (model, tier) pool")
        return cls(keys, tiers, pools)


def _obj(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise GatewayConfigError(f"{where} must be a JSON object, got {type(v).__name__}")
    return v


def _tier(name: str, t: Any) -> Tier:
    t = _obj(t, f"tiers.{name}")
    unknown = set(t) - {"rps", "burst", "fallback"}
    if unknown:
        raise GatewayConfigError(f"tiers.{name}: unknown fields {sorted(unknown)}")
    rps, burst = t.get("rps"), t.get("burst")
    for f, v in (("rps", rps), ("burst", burst)):
        if v is not None and (not isinstance(v, (int, float)) or not v > 0):
            raise GatewayConfigError(f"tiers.{name}.{f} must be a positive number, got {v!r}")
    fb = t.get("fallback", [])
    if not isinstance(fb, list):
        raise GatewayConfigError(f"tiers.{name}.fallback must be a list of tier names")
    return Tier(name, rps, burst, list(fb))


class GatewayMetrics:
    """The gateway's counters, on the router's registry."""

    def __init__(self, registry: Any) -> None:
        lab = ["model", "tier"]
        self.requests = Counter("labkit_gateway_requests", "requests admitted, by the tier "
                                "that served them", lab, registry=registry)
        self.fallbacks = Counter("labkit_gateway_fallbacks", "requests served by a fallback "
                                 "tier because their own pool had no replica in rotation",
                                 ["model", "from_tier", "to_tier"], registry=registry)
        self.rate_limited = Counter("labkit_gateway_rate_limited", "requests refused with 429",
                                    ["tier"], registry=registry)
        self.unavailable = Counter("labkit_gateway_unavailable", "requests refused with 503: "
                                   "no pool of any allowed tier had a replica", lab,
                                   registry=registry)


class Gateway:
    """Keys -> tiers -> pools; ``admit`` runs steps 1-4 of the module docstring."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics,
                 clock: Callable[[], float] | None = None) -> None:
        self.config, self.metrics = config, metrics
        self.pools = {mt: [Upstream(f"{mt[0]}/{mt[1]}-{i}", u) for i, u in enumerate(urls)]
                      for mt, urls in config.pools.items()}
        self.pool_of = {u.name: mt for mt, ups in self.pools.items() for u in ups}
        self.models = sorted({m for m, _ in config.pools})
        self._buckets: dict[str, TokenBucket] = {}
        self._clock = clock

    @property
    def upstreams(self) -> list[Upstream]:
        return [u for ups in self.pools.values() for u in ups]

    def tier_of(self, authorization: str | None) -> str | None:
        """The key's tier, comparing against every key in constant time (no early exit)."""
        given = (authorization or "").removeprefix("Bearer ").strip().encode()
        tier = None
        for k, t in self.config.keys.items():
            if hmac.compare_digest(k.encode(), given):
                tier = t
        return tier

    def _bucket(self, key: str, tier: Tier) -> TokenBucket | None:
        if tier.rps is None:
            return None
        if key not in self._buckets:
            kw = {"clock": self._clock} if self._clock else {}
            self._buckets[key] = TokenBucket(tier.rps, tier.burst, **kw)
        return self._buckets[key]

    def admit(self, authorization: str | None, model: Any,
              in_rotation: Callable[[list[Upstream]], list[Upstream]]) -> Any:
        """``(tier_served, pool)`` or an error response (401, 429, 404, 503)."""
        tier_name = self.tier_of(authorization)
        if tier_name is None:
            return router_error(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                "invalid_api_key")
        tier = self.config.tiers[tier_name]
        bucket = self._bucket(authorization or "", tier)
        wait = bucket.try_take(1.0) if bucket is not None else 0.0
        if wait > 0:
            self.metrics.rate_limited.labels(tier_name).inc()
            resp = router_error(429, f"rate limit of tier {tier_name!r} ({tier.rps:g} "
                                "requests/s per key) reached", "rate_limit_exceeded")
            resp.headers["Retry-After"] = str(max(1, math.ceil(min(wait, 3600))))
            return resp
        if not any(m == model for m, _ in self.config.pools):
            return router_error(404, f"the model {model!r} does not exist; served: "
                                f"{', '.join(self.models)}", "model_not_found")
        for t in [tier_name, *tier.fallback]:
            pool = self.pools.get((model, t))
            if pool and in_rotation(pool):
                if t != tier_name:
                    self.metrics.fallbacks.labels(model, tier_name, t).inc()
                self.metrics.requests.labels(model, t).inc()
                return t, pool
        self.metrics.unavailable.labels(model, tier_name).inc()
        return router_error(503, f"no replica of {model!r} can serve tier {tier_name!r} now "
                            f"(tried tiers {[tier_name, *tier.fallback]})", "no_replica")


def create_gateway_app(config: GatewayConfig, policy: str = "least-outstanding",
                       health: HealthTracker | None = None, backoff: Backoff | None = None,
                       probe_interval_s: float | None = None, probe_timeout_s: float = 1.0,
                       timeout_s: float = 600.0, max_failovers: int = 2,
                       clock: Callable[[], float] | None = None) -> FastAPI:
    """The gateway's app: ``/v1/completions`` and ``/v1/chat/completions`` through
    :meth:`Gateway.admit` and the relay, ``/v1/models``, ``/health``, ``/metrics`` and the
    router's ``/admin`` routes. ``policy`` picks inside each pool (one instance per pool)."""
    metrics = RouterMetrics()
    gw = Gateway(config, GatewayMetrics(metrics.registry), clock)
    ups = gw.upstreams
    by_name = {u.name: u for u in ups}
    health = health or HealthTracker([u.name for u in ups])
    policies = {mt: get_policy(policy) for mt in gw.pools}
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    def in_rotation(pool: Sequence[Upstream]) -> list[Upstream]:
        return [u for u in health.available(pool) if not u.draining]

    relay = Relay(client, health, backoff or Backoff(rng=random.Random(0)), metrics,
                  lambda pool: policies[gw.pool_of[pool[0].name]], in_rotation, ups,
                  max_failovers)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        prober = asyncio.create_task(_probe_loop(client, ups, health, metrics, probe_interval_s,
                                                 probe_timeout_s)) if probe_interval_s else None
        yield
        if prober is not None:
            prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await prober
        await client.aclose()

    app = FastAPI(title="labkit gateway", lifespan=lifespan)
    app.state.gateway, app.state.health, app.state.upstreams = gw, health, ups
    app.state.policy, app.state.model_cards, app.state.failovers = None, {}, relay.failovers
    _add_completion_routes(app, gw, relay, in_rotation)
    _add_status_routes(app, gw, health, metrics, in_rotation)
    add_admin_routes(app, by_name, health, metrics)
    return app


def _add_completion_routes(app: FastAPI, gw: Gateway, relay: Relay,
                           in_rotation: Callable[[Sequence[Upstream]], list[Upstream]]) -> None:
    """The OpenAI routes: each request admitted by the gateway (key, rate, model, pool), then
    relayed inside the pool it was given."""

    async def forward(request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return router_error(400, "request body is not valid JSON", "invalid_json")
        if not isinstance(body, dict):
            return router_error(400, "request body must be a JSON object", "invalid_json")
        got = gw.admit(request.headers.get("authorization"), body.get("model"), in_rotation)
        if isinstance(got, Response):
            return got
        tier, pool = got
        return await _relay(relay, request, path, raw, body, pool, {"x-labkit-tier": tier})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")


def _add_status_routes(app: FastAPI, gw: Gateway, health: HealthTracker, metrics: RouterMetrics,
                       in_rotation: Callable[[Sequence[Upstream]], list[Upstream]]) -> None:
    """What clients, probes and scrapers read: the models served, health, the metrics."""
    ups = gw.upstreams

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                            "owned_by": "labkit"} for m in gw.models]}

    @app.get("/health")
    async def healthz() -> Response:
        return JSONResponse({"replicas": health.states()},
                            status_code=200 if in_rotation(ups) else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain")


async def _relay(relay: Relay, request: Request, path: str, raw: bytes, body: dict[str, Any],
                 pool: list[Upstream], extra: dict[str, str]) -> Response:
    """The router's data path inside ``pool`` (as ``labkit.router.proxy.forward``, no canary).
    The gateway's key is not forwarded: replicas behind a gateway trust the gateway."""
    key, t0 = route_key(body), time.monotonic()
    headers = {k: v for k, v in request.headers.items()
               if k.lower() in ("content-type", "x-request-id")}
    chat = path.endswith("/chat/completions")
    if not body.get("stream"):
        resp = await relay.buffered(request, path, raw, key, headers, pool, None, None, t0)
        resp.headers.update(extra)
        return resp
    state = None if not_resumable(body, chat) else StreamResume(body, chat)
    got = await relay.connect(path, raw if state is None else state.upstream_body(), key,
                              headers, set(), pool)
    if isinstance(got, Response):
        return got
    resp, up = got
    media = resp.headers.get("content-type", "application/json")
    if state is None or resp.status_code != 200 or not media.startswith("text/event-stream"):
        it, status = relay.stream(resp, up), resp.status_code
    else:
        it, status = relay.resumable(state, resp, up, key, headers, pool), 200
    return StreamingResponse(it, status_code=status, media_type=media,
                             headers={"x-labkit-replica": up.name, **extra})


async def _probe_loop(client: httpx.AsyncClient, ups: Sequence[Upstream],
                      health: HealthTracker, metrics: RouterMetrics, interval: float,
                      timeout: float) -> None:
    """``GET /health`` of every replica into its breaker (as the router's probe loop)."""
    while True:
        for u in ups:
            try:
                ok = (await client.get(u.url + "/health", timeout=timeout)).status_code == 200
            except httpx.TransportError:
                ok = False
            if not ok:
                metrics.probe_failures.labels(u.name).inc()
            health.probe(u.name, ok)
            metrics.open.labels(u.name).set(health.breakers[u.name].state != "closed")
        await asyncio.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    """``labkit router --gateway CONFIG.json [--policy P] [--host H] [--port N]``."""
    import argparse

    import uvicorn

    p = argparse.ArgumentParser(prog="labkit router --gateway",
                                description=__doc__.splitlines()[0])
    p.add_argument("--gateway", required=True, metavar="CONFIG.json",
                   help="keys -> tiers, tiers' rate limits and fallbacks, (model, tier) pools")
    p.add_argument("--policy", default="least-outstanding", help="the policy inside a pool")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--probe-interval", type=float, default=1.0, metavar="S")
    args = p.parse_args(argv)
    try:
        with open(args.gateway) as f:
            cfg = GatewayConfig.from_dict(json.load(f))
        app = create_gateway_app(cfg, args.policy, probe_interval_s=args.probe_interval or None)
    except (OSError, ValueError) as e:
        p.error(str(e))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
