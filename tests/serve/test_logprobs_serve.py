"""OpenAI logprobs through the real server: completions ``logprobs`` / ``echo`` (streamed and
not), chat ``logprobs`` + ``top_logprobs``, each equal to the Python API's numbers (which
tests/engine/test_logprobs.py checks against the reference model's log_softmax)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from serve_helpers import NAME, idle, sse_events

from labkit.engine.llm import LLM
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.model.generate import ContiguousKVCache
from labkit.serve.api_server import ServeConfig
from labkit.serve.chat import chatml
from labkit.serve.launcher import ServerThread

PROMPT = "def fib(n):"
ATOL = 1e-4


@pytest.fixture(scope="module")
def ref(labkit_tiny):
    return LLM(labkit_tiny, num_blocks=128)


@pytest.fixture(scope="module")
def server(labkit_tiny):
    m, tok = labkit_tiny
    eng = LLMEngine.from_model(m, tok, block_size=16, num_blocks=128, max_num_seqs=8,
                               enable_prefix_caching=True)
    with ServerThread(eng, tok, ServeConfig(model_name=NAME)) as srv:
        yield srv


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": NAME, **body}, timeout=60)


def stream(server, path: str, body: dict) -> list[dict]:
    r = post(server, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    return [json.loads(e) for e in sse_events(r.content)[:-1]]


def legacy(entries, ids) -> tuple[list, list]:
    """The Python API's entries as (token_logprobs, top_logprobs) of the legacy shape."""
    lps = [None if e is None else e[t].logprob for t, e in zip(ids, entries)]
    tops = [None if e is None else {v.decoded_token: v.logprob for v in e.values()}
            for e in entries]
    return lps, tops


def assert_close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None or g is None:
            assert g is w is None
        elif isinstance(w, dict):
            assert g.keys() == w.keys()
            assert all(g[k] == pytest.approx(max(w[k], -9999.0), abs=ATOL) for k in w)
        else:
            assert g == pytest.approx(w, abs=ATOL)


def test_completion_logprobs_equal_python_api(server, ref):
    want = ref.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, logprobs=3))
    c = want[0].outputs[0]
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                         "logprobs": 3})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"] == c.text and lp["tokens"] == [e[t].decoded_token for t, e in
                                                      zip(c.token_ids, c.logprobs)]
    wl, wt = legacy(c.logprobs, c.token_ids)
    assert_close(lp["token_logprobs"], wl)
    assert_close(lp["top_logprobs"], wt)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i])
                                 for i in range(len(lp["tokens"]))]
    chunks = stream(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12,
                                                "temperature": 0, "logprobs": 3})
    got = [ch["choices"][0]["logprobs"] for ch in chunks if ch["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for g in got for x in g[key]] == lp[key]
    idle(server)


def test_greedy_logprobs_are_the_model_fp32_log_softmax(server, labkit_tiny):
    """The interface check of issue 32: temperature 0 logprobs = log_softmax of the logits."""
    model, tok = labkit_tiny
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                         "logprobs": 1, "echo": True,
                                         "return_token_ids": True}).json()["choices"][0]
    ids = tok.encode(PROMPT) + r["token_ids"]
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None],
                       ContiguousKVCache(model, 1, len(ids)))[0].float()
    want = torch.log_softmax(logits, -1)
    got = r["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        assert got[p] == pytest.approx(float(want[p - 1, ids[p]]), abs=ATOL)


def test_echo_max_tokens_0_scores_the_prompt(server, ref, labkit_tiny):
    """lm-eval's loglikelihood request: echo=True, max_tokens=0, logprobs=1."""
    tok = labkit_tiny[1]
    prompt = "import os\nprint(os.getcwd())"
    ids = tok.encode(prompt)
    want = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                 prompt_logprobs=1))[0].prompt_logprobs
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    for _ in range(2):  # the second time the prefix is cached: the numbers must not change
        r = post(server, "/v1/completions", body).json()
        ch = r["choices"][0]
        assert ch["text"] == prompt and ch["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == 0
        wl, wt = legacy(want, ids)
        assert_close(ch["logprobs"]["token_logprobs"], wl)
        assert_close(ch["logprobs"]["top_logprobs"], wt)
        assert len(ch["logprobs"]["tokens"]) == len(ids)
    chunks = stream(server, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt
    assert_close([x for c in chunks if c["choices"][0]["logprobs"]
                  for x in c["choices"][0]["logprobs"]["token_logprobs"]], wl)
    idle(server)


def test_echo_with_generation_and_without_logprobs(server, ref):
    want = ref.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    ch = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                          "echo": True}).json()["choices"][0]
    assert ch["text"] == PROMPT + want.text and ch["logprobs"] is None
    ch = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                          "echo": True, "logprobs": 0}).json()["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"] == PROMPT + want.text
    assert "".join(lp["tokens"]).endswith(want.text) and lp["token_logprobs"][0] is None


