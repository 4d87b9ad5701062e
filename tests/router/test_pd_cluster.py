"""Prefill/decode disaggregation with REAL processes: ``labkit cluster up --prefill 1 --decode 1``
as a ``PDCluster`` (two ``labkit serve`` children and the P/D proxy on 127.0.0.1).

One test, in phases (a module-scoped cluster would be started once per xdist worker):
1. completions through the proxy, streamed and not, equal the reference greedy generation; the
   prefill instance pushed exactly the formula's KV bytes (labkit.bench.disagg.kv_bytes_formula:
   full prompt blocks x 16 x layers x 2 x kv heads x head dim x 4), the decode instance received
   the same, and neither holds a block afterwards;
2. the prefill instance is killed: requests still succeed with the same text (the decode
   instance computes the prompt itself) and the proxy counts the failed prefills;
3. the decode instance is killed too: the client gets a 503 with an OpenAI error body, and
   every process is stopped at the end.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from labkit.bench.disagg import kv_bytes_formula
from labkit.model.generate import generate
from labkit.model.loader import load_pretrained
from labkit.router.pd_cluster import PDCluster
from labkit.serve.metrics import parse_metrics

pytestmark = pytest.mark.slow
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n"]
MAX = 12


def reference(prompts: list[str]) -> list[str]:
    model, tok = load_pretrained("labkit-tiny", dtype=torch.float32)
    return [tok.decode(generate(model, tok.encode(p), MAX, ignore_eos=True)) for p in prompts]


def complete(url: str, prompt: str, stream: bool) -> httpx.Response | str:
    body = {"model": "labkit-tiny", "prompt": prompt, "max_tokens": MAX, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        return httpx.post(url + "/v1/completions", json=body, timeout=120)
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)


def settled(server, within_s: float = 15.0) -> dict[str, float]:
    """The server's metrics once its engine has published the step after the last request:
    ``/metrics`` reads a stats snapshot the engine thread refreshes after each step, which can
    trail the HTTP answer on a loaded machine. A leaked block never settles to 0."""
    deadline = time.monotonic() + within_s
    while True:
        m = metrics(server)
        if m["labkit:kv_cache_usage_perc"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_pd_cluster_equals_reference_and_survives_its_faults():
    want = reference(PROMPTS)
    c = PDCluster(1, 1, replica_args=("--num-blocks", "128", "--max-num-seqs", "8",
                                      "--dtype", "float32", "--block-size", "16"))
    with c:
        for p, w in zip(PROMPTS, want):  # 1. both hops, both answer shapes
            r = complete(c.url, p, stream=False)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == w
            assert complete(c.url, p, stream=True) == w
        blocks, nbytes = kv_bytes_formula(PROMPTS * 2)  # each prompt sent twice
        pushed, got = settled(c.prefill[0]), settled(c.decode[0])
        assert pushed["labkit:kv_transfer_blocks_total"] == blocks > 0
        assert pushed["labkit:kv_transfer_bytes_total"] == nbytes
        assert got["labkit:kv_transfer_bytes_total"] == nbytes
        for m in (pushed, got):
            assert m["labkit:kv_cache_usage_perc"] == 0  # no block left held
        assert c.state()["prefilled"] == 2 * len(PROMPTS)

        c.kill_prefill(0)  # 2. the decode instance computes the prompt itself
        r = complete(c.url, PROMPTS[0], stream=False)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[0]
        assert c.state()["prefill_failed"] >= 1

        c.kill_decode(0)  # 3. nobody to decode: a clean 503
        r = complete(c.url, PROMPTS[1], stream=False)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_decode_instance"
    assert not any(s.alive() for s in (*c.prefill, *c.decode)) and not c.router.alive()
