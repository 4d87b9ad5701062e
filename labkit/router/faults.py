"""Fault injection in front of a replica: added latency and injected errors, switchable live.

A canary analysis is only trusted once it has been seen to catch a bad build, and "bad" must be
made on purpose: deployments do it with Envoy/Istio's fault filter (``fault.delay``,
``fault.abort``) or Toxiproxy between the router and a service. :class:`FaultInjector` is that
hop for one ``labkit serve`` replica: a tiny reverse proxy that, per request, answers 503 with
probability ``error_rate`` (seeded) or waits ``delay_s`` before forwarding (which lands on TTFT),
and otherwise relays the replica's answer chunk by chunk. The faults can change while traffic
runs (``POST /faults``, or the attributes), which is how a canary that *degrades* is made.

:func:`serve_in_thread` runs any ASGI app (this one, the router) on a loopback port in a
background thread and stops it on exit: tests, benchmarks and notebooks share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


class FaultInjector:
    """``FaultInjector(url, delay_s=0.3).app``: an ASGI app that forwards to ``url``."""

    def __init__(self, url: str, delay_s: float = 0.0, error_rate: float = 0.0,
                 seed: int = 0) -> None:
        self.url = url.rstrip("/")
        self.set(delay_s, error_rate)
        self.rng = random.Random(seed)
        self.injected = {"delayed": 0, "errors": 0, "passed": 0}
        self.app = self._build()

    def set(self, delay_s: float | None = None, error_rate: float | None = None) -> None:
        """Change the faults (None leaves one as it is)."""
        if delay_s is not None:
            if delay_s < 0:
                raise ValueError(f"delay_s must be >= 0, got {delay_s}")
            self.delay_s = float(delay_s)
        if error_rate is not None:
            if not 0.0 <= error_rate <= 1.0:
                raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
            self.error_rate = float(error_rate)

    def _build(self) -> FastAPI:
        client: httpx.AsyncClient | None = None

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            nonlocal client
            client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))
            yield
            await client.aclose()

        app = FastAPI(title="labkit fault injector", lifespan=lifespan)

        @app.post("/faults")
        async def faults(request: Request) -> Response:
            body = await request.json()
            try:
                self.set(body.get("delay_s"), body.get("error_rate"))
            except ValueError as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)
            return JSONResponse({"delay_s": self.delay_s, "error_rate": self.error_rate,
                                 "injected": self.injected})

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(path: str, request: Request) -> Response:
            if request.method == "POST" and self.rng.random() < self.error_rate:
                self.injected["errors"] += 1
                return JSONResponse({"error": {"message": "injected fault", "type":
                                               "fault_injection", "code": "injected"}},
                                    status_code=503)
            if request.method == "POST" and self.delay_s > 0:
                self.injected["delayed"] += 1
                await asyncio.sleep(self.delay_s)
            self.injected["passed"] += 1
            headers = {k: v for k, v in request.headers.items()
                       if k.lower() in ("authorization", "content-type")}
            req = client.build_request(request.method, f"{self.url}/{path}",
                                       content=await request.body(), headers=headers)
            resp = await client.send(req, stream=True)

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()

            return StreamingResponse(chunks(), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"))

        return app


@contextlib.contextmanager
def serve_in_thread(app: Any, startup_timeout: float = 10.0) -> Iterator[str]:
    """``with serve_in_thread(app) as url:``: uvicorn on 127.0.0.1 (a free port) in a daemon
    thread; leaving the block stops it and joins the thread."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    server.install_signal_handlers = lambda: None  # not the main thread
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name=f"labkit-app-{port}")
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"app on port {port} did not start in {startup_timeout} s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