def test_chat_logprobs_and_top_logprobs(server, ref):
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    want = ref.generate([chatml(msgs)], SamplingParams(temperature=0, max_tokens=8,
                                                       logprobs=2))[0].outputs[0]
    body = {"messages": msgs, "max_tokens": 8, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == len(want.token_ids)
    for item, t, e in zip(content, want.token_ids, want.logprobs):
        assert item["token"] == e[t].decoded_token
        assert item["bytes"] == list(item["token"].encode())
        assert item["logprob"] == pytest.approx(e[t].logprob, abs=ATOL)
        best = sorted(e.values(), key=lambda v: -v.logprob)[:2]
        assert [x["token"] for x in item["top_logprobs"]] == [v.decoded_token for v in best]
        assert [x["logprob"] for x in item["top_logprobs"]] == pytest.approx(
            [v.logprob for v in best], abs=ATOL)
    chunks = stream(server, "/v1/chat/completions", body)
    streamed = [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for x in c["choices"][0]["logprobs"]["content"]]
    # the same tokens, bytes and ranking; the numbers within ATOL, not bit for bit: the second
    # request reads the first's prompt blocks from the prefix cache, and attention over cached
    # blocks sums in another order (1e-6 apart on some CPUs)
    def shape(items: list[dict]) -> list:
        return [(x["token"], x["bytes"], [(y["token"], y["bytes"]) for y in x["top_logprobs"]])
                for x in items]

    def numbers(items: list[dict]) -> list[float]:
        return [v for x in items for v in (x["logprob"], *(y["logprob"]
                                                          for y in x["top_logprobs"]))]

    assert shape(streamed) == shape(content)
    assert numbers(streamed) == pytest.approx(numbers(content), abs=ATOL)
    plain = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert plain.json()["choices"][0]["logprobs"] is None
    idle(server)


@pytest.mark.parametrize("body,param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"echo": True}, "echo"),
])
def test_chat_logprobs_mistakes_are_400(server, body, param):
    r = post(server, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def vllm_shape(entries: list, k: int) -> list:
    """The Python API's prompt entries in vLLM's wire shape, trimmed to the prompt token and
    the top k: what ``prompt_logprobs: k`` must return."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        first = next(iter(e))
        out.append({str(t): {"logprob": max(v.logprob, -9999.0), "rank": v.rank,
                             "decoded_token": v.decoded_token}
                    for t, v in e.items() if t == first or v.rank <= k})
    return out


def assert_prompt_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.keys() == w.keys()
        for t in w:
            assert g[t]["rank"] == w[t]["rank"] and g[t]["decoded_token"] == w[t]["decoded_token"]
            assert g[t]["logprob"] == pytest.approx(w[t]["logprob"], abs=ATOL)


def test_vllm_prompt_logprobs_field(server, ref, labkit_tiny):
    """vLLM's ``prompt_logprobs: k``: per choice on completions (streamed: with a choice's first
    chunk), beside the choices on chat; equal to the Python API's ``prompt_logprobs``, and
    trimmed to k when an echo asked the engine for more."""
    tok = labkit_tiny[1]
    prompt = "import os\nprint(os.getcwd())"
    want = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                 prompt_logprobs=3))[0].prompt_logprobs
    assert len(want) == len(tok.encode(prompt))
    for k, extra in ((1, {}), (0, {"echo": True, "logprobs": 3})):
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": k,
                "n": 2, **extra}
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        for ch in r.json()["choices"]:
            assert_prompt_logprobs(ch["prompt_logprobs"], vllm_shape(want, k))
        chunks = stream(server, "/v1/completions", body)
        firsts = [c["choices"][0] for c in chunks if "prompt_logprobs" in c["choices"][0]]
        assert sorted(c["index"] for c in firsts) == [0, 1]
        for c in firsts:
            assert_prompt_logprobs(c["prompt_logprobs"], vllm_shape(want, k))
    messages = [{"role": "user", "content": "hi"}]
    chat_want = ref.generate([chatml(messages)], SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                              "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    assert_prompt_logprobs(r.json()["prompt_logprobs"], vllm_shape(chat_want, 2))
    for bad in (-1, 21, True, "2"):
        r = post(server, "/v1/completions", {"prompt": prompt, "prompt_logprobs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    idle(server)
