"""Adapter affinity (``labkit.router.policies.AdapterAffinity``): hand-computed choices (an
adapter sticks, a second one takes the free slot, the load bound spills a hot one, base requests
go least-outstanding, base names learned from /v1/models), the slot simulation on hand-counted
workloads, the measured comparison with round-robin in adapter loads per request (counts, seeded:
``labkit bench lora-router``), and the HTTP router reading its replicas' /v1/models."""

import json
import time
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI, Request

from labkit.bench import lora_router
from labkit.router.faults import serve_in_thread as serve
from labkit.router.policies import AdapterAffinity, RoundRobin, RouteKey, get_policy
from labkit.router.proxy import create_app, route_key
from labkit.sim.adapter_slots import SlotLRU, adapter_workload, simulate_adapter_fleet


@dataclass
class R:
    name: str
    outstanding: int = 0


def ask(p, model, rs):
    return p.choose(RouteKey(model=model), rs).name


def test_an_adapter_sticks_and_a_second_takes_the_free_replica():
    rs = [R("r0"), R("r1")]
    p = AdapterAffinity(max_loras=1)
    first = ask(p, "sql", rs)
    assert [ask(p, "sql", rs) for _ in range(5)] == [first] * 5
    other = ask(p, "code", rs)
    assert other != first  # the free slot (in the router's model) beats evicting sql
    assert ask(p, "sql", rs) == first and ask(p, "code", rs) == other
    assert p.holders("sql") == [first] and p.holders("code") == [other]


def test_the_new_home_does_not_depend_on_replica_order():
    names = [f"r{i}" for i in range(5)]
    homes = [ask(AdapterAffinity(), f"a{k}", [R(n) for n in names]) for k in range(8)]
    assert homes == [ask(AdapterAffinity(), f"a{k}", [R(n) for n in names[::-1]])
                     for k in range(8)]
    assert len(set(homes)) > 1  # rendezvous hashing spreads adapters, not all on r0


def test_a_hot_adapter_spills_at_the_load_bound():
    """sql's holder has 3 of m = 4 (with the new one) in flight over 2 replicas: the cap is
    ceil(1.25 * 4 / 2) = 3, so the request goes to r1, which now holds sql too."""
    p = AdapterAffinity(max_loras=2)
    rs = [R("r0"), R("r1")]
    home = ask(p, "sql", rs)
    rs = [R(home, 3), R("r1" if home == "r0" else "r0", 0)]
    assert ask(p, "sql", rs) == rs[1].name
    assert sorted(p.holders("sql")) == ["r0", "r1"]
    # unbounded (eps=None) it stays home however loaded
    q = AdapterAffinity(max_loras=2, eps=None)
    home = ask(q, "sql", [R("r0"), R("r1")])
    assert ask(q, "sql", [R(home, 50), R("r1" if home == "r0" else "r0", 0)]) == home
    # min_load: a replica under it is never over the bound
    m = AdapterAffinity(max_loras=2, min_load=4)
    home = ask(m, "sql", [R("r0"), R("r1")])
    assert ask(m, "sql", [R(home, 3), R("r1" if home == "r0" else "r0", 0)]) == home


def test_router_model_of_slots_is_an_lru_of_max_loras():
    p, rs = AdapterAffinity(max_loras=2, eps=None), [R("r0")]
    for a in ("a", "b", "a", "c"):  # a touched after b: b is the least recently used
        ask(p, a, rs)
    assert list(p.slots["r0"]) == ["a", "c"]


def test_base_requests_go_least_outstanding_and_base_names_are_learned():
    p = AdapterAffinity(base_models=["llama"])
    rs = [R("r0", 2), R("r1", 0), R("r2", 1)]
    assert ask(p, None, rs) == "r1" and ask(p, "llama", rs) == "r1"
    assert p.slots == {}  # base requests leave no adapter behind
    p.observe_models([{"id": "tiny", "parent": None}, {"id": "sql", "parent": "tiny"}])
    assert p.adapter_of(RouteKey(model="tiny")) is None
    assert p.adapter_of(RouteKey(model="sql")) == "sql"


def test_bad_arguments_are_named():
    for kw, words in (({"max_loras": 0}, "max_loras"), ({"eps": 0}, "eps"),
                      ({"min_load": -1}, "min_load")):
        with pytest.raises(ValueError, match=words):
            get_policy("adapter-affinity", **kw)


def test_slot_lru_by_hand():
    s = SlotLRU(2)
    assert s.acquire("a", set()) and s.acquire("b", set()) and s.acquire("a", set())
    assert (s.loads, s.evictions) == (2, 0)
    assert s.acquire("c", set())  # b is the least recently used
    assert list(s.resident) == ["a", "c"] and (s.loads, s.evictions) == (3, 1)
    assert s.acquire("d", {"a"}) and list(s.resident) == ["a", "d"]  # a in use: c goes
    assert not s.acquire("e", {"a", "d"})  # every slot in use: wait
    assert (s.loads, s.evictions) == (4, 2)


