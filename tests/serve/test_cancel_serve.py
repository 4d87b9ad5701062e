"""Cancel paths and tokens per SSE event (labkit.serve.cancel, .ws, .stream_interval), against
a real server on 127.0.0.1 over labkit-tiny.

References: the engine's own block accounting (``num_used_blocks`` back to 0 and
``assert_no_leaks`` in the core, after the blocks were seen in use mid-stream), the server's
abort counter by reason, and the same server's N = 1 stream for the greedy text (itself pinned
to in-process ``LLM.generate`` by test_server.py). Every server is stopped by its fixture."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import NAME, idle, sse_events
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from labkit.engine.llm_engine import LLMEngine
from labkit.serve.api_server import ServeConfig
from labkit.serve.launcher import ServerThread
from labkit.serve.stream_interval import TokenBatcher

LONG = {"model": NAME, "prompt": "def fib(n):", "max_tokens": 600, "temperature": 0,
        "ignore_eos": True, "stream": True}


def _server(labkit_tiny, **cfg) -> ServerThread:
    m, tok = labkit_tiny
    eng = LLMEngine.from_model(m, tok, block_size=16, num_blocks=128, max_num_seqs=8)
    return ServerThread(eng, tok, ServeConfig(model_name=NAME, **cfg))


@pytest.fixture(scope="module")
def server(labkit_tiny):
    with _server(labkit_tiny, api_keys={"k1": "a", "k2": "b"}) as srv:
        yield srv


H1, H2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}


def metric(server, name: str, **labels) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def aborted(server, reason: str) -> float:
    return metric(server, "labkit:request_aborted_total", reason=reason)


def _data(line: str) -> dict | str:
    body = line[len("data: "):]
    return body if body == "[DONE]" else json.loads(body)


def test_cancel_route_frees_every_block_and_ends_the_stream(server):
    before = aborted(server, "cancel")
    with httpx.Client(base_url=server.url, headers=H1, timeout=30) as c, \
            c.stream("POST", "/v1/completions", json=LONG) as r:
        lines = (ln for ln in r.iter_lines() if ln)
        first = _data(next(lines))
        assert metric(server, "labkit:kv_cache_usage_perc") > 0  # the blocks are in use
        assert c.post(f"/v1/requests/{first['id']}/cancel", headers=H2).status_code == 404
        ok = c.post(f"/v1/requests/{first['id']}/cancel")
        assert ok.status_code == 200 and ok.json()["cancelled"] is True
        rest = [_data(ln) for ln in lines]
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "abort"
    assert all(e["choices"][0]["finish_reason"] is None for e in rest[:-2])
    assert len(rest) - 1 < LONG["max_tokens"]  # it stopped early, no usage chunk
    s = idle(server)  # every block back, no leak in the core
    assert s["num_used_blocks"] == 0 and metric(server, "labkit:kv_cache_usage_perc") == 0
    assert aborted(server, "cancel") == before + 1
    again = httpx.post(f"{server.url}/v1/requests/{first['id']}/cancel", headers=H1)
    assert again.status_code == 404  # finished: nothing to cancel any more


def test_cancel_aborts_every_prompt_and_sample_of_the_request(server):
    body = {**LONG, "prompt": ["def fib(n):", "import os\n"], "n": 2}
    with httpx.Client(base_url=server.url, headers=H1, timeout=30) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        lines = (ln for ln in r.iter_lines() if ln)
        first = _data(next(lines))
        ok = c.post(f"/v1/requests/{first['id']}/cancel").json()
        assert ok["num_engine_requests"] == 2  # one per prompt, each holding n = 2 sequences
        rest = [_data(ln) for ln in lines][:-1]
    ends = {e["choices"][0]["index"] for e in rest if e["choices"][0]["finish_reason"]}
    assert ends == {0, 1, 2, 3} and all(e["choices"][0]["finish_reason"] == "abort"
                                        for e in rest if e["choices"][0]["finish_reason"])
    idle(server)


def test_unknown_id_is_404_with_an_openai_error(server):
    r = httpx.post(server.url + "/v1/requests/cmpl-nope/cancel", headers=H1)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found" and "cmpl-nope" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/requests/x/cancel").status_code == 401  # key guard


def _ws(server):
    return connect(server.url.replace("http", "ws") + "/v1/completions/ws",
                   additional_headers=H1, open_timeout=10)


def test_websocket_cancel_message_aborts(server):
    before = aborted(server, "cancel")
    with _ws(server) as ws:
        ws.send(json.dumps(LONG))
        first = json.loads(ws.recv(timeout=30))
        assert first["object"] == "text_completion" and first["id"].startswith("cmpl-")
        ws.send(json.dumps({"type": "cancel"}))
        msgs = [json.loads(m) for m in ws]  # until the server closes (code 1000)
    assert msgs[-1] == {"type": "done"}
    assert msgs[-2]["choices"][0]["finish_reason"] == "abort"
    assert len(msgs) < LONG["max_tokens"]
    idle(server)
    assert aborted(server, "cancel") == before + 1


def test_websocket_events_are_the_sse_events(server):
    """The same greedy chat request over POST + SSE and over the socket: the same chunks
    (ids and timestamps aside), the role chunk first, then the end marker."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "def fib(n):"}],
            "max_tokens": 12, "temperature": 0, "stream": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=H1, timeout=30)
    sse = [json.loads(e) for e in sse_events(r.content)[:-1]]
    url = server.url.replace("http", "ws") + "/v1/chat/completions/ws"
    with connect(url, additional_headers=H1, open_timeout=10) as ws:
        ws.send(json.dumps(body))
        msgs = [json.loads(m) for m in ws]
    assert msgs[-1] == {"type": "done"} and ws.close_code == 1000
    strip = [{k: v for k, v in e.items() if k not in ("id", "created")} for e in sse]
    assert [{k: v for k, v in m.items() if k not in ("id", "created")}
            for m in msgs[:-1]] == strip
    assert sse[0]["choices"][0]["delta"].get("role") == "assistant" and len(sse) > 3
    idle(server)


