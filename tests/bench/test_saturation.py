"""The checks a serving benchmark runs on its own load before it reports a ratio (issue 27):
hand-built request timelines with a known answer."""

from __future__ import annotations

import math

from labkit.bench.saturation import knee_check, peak_in_flight, queue_check
from labkit.bench.serve_client import RequestResult


def _r(start: float, e2e: float, ok: bool = True) -> RequestResult:
    return RequestResult(ok=ok, start=start, e2e=e2e)


def test_peak_in_flight_counts_overlaps_and_not_back_to_back_requests():
    assert peak_in_flight([]) == 0
    assert peak_in_flight([_r(0, 1), _r(1, 1), _r(2, 1)]) == 1  # each ends as the next starts
    assert peak_in_flight([_r(0, 3), _r(1, 3), _r(2, 3), _r(5.5, 1)]) == 3


def test_a_server_that_keeps_up_is_inconclusive_and_says_why():
    # 2 slots, 20 heavy requests offered at 10/s, each done in 0.05 s: never more than 1 open
    heavy = [_r(i / 10, 0.05) for i in range(20)]
    c = queue_check(heavy, heavy, slots=2, offered_heavy_rate=10.0)
    assert c["peak_in_flight"] == 1
    assert c["verdict"].startswith("inconclusive: ")
    assert "no queue formed" in c["verdict"] and "backlog never grew" in c["verdict"]


def test_a_growing_backlog_is_conclusive():
    # 2 slots serving 2 requests per second (0.5 s each, 2 at a time) against 10/s offered: the
    # k-th request finishes at about k / 2 s, so the backlog grows the whole run
    heavy = [_r(i / 10, (i // 2 + 1) * 0.5 - i / 10) for i in range(40)]
    c = queue_check(heavy, heavy, slots=2, offered_heavy_rate=10.0)
    assert c["peak_in_flight"] >= 4 and c["heavy_done_req_s"] < 9.0
    assert c["verdict"] == "conclusive"


def test_knee_check_wants_a_finite_rate_at_or_above_capacity():
    sweep = [{"request_rate": 2.0}, {"request_rate": 4.0}, {"request_rate": math.inf}]
    assert knee_check(sweep, capacity_req_s=4.2) == "conclusive"
    v = knee_check(sweep, capacity_req_s=12.6)
    assert v.startswith("inconclusive: ") and "4 req/s" in v
    assert knee_check([{"request_rate": math.inf}], 3.0).startswith("inconclusive: ")


def test_the_sweep_offers_fractions_of_the_capacity_it_measured_first(monkeypatch):
    """Fixed rates (4 and 8 req/s) never reached a 14 req/s server's knee; the sweep now
    measures the burst first and offers fractions of it, so its top rate passes capacity."""
    from types import SimpleNamespace

    from labkit.bench import serve

    offered = []

    def fake_load(url, model, reqs, bar, rate=None, **kw):
        offered.append(rate)
        done = min(rate, 10.0)  # a server that finishes at most 10 req/s
        return [RequestResult(ok=True, start=i / done, e2e=0.01) for i in range(20)], 20 / done

    monkeypatch.setattr(serve, "_load", fake_load)
    cfg = dict(serve.QUICK)
    args = SimpleNamespace(model="m", burstiness=1.0, seed=0)
    rows = serve._sweep("http://x", args, [None] * 20, cfg, None, {"ttft": 1e9, "tpot": 1e9})
    assert offered[0] == math.inf  # the burst first
    cap = rows[-1]["request_throughput"]
    assert offered[1:] == [round(f * cap, 2) for f in serve.QUICK["rate_fractions"]]
    assert [r["request_rate"] for r in rows] == list(cfg["rates"]) and rows[-1]["request_rate"] \
        == math.inf
    assert knee_check(rows, cap) == "conclusive"
