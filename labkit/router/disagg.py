"""The disaggregated-serving proxy: prompt on a prefill instance, decoding on a decode instance.

    labkit router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000

Each completion or chat request makes two hops (vLLM's disaggregated proxy, SGLang's mini load
balancer with ``--pd-disaggregation``):

1. **prefill**: the body goes to a prefill instance (``labkit serve --kv-role prefill``) with
   ``max_tokens`` 1, not streamed, and ``kv_transfer_params`` naming the chosen decode
   instance's KV port. That instance computes the prompt's KV and, before it answers, pushes the
   full blocks to the decode instance and waits for the acknowledgement
   (:mod:`labkit.kv.connector.p2p`);
2. **decode**: the original body goes to the decode instance (``--kv-role decode``), whose
   scheduler finds the pushed blocks by their prefix hashes and computes only the rest; its
   answer (streamed or not) is the client's.

Faults end cleanly: a prefill instance that is down or fails (5xx, connection refused, timeout)
is skipped and the decode instance computes the prompt itself (slower, same tokens); a 4xx from
it is the client's error and is returned as is. A decode instance that cannot be reached is
tried after the next one; with none left the client gets a 503 with an OpenAI error body. The
counters at ``GET /admin/pd`` say how often each happened.

Decode instances are found by their ``/v1/models`` card: ``labkit.kv_role == "decode"`` and
``labkit.kv_transfer_port``; the KV host is the URL's host.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import urlparse

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from labkit.router.admin import router_error


class PDProxy:
    """Round-robin over prefill instances and over decode instances (see the module doc)."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str],
                 timeout_s: float = 600.0) -> None:
        if not prefill or not decode:
            raise ValueError("disaggregated serving needs --prefill URL and --decode URL")
        self.prefill, self.decode = list(prefill), list(decode)
        self._p, self._d = itertools.cycle(self.prefill), itertools.cycle(self.decode)
        self.client = httpx.AsyncClient(timeout=timeout_s)
        self.kv_addr: dict[str, tuple[str, int]] = {}
        self.counts = {"requests": 0, "prefilled": 0, "prefill_failed": 0,
                       "decode_failed": 0, "refused": 0}

    async def kv_address(self, url: str) -> tuple[str, int]:
        """The decode instance's KV receiver, from its model card (cached)."""
        if url not in self.kv_addr:
            r = await self.client.get(url + "/v1/models", timeout=5.0)
            card = r.json()["data"][0].get("labkit", {})
            if card.get("kv_role") != "decode" or not card.get("kv_transfer_port"):
                raise ValueError(f"{url} is not a --kv-role decode instance (its card: {card})")
            self.kv_addr[url] = (urlparse(url).hostname or "127.0.0.1",
                                 int(card["kv_transfer_port"]))
        return self.kv_addr[url]

    async def run_prefill(self, path: str, body: dict[str, Any], decode_url: str,
                          headers: dict[str, str]) -> Response | None:
        """Hop 1. Returns an error response to give the client (a 4xx), else None (done, or
        failed in a way the decode instance absorbs by computing the prompt itself)."""
        host, port = await self.kv_address(decode_url)
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pre.update(max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "remote_host": host, "remote_port": port})
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        url = next(self._p)
        try:
            r = await self.client.post(url + path, json=pre, headers=headers)
        except httpx.HTTPError:
            self.counts["prefill_failed"] += 1
            return None
        if 400 <= r.status_code < 500:
            self.counts["refused"] += 1
            return Response(r.content, r.status_code, media_type="application/json")
        self.counts["prefilled" if r.status_code == 200 else "prefill_failed"] += 1
        return None

    async def handle(self, request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return router_error(400, f"the body must be a JSON object ({e})", "invalid_json")
        self.counts["requests"] += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for _ in range(len(self.decode)):
            decode_url = next(self._d)
            try:
                early = await self.run_prefill(path, body, decode_url, headers)
                if early is not None:
                    return early
                return await self._decode(decode_url + path, body, headers)
            except (httpx.HTTPError, ValueError, KeyError):
                self.counts["decode_failed"] += 1
        return router_error(503, "no decode instance could take the request",
                            "no_decode_instance")

    async def _decode(self, url: str, body: dict[str, Any], headers: dict[str, str]
                      ) -> Response:
        """Hop 2: the client's answer, streamed as it comes when it asked for a stream."""
        req = self.client.build_request("POST", url, json=body, headers=headers)
        resp = await self.client.send(req, stream=True)
        if not body.get("stream"):
            content = await resp.aread()
            await resp.aclose()
            return Response(content, resp.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), resp.status_code, media_type="text/event-stream")


def create_pd_app(prefill: Sequence[str], decode: Sequence[str],
                  timeout_s: float = 600.0) -> FastAPI:
    """The proxy as a FastAPI app (``/v1/completions``, ``/v1/chat/completions``,
    ``/health``, ``GET /admin/pd``)."""
    proxy = PDProxy(prefill, decode, timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.client.aclose()

    app = FastAPI(lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/admin/pd")
    async def pd_state() -> JSONResponse:
        return JSONResponse({"prefill": proxy.prefill, "decode": proxy.decode,
                             "kv_addresses": {u: list(a) for u, a in proxy.kv_addr.items()},
                             **proxy.counts})

    return app


def main(argv: list[str] | None = None) -> int:
    """``labkit router --prefill URL... --decode URL... [--host H] [--port P]``."""
    import argparse

    import uvicorn

    p = argparse.ArgumentParser(prog="labkit router (prefill/decode)",
                                description=__doc__.splitlines()[0])
    p.add_argument("--prefill", action="append", required=True, metavar="URL")
    p.add_argument("--decode", action="append", required=True, metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, metavar="S")
    args = p.parse_args(argv)
    app = create_pd_app(args.prefill, args.decode, args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
