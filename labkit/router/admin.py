"""The router's operator routes (loopback, no auth: the router is meant to listen on 127.0.0.1).

- ``GET /admin/replicas``: per replica, its URL, requests in flight, draining, breaker state;
- ``POST /admin/replicas/{name}/drain``: out of rotation, the streams it holds finish (a rolling
  update drains before it restarts); ``/undrain``: back, with a fresh closed breaker;
- ``POST /admin/policy``: ``{"policy": NAME, ...keyword arguments}`` switches the policy live
  (a notebook compares policies on one set of replicas without restarting them);
- ``GET /admin/failovers``: one record per stream resumed on another replica.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from labkit.router.health import HealthTracker
from labkit.router.policies import get_policy


def router_error(status: int, message: str, code: str) -> JSONResponse:
    """An OpenAI-shaped error body from the router itself."""
    return JSONResponse({"error": {"message": message, "type": "router_error", "param": None,
                                   "code": code}}, status_code=status)


def _replica(by_name: dict[str, Any], name: str) -> Any:
    """The upstream an operator named, or a 404 listing the names there are (a typo)."""
    if name not in by_name:
        return router_error(404, f"no replica named {name!r}; valid: "
                            f"{', '.join(by_name)}", "unknown_replica")
    return by_name[name]


def add_admin_routes(app: FastAPI, by_name: dict[str, Any], health: HealthTracker,
                     metrics: Any) -> None:
    """The operator's routes on ``app`` over the router's upstreams (``by_name``), breakers
    and metrics."""

    @app.get("/admin/replicas")
    async def replicas() -> list[dict[str, Any]]:
        return [{"name": u.name, "url": u.url, "outstanding": u.outstanding,
                 "draining": u.draining, "breaker": health.add(u.name).state.value}
                for u in by_name.values()]

    @app.post("/admin/replicas/{name}/{action}")
    async def drain(name: str, action: str) -> Response:
        """``drain``: out of rotation (streams in flight finish); ``undrain``: back in, with a
        fresh breaker (the operator says it is back)."""
        u = _replica(by_name, name)
        if isinstance(u, Response):
            return u
        if action not in ("drain", "undrain"):
            return router_error(404, f"unknown action {action!r}: drain or undrain",
                                "not_found")
        u.draining = action == "drain"
        if not u.draining:
            health.reset(name)
            metrics.open.labels(name).set(0)
        metrics.draining.labels(name).set(int(u.draining))
        return JSONResponse({"name": name, "draining": u.draining,
                             "outstanding": u.outstanding})

    @app.post("/admin/policy")
    async def set_policy(request: Request) -> Response:
        try:
            body = dict(await request.json())
            app.state.policy = get_policy(body.pop("policy"), **body)
            if hasattr(app.state.policy, "observe_models"):  # adapter-affinity's base names
                for cards in app.state.model_cards.values():
                    app.state.policy.observe_models(cards)
        except (ValueError, KeyError, TypeError) as exc:
            return router_error(400, f"send {{\"policy\": NAME, its keyword arguments...}}: "
                                f"{exc}", "invalid_policy")
        return JSONResponse({"policy": app.state.policy.name})

    @app.get("/admin/failovers")
    async def failover_log() -> list[dict[str, Any]]:
        return app.state.failovers
