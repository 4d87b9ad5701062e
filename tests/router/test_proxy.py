"""The router's reverse proxy against FAKE replicas: a tiny in-test FastAPI app that answers
OpenAI-shaped JSON and streams SSE under the test's control. Real ``labkit serve`` replicas:
tests/router/test_real_replicas.py."""

import asyncio
import json
import socket
import threading
import time

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
        self.die_whole = False  # a non-streamed answer: headers, half a body, then a crash
        self.health_delay = 0.0  # a busy replica: /health answers, but late
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.prompts.append(body.get("prompt"))
            if self.status != 200:
                return JSONResponse({"error": {"message": "down"}}, status_code=self.status)
            if not body.get("stream") and self.die_whole:
                return StreamingResponse(self._half_body(), media_type="application/json")
            if not body.get("stream"):
                return {"object": "text_completion", "model": self.name,
                        "choices": [{"index": 0, "text": f"hi from {self.name}"}]}
            return StreamingResponse(self._events(body.get("n_chunks", 5),
                                                  body.get("die_after")),
                                     media_type="text/event-stream")

        @app.get("/health")
        async def health():
            await asyncio.sleep(self.health_delay)
            return JSONResponse({}, status_code=self.status)

        self.app = app

    async def _half_body(self):
        yield b'{"object": "text_completion", "choices": [{"index": 0, "te'
        await asyncio.sleep(0.05)
        raise RuntimeError("replica crashed while sending a non-streamed answer")

    async def _events(self, n, die_after=None):
        try:
            for i in range(n):
                if i == die_after:
                    raise RuntimeError("replica crashed mid-stream")
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


def _wait(pred, timeout=10.0):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_drain_probes_and_policy_switch(fakes):
    (a, ua), (b, ub) = fakes
    health = HealthTracker(failure_threshold=2, recovery_s=0.2)
    app = create_app([ua, ub], "round-robin", health=health, probe_interval_s=0.05)
    with serve(app) as router, httpx.Client(timeout=10) as c:
        def models(n):
            return [c.post(router + "/v1/completions", json={"prompt": f"p{i}"}).json()["model"]
                    for i in range(n)]

        assert c.post(router + "/admin/replicas/replica-0/drain").json()["draining"]
        assert models(4) == ["b"] * 4  # out of rotation
        c.post(router + "/admin/replicas/replica-0/undrain")
        assert sorted(models(4)) == ["a", "a", "b", "b"]
        a.status = 503  # its /health fails: the probes open its breaker, no client involved
        sent = len(a.prompts)

        def breaker():
            return c.get(router + "/admin/replicas").json()[0]["breaker"]

        _wait(lambda: breaker() == "open")
        assert len(a.prompts) == sent and models(3) == ["b"] * 3
        a.status = 200  # back: after recovery_s a probe is the half-open trial and closes it
        _wait(lambda: breaker() == "closed")
        assert c.post(router + "/admin/replicas/nope/drain").status_code == 404
        assert c.post(router + "/admin/policy", json={"policy": "nope"}).status_code == 400
        assert c.post(router + "/admin/policy",
                      json={"policy": "prefix-affinity"}).json()["policy"] == "prefix-affinity"
        assert app.state.policy.name == "prefix-affinity"
        r = c.post(router + "/admin/policy", json={"policy": "prefix-affinity", "min_load": 3})
        assert r.status_code == 200 and app.state.policy.min_load == 3
        r = c.post(router + "/admin/policy", json={"policy": "round-robin", "min_load": 3})
        assert r.status_code == 400  # round-robin takes no min_load: named, not ignored


def test_a_stream_cut_without_prompt_ids_ends_with_an_error_event_not_a_replay(fakes):
    (a, ua), (b, ub) = fakes
    a.release.set()
    with serve(create_app([ua, ub], "round-robin")) as router, httpx.Client(timeout=10) as c:
        r = c.post(router + "/v1/completions",
                   json={"prompt": "x", "stream": True, "n_chunks": 5, "die_after": 2})
        events = [e for e in r.text.split("\n\n") if e]
    assert [json.loads(e[6:]).get("i") for e in events[:2]] == [0, 1]  # what a sent, once
    err = json.loads(events[2][6:])["error"]
    assert err["code"] == "upstream_failed" and "prompt_token_ids" in err["message"]
    assert events[3] == "data: [DONE]" and len(events) == 4
    assert b.prompts == []  # not replayed on b


