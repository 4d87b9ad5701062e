"""LoRA adapters through the HTTP server (``--enable-lora --lora-modules``): a request's
``model`` picks an adapter and its greedy tokens equal in-process ``LLM.generate(...,
lora_request=...)``; mixed concurrent requests; the load / unload endpoints; 404 / 400 / 409;
the flags. Adapters are made by peft on a tiny random checkpoint (tests/lora's helpers)."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the lora helpers
pytest.importorskip("peft")
from lora.conftest import save_adapter, save_base  # noqa: E402

import labkit  # noqa: E402
from labkit import LoRARequest, SamplingParams  # noqa: E402
from labkit.engine.llm_engine import LLMEngine  # noqa: E402
from labkit.serve.api_server import ServeConfig  # noqa: E402
from labkit.serve.engine_core import EngineSpec, build_engine  # noqa: E402
from labkit.serve.engine_flags import check_features, lora_modules_of  # noqa: E402
from labkit.serve.launcher import ENGINE_FLAGS, ServerThread, build_parser, main  # noqa: E402
from labkit.serve.lora_routes import LoRAInUseError, engine_remove_lora  # noqa: E402
from labkit.serve.metrics import parse_metrics  # noqa: E402

BASE = "base"
PROMPT = [5, 17, 42, 8, 3, 9]
N = 8
LORA_KW = dict(enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora-serve")
    base = save_base(d / "base", "llama", seed=0)
    return base, {
        "a1": save_adapter(base, d / "a1", ["q_proj", "v_proj"], r=8, seed=11),
        "a2": save_adapter(base, d / "a2", ALL, r=16, alpha=16, seed=12),
        "a3": save_adapter(base, d / "a3", ["o_proj", "down_proj"], r=4, seed=13),
        "a4": save_adapter(base, d / "a4", ["k_proj"], r=8, seed=14),
        "r32": save_adapter(base, d / "r32", ["q_proj"], r=32, seed=15),
    }


@pytest.fixture(scope="module")
def want(folders):
    """Greedy tokens per model name from in-process LLM.generate with the adapter."""
    base, paths = folders
    llm = labkit.LLM(model=str(base), dtype=torch.float32, device="cpu", **LORA_KW)
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    out = {}
    for i, name in enumerate([BASE, "a1", "a2", "a3"]):
        lora = None if name == BASE else LoRARequest(name, i, str(paths[name]))
        out[name] = llm.generate(prompt_token_ids=[PROMPT], sampling_params=sp,
                                 lora_request=lora)[0].outputs[0].token_ids
    assert len({tuple(v) for v in out.values()}) == 4  # every adapter changes the output
    return out


@pytest.fixture(scope="module")
def server(folders):
    base, paths = folders
    eng, tok, _ = build_engine(str(base), dtype="float32", device="cpu", num_blocks=64,
                               max_num_seqs=8, **LORA_KW)
    cfg = ServeConfig(model_name=BASE, lora_modules={"a1": str(paths["a1"]),
                                                      "a2": str(paths["a2"])})
    with ServerThread(eng, tok, cfg) as srv:
        yield srv


def complete(srv, model, max_tokens=N, **kw):
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **kw}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=60)


def tokens(r):
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def post(srv, path, **body):
    return httpx.post(srv.url + path, json=body, timeout=60)


def test_model_field_picks_the_adapter(server, want):
    for name in (BASE, "a1", "a2"):
        r = complete(server, name)
        assert tokens(r) == want[name], name
        assert r.json()["model"] == name
    r = complete(server, "a9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_mixed_concurrent_requests(server, want):
    names = [BASE, "a1", "a2"] * 3
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: tokens(complete(server, n)), names))
    assert got == [want[n] for n in names]


def test_models_lists_adapters_with_parent(server):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert data[0]["id"] == BASE and "parent" not in data[0]
    by_id = {d["id"]: d for d in data[1:]}
    assert {"a1", "a2"} <= set(by_id)
    assert all(d["parent"] == BASE for d in by_id.values())


def test_load_and_unload_at_run_time(server, folders, want):
    _, paths = folders
    assert complete(server, "a3").status_code == 404
    r = post(server, "/v1/load_lora_adapter", lora_name="a3", lora_path=str(paths["a3"]))
    assert r.status_code == 200, r.text
    assert tokens(complete(server, "a3")) == want["a3"]
    assert "a3" in {d["id"] for d in httpx.get(server.url + "/v1/models").json()["data"]}
    assert post(server, "/v1/unload_lora_adapter", lora_name="a3").status_code == 200
    assert complete(server, "a3").status_code == 404
    r = post(server, "/v1/unload_lora_adapter", lora_name="a3")
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found"


@pytest.mark.parametrize("name,path,expect", [
    ("big", "r32", "max_lora_rank"),          # rank 32 > --max-lora-rank 16
    ("nowhere", "/no/such/folder", "not a PEFT adapter folder"),
    ("a1", "a3", "already served"),           # a name in use
    (BASE, "a3", "already served"),           # the base model's name
    ("", "a3", "lora_name"),
])
def test_bad_loads_are_400_naming_the_problem(server, folders, name, path, expect):
    _, paths = folders
    r = post(server, "/v1/load_lora_adapter", lora_name=name,
             lora_path=str(paths.get(path, path)))
    assert r.status_code == 400 and expect in r.json()["error"]["message"], r.text
    assert complete(server, name or "x").status_code in (200, 404)  # nothing half-loaded
    assert name not in {"big", "nowhere"} or complete(server, name).status_code == 404


def test_unload_in_use_is_refused_and_the_request_finishes(server, folders):
    _, paths = folders
    assert post(server, "/v1/load_lora_adapter", lora_name="a4",
                lora_path=str(paths["a4"])).status_code == 200
    body = {"model": "a4", "prompt": PROMPT, "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["model"] == "a4"
        r = post(server, "/v1/unload_lora_adapter", lora_name="a4")
        assert r.status_code == 409 and r.json()["error"]["code"] == "lora_in_use", r.text
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    text = [json.loads(x[6:])["choices"][0] for x in rest[:-1] if json.loads(x[6:])["choices"]]
    assert text[-1]["finish_reason"] == "length"
    assert post(server, "/v1/unload_lora_adapter", lora_name="a4").status_code == 200


def test_engine_refuses_to_remove_an_adapter_a_live_request_uses(folders):
    base, paths = folders
    eng, _, _ = build_engine(str(base), dtype="float32", device="cpu", num_blocks=32,
                             **LORA_KW)
    eng.add_request("r", None, SamplingParams(max_tokens=4), prompt_token_ids=PROMPT,
                    lora_request=LoRARequest("a1", 7, str(paths["a1"])))
    eng.step()
    with pytest.raises(LoRAInUseError, match="1 live request"):
        engine_remove_lora(7, eng)
    while eng.has_unfinished_requests():
        eng.step()
    assert engine_remove_lora(7, eng) is True
    assert eng.executor.manager.stats()["resident"] == []
    assert engine_remove_lora(7, eng) is False


def test_metrics_show_slots_and_loads(server, want):
    tokens(complete(server, "a1"))
    m = parse_metrics(httpx.get(server.url + "/metrics").text)
    assert m["labkit:lora_slots_total"] == 2
    assert 1 <= m["labkit:lora_slots_used"] <= 2
    assert m["labkit:lora_slot_loads_total"] >= 2  # a1 and a2 at least
    assert m["labkit:lora_adapters_served"] >= 2
    assert m["labkit:lora_requests_running"] == 0  # all finished


def test_cli_parses_the_lora_flags(tmp_path):
    args = build_parser().parse_args(["m", "--enable-lora", "--lora-modules", "sql=/a",
                                      "code=/b", "--max-loras", "3", "--max-lora-rank", "32",
                                      "--max-cpu-loras", "6"])
    assert lora_modules_of(args) == {"sql": "/a", "code": "/b"}
    kw = {k: getattr(args, k) for k in ENGINE_FLAGS}
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"], kw["max_cpu_loras"]) == \
        (True, 3, 32, 6)
    assert build_parser().parse_args(["m"]).enable_lora is None
    with pytest.raises(ValueError, match="--enable-lora"):
        lora_modules_of(build_parser().parse_args(["m", "--lora-modules", "sql=/a"]))
    with pytest.raises(ValueError, match="more than once"):
        lora_modules_of(build_parser().parse_args(["m", "--enable-lora", "--lora-modules",
                                                   "a=/x", "a=/y"]))
    with pytest.raises(ValueError, match="only apply with --enable-lora"):
        check_features("m", {"max_loras": 2})
    with pytest.raises(SystemExit) as e:
        main(["m", "--lora-modules", "noequals"])
    assert e.value.code == 2


@pytest.mark.slow
def test_engine_process_serves_adapters(folders, want):
    """The other engine home: the flags travel in a pickled EngineSpec, the adapter in the add
    command, and load / unload as picklable calls into the engine process."""
    base, paths = folders
    spec = EngineSpec(str(base), "float32", "cpu", {"num_blocks": 64, **LORA_KW}, 1)
    with ServerThread(spec, None, ServeConfig(model_name=BASE,
                                              lora_modules={"a1": str(paths["a1"])})) as srv:
        assert tokens(complete(srv, "a1")) == want["a1"]
        assert post(srv, "/v1/load_lora_adapter", lora_name="a3",
                    lora_path=str(paths["a3"])).status_code == 200
        assert tokens(complete(srv, "a3")) == want["a3"]
        assert post(srv, "/v1/unload_lora_adapter", lora_name="a3").status_code == 200
        r = post(srv, "/v1/load_lora_adapter", lora_name="big", lora_path=str(paths["r32"]))
        assert r.status_code == 400 and "max_lora_rank" in r.text


def test_engine_without_lora_refuses_loads(folders, labkit_tiny):
    _, paths = folders
    m, tok = labkit_tiny
    eng = LLMEngine.from_model(m, tok, block_size=16, num_blocks=16)
    with ServerThread(eng, tok, ServeConfig(model_name=BASE)) as srv:
        r = post(srv, "/v1/load_lora_adapter", lora_name="a1", lora_path=str(paths["a1"]))
        assert r.status_code == 400 and "enable_lora" in r.json()["error"]["message"]
