"""The HTTP server against the real openai client and raw httpx streaming, on 127.0.0.1.

Reference: the same model through in-process ``LLM.generate`` (greedy token for token; sampled
with the same seed). Every server here is started and stopped by the test module."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_helpers import NAME, idle, sse_events, wait_aborted

from labkit.engine.llm import LLM
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.serve.api_server import ServeConfig
from labkit.serve.chat import chatml
from labkit.serve.launcher import ServerThread

PROMPTS = ["def fib(n):", "import os\n", "class Stack:\n    def push(self, x):"]


@pytest.fixture(scope="module")
def ref(labkit_tiny):
    return LLM(labkit_tiny, num_blocks=128)


@pytest.fixture(scope="module")
def server(labkit_tiny):
    m, tok = labkit_tiny
    eng = LLMEngine.from_model(m, tok, block_size=16, num_blocks=128, max_num_seqs=16)
    with ServerThread(eng, tok, ServeConfig(model_name=NAME, max_body_bytes=20000)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_greedy_completions_equal_in_process_generate(client, ref, server):
    sp = SamplingParams(temperature=0, max_tokens=24)
    want = ref.generate(PROMPTS, sp)
    r = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, w in zip(r.choices, want):
        assert c.model_extra["token_ids"] == w.outputs[0].token_ids
        assert c.text == w.outputs[0].text
        assert c.finish_reason == w.outputs[0].finish_reason
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert r.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in want)
    idle(server)


def test_seeded_n_and_stop_equal_in_process(client, ref, server):
    sp = SamplingParams(n=3, temperature=0.9, top_k=50, seed=7, max_tokens=20, stop=["\n\n"])
    want = ref.generate(["def parse(line):"], sp)[0]
    r = client.completions.create(model=NAME, prompt="def parse(line):", n=3, temperature=0.9,
                                  seed=7, max_tokens=20, stop="\n\n",
                                  extra_body={"top_k": 50, "return_token_ids": True})
    assert len(r.choices) == 3
    for c, w in zip(r.choices, want.outputs):
        assert c.model_extra["token_ids"] == w.token_ids and c.text == w.text
        assert c.finish_reason == w.finish_reason and "\n\n" not in c.text
    idle(server)


def test_streaming_openai_client_and_usage(client, ref):
    want = ref.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30,
                                                     stop=["return"]))[0].outputs[0]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=30,
                                            temperature=0, stop=["return"], stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        len(want.token_ids)


def test_raw_sse_bytes(server, ref):
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0,
            "stream": True, "n": 2, "return_token_ids": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(resp.iter_raw())
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    toks: dict[int, list[int]] = {0: [], 1: []}
    for e in events[:-1]:
        d = json.loads(e)
        assert d["object"] == "text_completion" and len(d["choices"]) == 1
        toks[d["choices"][0]["index"]] += d["choices"][0]["token_ids"]
    want = ref.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12))[0]
    assert toks[0] == toks[1] == want.outputs[0].token_ids


def test_chat_uses_template_and_streams(client, ref, labkit_tiny):
    msgs = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def add(a, b):"}]
    want = ref.generate([chatml(msgs)], SamplingParams(temperature=0, max_tokens=16))[0]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(labkit_tiny[1].encode(chatml(msgs)))
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == want.outputs[0].finish_reason


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.text == "ok"


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "temperature": True}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 1000}, 400, "n"),
    ({"prompt": "x", "stop": [1]}, 400, "stop"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "seed": "a"}, 400, "seed"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "x", "top_logprobs": 2}, 400, "top_logprobs"),
    ({"prompt": "x", "echo": "yes"}, 400, "echo"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"prompt": [[1], "a", 3]}, 400, "prompt"),
    ({"prompt": {"a": 1}}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "x " * 1100, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x", "model": 3}, 400, "model"),
    ({"prompt": "x", "user": 5}, 400, "user"),
    ({"prompt": "x", "priority": "high"}, 400, "priority"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_client_mistakes_get_4xx_openai_errors(server, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": {"model": NAME, **body}}
    r = httpx.post(server.url + "/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_chat_mistakes_and_oversize_body(server):
    url = server.url + "/v1/chat/completions"
    for msgs in ([], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 3}],
                 "hi", [{"role": "user", "content": [{"type": "image_url"}]}]):
        r = httpx.post(url, json={"model": NAME, "messages": msgs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", msgs
    r = httpx.post(url, content=b"{" + b" " * 30000 + b"}")  # max_body_bytes=20000
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: refused while reading
        for _ in range(30):
            yield b" " * 1000
    r = httpx.post(url, content=chunks())
    assert r.status_code == 413
    assert httpx.get(url).status_code == 405
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["code"] == "not_found"
    idle(server)


@pytest.mark.slow
def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = server.state.counts["aborted"]
    body = {"model": NAME, "prompt": "def main():", "max_tokens": 900, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        it = resp.iter_lines()
        first = next(it)
        assert first.startswith("data: ")
        assert server.call(lambda e: e.stats()["num_used_blocks"]) > 0
    # the connection is closed: within a step or so the request is aborted and freed
    s = idle(server, timeout=10)
    assert s["num_used_blocks"] == 0
    wait_aborted(server, before)


@pytest.mark.slow
def test_disconnect_while_waiting_non_streaming(server):
    before = server.state.counts["aborted"]
    body = {"model": NAME, "prompt": "def main():", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    idle(server, timeout=10)
    wait_aborted(server, before)


def test_dashboard_draws_what_metrics_says_as_a_small_figure_view(server, client):
    """ServeDashboard polls /metrics and draws the series as a plotly bundle in a FigureView
    (the figure's JSON only: no FigureWidget carrying plotly.js in its state)."""
    from labkit.serve.metrics import parse_metrics
    from labkit.viz.figure_view import PLOTLY_MIME, FigureView
    from labkit.viz.serve_dashboard import SERIES, ServeDashboard

    dash = ServeDashboard(server.url)
    client.completions.create(model=NAME, prompt="def f(x):", max_tokens=4, temperature=0)
    idle(server)
    m = dash.update()
    assert m == dash.history[-1]
    truth = parse_metrics(httpx.get(server.url + "/metrics").text)
    assert m["labkit:request_success_total"] == truth["labkit:request_success_total"] >= 1
    assert isinstance(dash.view, FigureView) and dash.fig is dash.view.figure
    (out,) = dash.view.outputs
    traces = out["data"][PLOTLY_MIME]["data"]
    assert [t["name"] for t in traces] == [label for _, label, _ in SERIES]
    for t, (name, _, axis) in zip(traces, SERIES):
        assert list(t["y"]) == [h.get(name, 0.0) for h in dash.history]
        # KV usage is a fraction: its own 0-100% axis, not drawn flat on the request counts
        assert t.get("yaxis", "y") == axis == ("y2" if name.endswith("kv_cache_usage_perc")
                                               else "y")
    layout = out["data"][PLOTLY_MIME]["layout"]
    assert layout["yaxis2"]["overlaying"] == "y" and layout["yaxis2"]["range"][1] <= 1.1
    assert ">finished<" in dash.table.value
    assert len(json.dumps(dash.view.get_state(), default=str)) < 64 * 1024