def test_websocket_close_aborts(server):
    before = aborted(server, "disconnect")
    with _ws(server) as ws:
        ws.send(json.dumps(LONG))
        ws.recv(timeout=30)
    s = idle(server)  # the close aborted it: 600 tokens would take longer than this wait
    assert s["num_used_blocks"] == 0
    for _ in range(100):
        if aborted(server, "disconnect") == before + 1:
            break
        time.sleep(0.05)  # the outcome is recorded as the handler unwinds
    assert aborted(server, "disconnect") == before + 1


def test_websocket_refusal_closes_with_4000_plus_status(server):
    with _ws(server) as ws:
        ws.send(json.dumps({"model": NAME, "prompt": "x", "max_tokens": -1}))
        err = json.loads(ws.recv(timeout=10))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert err["error"]["param"] == "max_tokens"
    assert ws.close_code == 4400
    url = server.url.replace("http", "ws") + "/v1/completions/ws"
    with connect(url, open_timeout=10) as ws:  # no key: the POST route's 401, as a close code
        ws.send(json.dumps(LONG))
        assert json.loads(ws.recv(timeout=10))["error"]["code"] == "invalid_api_key"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert ws.close_code == 4401


def _events(url: str, body: dict) -> list[dict]:
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    return [json.loads(e) for e in sse_events(r.content)[:-1]]


def test_stream_interval_same_text_fewer_events(labkit_tiny):
    body = {"model": NAME, "prompt": "class Stack:\n", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    got = {}
    for n in (1, 4, 16):
        with _server(labkit_tiny, stream_interval=n) as srv:
            got[n] = _events(srv.url, body)
            idle(srv)
    texts = {n: "".join(e["choices"][0]["text"] for e in ev) for n, ev in got.items()}
    ids = {n: [t for e in ev for t in e["choices"][0]["token_ids"]] for n, ev in got.items()}
    assert texts[1] == texts[4] == texts[16] and len(ids[1]) == 40
    assert ids[1] == ids[4] == ids[16]
    assert len(got[1]) == 40 and len(got[4]) < len(got[1]) and len(got[16]) < len(got[4])
    for n in (4, 16):  # the first event at once, middle ones n tokens, the last flushed
        sizes = [len(e["choices"][0]["token_ids"]) for e in got[n]]
        assert sizes[0] == 1 and all(s == n for s in sizes[1:-1]) and sizes[-1] <= n
        assert got[n][-1]["choices"][0]["finish_reason"] == "length"


def test_token_batcher_hand_case():
    b = TokenBatcher(3)
    out = [b.add(0, t, [i], None, None, first=i == 0) for i, t in enumerate("abcd")]
    assert out[0] == (0, "a", [0], None, None) and out[1] is None and out[2] is None
    assert out[3] == (0, "bcd", [1, 2, 3], None, None)
    assert b.add(0, "e", [4], None, [{"x": 1}], first=False) is None
    assert b.add(0, "", [], "stop", None, first=False) == (0, "e", [4], "stop", [{"x": 1}])
    with pytest.raises(ValueError, match="stream interval"):
        TokenBatcher(0)
