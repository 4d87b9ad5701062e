"""LoRA adapters over HTTP, as vLLM serves them (``labkit serve MODEL --enable-lora
--lora-modules sql=PATH code=PATH``).

- A request's ``model`` field names the base model or an adapter: ``"model": "sql"`` runs the
  request through adapter ``sql`` (the response's ``model`` says ``sql``); an unknown name stays
  a 404. :meth:`LoRARegistry.resolve` turns the name into the engine's ``LoRARequest``.
- ``GET /v1/models`` lists every adapter after the base model, with ``"parent"`` = the base
  model's name and ``"root"`` = the adapter's folder (vLLM's cards).
- ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` adds an adapter at run time: the
  engine core loads and checks it (``Executor.add_lora``, between two steps) before the name is
  served, so a bad folder is a 400 naming what is wrong (rank above ``--max-lora-rank``, a
  module the model lacks, shapes of another model) and a name already served is a 400.
- ``POST /v1/unload_lora_adapter {"lora_name"}`` removes one (``Executor.remove_lora``: its slot
  and CPU copy). **An adapter that requests still use is refused with 409** (how many use it is
  in the message), never pulled from under them: the server counts each adapter's requests from
  admission to their last output (the counter is also ``labkit:lora_requests_running``), and
  the engine core checks again that no live request names it before removing. Refusing rather
  than waiting keeps the endpoint's answer immediate; a client retries after its requests end.

Every adapter gets a fresh ``lora_int_id`` (1, 2, ... in load order), also when a name is
unloaded and loaded again: the prefix cache keys KV blocks by that id, so reusing an id for
another folder could hand one adapter's cached KV to another.

Metrics (``/metrics``, read from the engine's stats after every step): adapters resident in
slots and the slot count, slot loads and evictions, disk loads and CPU-cache evictions
(:class:`~labkit.lora.manager.LoRAManager`'s counters), adapters served, and running requests
per adapter.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from labkit.errors import LoRAError
from labkit.lora.request import LoRARequest
from labkit.serve.metrics import P
from labkit.serve.protocol import APIError, bad, parse_json


class LoRAInUseError(LoRAError):
    """An unload named an adapter that live requests still use."""


def engine_add_lora(req: LoRARequest, engine: Any) -> None:
    """In the engine core: load and check the adapter (picklable, for an engine process)."""
    engine.executor.add_lora(req)


def engine_remove_lora(lora_int_id: int, engine: Any) -> bool:
    """In the engine core: remove the adapter unless a live request still uses it."""
    users = [r.request_id for r in engine.requests.values()
             if r.lora_int_id == lora_int_id and not r.is_finished]
    if users:
        raise LoRAInUseError(f"{len(users)} live request(s) use it")
    return engine.executor.remove_lora(lora_int_id)


class LoRARegistry:
    """The adapters a server serves, by name, and how many requests use each."""

    def __init__(self, llm: Any, base_name: str, modules: dict[str, str] | None = None) -> None:
        self.llm, self.base_name = llm, base_name
        self.modules = dict(modules or {})  # --lora-modules, loaded when the server starts
        self.adapters: dict[str, LoRARequest] = {}
        self.running: Counter[str] = Counter()
        self._reserved: set[str] = set()  # names being loaded right now
        self._ids = itertools.count(1)

    async def load_modules(self) -> None:
        """Load ``--lora-modules`` (the server's lifespan start; a bad one stops the start)."""
        for name, path in self.modules.items():
            try:
                await self.load(name, path)
            except APIError as e:
                raise LoRAError(f"--lora-modules {name}={path}: {e.message}") from None

    def resolve(self, model: Any) -> LoRARequest | None:
        """The adapter a request's ``model`` field names, or None (base model or unknown)."""
        return self.adapters.get(model) if isinstance(model, str) else None

    async def load(self, name: Any, path: Any) -> LoRARequest:
        if not isinstance(name, str) or not name:
            raise bad(f"lora_name must be a non-empty string, got {name!r}", "lora_name")
        if not isinstance(path, str) or not path:
            raise bad(f"lora_path must be a non-empty string, got {path!r}", "lora_path")
        if name == self.base_name or name in self.adapters or name in self._reserved:
            raise bad(f"the name {name!r} is already served (the base model or a loaded "
                      "adapter); unload it first or pick another name", "lora_name")
        req = LoRARequest(name, next(self._ids), path)
        self._reserved.add(name)
        try:
            await self.llm.call(functools.partial(engine_add_lora, req))
        except LoRAError as e:
            raise bad(f"cannot load LoRA adapter {name!r}: {e}", "lora_path",
                      "invalid_lora_adapter") from None
        finally:
            self._reserved.discard(name)
        self.adapters[name] = req
        return req

    async def unload(self, name: Any) -> None:
        req = self.resolve(name)
        if req is None:
            raise APIError(404, f"the LoRA adapter {name!r} is not loaded", param="lora_name",
                           code="lora_not_found")
        if self.running[name]:
            raise _in_use(name, f"{self.running[name]} request(s) use it")
        del self.adapters[name]  # no new request resolves it from here on
        try:
            await self.llm.call(functools.partial(engine_remove_lora, req.lora_int_id))
        except LoRAInUseError as e:
            self.adapters[name] = req
            raise _in_use(name, str(e)) from None

    def started(self, req: LoRARequest | None) -> None:
        if req is not None:
            self.running[req.lora_name] += 1

    def finished(self, req: LoRARequest | None) -> None:
        if req is not None:
            self.running[req.lora_name] -= 1
            if not self.running[req.lora_name]:
                del self.running[req.lora_name]

    def cards(self, max_model_len: int | None) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters (vLLM's: ``parent`` = the base model)."""
        return [{"id": name, "object": "model", "created": 0, "owned_by": "labkit",
                 "root": str(r.lora_path), "parent": self.base_name,
                 "max_model_len": max_model_len} for name, r in self.adapters.items()]

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        s, model = self.llm.stats, [self.base_name]
        for name, doc, v in (
                ("lora_slots_used", "Adapters resident in the device slots",
                 s.get("lora_resident", 0)),
                ("lora_slots_total", "Device slots for adapters (--max-loras)",
                 s.get("lora_num_slots", 0)),
                ("lora_adapters_served", "Adapter names the server serves", len(self.adapters))):
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            g.add_metric(model, float(v))
            yield g
        for key, doc in (("slot_loads", "Adapters copied into a device slot"),
                         ("slot_evictions", "Adapters evicted from a device slot (LRU)"),
                         ("disk_loads", "Adapters read from disk into the CPU cache"),
                         ("cpu_evictions", "Adapters evicted from the CPU cache (LRU)")):
            c = CounterMetricFamily(P + "lora_" + key, doc, labels=["model_name"])
            c.add_metric(model, float(s.get("lora_" + key, 0)))
            yield c
        g = GaugeMetricFamily(P + "lora_requests_running", "Requests admitted and not yet "
                              "finished, per adapter", labels=["model_name", "lora_name"])
        for name in self.adapters:
            g.add_metric([self.base_name, name], float(self.running.get(name, 0)))
        yield g


def _in_use(name: str, why: str) -> APIError:
    return APIError(409, f"the LoRA adapter {name!r} is in use ({why}); unload it after they "
                    "finish", param="lora_name", code="lora_in_use")


def install_lora_routes(app: FastAPI, registry: LoRARegistry) -> None:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (under ``/v1``, so
    ``--api-key`` guards them like every other ``/v1`` route)."""

    async def body(request: Request) -> dict[str, Any]:
        return parse_json(await request.body())

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        try:
            d = await body(request)
            req = await registry.load(d.get("lora_name"), d.get("lora_path"))
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        try:
            d = await body(request)
            await registry.unload(d.get("lora_name"))
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return PlainTextResponse(f"Success: LoRA adapter '{d['lora_name']}' removed "
                                 "successfully.")
