"""Adapter affinity over real LoRA servers: two ``labkit serve --enable-lora`` apps (the same
server as the CLI's, in threads on 127.0.0.1, one adapter slot each, ``--lora-modules x=... y=...``
with peft adapters on a tiny random checkpoint) behind the router app, everything stopped at the
end. Round-robin makes the replicas copy adapters into their slot 5 times for 6 requests;
adapter affinity keeps each adapter on one replica (at most one load each), read from the
replicas' own ``labkit:lora_slot_loads_total``. (``tests/serve/test_lora_serve.py`` tests the
CLI flags themselves.)"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the lora helpers
pytest.importorskip("peft")
from lora.conftest import save_adapter, save_base  # noqa: E402

from labkit.router.faults import serve_in_thread  # noqa: E402
from labkit.router.proxy import create_app  # noqa: E402
from labkit.serve.api_server import ServeConfig  # noqa: E402
from labkit.serve.engine_core import build_engine  # noqa: E402
from labkit.serve.launcher import ServerThread  # noqa: E402
from labkit.serve.metrics import parse_metrics  # noqa: E402

ORDER = ["x", "x", "y", "y", "x", "y"]


def slot_loads(urls: list[str]) -> list[float]:
    return [parse_metrics(httpx.get(u + "/metrics").text)["labkit:lora_slot_loads_total"]
            for u in urls]


def send(router: str, model: str) -> str:
    body = {"model": model, "prompt": [5, 17, 42, 8], "max_tokens": 2, "temperature": 0}
    r = httpx.post(router + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.headers["x-labkit-replica"]


def test_adapter_affinity_keeps_each_adapter_on_one_replica(tmp_path):
    base = save_base(tmp_path / "base", "llama", seed=0)
    mods = {"x": str(save_adapter(base, tmp_path / "x", ["q_proj", "v_proj"], r=8, seed=1)),
            "y": str(save_adapter(base, tmp_path / "y", ["o_proj", "down_proj"], r=4, seed=2))}
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(2):
            eng, tok, _ = build_engine(str(base), dtype="float32", device="cpu", num_blocks=64,
                                       max_num_seqs=4, block_size=4, enable_lora=True,
                                       max_loras=1, max_lora_rank=8)
            srv = stack.enter_context(ServerThread(eng, tok, ServeConfig(
                model_name="base", lora_modules=mods)))
            urls.append(srv.url)
        app = create_app(urls, "round-robin")
        router = stack.enter_context(serve_in_thread(app))
        # one request at a time, one slot per replica: round-robin sends x, y, x to replica-0
        # and x, y, y to replica-1: 3 + 2 loads
        l0 = slot_loads(urls)
        assert [send(router, m) for m in ORDER] == ["replica-0", "replica-1"] * 3
        l1 = slot_loads(urls)
        assert [b - a for a, b in zip(l0, l1)] == [3, 2]
        deadline = time.monotonic() + 10
        while len(app.state.model_cards) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the router reads /v1/models in the background
        r = httpx.post(router + "/admin/policy",
                       json={"policy": "adapter-affinity", "max_loras": 1})
        assert r.status_code == 200 and app.state.policy.base_models == {"base"}
        where: dict[str, set[str]] = {"x": set(), "y": set(), "base": set()}
        for m in ORDER * 2 + ["base", "base"]:
            where[m].add(send(router, m))
        l2 = slot_loads(urls)
        assert len(where["x"]) == len(where["y"]) == 1 and where["x"] != where["y"]
        assert sum(l2) - sum(l1) <= 2  # each replica copies its adapter in at most once
        assert where["base"] == {"replica-0", "replica-1"}  # base: least-outstanding rotates
