"""Did the load do what the benchmark's meaning needs? Checks a serving benchmark runs on its
own results before it reports a ratio.

A noisy-neighbour run means something only if the heavy tenant really overloaded the server:
if its queue never grew, "fcfs starves the light tenant" and "fair protects it" were never put
to the test, and a ratio of 1 or 2 says nothing (issue 27: a run calibrated 5.8 req/s of
capacity on a server that then finished 12.6 req/s of the heavy tenant's work; nothing queued).
A latency knee means something only if the sweep offered more than the server's capacity. So
each check returns a verdict, ``conclusive`` or ``inconclusive: <why>``, and the benchmark
prints and stores that instead of the ratio when the load fell short.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from labkit.bench.serve_client import RequestResult


def peak_in_flight(results: Sequence[RequestResult]) -> int:
    """The most requests open at once (sent, not yet finished) over the run: above the
    server's running slots, the rest were waiting in its queue."""
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.e2e, -1) for r in results],
                    key=lambda e: (e[0], e[1]))  # a finish before a start at the same instant
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


def queue_check(results: Sequence[RequestResult], heavy: Sequence[RequestResult],
                slots: int, offered_heavy_rate: float) -> dict[str, Any]:
    """Whether a two-tenant run saturated a server with ``slots`` running sequences: at its
    peak at least twice ``slots`` requests were open (a queue as long as the batch), and the
    heavy tenant's requests finished slower than they arrived (its backlog grew)."""
    peak = peak_in_flight(results)
    if heavy:
        t0 = min(r.start for r in heavy)
        span = max(r.start + r.e2e for r in heavy) - t0
        done_rate = sum(r.ok for r in heavy) / span if span > 0 else float("inf")
    else:
        done_rate = 0.0
    why = []
    if peak < 2 * slots:
        why.append(f"at most {peak} requests were open at once, under twice the {slots} "
                   "running slots: no queue formed")
    if done_rate >= 0.9 * offered_heavy_rate:
        why.append(f"the heavy tenant's requests finished at {done_rate:.1f}/s, keeping up "
                   f"with the {offered_heavy_rate:.1f}/s offered: its backlog never grew")
    return {"peak_in_flight": peak, "slots": slots, "heavy_done_req_s": done_rate,
            "heavy_offered_req_s": offered_heavy_rate,
            "verdict": "conclusive" if not why else "inconclusive: " + "; ".join(why)}


def knee_check(sweep: Sequence[dict[str, Any]], capacity_req_s: float) -> str:
    """A knee lies inside the sweep only if some finite offered rate reached the capacity
    (the highest throughput the sweep achieved, usually its all-at-once burst)."""
    finite = [r["request_rate"] for r in sweep if r.get("request_rate", math.inf) != math.inf]
    if not finite:
        return "inconclusive: the sweep has no finite rate, so no curve to bend"
    if max(finite) < 0.9 * capacity_req_s:
        return (f"inconclusive: the highest finite rate, {max(finite):g} req/s, stays under "
                f"the measured capacity of {capacity_req_s:.2f} req/s, so the sweep never "
                "reaches the knee (add higher --rates)")
    return "conclusive"
