"""Admission control, keys and token buckets, timeouts, drain, and /metrics, each on its own
small loopback server (they start in well under a second)."""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import NAME, idle, sse_events

from labkit.engine.llm_engine import LLMEngine
from labkit.serve.api_server import ServeConfig
from labkit.serve.launcher import ServerThread
from labkit.serve.limits import Authenticator, KeyLimits, TokenBucket, parse_api_keys

LONG = {"model": NAME, "prompt": "def main():", "max_tokens": 900, "ignore_eos": True}


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _server(labkit_tiny, max_num_seqs=16, **cfg) -> ServerThread:
    m, tok = labkit_tiny
    eng = LLMEngine.from_model(m, tok, block_size=16, num_blocks=128, max_num_seqs=max_num_seqs)
    return ServerThread(eng, tok, ServeConfig(model_name=NAME, **cfg))


def test_token_bucket_hand_computed():
    clk = FakeClock()
    b = TokenBucket(rate=2.0, burst=2.0, clock=clk)
    assert b.try_take() == 0.0 and b.try_take() == 0.0
    assert b.try_take() == pytest.approx(0.5)  # empty: one token comes back in 1/2 s
    clk.t += 0.25
    assert b.try_take() == pytest.approx(0.25)  # refused requests take nothing
    clk.t += 0.25
    assert b.try_take() == 0.0
    clk.t += 100
    assert b.tokens == 0.0 and b.try_take(2) == 0.0  # refill is capped at the burst
    assert b.try_take(3) == math.inf  # never fits: not a Retry-After loop
    with pytest.raises(ValueError):
        TokenBucket(0)
    # a request admitted by the request bucket but refused by the token bucket gives back
    lim = KeyLimits(TokenBucket(1, 1, clk), TokenBucket(10, 10, clk))
    assert lim.check(11) == math.inf and lim.requests.tokens == 1
    assert lim.check(6) == 0.0 and lim.check(1) == pytest.approx(1.0)


def test_keys_compared_in_constant_time(monkeypatch):
    keys = parse_api_keys(["k-alice:alice", "k-bob:bob", "k-carol"])
    assert keys == {"k-alice": "alice", "k-bob": "bob", "k-carol": "key2"}
    auth = Authenticator(keys)
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert auth.tenant("Bearer k-alice") == "alice"
    assert len(calls) == 3  # every key compared, even after the first matched
    assert auth.tenant("Bearer k-alic") is None and auth.tenant(None) is None
    assert len(calls) == 9


@pytest.mark.slow
def test_queue_full_gets_429_with_retry_after(labkit_tiny):
    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as a:
                lines = a.aiter_lines()  # keep it: a dropped iterator closes the connection
                await lines.__anext__()  # A is running (max_num_seqs=1)
                async with c.stream("POST", "/v1/completions",
                                    json={**LONG, "stream": True}) as b:  # B waits
                    await asyncio.sleep(0.1)
                    r = await c.post("/v1/completions", json={**LONG, "max_tokens": 2})
                    assert b.status_code == 200
                return r

    with _server(labkit_tiny, max_num_seqs=1, max_waiting=1) as srv:
        r = asyncio.run(main(srv.url))
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["Retry-After"]) >= 1
        idle(srv)
        c = srv.state.counts
        assert (c["accepted"], c["aborted"], c["rejected"]) == (2, 2, 1)


@pytest.mark.slow
def test_api_keys_and_per_key_rate_limit(labkit_tiny):
    keys = {"k-alice": "alice", "k-bob": "bob"}
    clock0 = FakeClock()
    with _server(labkit_tiny, api_keys=keys, rate_limit_rps=0.5,
                 bucket=lambda r, b, _: TokenBucket(r, b, clock0)) as srv:
        url, body = srv.url + "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 1}
        assert httpx.post(url, json=body).status_code == 401
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer k-eve"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        alice = {"Authorization": "Bearer k-alice"}
        assert httpx.post(url, json=body, headers=alice).status_code == 200
        r = httpx.post(url, json=body, headers=alice)  # bucket: 1 request per 2 s
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit"
        assert 1 <= int(r.headers["Retry-After"]) <= 2
        bob = {"Authorization": "Bearer k-bob"}
        assert httpx.post(url, json=body, headers=bob).status_code == 200  # own bucket
    clock = FakeClock()  # the buckets' clock stands still: no refill while requests run
    with _server(labkit_tiny, rate_limit_tps=10,
                 bucket=lambda r, b, _: TokenBucket(r, b, clock)) as srv:  # cost = prompt + mt
        url, one = srv.url + "/v1/completions", {"model": NAME, "prompt": [5]}
        r = httpx.post(url, json={**one, "max_tokens": 10})  # 11 > the bucket's 10
        assert r.status_code == 400 and r.json()["error"]["code"] == "rate_limit_cost"
        assert httpx.post(url, json={**one, "max_tokens": 8}).status_code == 200
        r = httpx.post(url, json={**one, "max_tokens": 8})  # 9 more, 1 left: 0.8 s to wait
        assert r.status_code == 429 and int(r.headers["Retry-After"]) == 1
        clock.t += 1.0
        assert httpx.post(url, json={**one, "max_tokens": 8}).status_code == 200


