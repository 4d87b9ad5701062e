"""Blue/green weight rollouts through the router against FAKE replicas that serve a weight
version and accept ``POST /v1/admin/update_weights`` (a real replica's route is tested in
tests/serve/test_weight_update_serve.py): a stream in flight at the flip finishes on the old
set, new requests go to the new one, a refused update leaves traffic where it was, rollback."""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from labkit.router.blue_green import BlueGreen, RolloutError, RouterAdmin, rolling_weight_update
from labkit.router.faults import serve_in_thread as serve
from labkit.router.proxy import create_app


def weights_replica(name):
    app = FastAPI()
    app.state.version, app.state.gate = "v1", threading.Event()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        served_by = f"{name}@{app.state.version}"
        if not body.get("stream"):
            return {"object": "text_completion", "model": served_by, "choices": []}

        async def events():
            yield f"data: {json.dumps({'model': served_by})}\n\n".encode()
            while not app.state.gate.is_set():
                await asyncio.sleep(0.01)
            yield f"data: {json.dumps({'model': served_by, 'last': True})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/admin/update_weights")
    async def update(request: Request):
        body = await request.json()
        if body["path"] == "bad":
            return JSONResponse({"error": {"message": "tensor 'x' has shape (3,)", "type":
                                           "invalid_request_error", "param": "path",
                                           "code": "invalid_weights"}}, status_code=400)
        prev, app.state.version = app.state.version, body["version"]
        return {"version": body["version"], "previous_version": prev, "num_recomputed": 0,
                "pause_ms": 1.0}

    @app.get("/health")
    async def health():
        return {}

    return app


@pytest.fixture
def fleet():
    apps = [weights_replica(f"r{i}") for i in range(4)]
    with serve(apps[0]) as u0, serve(apps[1]) as u1, serve(apps[2]) as u2, \
            serve(apps[3]) as u3, serve(create_app([u0, u1, u2, u3], "round-robin")) as router:
        yield apps, router


def models(router, n=8):
    with httpx.Client(timeout=10) as c:
        return {c.post(router + "/v1/completions", json={"prompt": f"p{i}"}).json()["model"]
                for i in range(n)}


def stream(router):
    with httpx.Client(timeout=30) as c, c.stream(
            "POST", router + "/v1/completions", json={"prompt": "s", "stream": True}) as r:
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


def test_flip_waits_for_in_flight_streams_and_rolls_back(fleet):
    apps, router = fleet
    admin = RouterAdmin(router)
    bg = BlueGreen(admin, ["replica-0", "replica-1"], ["replica-2", "replica-3"])
    bg.start()
    assert models(router) == {"r0@v1", "r1@v1"}
    assert [u["version"] for u in bg.update_standby("ckpt", "v2")] == ["v2", "v2"]
    assert models(router) == {"r0@v1", "r1@v1"}  # the standby set is still out of rotation
    pool = ThreadPoolExecutor(1)
    held = pool.submit(stream, router)  # in flight on blue, held open by its gate
    while not any(r["outstanding"] for r in admin.replicas().values()):
        time.sleep(0.01)
    with ThreadPoolExecutor(1) as pool2:
        flip = pool2.submit(bg.flip, 10.0)
        with pytest.raises(TimeoutError):
            flip.result(0.3)  # the flip waits for the blue stream to finish
        assert models(router) == {"r2@v2", "r3@v2"}  # but new traffic already goes to green
        for a in apps:
            a.state.gate.set()
        rec = flip.result(10)
        events = held.result(10)
    pool.shutdown()
    assert rec["live"] == ["replica-2", "replica-3"] and rec["drain_s"] > 0.2
    assert len(events) == 2 and events[0]["model"] == events[1]["model"] \
        and events[0]["model"].endswith("@v1")  # finished, whole, on the old weights
    bg.rollback(10.0)
    assert models(router) == {"r0@v1", "r1@v1"}


def test_refused_update_stops_the_rollout_and_traffic_stays(fleet):
    _, router = fleet
    bg = BlueGreen(RouterAdmin(router), ["replica-0"], ["replica-1"])
    bg.start()
    with pytest.raises(RolloutError, match="replica-1 refused the weights .*has shape"):
        bg.update_standby("bad", "v2")
    served = models(router)
    assert "r0@v1" in served and not any(m.startswith("r1@") for m in served)
    with pytest.raises(RolloutError, match="nothing to roll back"):
        bg.rollback()
    with pytest.raises(ValueError, match="disjoint"):
        BlueGreen(RouterAdmin(router), ["replica-0"], ["replica-0"])
    with pytest.raises(ValueError, match="unknown replicas"):
        BlueGreen(RouterAdmin(router), ["replica-0"], ["nope"])


def test_rolling_update_one_replica_at_a_time(fleet):
    _, router = fleet
    admin = RouterAdmin(router)
    out = rolling_weight_update(admin, ["replica-0", "replica-1", "replica-2", "replica-3"],
                                "ckpt", "v2")
    assert [o["previous_version"] for o in out] == ["v1"] * 4
    assert models(router) == {f"r{i}@v2" for i in range(4)}
    assert not any(r["draining"] for r in admin.replicas().values())
    with pytest.raises(RolloutError, match="replica-0 refused"):
        rolling_weight_update(admin, ["replica-0", "replica-1"], "bad", "v3")
    assert admin.replicas()["replica-0"]["draining"]  # left out of rotation, said so
    assert models(router) == {f"r{i}@v2" for i in (1, 2, 3)}