def test_a_non_streamed_answer_cut_after_its_headers_is_retried_whole(fakes):
    """The router reads a non-streamed answer whole before sending a byte, so a replica that
    dies after its headers costs a retry elsewhere, not a broken response."""
    (a, ua), (b, ub) = fakes
    a.die_whole = True
    with serve(create_app([ua, ub])) as router:  # round-robin: the first request goes to a
        r = httpx.post(router + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi from b"
        assert r.headers["x-labkit-replica"] == "replica-1"
        fo = httpx.get(router + "/admin/failovers", timeout=10).json()
        b.status = 503  # now both fail: the client gets an error, not a cut connection
        r = httpx.post(router + "/v1/completions", json={"prompt": "y"}, timeout=10)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_failed"
    assert a.prompts[0] == "x" and b.prompts[0] == "x"
    assert len(fo) == 1 and fo[0]["whole"] and (fo[0]["from"], fo[0]["to"]) == (
        "replica-0", "replica-1")


@pytest.mark.parametrize("timeout_s,opens", [(1.0, False), (0.1, True)])
def test_a_slow_health_answer_is_not_a_failure_within_the_probe_timeout(fakes, timeout_s,
                                                                        opens):
    """Probes every 0.05 s of a replica that answers /health after 0.3 s: with the default
    1 s probe timeout it stays in rotation; with 0.1 s three late answers open its breaker
    (the timeout is its own setting, not the interval)."""
    (a, ua), _ = fakes
    a.health_delay = 0.3
    health = HealthTracker(failure_threshold=3, recovery_s=30)
    app = create_app([ua], "round-robin", health=health, probe_interval_s=0.05,
                     probe_timeout_s=timeout_s)
    with serve(app) as router, httpx.Client(timeout=10) as c:
        deadline = time.time() + 2.5  # >= 3 probes of either kind
        while time.time() < deadline and health.states().get("replica-0", "closed") == "closed":
            time.sleep(0.05)
        assert (health.states().get("replica-0", "closed") != "closed") == opens
        assert c.get(router + "/admin/replicas").status_code == 200


class DyingReplica:
    """A raw TCP stand-in for a replica killed while it generates: it reads the request, then
    dies at a chosen point of a non-streamed answer's life, the way a SIGKILLed process's
    sockets end. ``rst``: the kernel resets the connection (the process left unread bytes:
    the client reads ECONNRESET, httpx.ReadError); ``fin``: a clean close with no answer
    (httpx.RemoteProtocolError); ``half_headers``: part of a status line, then a reset."""

    def __init__(self, how: str):
        self.how, self.seen = how, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import struct
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed: the test is over
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                self.seen += 1
                if self.how == "half_headers":
                    conn.sendall(b"HTTP/1.1 200 O")
                if self.how in ("rst", "half_headers"):  # SO_LINGER 0: close sends RST
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def close(self):
        self.sock.close()
        self.thread.join(5)


@pytest.mark.parametrize("how", ["rst", "fin", "half_headers"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_dying_before_its_headers_is_retried_however_the_socket_ends(fakes, how,
                                                                               stream):
    """Issue 27: a SIGKILLed replica's in-flight non-streamed requests came back as HTTP 500
    in 1 of 4 runs. The kill lands while the router waits for headers; a reset (ReadError)
    was not retried, only a clean close was. Every way the socket can end is a failure
    before the first byte: retried on the survivor, never a 500."""
    _, (b, ub) = fakes
    b.release.set()
    dying = DyingReplica(how)
    try:
        app = create_app([dying.url, ub], "round-robin",
                         backoff=Backoff(0.001, 0.01, max_retries=3),
                         health=HealthTracker(failure_threshold=10))
        with serve(app) as router, httpx.Client(timeout=10) as c:
            for i in range(2):  # round-robin: at least one of the two starts on the dying one
                r = c.post(router + "/v1/completions",
                           json={"prompt": f"q{i}", "stream": stream, "n_chunks": 2})
                assert r.status_code == 200, (how, r.text)
                if stream:
                    assert r.text.rstrip().endswith("data: [DONE]")
                else:
                    assert r.json()["choices"][0]["text"] == "hi from b"
                assert r.headers["x-labkit-replica"] == "replica-1"
    finally:
        dying.close()
    assert dying.seen >= 1  # the dying replica really got (and lost) a request
