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
                        ("guided_json", {"type": "object"}), ("use_beam_search", True)):
        r = httpx.post(url, json={**body, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
        assert r.json()["error"]["code"] == "unsupported"
    for name, value in (("repetition_penalty", 1.0), ("min_tokens", 0), ("min_p", 0.0)):
        assert httpx.post(url, json={**body, name: value}).status_code == 200, name
