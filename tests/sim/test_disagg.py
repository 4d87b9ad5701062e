"""The P/D disaggregation simulator against hand computations: KV bytes from the geometry, the
transfer from the link, one request's timeline from ``cost.step_time``, the interference a
colocated prefill causes, and the goodput search's orderings (looser SLO, faster link)."""

import pytest

from labkit.sim.cost import step_time
from labkit.sim.disagg import (
    KV_LINKS,
    Deployment,
    SimRequest,
    Workload,
    attainment_at,
    goodput,
    kv_bytes_per_request,
    simulate_deployment,
    transfer_s,
)

M, G = "llama-3-8b", "h100-sxm"


def test_kv_bytes_from_the_geometry():
    # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16; K and V.
    assert kv_bytes_per_request(M, 1000) == 1000 * 2 * 32 * 8 * 128 * 2 == 131_072_000
    assert kv_bytes_per_request("llama-2-7b", 10) == 10 * 2 * 32 * 32 * 128 * 2  # no GQA


def test_transfer_time_scales_with_the_link():
    b = 128 * 2**20
    times = {name: transfer_s(b, name) for name in KV_LINKS}
    for name, link in KV_LINKS.items():
        assert times[name] - link.hop_latency_s == pytest.approx(b / link.bandwidth, rel=1e-9)
    assert times["nvlink4"] < times["pcie5"] < times["ib-ndr"] < times["eth-100g"]
    assert times["eth-100g"] / times["ib-ndr"] == pytest.approx(4.0, rel=1e-3)  # 100 vs 400 Gb/s
    with pytest.raises(ValueError, match="unknown link"):
        transfer_s(b, "carrier-pigeon")


def _solo_decode_s(prompt: int, out: int) -> float:
    return sum(step_time(M, G, 0, 1, prompt + k) for k in range(1, out))


def test_one_request_timeline_by_hand():
    L, out = 1000, 20
    prefill = step_time(M, G, L, 0, 0, attention_pairs=L * (L + 1) // 2)
    [r] = simulate_deployment(Deployment(0, 1), [SimRequest(0.5, L, out, ready=0.5)], M, G)
    assert r.ttft == pytest.approx(prefill, rel=1e-9)
    assert r.finish - r.first_token == pytest.approx(_solo_decode_s(L, out), rel=1e-9)
    for link in ("nvlink4", "eth-100g"):
        [d] = simulate_deployment(Deployment(1, 1, link), [SimRequest(0.5, L, out, ready=0.5)],
                                  M, G)
        xfer = transfer_s(kv_bytes_per_request(M, L), link)
        assert d.ttft == pytest.approx(prefill + xfer, rel=1e-9)
        assert d.finish - d.first_token == pytest.approx(_solo_decode_s(L, out), rel=1e-9)


def test_a_colocated_prefill_stalls_running_decodes_and_disaggregation_does_not():
    L, out = 1000, 50

    def pair(dep):
        a = SimRequest(0.0, L, out, ready=0.0)
        b = SimRequest(0.1, L, 2, ready=0.1)  # arrives while a decodes (0.017 to 0.28 s)
        return simulate_deployment(dep, [a, b], M, G)[0]

    def solo(dep):
        return simulate_deployment(dep, [SimRequest(0.0, L, out, ready=0.0)], M, G)[0]

    stall = step_time(M, G, L, 0, 0, attention_pairs=L * (L + 1) // 2)
    co = Deployment(0, 1)
    assert pair(co).finish - solo(co).finish >= stall
    pd = Deployment(1, 1)
    assert 0 <= pair(pd).finish - solo(pd).finish < stall / 5  # b's KV joins the batch, no stall


SMALL = {"num_requests": 300, "prompt_range": (512, 2048), "output_range": (64, 512)}


def test_a_trickle_meets_every_slo():
    wl = Workload(**SMALL)
    for dep in (Deployment(0, 1), Deployment(1, 1), Deployment(2, 1, "eth-100g")):
        assert attainment_at(dep, 0.2, wl, M, G) == 1.0


def test_goodput_orderings():
    tight, loose = Workload(tpot_slo=0.015, **SMALL), Workload(tpot_slo=0.1, **SMALL)
    co, pd = Deployment(0, 2), Deployment(1, 1)
    g = {(d, w): goodput(d, w, 0.9, M, G, iters=6) for d in (co, pd) for w in (tight, loose)}
    for d in (co, pd):
        assert 0 < g[d, tight] <= g[d, loose]  # a looser SLO passes wherever a tight one does
    # Generous TPOT: only TTFT binds, and two colocated GPUs both prefill: not worse than 1:1.
    assert g[co, loose] >= g[pd, loose]
    # Tight TPOT: colocated decodes wait for every prefill; 1:1 keeps them apart and wins.
    assert g[pd, tight] > g[co, tight]
    assert goodput(pd, tight, 0.9, M, G, iters=6) == g[pd, tight]  # deterministic
    # A slower link only delays each request's first token.
    assert goodput(Deployment(1, 1, "eth-100g"), loose, 0.9, M, G, iters=6) <= g[pd, loose]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="decode >= 1"):
        simulate_deployment(Deployment(1, 0), [SimRequest(0, 10, 2)], M, G)
    with pytest.raises(ValueError, match="target attainment"):
        goodput(Deployment(0, 1), Workload(**SMALL), 1.5)
    with pytest.raises(ValueError, match="exceeds"):
        simulate_deployment(Deployment(0, 1), [SimRequest(0, 10**7, 2)], M, G)
