"""Hot weight updates through ``labkit serve`` (``POST /v1/admin/update_weights``): requests in
flight at the swap all complete, each old-weights tokens up to the swap and new-weights tokens
after it; a prefix cached before the swap is not reused; a bad folder is a 400 with an OpenAI
error body and the old weights keep serving; the engine process path (picklable calls).

References: labkit.model.generate on a model loaded fresh from each folder."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from operator import methodcaller

import httpx
import pytest

from labkit.bench.ops_hot_swap import spans_the_swap
from labkit.engine.invariants import assert_no_leaks
from labkit.model import testing
from labkit.model.generate import generate
from labkit.model.loader import load_model
from labkit.serve.api_server import ServeConfig
from labkit.serve.engine_core import EngineSpec, build_engine
from labkit.serve.launcher import ServerThread

pytest.importorskip("transformers")
N = 12
LONG = 64  # long enough that the swap lands while they decode
PROMPTS = [[(7 * i + 3 + j) % 128 for i in range(13)] for j in range(5)]
KW = dict(block_size=4, num_blocks=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    old = testing.tiny_llama_checkpoint(d / "old", 0)
    new = testing.tiny_llama_checkpoint(d / "new", 1)
    wide = testing.tiny_llama_checkpoint(d / "wide", 2, intermediate_size=64)
    return {"old": old, "new": new, "wide": wide,
            "models": (load_model(old), load_model(new))}


def complete(srv, prompt, n=N):
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=120)


def tokens(r, n=N):
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == n
    return choice["token_ids"]


def update(srv, path, version):
    return httpx.post(srv.url + "/v1/admin/update_weights", timeout=120,
                      json={"path": str(path), "version": version})


@pytest.fixture
def server(folders):
    eng, tok, _ = build_engine(str(folders["old"]), dtype="float32", device="cpu", **KW)
    with ServerThread(eng, tok, ServeConfig(model_name="m")) as srv:
        yield srv


def test_swap_under_load_loses_no_request(server, folders):
    old, new = folders["models"]
    assert tokens(complete(server, PROMPTS[0])) == generate(old, PROMPTS[0], N)  # cached
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futs = [pool.submit(complete, server, p, LONG) for p in PROMPTS]
        deadline = time.monotonic() + 30
        while server.call(methodcaller("stats"))["num_running"] < 2:
            assert time.monotonic() < deadline, "requests never started"
            time.sleep(0.005)
        r = update(server, folders["new"], "v2")
        results = [tokens(f.result(), LONG) for f in futs]  # every one completes
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["version"] == "v2" and info["previous_version"] is None
    assert info["num_recomputed"] >= 1 and info["pause_ms"] > 0
    for got, p in zip(results, PROMPTS):
        assert spans_the_swap(got, p, old, new)
    # the prompt cached under the old weights: served as a fresh new-weights engine would
    assert tokens(complete(server, PROMPTS[0])) == generate(new, PROMPTS[0], N)
    assert httpx.get(server.url + "/v1/admin/weights").json() == {"version": "v2"}
    server.call(assert_no_leaks)


def test_bad_update_is_a_400_and_old_weights_keep_serving(server, folders):
    old, _ = folders["models"]
    r = update(server, folders["wide"], "v2")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_weights" and err["type"] == "invalid_request_error"
    assert "has shape" in err["message"] and "old ones keep serving" in err["message"]
    for body, param in (({"version": "v2"}, "path"), ({"path": "x", "version": 3}, "version")):
        r = httpx.post(server.url + "/v1/admin/update_weights", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = httpx.post(server.url + "/v1/admin/update_weights", content=b"{not json")
    assert r.status_code == 400 and "error" in r.json()
    assert update(server, folders["old"] / "missing", "v2").status_code == 400
    assert tokens(complete(server, PROMPTS[1])) == generate(old, PROMPTS[1], N)
    assert httpx.get(server.url + "/v1/admin/weights").json() == {"version": None}


def test_update_in_an_engine_process(folders):
    """``--engine-mode process``: the update is a picklable call into the engine process."""
    _, new = folders["models"]
    spec = EngineSpec(str(folders["old"]), "float32", "cpu", KW, 1)
    with ServerThread(spec, None, ServeConfig(model_name="m")) as srv:
        assert update(srv, folders["new"], "v2").status_code == 200
        assert tokens(complete(srv, PROMPTS[2])) == generate(new, PROMPTS[2], N)
        r = update(srv, folders["wide"], "v3")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_weights"
        r = update(srv, folders["new"], "v2")
        assert r.status_code == 400 and r.json()["error"]["param"] == "version"


