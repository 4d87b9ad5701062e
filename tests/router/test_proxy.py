"""The router's reverse proxy against FAKE replicas: a tiny in-test FastAPI app that answers
OpenAI-shaped JSON and streams SSE under the test's control. Real ``labkit serve`` replicas are
not used here (that test comes when the serve branch is merged)."""

import asyncio
import json
import socket
import threading

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from labkit.router.faults import serve_in_thread as serve
from labkit.router.health import Backoff, HealthTracker
from labkit.router.proxy import create_app


class FakeReplica:
    """An in-test stand-in for an OpenAI server: streams ``n`` SSE chunks, the second one only
    after ``release`` is set; records prompts it saw and whether a stream was cut off."""

    def __init__(self, name, status=200):
        self.name, self.status = name, status
        self.prompts = []
        self.release = threading.Event()
        self.disconnected = threading.Event()
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.prompts.append(body.get("prompt"))
            if self.status != 200:
                return JSONResponse({"error": {"message": "down"}}, status_code=self.status)
            if not body.get("stream"):
                return {"object": "text_completion", "model": self.name,
                        "choices": [{"index": 0, "text": f"hi from {self.name}"}]}
            return StreamingResponse(self._events(body.get("n_chunks", 5)),
                                     media_type="text/event-stream")

        self.app = app

    async def _events(self, n):
        try:
            for i in range(n):
                if i == 1:
                    while not self.release.is_set():
                        await asyncio.sleep(0.01)
                yield f"data: {json.dumps({'i': i, 'replica': self.name})}\n\n".encode()
                await asyncio.sleep(0.01)
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.disconnected.set()
            raise


def free_port_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here: connection refused
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def fakes():
    a, b = FakeReplica("a"), FakeReplica("b")
    with serve(a.app) as ua, serve(b.app) as ub:
        yield (a, ua), (b, ub)


def test_sse_is_relayed_chunk_by_chunk(fakes):
    (a, ua), _ = fakes
    with serve(create_app([ua])) as router:
        with httpx.Client(timeout=10) as c, c.stream(
                "POST", router + "/v1/completions",
                json={"prompt": "x", "stream": True, "n_chunks": 4}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            # the replica holds chunk 2 until released: we got chunk 1 before it was sent
            assert json.loads(first[len("data: "):])["i"] == 0 and not a.release.is_set()
            a.release.set()
            rest = [line for line in lines if line]
    assert [json.loads(x[6:])["i"] for x in rest[:-1]] == [1, 2, 3] and rest[-1] == "data: [DONE]"


def test_client_disconnect_reaches_the_replica(fakes):
    (a, ua), _ = fakes
    with serve(create_app([ua])) as router:
        with httpx.Client(timeout=10) as c, c.stream(
                "POST", router + "/v1/completions",
                json={"prompt": "x", "stream": True, "n_chunks": 1000}) as r:
            next(line for line in r.iter_lines() if line)
            a.release.set()
        assert a.disconnected.wait(10), "the replica kept streaming after the client left"


def test_round_robin_and_prefix_affinity(fakes):
    (a, ua), (b, ub) = fakes
    with serve(create_app([ua, ub], "round-robin")) as router, httpx.Client(timeout=10) as c:
        got = [c.post(router + "/v1/completions", json={"prompt": f"p{i}"}).json()["model"]
               for i in range(4)]
        assert got == ["a", "b", "a", "b"]
    system = "You are a terse assistant for the billing team. " * 4
    with serve(create_app([ua, ub], "prefix-affinity")) as router, httpx.Client(timeout=10) as c:
        got = {c.post(router + "/v1/completions",
                      json={"prompt": system + f"question {i}"}).json()["model"]
               for i in range(6)}
        assert len(got) == 1  # one system prompt, one replica


def test_failures_before_the_first_byte_go_elsewhere_and_open_the_breaker(fakes):
    (a, ua), (b, ub) = fakes
    a.status = 503
    health = HealthTracker(["replica-0", "replica-1", "replica-2"], failure_threshold=2,
                           recovery_s=60)
    app = create_app([ua, free_port_url(), ub], "round-robin", health=health,
                     backoff=Backoff(0.001, 0.01, max_retries=3))
    with serve(app) as router, httpx.Client(timeout=10) as c:
        for i in range(6):
            r = c.post(router + "/v1/completions", json={"prompt": f"q{i}"})
            assert r.status_code == 200 and r.json()["model"] == "b"
        assert health.states() == {"replica-0": "open", "replica-1": "open",
                                   "replica-2": "closed"}
        tried_a = len(a.prompts)
        c.post(router + "/v1/completions", json={"prompt": "again"})
        assert len(a.prompts) == tried_a  # open breaker: not even tried
        fams = {f.name: f for f in text_string_to_metric_families(c.get(router + "/metrics").text)}
        fails = {s.labels["replica"]: s.value for s in fams["labkit_router_failures"].samples
                 if s.name.endswith("_total")}
        assert fails["replica-0"] == 2 and fails["replica-1"] == 2 and "replica-2" not in fails
        assert c.get(router + "/health").status_code == 200


def test_all_replicas_down_is_a_named_error():
    app = create_app([free_port_url()], backoff=Backoff(0.001, 0.01, max_retries=1),
                     health=HealthTracker(failure_threshold=10))
    with serve(app) as router, httpx.Client(timeout=10) as c:
        r = c.post(router + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 502 and "before the first byte" in r.json()["error"]["message"]
        assert c.post(router + "/v1/completions", content=b"{").status_code == 400
