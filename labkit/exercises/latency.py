"""Exercise: TTFT, TPOT and tail percentiles from per-request timestamps.

Serving SLOs are written in these: time to first token (prefill + queueing: what a chat user
feels first), time per output token after the first (decode speed: reading speed), end-to-end
latency, and their tails (P99), because one slow request in a hundred is a user every minute.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from labkit.engine.metrics import compute_metrics
from labkit.engine.sampling_params import SamplingParams
from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.exercises.shared import tiny_engine


def _requests(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        arrival = rng.uniform(0, 10)
        first = arrival + rng.expovariate(1 / 0.3)
        k = rng.choice([1, 1, 2, 5, 17, 64])
        times = [first]
        for _ in range(k - 1):
            times.append(times[-1] + rng.expovariate(1 / 0.02))
        out.append({"arrival_time": arrival, "first_scheduled_time": arrival,
                    "first_token_time": first, "token_times": times,
                    "finish_time": times[-1] + rng.uniform(0, 0.001)})
    return out


def _close(a: Any, b: float) -> bool:
    if not isinstance(a, (int, float)):
        return False
    if math.isnan(b):
        return math.isnan(a)
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _hint(metric: str, stat: str, reqs: list[dict], actual: Any, expected: float) -> str:
    if metric == "tpot":
        multi = [r for r in reqs if len(r["token_times"]) >= 2]
        alt = [(r["token_times"][-1] - r["token_times"][0]) / len(r["token_times"])
               for r in multi]
        if stat == "mean" and alt and _close(actual, sum(alt) / len(alt)):
            return "divide by len(token_times) - 1: n tokens have n - 1 gaps after the first."
        if len(multi) != len(reqs):
            return "leave out single-token requests: their TPOT is undefined (not 0)."
    if stat == "p99" or stat == "p50":
        return ("interpolate linearly: sorted v, position (len(v)-1)*p/100, blend the two "
                "neighbours (nearest-rank gives a different number on small samples).")
    if metric == "ttft":
        return "TTFT counts from arrival (queueing included), not from first scheduling."
    return "re-read the definitions in the docstring."


def check(latency_metrics: Callable[[list[dict]], dict]) -> object:
    """Exact statistics on random workloads and on a real engine run, against labkit's metrics."""

    def body() -> str:
        rng = random.Random(0)
        workloads = [_requests(rng, n) for n in (1, 2, 3, 10, 101, 250)]
        # a request queued for a long time: TTFT must include the queueing
        queued = _requests(rng, 20)
        for r in queued:  # everything after arrival happens 5 s later
            r["first_scheduled_time"] = r["arrival_time"] + 5.0
            r["first_token_time"] += 5.0
            r["token_times"] = [t + 5.0 for t in r["token_times"]]
            r["finish_time"] += 5.0
        workloads.append(queued)
        for reqs in workloads:
            expected = reference_latency_metrics(reqs)
            actual = call(latency_metrics, [dict(r) for r in reqs],
                          _label=f"latency_metrics(<{len(reqs)} requests>)")
            for metric, stats in expected.items():
                for stat, value in stats.items():
                    got = actual.get(metric, {}).get(stat) if isinstance(actual, dict) else None
                    if not _close(got, value):
                        shown = reqs if len(reqs) <= 3 else f"{len(reqs)} requests, e.g. {reqs[0]}"
                        raise CheckFailure(
                            f"wrong {metric} {stat}", inputs=f"requests={shown}",
                            expected=value, actual=got,
                            hint=_hint(metric, stat, reqs, got, value))
        engine_note = _engine_cross_check(latency_metrics)
        return f"TTFT/TPOT/E2E mean, P50 and P99 right on {len(workloads)} workloads.{engine_note}"

    return run_check("latency_metrics", body)


def engine_timings(num_requests: int = 6, seed: int = 0) -> list[dict]:
    """Per-request timestamps from a real ``LLMEngine`` run on the tiny seeded model."""
    engine = tiny_engine(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    rng = random.Random(seed)
    for i in range(num_requests):
        prompt = [rng.randrange(128) for _ in range(rng.randint(3, 20))]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=rng.choice(
            [1, 4, 8, 12]), ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.request_timings()


def reference_latency_metrics(requests: list[dict]) -> dict[str, dict[str, float]]:
    """labkit's own metrics (``labkit.engine.metrics.compute_metrics``), the statistics the
    contract names; a metric with no samples is NaN."""
    m = compute_metrics(requests)
    return {k: {s: math.nan if m[k][s] is None else m[k][s] for s in ("mean", "p50", "p99")}
            for k in ("ttft", "tpot", "e2e")}


def _engine_cross_check(learner: Callable) -> str:
    """On a real engine run the learner's metrics must equal labkit's compute_metrics."""
    timings = engine_timings()
    theirs = reference_latency_metrics(timings)
    actual = call(learner, [dict(t) for t in timings],
                  _label=f"latency_metrics(<{len(timings)} requests from a real engine run>)")
    for metric in ("ttft", "tpot", "e2e"):
        for stat in ("mean", "p50", "p99"):
            got = actual.get(metric, {}).get(stat) if isinstance(actual, dict) else None
            if not _close(got, theirs[metric][stat]):
                raise CheckFailure(f"on a real engine run, wrong {metric} {stat}",
                                   inputs=f"engine.request_timings(), e.g. {timings[0]}",
                                   expected=theirs[metric][stat], actual=got,
                                   hint=_hint(metric, stat, timings, got, theirs[metric][stat]))
    ttft = theirs["ttft"]["p50"] * 1e3
    return (f" On a real engine run (tiny model, {len(timings)} requests) your numbers equal "
            f"labkit.engine.metrics: TTFT P50 {ttft:.1f} ms.")
