"""Hot weight updates over HTTP (``labkit serve``'s admin routes, under ``/v1`` so ``--api-key``
guards them like every other ``/v1`` route).

- ``POST /v1/admin/update_weights {"path": FOLDER, "version": "v2"}``: the engine core reads
  the checkpoint folder and swaps the weights in between two steps
  (:meth:`labkit.engine.llm_engine.LLMEngine.update_weights`): checked first, so a folder of
  another model (a missing tensor, another shape) is a 400 with an OpenAI error body
  (``code: "invalid_weights"``) and the old weights keep serving; a version already used is a
  400 too. Requests in flight are not lost: they are recomputed under the new weights and
  continue (the rule, and why, in :mod:`labkit.engine.weight_update`). The answer is
  ``{"version", "previous_version", "num_recomputed", "pause_ms"}``: ``pause_ms`` is how long
  the engine loop stood still (read + check + copy + requeue), no step runs meanwhile.
- ``GET /v1/admin/weights``: ``{"version"}``, the version serving now (null before any update).

The prefix cache is keyed by the version, so nothing computed before the swap is reused after.
A router that must not mix versions inside one answer drains the replica first
(:mod:`labkit.router.blue_green`).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from labkit.errors import WeightUpdateError
from labkit.serve.protocol import APIError, bad, parse_json


def engine_update_weights(path: str, version: str, engine: Any) -> dict[str, Any]:
    """In the engine core, between two steps (picklable, for an engine process)."""
    t0 = time.perf_counter()
    info = engine.update_weights(path, version)
    return {**info, "pause_ms": 1e3 * (time.perf_counter() - t0)}


def engine_weight_version(engine: Any) -> str | None:
    return engine.block_manager.weight_version


async def update_weights(llm: Any, body: dict[str, Any]) -> dict[str, Any]:
    """Check the body's fields, then run the update in the engine core; APIError on bad input."""
    path, version = body.get("path"), body.get("version")
    if not isinstance(path, str) or not path:
        raise bad(f"path must be a checkpoint folder (a non-empty string), got {path!r}", "path")
    if not isinstance(version, str) or not version:
        raise bad(f"version must be a non-empty string, got {version!r}", "version")
    try:
        return await llm.call(functools.partial(engine_update_weights, path, version))
    except WeightUpdateError as e:
        param = "version" if "already used" in str(e) else "path"
        raise bad(f"weights not updated, the old ones keep serving: {e}", param,
                  "invalid_weights") from None


def install_weight_routes(app: FastAPI, llm: Any) -> None:
    """``/v1/admin/update_weights`` and ``/v1/admin/weights`` on ``app``."""

    @app.post("/v1/admin/update_weights")
    async def update(request: Request) -> Response:
        try:
            info = await update_weights(llm, parse_json(await request.body()))
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse(info)

    @app.get("/v1/admin/weights")
    async def weights() -> dict[str, Any]:
        return {"version": await llm.call(engine_weight_version)}
