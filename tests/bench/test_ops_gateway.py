"""``labkit bench ops gateway``: its config is one the gateway accepts, and its summary counts
answers by the pool that gave them (the live run starts two servers: run by hand)."""

from __future__ import annotations

from labkit.bench.ops import describe
from labkit.bench.ops_gateway import QUICK, _summary, gateway_config
from labkit.router.gateway import GatewayConfig


def test_config_is_valid_for_the_gateway():
    cfg = GatewayConfig.from_dict(gateway_config({"premium": "http://127.0.0.1:1",
                                                  "standard": "http://127.0.0.1:2"}, QUICK))
    assert cfg is not None


def test_summary_attributes_answers_and_checks_them_against_the_pools_model():
    texts = {"premium": {0: "a", 1: "b"}, "standard": {0: "a", 1: "c"}}
    results = [
        {"key": "premium", "status": 200, "latency_s": 0.1, "i": 0, "pool": "premium",
         "text": "a"},
        {"key": "premium", "status": 200, "latency_s": 0.3, "i": 1, "pool": "standard",
         "text": "c"},
        {"key": "standard", "status": 429, "latency_s": 0.01, "i": 0, "pool": None,
         "text": None},
        {"key": "standard", "status": 503, "latency_s": 0.02, "i": 1, "pool": None,
         "text": None},
    ]
    prem, std = _summary("p", results, texts)
    assert (prem["ok"], prem["answered_by_premium"], prem["answered_by_standard"]) == (2, 1, 1)
    assert prem["answers_match_pool"] is True and prem["latency_p50_ms"] == 200.0
    assert (std["rate_limited_429"], std["unavailable_503"], std["ok"]) == (1, 1, 0)
    results[1]["text"] = "b"  # the premium model's answer, from the standard pool: wrong
    assert _summary("p", results, texts)[0]["answers_match_pool"] is False


def test_listed():
    assert any(line.startswith("gateway:") for line in describe())
