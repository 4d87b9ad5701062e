"""The engine in its own process (``EngineSpec``; vLLM's EngineCore): same answers through
HTTP as in-process ``LLM.generate``, disconnects free blocks, bad input is still a 400, and a
dead engine process fails the open streams and /health instead of hanging the server.

Each server here spawns an engine process (a fresh interpreter that imports torch: seconds),
so the module starts two and keeps every check on them."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from serve_helpers import NAME, idle, wait_aborted

from labkit.engine.errors import InvalidPromptError
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.serve.api_server import ServeConfig
from labkit.serve.async_llm import EngineSpec
from labkit.serve.launcher import ServerThread

PROMPTS = ["def fib(n):", "import os\n", "class Stack:\n    def push(self, x):"]
SPEC = EngineSpec(NAME, "float32", engine_kw={"num_blocks": 128, "max_num_seqs": 16},
                  num_threads=1)



@pytest.fixture(scope="module")
def server():
    with ServerThread(SPEC, None, ServeConfig(model_name=NAME)) as srv:
        yield srv
    assert not srv.llm.core_proc.proc.is_alive()  # shutdown stops and reaps the engine process


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"  # a zombie is dead (not reaped by us: fine)
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_greedy_http_equals_in_process_generate(server, labkit_tiny):
    assert server.llm.mode == "process" and server.llm.engine is None
    want = LLM(labkit_tiny, num_blocks=128).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": NAME, "prompt": PROMPTS, "max_tokens": 20, "temperature": 0,
        "return_token_ids": True}).json()
    for c, w in zip(r["choices"], want):
        assert c["token_ids"] == w.outputs[0].token_ids
        assert c["text"] == w.outputs[0].text
    idle(server)


@pytest.mark.slow
def test_logprobs_and_echo_cross_the_process_boundary(server, labkit_tiny):
    """Logprob dicts are pickled with the step's outputs: same numbers as in-process."""
    want = LLM(labkit_tiny, num_blocks=128).generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                     prompt_logprobs=2))[0]
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": NAME, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
        "logprobs": 2, "echo": True}).json()["choices"][0]
    c = want.outputs[0]
    assert r["text"] == PROMPTS[0] + c.text
    lps = r["logprobs"]["token_logprobs"]
    ids = want.prompt_token_ids + c.token_ids
    entries = want.prompt_logprobs + c.logprobs
    assert lps[0] is None and len(lps) == len(ids)
    for got, t, e in zip(lps[1:], ids[1:], entries[1:]):
        assert got == pytest.approx(e[t].logprob, abs=1e-4)
    idle(server)


@pytest.mark.slow
def test_structured_outputs_cross_the_process_boundary(server):
    """The constraint is compiled in the engine process; its errors come back as a 400."""
    pytest.importorskip("xgrammar", reason="structured outputs need the optional xgrammar")
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={**body, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={**body, "guided_regex": "[a-"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
    idle(server)


@pytest.mark.slow
def test_engine_process_freezes_its_startup_heap(server):
    # torch, the model and the engine: far more than a bare interpreter's ~10^4 objects
    assert server.llm.core_proc.handshake["gc_frozen"] > 50_000


@pytest.mark.slow
def test_bad_prompt_is_400_and_server_goes_on(server):
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": NAME, "prompt": "x" * 20000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # the engine's own ValueError (what the server answers 400 for) crosses the pipe intact
    llm = server.llm
    bad = llm.add_request("bad", [1, 10**6], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidPromptError, match="token ids"):
        asyncio.run_coroutine_threadsafe(bad, llm._loop).result(30)
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.slow
def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = server.state.counts["aborted"]
    # the engine process does not share this process's GIL, so under load it can run far
    # ahead of this thread: the longest request the context allows, and no "blocks are held
    # now" check (racy); an abort, not a finish, is what the counts below must show
    body = {"model": NAME, "prompt": "def main():", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        first = next(resp.iter_lines())
        assert first.startswith("data: "), first
    assert idle(server)["num_used_blocks"] == 0  # assert_no_leaks ran in the engine process
    wait_aborted(server, before)


@pytest.mark.slow
def test_killed_engine_process_fails_streams_and_health():
    srv = ServerThread(SPEC, None, ServeConfig(model_name=NAME)).start()
    pid = srv.llm.core_proc.proc.pid
    try:
        body = {"model": NAME, "prompt": "def main():", "max_tokens": 900, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(pid, signal.SIGKILL)
            rest = [ln for ln in lines if ln]  # ends (no hang): an error event, then [DONE]
        assert any('"error"' in ln and "engine" in ln for ln in rest), rest[-3:]
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", timeout=30, json={
            "model": NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code >= 500
    finally:
        srv.stop()
    assert _gone(pid) and not srv.thread.is_alive()


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out |= {int(c) for c in f.read().split()}
    return out


@pytest.mark.slow
def test_sigterm_to_labkit_serve_leaves_no_engine_process():
    """``labkit serve`` as a real process (its engine in a process by default): SIGTERM
    drains, stops the engine process and exits; nothing it started is left running. The
    soak's memory probe counts the engine process too (the KV cache and weights live there)."""
    from labkit.bench.serve_soak import rss_kb, tree_rss_kb
    from labkit.serve.process import ServerProcess

    srv = ServerProcess(NAME, ["--num-blocks", "64", "--dtype", "float32"])
    with srv:
        kids = _children(srv.pid)
        assert tree_rss_kb(srv.pid) > rss_kb(srv.pid) + 50_000  # an engine imports torch
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": NAME, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert "engine in a process" in srv.output()
    assert srv.proc.returncode == 0 and kids
    deadline = time.monotonic() + 10
    while not all(_gone(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(k) for k in kids), kids


def test_bench_engine_args_name_the_mode():
    from labkit.bench.serve import engine_args

    assert engine_args("process", 2) == ["--engine-threads", "2", "--engine-mode", "process"]
    assert engine_args("thread", 1) == ["--engine-threads", "1", "--engine-mode", "thread"]
    with pytest.raises(ValueError, match="thread or process"):
        engine_args("gpu", 1)
