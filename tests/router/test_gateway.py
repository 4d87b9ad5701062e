"""The model gateway (labkit.router.gateway) against FAKE replicas: routing by model and key
tier, per-tier rate limits (429), fallback to another tier when a pool's breakers are open
(counted in /metrics), 503 when nothing can serve, and the config's named errors."""

import json
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from labkit.router.faults import serve_in_thread as serve
from labkit.router.gateway import GatewayConfig, GatewayConfigError, create_gateway_app
from labkit.router.health import Backoff, HealthTracker

PREMIUM, STANDARD = {"authorization": "Bearer sk-alice"}, {"authorization": "Bearer sk-bob"}


def replica(name):
    app = FastAPI()
    app.state.status, app.state.seen = 200, []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.seen.append(request.headers.get("authorization"))
        if app.state.status != 200:
            return JSONResponse({"error": {"message": "down"}}, status_code=app.state.status)
        if body.get("stream"):
            async def events():
                yield f"data: {json.dumps({'replica': name})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"object": "text_completion", "model": name, "choices": []}

    @app.get("/health")
    async def health():
        return JSONResponse({}, status_code=app.state.status)

    return app


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def config(urls):
    return GatewayConfig.from_dict({
        "keys": {"sk-alice": "premium", "sk-bob": "standard"},
        "tiers": {"premium": {"rps": 100, "fallback": ["standard"]},
                  "standard": {"rps": 1, "burst": 2}},
        "pools": {"tiny": {"premium": [urls["fp32-a"], urls["fp32-b"]],
                           "standard": [urls["int8"]]},
                  "other": {"standard": [urls["other"]]}}})


@pytest.fixture
def gateway():
    names = ["fp32-a", "fp32-b", "int8", "other"]
    apps = {n: replica(n) for n in names}
    clock = Clock()
    with serve(apps["fp32-a"]) as a, serve(apps["fp32-b"]) as b, serve(apps["int8"]) as c, \
            serve(apps["other"]) as d:
        urls = dict(zip(names, (a, b, c, d)))
        app = create_gateway_app(config(urls), "round-robin", probe_interval_s=0.05,
                                 health=HealthTracker(failure_threshold=1, recovery_s=60),
                                 backoff=Backoff(0.001, 0.01, max_retries=1), clock=clock)
        with serve(app) as url, httpx.Client(base_url=url, timeout=10) as client:
            yield apps, client, clock


def post(client, headers, model="tiny", **kw):
    return client.post("/v1/completions", headers=headers,
                       json={"model": model, "prompt": "x", **kw})


def metric(client, name, **labels):
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def error(r, status, code):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and "type" in err and "param" in err
    return err


def _wait(pred, timeout=10.0):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_routes_by_model_and_key_tier(gateway):
    apps, client, clock = gateway
    got = {post(client, PREMIUM).json()["model"] for _ in range(4)}
    assert got == {"fp32-a", "fp32-b"}  # premium: the fp32 pool, round robin inside it
    r = post(client, STANDARD)
    assert r.json()["model"] == "int8" and r.headers["x-labkit-tier"] == "standard"
    clock.t += 10
    assert post(client, STANDARD, model="other").json()["model"] == "other"
    assert apps["int8"].state.seen == [None]  # the gateway's key is not forwarded
    with client.stream("POST", "/v1/completions", headers=PREMIUM,
                       json={"model": "tiny", "prompt": "x", "stream": True}) as r:
        lines = [x for x in r.iter_lines() if x]
    assert json.loads(lines[0][6:])["replica"].startswith("fp32") and lines[-1].endswith("[DONE]")
    error(post(client, PREMIUM, model="gpt-9"), 404, "model_not_found")
    error(post(client, {}), 401, "invalid_api_key")
    error(post(client, {"authorization": "Bearer sk-alicf"}), 401, "invalid_api_key")
    assert metric(client, "labkit_gateway_requests_total", model="tiny", tier="premium") == 5
    assert client.get("/v1/models").json()["data"][0]["id"] == "other"


def test_per_tier_rate_limits(gateway):
    _, client, clock = gateway
    assert post(client, STANDARD).status_code == post(client, STANDARD).status_code == 200
    r = post(client, STANDARD)  # burst 2 at 1 request/s
    error(r, 429, "rate_limit_exceeded")
    assert r.headers["retry-after"] == "1"
    assert all(post(client, PREMIUM).status_code == 200 for _ in range(5))  # its own bucket
    clock.t += 1.0
    assert post(client, STANDARD).status_code == 200
    assert metric(client, "labkit_gateway_rate_limited_total", tier="standard") == 1
    assert metric(client, "labkit_gateway_rate_limited_total", tier="premium") == 0


def test_fallback_to_another_tier_then_503(gateway):
    apps, client, clock = gateway
    for n in ("fp32-a", "fp32-b"):
        apps[n].state.status = 503  # the probes open both premium breakers

    def states():
        return {r["name"]: r["breaker"] for r in client.get("/admin/replicas").json()}

    _wait(lambda: states()["tiny/premium-0"] == states()["tiny/premium-1"] == "open")
    r = post(client, PREMIUM)
    assert r.status_code == 200 and r.json()["model"] == "int8"
    assert r.headers["x-labkit-tier"] == "standard"
    assert metric(client, "labkit_gateway_fallbacks_total", model="tiny", from_tier="premium",
                  to_tier="standard") == 1
    apps["int8"].state.status = 503
    _wait(lambda: states()["tiny/standard-0"] == "open")
    err = error(post(client, PREMIUM), 503, "no_replica")
    assert "premium" in err["message"] and "standard" in err["message"]
    error(post(client, STANDARD), 503, "no_replica")  # standard has no fallback
    assert metric(client, "labkit_gateway_unavailable_total", model="tiny", tier="premium") == 1
    assert client.get("/health").status_code == 200  # "other" still serves


@pytest.mark.parametrize("patch,words", [
    ({"keys": {"k": "gold"}}, "names tier 'gold'"),
    ({"tiers": {"premium": {"rps": 0}}}, "rps must be a positive number"),
    ({"tiers": {"premium": {"fallback": ["premium"]}}}, "are not other tiers"),
    ({"tiers": {"premium": {"rate": 1}}}, "unknown fields"),
    ({"pools": {"tiny": {"premium": []}}}, "non-empty list"),
    ({"pools": {"tiny": {"gold": ["http://x"]}}}, "unknown tier 'gold'"),
    ({"pools": {}}, "at least one"),
])
def test_config_errors_are_named(patch, words):
    d = {"keys": {"k": "premium"}, "tiers": {"premium": {}},
         "pools": {"tiny": {"premium": ["http://127.0.0.1:1"]}}}
    with pytest.raises(GatewayConfigError, match=words):
        GatewayConfig.from_dict({**d, **patch})
    with pytest.raises(GatewayConfigError, match="needs 'keys'"):
        GatewayConfig.from_dict({"keys": {}})


def test_cli_refuses_a_bad_config_by_name(tmp_path, capsys):
    from labkit.router.proxy import main

    bad = tmp_path / "gw.json"
    bad.write_text(json.dumps({"keys": {"k": "gold"}, "tiers": {}, "pools": {}}))
    with pytest.raises(SystemExit) as e:
        main(["--gateway", str(bad)])  # labkit router --gateway hands over to the gateway
    assert e.value.code == 2 and "names tier 'gold'" in capsys.readouterr().err
