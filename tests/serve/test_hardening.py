"""``labkit serve`` against what third-party clients and raw sockets send (issue 27): lone
surrogates, clients that leave or stall while sending, keys on every ``/v1`` route, counters
that count requests, ``stream_options.continuous_usage_stats`` and unknown fields, and the
``--max-waiting`` split of a burst. Every server here is started and stopped by its test (or
this module), on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import NAME, idle, sse_events

from labkit.engine.llm_engine import LLMEngine
from labkit.serve.api_server import ServeConfig
from labkit.serve.launcher import ServerThread, build_parser


def _server(labkit_tiny, max_num_seqs=16, num_blocks=128, http="auto", **cfg) -> ServerThread:
    m, tok = labkit_tiny
    eng = LLMEngine.from_model(m, tok, block_size=16, num_blocks=num_blocks,
                               max_num_seqs=max_num_seqs)
    return ServerThread(eng, tok, ServeConfig(model_name=NAME, **cfg), http=http)


@pytest.fixture(scope="module")
def server(labkit_tiny):
    with _server(labkit_tiny) as srv:
        yield srv


def metric(srv, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 if none)."""
    text = httpx.get(srv.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def server_log():
    """What the server logs (uvicorn's ``uvicorn.error`` logger, at INFO) during the test."""
    log, h = logging.getLogger("uvicorn.error"), Records()
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(h)
    try:
        yield h.records
    finally:
        log.removeHandler(h)
        log.setLevel(level)


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    """Wait until ``cond()`` holds (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


# ---- 1. lone surrogates are a 400 naming the field ------------------------------------------
SURROGATE = [  # raw JSON: "\ud800" is a valid JSON escape that decodes to no character
    ("completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("completions", b'{"prompt": ["fine", "cut \\ud83d"]}', "prompt[1]"),
    ("completions", b'{"prompt": "x", "stop": ["\\n", "\\udc00"]}', "stop[1]"),
    ("completions", b'{"prompt": "x", "stop": "\\udfff"}', "stop"),
    ("completions", b'{"prompt": "x", "user": "\\ud800"}', "user"),
    ("chat/completions", b'{"messages": [{"role": "system", "content": "hi"}, '
     b'{"role": "user", "content": "\\ud800"}]}', "messages[1].content"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", '
     b'"text": "ok"}, {"type": "text", "text": "\\udbff"}]}]}', "messages[0].content[1].text"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"stop": ["\\ud800"]}', "stop[0]"),
]


@pytest.mark.parametrize("route,body,param", SURROGATE)
def test_lone_surrogate_is_a_400_naming_the_field(server, route, body, param):
    before = metric(server, "labkit:request_errors_total", status="500")
    r = httpx.post(f"{server.url}/v1/{route}", content=body, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_unicode", err
    assert "surrogate" in err["message"] and param in err["message"]
    assert metric(server, "labkit:request_errors_total", status="500") == before


def test_surrogate_pairs_are_whole_characters_and_served(server):
    body = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'  # one emoji, as a pair
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=30)
    assert r.status_code == 200, r.text


# ---- 2. a client gone while its body is read is an abort, not a 500 -------------------------
def _raw_request(path: str, body: bytes, content_length: int | None = None,
                 extra: bytes = b"") -> bytes:
    cl = len(body) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {cl}\r\n").encode() + extra + b"\r\n" + body


def test_client_gone_mid_body_is_an_abort_not_a_500(server, server_log):
    reason = {"reason": "disconnect_reading_body"}
    before = (metric(server, "labkit:request_aborted_total", **reason),
              metric(server, "labkit:request_errors_total"),
              metric(server, "labkit:request_accepted_total"))
    body = json.dumps({"model": NAME, "prompt": "hello", "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(_raw_request("/v1/completions", body, len(body) + 100))
    wait_for(lambda: metric(server, "labkit:request_aborted_total", **reason) == before[0] + 1,
             what="the abort counted")
    assert metric(server, "labkit:request_errors_total") == before[1]  # no 500, no 4xx
    assert metric(server, "labkit:request_accepted_total") == before[2]
    assert not [r for r in server_log if r.exc_info or "Traceback" in r.getMessage()]
    lines = [r.getMessage() for r in server_log if "disconnect" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    # the server goes on serving
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x",
                                                        "max_tokens": 1})
    assert r.status_code == 200


# ---- 3. stalled connections are closed (408 once a request has begun) -----------------------
def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (socket timeout: it never closed)."""
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def _read_response(s: socket.socket) -> bytes:
    """One whole response with a Content-Length (the connection stays open)."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536)
    head, body = out.split(b"\r\n\r\n", 1)
    length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                  if ln.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_stalled_connections_are_closed_within_the_read_timeout(labkit_tiny, http):
    with _server(labkit_tiny, http=http, request_read_timeout=0.5) as srv:
        addr = ("127.0.0.1", srv.port)
        before = metric(srv, "labkit:request_errors_total", status="408")
        gone = {"reason": "disconnect_reading_body"}
        with socket.create_connection(addr, timeout=10) as s:  # nothing sent: closed, no reply
            assert _read_all(s) == b""
        with socket.create_connection(addr, timeout=10) as s:  # half the headers
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            reply = _read_all(s)
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == \
            "request_read_timeout"
        body = json.dumps({"model": NAME, "prompt": "hello"}).encode()
        with socket.create_connection(addr, timeout=10) as s:  # headers, then half the body
            s.sendall(_raw_request("/v1/completions", body[:10], len(body)))
            reply = _read_all(s)
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert err["code"] == "request_read_timeout" and "body" in err["message"]
        with socket.create_connection(addr, timeout=10) as s:  # a kept-alive connection
            s.sendall(_raw_request("/health", b"").replace(b"POST", b"GET"))
            assert _read_response(s).startswith(b"HTTP/1.1 200 ")
            s.sendall(b"GET /health HTTP/1.1\r\nHo")  # its next request stalls
            assert _read_all(s).startswith(b"HTTP/1.1 408 ")
        assert metric(srv, "labkit:request_errors_total", status="408") == before + 3
        # the server closed those: not client drops, not 500s
        assert metric(srv, "labkit:request_aborted_total", **gone) == 0
        assert metric(srv, "labkit:request_errors_total", status="500") == 0
        assert srv.state.counts["read_timeout"] == 3
        # a request sent whole is served as before
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x",
                                                         "max_tokens": 1})
        assert r.status_code == 200
        idle(srv)


def test_read_timeout_flag_and_default():
    assert ServeConfig().request_read_timeout == 30.0
    p = build_parser()
    assert p.parse_args(["m"]).request_read_timeout == 30.0
    assert p.parse_args(["m", "--request-read-timeout", "5"]).request_read_timeout == 5.0


# ---- 4. --api-key protects every /v1 route; /health and /metrics stay open ------------------
def test_api_key_protects_every_v1_route(labkit_tiny):
    with _server(labkit_tiny, api_keys={"k-alice": "alice"}) as srv:
        key = {"Authorization": "Bearer k-alice"}
        for path in ("/v1/models", "/v1/nothing"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"}
                         ).status_code == 401
        r = httpx.get(srv.url + "/v1/models", headers=key)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == NAME
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x"})
        assert r.status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200


# ---- 5. request_success_total counts requests -----------------------------------------------
def test_request_success_counts_requests_not_choices(server):
    def counts():
        return (metric(server, "labkit:request_success_total"),
                metric(server, "labkit:sequence_success_total"),
                metric(server, "labkit:request_accepted_total"))

    base = {"model": NAME, "max_tokens": 3, "ignore_eos": True}
    for extra, seqs in (({"prompt": "def f():", "n": 2}, 2),
                        ({"prompt": ["import os", "x = 1"]}, 2),
                        ({"prompt": ["a", "b"], "n": 2, "stream": True}, 4)):
        b = counts()
        r = httpx.post(server.url + "/v1/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 200
        idle(server)
        a = counts()
        assert a[0] - b[0] == 1 == a[2] - b[2], (extra, a, b)  # one request, one success
        assert a[1] - b[1] == seqs
    assert metric(server, "labkit:request_success_total", finished_reason="length") >= 3


def test_multi_choice_finish_reason_is_length_when_any_choice_was_cut():
    from labkit.serve.api_server import request_finish_reason

    assert request_finish_reason(["stop", "stop"]) == "stop"
    assert request_finish_reason(["stop", "length"]) == "length"
    assert request_finish_reason(["length"]) == "length"


# ---- 6. continuous_usage_stats, unknown fields -----------------------------------------------
def test_continuous_usage_stats_puts_usage_on_every_chunk(server):
    body = {"model": NAME, "prompt": "def f():", "max_tokens": 5, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(e) for e in sse_events(b"".join(r.iter_raw()))[:-1]]
    *chunks, last = events
    assert chunks and last["choices"] == []
    prompt_tokens = last["usage"]["prompt_tokens"]
    seen = []
    for c in chunks:
        u = c["usage"]
        assert u["prompt_tokens"] == prompt_tokens
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        seen.append(u["completion_tokens"])
    assert seen == sorted(seen) and seen[-1] == 5 == last["usage"]["completion_tokens"]
    # chat: the role chunk carries usage too (0 completion tokens so far)
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(e) for e in sse_events(b"".join(r.iter_raw()))[:-1]]
    assert events[0]["usage"]["completion_tokens"] == 0
    assert all(e["usage"] is not None for e in events)
    # without it (include_usage only) usage stays null until the last chunk, as before
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(e) for e in sse_events(b"".join(r.iter_raw()))[:-1]]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["usage"]
    r = httpx.post(server.url + "/v1/completions", json={
        "model": NAME, "prompt": "x", "stream": True,
        "stream_options": {"continuous_usage_stats": "yes"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == \
        "stream_options.continuous_usage_stats"


def test_unknown_fields_are_ignored_with_a_warning_vllm_extras_refused(server, server_log):
    url = server.url + "/v1/completions"
    body = {"model": NAME, "prompt": "x", "max_tokens": 1, "temperature": 0}
    r = httpx.post(url, json={**body, "my_client_tag": "abc", "metadata": {"a": 1},
                              "stream": True, "stream_options": {"include_usage": True,
                                                                 "vendor_flag": 1}})
    assert r.status_code == 200, r.text
    warned = [rec.getMessage() for rec in server_log if rec.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    for name in ("my_client_tag", "metadata", "stream_options.vendor_flag"):
        assert name in warned[0]
    # vLLM's sampling extras change the answer: refused unless neutral, like the penalties
    for name, value in (("repetition_penalty", 1.3), ("min_tokens", 4), ("min_p", 0.1),
                        ("bad_words", ["x"]), ("use_beam_search", True)):
        r = httpx.post(url, json={**body, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
        assert r.json()["error"]["code"] == "unsupported"
    for name, value in (("repetition_penalty", 1.0), ("min_tokens", 0), ("min_p", 0.0)):
        assert httpx.post(url, json={**body, name: value}).status_code == 200, name


# ---- 7. --max-waiting: a burst of 16 with 4 running slots and 6 waiting places -------------
def test_burst_of_16_with_4_slots_and_max_waiting_6_is_10_served_6_refused(labkit_tiny):
    """Notebook 07 §4's burst: 4 get a running slot, 6 wait, 6 are told to come back. The
    engine is held between two steps while the burst arrives (a call that waits on an event),
    so the split cannot depend on how fast this machine steps: admission must be decided by
    what the server holds, not by a stats snapshot the engine has not refreshed yet."""
    with _server(labkit_tiny, max_num_seqs=4, num_blocks=64, max_waiting=6) as srv:
        release = threading.Event()
        held = asyncio.run_coroutine_threadsafe(srv.llm.call(lambda e: release.wait(60)),
                                                srv.llm._loop)

        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"model": NAME, "prompt": "x = ", "max_tokens": 32, "ignore_eos": True}
                return await asyncio.gather(*(c.post(srv.url + "/v1/completions", json=body)
                                              for _ in range(16)))

        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("r", asyncio.run(burst())))
        t.start()
        try:
            wait_for(lambda: srv.state.counts["rejected"] + srv.llm.num_pending_adds >= 16
                     or srv.state.counts["rejected"] > 6, what="all 16 requests at the gate")
        finally:
            release.set()
            t.join(120)
        held.result(30)
        codes = sorted(r.status_code for r in box["r"])
        assert codes == [200] * 10 + [429] * 6
        refused = [r for r in box["r"] if r.status_code == 429]
        assert all(r.json()["error"]["code"] == "queue_full" for r in refused)
        assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
        idle(srv)
        c = srv.state.counts
        assert (c["accepted"], c["finished"], c["rejected"]) == (10, 10, 6)


@pytest.mark.parametrize("ktp,words", [
    ("push it", "must be a dict"),
    ({"do_remote_decode": True}, "remote_host"),
    ({"do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": 70000}, "1..65535"),
])
def test_bad_kv_transfer_params_are_a_400_not_a_500(server, ktp, words):
    """vLLM's disaggregation field is checked at the door: a prefill engine would otherwise
    find out when the request finishes, inside a step."""
    before = metric(server, "labkit:request_errors_total", status="500")
    r = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": NAME, "prompt": "def f(x):", "max_tokens": 2, "kv_transfer_params": ktp})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params" and words in err["message"], err
    assert metric(server, "labkit:request_errors_total", status="500") == before
