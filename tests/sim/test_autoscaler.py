"""The autoscaler's rule by hand, and the fleet it drives: cold starts, draining, billing."""

from dataclasses import replace

import pytest

from labkit.router.policies import LeastOutstanding, PrefixAffinity, RoundRobin
from labkit.sim.autoscaler import Autoscaler, AutoscalerConfig
from labkit.sim.fleet import Fleet, FleetConfig
from labkit.sim.traces import poisson_trace
from labkit.sim.workloads import RequestSpec


def test_hpa_rule_by_hand():
    a = Autoscaler(AutoscalerConfig(target=32, max_replicas=10, cooldown_s=0))
    assert a.desired(0, [40, 40], 2) == 3  # ceil(80 / 32)
    assert a.desired(1, [34, 30], 2) == 2  # mean 32: within 10% tolerance
    assert a.desired(2, [400, 400], 2) == 10  # clamped to max
    assert a.desired(3, [0, 0, 0], 3) == 1  # clamped to min
    assert a.desired(4, [40], 3) == 2  # counts starting replicas: 3 current, 2 wanted


def test_scale_down_is_stabilised_scale_up_is_not():
    a = Autoscaler(AutoscalerConfig(target=10, cooldown_s=5))
    assert a.desired(0, [50], 1) == 5
    assert a.desired(1, [0] * 5, 5) == 5  # a dip: the window still holds the 5
    assert a.desired(4, [0] * 5, 5) == 5
    assert a.desired(6, [0] * 5, 5) == 1  # the 5 left the 5 s window
    b = Autoscaler(AutoscalerConfig(target=10, scale_up_cooldown_s=3))
    assert b.desired(0, [20], 1) == 2
    assert b.desired(1, [40, 40], 2) == 2  # too soon after the last scale-up
    assert b.desired(3, [40, 40], 2) == 8


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="unknown autoscaler metric"):
        AutoscalerConfig(metric="cpu")
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalerConfig(min_replicas=5, max_replicas=2)


def test_static_fleet_bills_every_replica_to_the_end():
    # the second request is still running when the trace ends: the day repeats, so that tail
    # is the next day's bill (as a static fleet's replicas x day is), not this one's
    specs = [RequestSpec(64, 16, 0.5), RequestSpec(64, 1024, 9.9)]
    res = Fleet(RoundRobin(), 3).run(specs, duration=10.0)
    assert res.replica_seconds == pytest.approx(30.0) and res.end == 10.0
    assert [r["replica"] for r in res.requests] == ["replica-0", "replica-1"]
    assert res.requests[1]["arrival"] + res.requests[1]["e2e"] > 10.0


def test_cold_start_then_drain():
    # 2 s of heavy load, then silence: the fleet grows (replicas ready cold_start later) and
    # shrinks back to min_replicas one cooldown after the load ends
    tr = poisson_trace(rate=150, duration=2.0, num_tenants=4, seed=0)
    cfg = AutoscalerConfig(target=8, max_replicas=4, interval_s=0.25, cooldown_s=1.0)
    fleet = Fleet(LeastOutstanding(), 1, FleetConfig(token_scale=8), Autoscaler(cfg),
                  cold_start_s=0.5)
    res = fleet.run(tr.specs, duration=12.0)
    new = [r for r in res.replicas if r["name"] != "replica-0"]
    assert new, "the load never triggered a scale-up"
    assert all(r["ready_at"] == pytest.approx(r["launched_at"] + 0.5) for r in new)
    served = {r["replica"] for r in res.requests}
    assert served - {"replica-0"}  # the new replicas took traffic
    first_ready = min(r["ready_at"] for r in new)
    assert all(r["arrival"] >= first_ready for r in res.requests if r["replica"] != "replica-0")
    assert res.timeline[-1]["ready"] == 1  # back to min after the quiet period
    billed = sum(r["stopped_at"] - r["launched_at"] for r in res.replicas)
    assert res.replica_seconds == pytest.approx(billed) and billed < 4 * 12.0


@pytest.mark.slow
def test_affinity_beats_round_robin_on_hit_rate_and_respects_the_bound():
    tr = poisson_trace(rate=60, duration=4.0, num_tenants=24, seed=1)
    cfg = FleetConfig(token_scale=8)
    rr = Fleet(RoundRobin(), 8, cfg).run(tr.specs, tr.duration)
    pa = Fleet(PrefixAffinity(eps=0.25), 8, cfg).run(tr.specs, tr.duration)
    assert pa.hit_rate > rr.hit_rate + 0.1
    per = [r["num_requests"] for r in pa.replicas]
    assert sum(per) == len(tr.specs) and min(per) > 0  # the bound spreads the hot tenants