@pytest.mark.slow
def test_queue_and_request_timeouts_free_blocks(labkit_tiny):
    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as a:
                lines = a.aiter_lines()
                await lines.__anext__()
                return await c.post("/v1/completions", json={**LONG, "max_tokens": 2})

    with _server(labkit_tiny, max_num_seqs=1, queue_timeout=0.3) as srv:
        r = asyncio.run(main(srv.url))
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"
        idle(srv)
        assert srv.state.counts["timed_out"] == 1
    with _server(labkit_tiny, request_timeout=0.4) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=LONG, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        with httpx.stream("POST", srv.url + "/v1/completions", json={**LONG, "stream": True},
                          timeout=30) as resp:
            events = sse_events(b"".join(resp.iter_raw()))
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        idle(srv)
        assert srv.state.counts["timed_out"] == 2


@pytest.mark.slow
def test_drain_finishes_in_flight_then_exits(labkit_tiny):
    srv = _server(labkit_tiny, drain_timeout=30).start()
    try:
        body = {"model": NAME, "prompt": "def main():", "max_tokens": 120, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(lines)
            srv.drain()
            time.sleep(0.1)
            assert httpx.get(srv.url + "/health").status_code == 503
            r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            rest = [ln for ln in lines if ln]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        srv.thread.join(15)
        assert not srv.thread.is_alive()  # left on its own once drained
        assert srv.state.counts["finished"] == 1
    finally:
        srv.stop()


@pytest.mark.slow
def test_metrics_parse_and_match_what_was_served(labkit_tiny):
    with _server(labkit_tiny) as srv:
        usage = [0, 0]
        for p in ("def a():", "import sys", "x = 1"):
            r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": p,
                                                             "max_tokens": 7, "n": 2,
                                                             "ignore_eos": True}).json()
            usage[0] += r["usage"]["prompt_tokens"]
            usage[1] += r["usage"]["completion_tokens"]
        httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": ""})
        idle(srv)
        text = httpx.get(srv.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def val(name, _suffix="", **lab):
        return sum(s.value for s in fams[name].samples if s.name == name + _suffix
                   and all(s.labels.get(k) == v for k, v in lab.items()))

    assert val("labkit:prompt_tokens", _suffix="_total") == usage[0]
    assert val("labkit:generation_tokens", _suffix="_total") == usage[1] == 3 * 2 * 7
    # three requests of n=2: three finished requests, six finished sequences
    assert val("labkit:request_success", finished_reason="length", _suffix="_total") == 3
    assert val("labkit:sequence_success", finished_reason="length", _suffix="_total") == 6
    assert val("labkit:request_accepted", _suffix="_total") == 3
    assert val("labkit:request_errors", status="400", _suffix="_total") == 1
    assert val("labkit:time_to_first_token_seconds", _suffix="_count") == 3
    assert val("labkit:e2e_request_latency_seconds", _suffix="_count") == 3
    assert val("labkit:inter_token_latency_seconds", _suffix="_count") == 3 * 2 * 6
    assert val("labkit:num_requests_running") == 0 == val("labkit:kv_cache_usage_perc")
    assert val("labkit:prefix_cache_queries", _suffix="_total") >= usage[0]
    for name in ("labkit:num_requests_waiting", "labkit:num_requests_swapped",
                 "labkit:num_preemptions", "labkit:prefix_cache_hits"):
        assert name in fams