def test_simulation_by_hand():
    """2 replicas x 1 slot, each request one tick. A, A, B, B: round-robin sends A to both
    replicas, then B to both (4 loads); affinity keeps A on one and B on the other (2)."""
    work = [("A", 1), ("A", 1), ("B", 1), ("B", 1)]
    rr = simulate_adapter_fleet(RoundRobin(), work, num_replicas=2, max_loras=1)
    aff = simulate_adapter_fleet(AdapterAffinity(max_loras=1), work, 2, 1)
    assert (rr["slot_loads"], rr["slot_evictions"]) == (4, 2)
    assert (aff["slot_loads"], aff["slot_evictions"]) == (2, 0)
    assert aff["loads_per_request"] == 0.5
    # one replica, one slot: B arrives while A runs (3 ticks), waits 2 ticks, then evicts A
    one = simulate_adapter_fleet(RoundRobin(), [("A", 3), ("B", 1), (None, 1)], 1, 1)
    assert (one["waited_for_slot"], one["slot_loads"], one["slot_evictions"]) == (1, 2, 1)
    assert one["mean_wait_ticks"] == pytest.approx(2 / 3)


def test_workload_is_seeded_and_skewed():
    w = adapter_workload(2000, num_adapters=8, zipf_s=1.0, base_fraction=0.2, seed=3)
    assert w == adapter_workload(2000, num_adapters=8, zipf_s=1.0, base_fraction=0.2, seed=3)
    names = [a for a, _ in w if a is not None]
    share0 = names.count("adapter-0") / len(names)
    assert share0 == pytest.approx(1 / sum(1 / k for k in range(1, 9)), abs=0.03)  # 0.368
    assert sum(a is None for a, _ in w) / len(w) == pytest.approx(0.2, abs=0.03)
    assert all(4 <= n <= 12 for _, n in w)


def test_affinity_loads_adapters_less_than_half_as_often_as_round_robin(tmp_path):
    """The measured claim (counts, deterministic): 4 replicas x 2 slots, 8 Zipf adapters."""
    out = tmp_path / "lora_router.json"
    assert lora_router.main(["--quick", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    by = {r["policy"]: r for r in d["rows"]}
    rr, aff = by["round-robin"], by["adapter-affinity"]
    assert d["affinity_vs_round_robin"] == pytest.approx(
        rr["loads_per_request"] / aff["loads_per_request"], rel=1e-3)
    assert d["affinity_vs_round_robin"] > 2.0
    assert rr["loads_per_request"] > 0.4 and min(rr["adapters_per_replica"]) == 8
    # the bound's trade: unbounded affinity nearly never reloads but piles up on one replica
    free = by["adapter-affinity unbounded"]
    assert free["loads_per_request"] < by["adapter-affinity min_load=4"]["loads_per_request"] \
        < aff["loads_per_request"]
    assert free["peak_outstanding"] > aff["peak_outstanding"]
    assert max(free["adapters_per_replica"]) <= 2 * d["setup"]["max_loras"]


def test_route_key_carries_the_model():
    assert route_key({"model": "sql", "prompt": [1, 2]}).model == "sql"
    assert route_key({"model": "sql", "messages": [{"content": "hi"}]}).model == "sql"
    assert route_key({"prompt": "x"}).model is None


def _replica(name, cards, seen):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": cards}

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen.append((name, (await request.json()).get("model")))
        return {"object": "text_completion", "model": name, "choices": [{"text": "x"}]}

    return app


def test_the_router_learns_base_names_from_v1_models_and_keeps_adapters_together():
    cards = [{"id": "tiny", "object": "model"}, {"id": "sql", "parent": "tiny"},
             {"id": "code", "parent": "tiny"}]
    seen = []
    with serve(_replica("a", cards, seen)) as ua, serve(_replica("b", cards, seen)) as ub:
        app = create_app([ua, ub], "adapter-affinity")
        with serve(app) as router, httpx.Client(timeout=10) as c:
            deadline = time.monotonic() + 10
            while len(app.state.model_cards) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # the router reads /v1/models in the background
            assert app.state.policy.base_models == {"tiny"}
            for m in ["sql", "code", "sql", "code", "tiny", "tiny", "sql"]:
                assert c.post(router + "/v1/completions", json={"model": m, "prompt": "p"}
                              ).status_code == 200
    where = {}
    for name, m in seen:
        where.setdefault(m, []).append(name)
    assert len(set(where["sql"])) == 1 and len(set(where["code"])) == 1
    assert where["sql"][0] != where["code"][0]
    assert sorted(where["tiny"]) == ["a", "b"]  # learned as the base: least-outstanding rotates


def test_slot_lru_replays_lora_managers_choices(tmp_path):
    """The simulator's slots against the engine's own LoRAManager on labkit-tiny (real adapters
    in PEFT's format): one adapter per step, the same resident set and counts after each."""
    import torch

    from labkit.lora import LoRAManager, LoRARequest, apply_lora
    from labkit.lora.writer import random_adapter
    from labkit.model.loader import load_pretrained

    model, _ = load_pretrained("labkit-tiny", dtype=torch.float32)
    paths = [random_adapter(model, tmp_path / f"a{i}", ["q_proj"], r=4, seed=i)
             for i in range(1, 6)]
    _, layers = apply_lora(model, 3, 4)
    manager = LoRAManager(layers, 3, 4, max_cpu_loras=5)
    for i, p in enumerate(paths, 1):
        manager.add_lora(LoRARequest(f"a{i}", i, p))
    sim = SlotLRU(3)
    for _, a in zip(range(60), adapter_workload(60, num_adapters=5, seed=7)):
        lid = 1 if a[0] is None else int(a[0].split("-")[1]) + 1
        manager.activate({lid})
        sim.acquire(str(lid), set())
        assert sorted(int(x) for x in sim.resident) == sorted(manager.slot_lru)
        assert (sim.loads, sim.evictions) == (manager.counts["slot_loads"],
                                              manager.counts["slot_evictions"])
    assert sim.evictions > 10  # the trace did exercise the LRU