def test_seasonal_forecast_learns_the_day_and_not_yesterdays_burst():
    import numpy as np

    from labkit.sim.autoscaler import SeasonalForecast
    from labkit.sim.traces import diurnal, thinning

    day, peak = 200.0, 300.0
    rate = diurnal(day, peak, 0.2)
    rng = np.random.default_rng(0)
    base = thinning(rate, peak, day, rng)
    f = SeasonalForecast(base, day)
    assert max(abs(f.rate(t) - rate(t)) / rate(t) for t in np.arange(0, day, 4.0)) < 0.05
    # yesterday had a burst at the peak (+75% for 4 s): the median-smoothed fit barely moves,
    # a fit of the raw counts (smooth=1) is pulled up around it
    burst = np.concatenate([base, rng.uniform(130.0, 134.0, 900)])
    moved = SeasonalForecast(burst, day).rate(132.0) - f.rate(132.0)
    raw = SeasonalForecast(burst, day, smooth=1).rate(132.0) - \
        SeasonalForecast(base, day, smooth=1).rate(132.0)
    assert abs(moved) < 0.01 * peak < 0.04 * peak < raw
    with pytest.raises(ValueError, match="odd smooth"):
        SeasonalForecast(base, day, smooth=4)
    # today 20% busier than yesterday: the forecast 13 s ahead scales with it; a burst in the
    # last 30 s (+60% for 4 s) adds its arrivals to the level (~8%)
    today = thinning(lambda t: 1.2 * rate(t), 1.2 * peak, day, rng)
    assert f.scaled(100.0, 13.0, today, 30.0) / f.rate(113.0) == pytest.approx(1.2, rel=0.03)
    extra = rng.uniform(95.0, 99.0, int(4 * 0.6 * 1.2 * rate(97.0)))
    hot = np.concatenate([today, extra])
    assert f.level(100.0, hot, 30.0) - f.level(100.0, today, 30.0) == pytest.approx(
        len(extra) / (30 * f.rate(85.0)), rel=0.05)
    assert f.level(0.5, today, 30.0) == 1.0  # nothing to compare yet


class _Step:
    """A perfect forecast of a load that steps from quiet to ``high`` requests/s at ``at``."""

    def __init__(self, at: float, high: float) -> None:
        self.at, self.high = at, high

    def rate(self, t: float) -> float:
        return self.high if t >= self.at else 2.0

    def scaled(self, t: float, lead_s: float, arrivals, window_s: float) -> float:
        return self.rate(t + lead_s)  # today's level is yesterday's


def test_a_forecast_read_one_cold_start_ahead_has_replicas_ready_when_the_load_comes():
    """The load steps up at t = 6; a replica takes 2 s to start. Read 2.5 s ahead, the
    forecast launches them at 3.5-4 s and they serve from the step on; the reactive rule sees
    the step only after it and launches them after it (each run has the same trace)."""
    quiet = poisson_trace(rate=2, duration=6.0, num_tenants=4, seed=0).specs
    busy = [replace(s, arrival_time=s.arrival_time + 6.0)
            for s in poisson_trace(rate=90, duration=1.5, num_tenants=4, seed=1).specs]
    cfg = AutoscalerConfig(metric="rps", target=30, max_replicas=4, interval_s=0.5,
                           window_s=1.0, lead_s=2.5, cooldown_s=5.0)
    ready = {}
    for name, fc in (("forecast", _Step(6.0, 90.0)), ("reactive", None)):
        fleet = Fleet(LeastOutstanding(), 1, FleetConfig(token_scale=8), Autoscaler(cfg),
                      cold_start_s=2.0, forecast=fc)
        res = fleet.run(quiet + busy, duration=8.0)
        ready[name] = sorted(r["ready_at"] for r in res.replicas if r["name"] != "replica-0")
    assert len(ready["forecast"]) >= 2 and all(t <= 6.0 for t in ready["forecast"][:2])
    assert ready["reactive"] and all(t > 6.0 for t in ready["reactive"])
    with pytest.raises(ValueError, match="lead_s"):
        AutoscalerConfig(lead_s=-1)
