"""The length-aware router policy: long prompts to the long pool (the last replicas by name),
the rest to the short pool, least outstanding within each, the other pool when one is empty;
lengths from token ids or estimated from text; bad settings named. And the experiment on the
fleet simulator keeps short requests from queueing behind long prefills."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from labkit.router.policies import LengthAware, RouteKey, get_policy


@dataclass
class Rep:
    name: str
    outstanding: int = 0


def test_long_prompts_go_to_the_long_pool_least_outstanding_within_each():
    reps = [Rep("r2", 0), Rep("r0", 3), Rep("r1", 1), Rep("r3", 5)]
    p = LengthAware(threshold_tokens=100, long_replicas=2)
    short, long_ = p.pools(reps)
    assert {r.name for r in short} == {"r0", "r1"} and {r.name for r in long_} == {"r2", "r3"}
    assert p.choose(RouteKey(token_ids=list(range(99))), reps).name == "r1"
    assert p.choose(RouteKey(token_ids=list(range(100))), reps).name == "r2"
    assert p.choose(RouteKey(text="x" * 400), reps).name == "r2"  # 400 chars / 4 = 100 tokens
    assert p.choose(RouteKey(text="x" * 396), reps).name == "r1"


def test_an_empty_pool_falls_back_to_the_other():
    p = LengthAware(threshold_tokens=10, long_replicas=1)
    only = [Rep("solo")]
    assert p.choose(RouteKey(token_ids=[1] * 50), only).name == "solo"
    assert p.choose(RouteKey(token_ids=[1]), only).name == "solo"


@pytest.mark.parametrize("kw,words", [({"threshold_tokens": 0}, "threshold_tokens"),
                                      ({"long_replicas": 0}, "long_replicas"),
                                      ({"chars_per_token": 0}, "chars_per_token")])
def test_bad_settings_are_named(kw, words):
    with pytest.raises(ValueError, match=words):
        LengthAware(**kw)


def test_registered_for_the_router_cli():
    p = get_policy("length-aware", threshold_tokens=512, long_replicas=2)
    assert isinstance(p, LengthAware) and p.threshold == 512


def test_simulated_pools_protect_the_short_requests_tail():
    """At a rate where long prefills queue, the short requests' TTFT p99 under length-aware is
    below least-outstanding's (the mechanism the bench measures; a seeded simulation)."""
    from labkit.bench import ops_length

    out = ops_length.run(quick=True, sizes={"num_requests": 300, "rates": [40.0],
                                            "reference_rate": 40.0})
    assert out["short_p99_ratio"] < 1.0
    la = next(r for r in out["rows"] if r["policy"] == "length-aware")
    assert la["num_long"] > 0 and la["num_short"] > la["num_long"]
