"""Serving metrics from per-request timestamps, and KV-cache usage over time from a trace.

Why these and why percentiles: users feel the time to the first token (TTFT) and the pace of the
rest (TPOT, time per output token, and ITL, the gap between consecutive tokens); operators pay
for throughput. SLOs are written at P90/P99 because a scheduler can raise mean throughput while
starving a few requests. Definitions follow vLLM's serving benchmark:

- queue time = first_scheduled_time - arrival_time
- TTFT = first_token_time - arrival_time (queueing + prefill)
- TPOT = (last_token_time - first_token_time) / (output_tokens - 1), per request with >= 2 tokens
- ITL = every gap between consecutive tokens of a request, pooled over requests (tokens produced
  in the same step, as speculative decoding does, give 0 gaps)
- E2E = finish_time - arrival_time
- tokens/s = output tokens / (last finish - first arrival); requests/s likewise.

Percentiles use linear interpolation between order statistics (numpy's default), so a set of
{1, 2, 3, 4} has P50 = 2.5. Input is a list of dicts shaped like ``engine.request_timings()``:
``arrival_time``, ``first_scheduled_time``, ``first_token_time``, ``token_times``, ``finish_time``
(one dict per sequence; ``request_id`` groups the n samples of one request).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 of ``values`` (None for each when there are none)."""
    if len(values) == 0:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()),
            **{f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}}


def _check(t: dict[str, Any], i: int) -> None:
    if "arrival_time" not in t or t["arrival_time"] is None:
        raise ValueError(f"timing {i} has no arrival_time; expected request_timings() dicts")
    times = t.get("token_times") or []
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError(f"timing {i}: token_times must be non-decreasing")


def compute_metrics(timings: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """TTFT, TPOT, ITL, E2E and queue time (seconds; mean/p50/p90/p99), throughput and counts."""
    timings = list(timings)
    ttft, tpot, itl, e2e, queue = [], [], [], [], []
    out_tokens, prompt_tokens = 0, 0
    requests, finished_requests = set(), set()
    first_arrival, last_finish = None, None
    for i, t in enumerate(timings):
        _check(t, i)
        arrival = float(t["arrival_time"])
        rid = t.get("request_id", i)
        if rid not in requests and t.get("prompt_len") is not None:
            prompt_tokens += int(t["prompt_len"])
        requests.add(rid)
        first_arrival = arrival if first_arrival is None else min(first_arrival, arrival)
        times = [float(x) for x in (t.get("token_times") or [])]
        out_tokens += len(times)
        first = t.get("first_token_time")
        if first is None and times:
            first = times[0]
        if t.get("first_scheduled_time") is not None:
            queue.append(float(t["first_scheduled_time"]) - arrival)
        if first is not None:
            ttft.append(float(first) - arrival)
        if len(times) >= 2:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(np.diff(times).tolist())
        if t.get("finish_time") is not None:
            finish = float(t["finish_time"])
            last_finish = finish if last_finish is None else max(last_finish, finish)
            if t.get("finish_reason") != "abort":
                e2e.append(finish - arrival)
                finished_requests.add(rid)
    duration = (last_finish - first_arrival) if last_finish is not None else 0.0
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    return {
        "ttft": summarize(ttft), "tpot": summarize(tpot), "itl": summarize(itl),
        "e2e": summarize(e2e), "queue": summarize(queue),
        "num_requests": len(requests), "num_finished": len(finished_requests),
        "output_tokens": out_tokens, "prompt_tokens": prompt_tokens, "duration_s": duration,
        "tokens_per_s": rate(out_tokens), "requests_per_s": rate(len(finished_requests)),
    }


def _trace_dict(trace: Any) -> dict[str, Any]:
    if isinstance(trace, dict):
        return trace
    if hasattr(trace, "to_dict"):
        return trace.to_dict()
    raise ValueError(f"expected a Trace or its to_dict(), got {type(trace).__name__}")


def kv_usage(trace: Any) -> list[dict[str, float]]:
    """One row per step: time, blocks used / total, and how full the used blocks are.

    ``usage`` = used / total blocks (what admission and preemption look at);
    ``slot_utilization`` = token slots holding state / slots in used blocks (what paging
    optimises: only the last block of each sequence is partly empty)."""
    d = _trace_dict(trace)
    block_size = int(d["meta"]["block_size"])
    rows = []
    for rec in d["steps"]:
        kv = rec["kv"]
        used, total = int(kv["used"]), int(kv["total"])
        slots = int(kv.get("token_slots_used", 0))
        rows.append({
            "step": rec["step"], "time": float(rec["time"]),
            "duration": float(rec.get("duration", 0.0)),
            "used": used, "total": total, "usage": used / total if total else 0.0,
            "token_slots_used": slots,
            "slot_utilization": slots / (used * block_size) if used else None,
        })
    return rows


def kv_summary(trace: Any) -> dict[str, float | None]:
    """Step-duration-weighted means over the trace: block usage and slot utilization, plus the
    peak usage. Steps with no used blocks do not count toward slot utilization."""
    rows = kv_usage(trace)
    if not rows:
        return {"mean_usage": None, "peak_usage": None, "mean_slot_utilization": None}
    w = np.array([r["duration"] for r in rows]) if any(r["duration"] for r in rows) \
        else np.ones(len(rows))
    usage = np.array([r["usage"] for r in rows])
    busy = [i for i, r in enumerate(rows) if r["slot_utilization"] is not None and w[i] > 0]
    util = (float(np.average([rows[i]["slot_utilization"] for i in busy], weights=w[busy]))
            if busy else None)
    return {"mean_usage": float(np.average(usage, weights=w)) if w.sum() > 0 else None,
            "peak_usage": float(usage.max()), "mean_slot_utilization": util}
