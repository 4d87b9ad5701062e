"""A canary on loopback, end to end: what ``labkit bench cluster`` measures and a notebook plots.

Baseline replicas and one candidate replica (``labkit serve`` processes, or any OpenAI-shaped
server), a :class:`~labkit.router.faults.FaultInjector` in front of the candidate (so it can be
made slow or failing on purpose, from the first request or after ``degrade_after`` requests),
the router with a :class:`~labkit.router.canary.Canary` in a thread, and ``concurrency`` client
threads sending streamed completions from ``users`` distinct OpenAI ``user`` ids (sticky arms).
The load stops ``after_rollback`` requests after a rollback (to show the traffic moving back) or
after ``n_requests``.

:func:`run_canary` returns every request (arm, replica, client-side TTFT, status) and every
verdict; :func:`promql_side_by_side` puts each PromQL number of the analysis beside the same
number computed from the router's own ``/metrics``.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from labkit.router.canary import CANDIDATE, Canary, CanaryAnalysis, CanarySplit
from labkit.router.faults import FaultInjector, serve_in_thread
from labkit.router.proxy import create_app

PROMPT = "Write one sentence about the sea. "


def _one(c: httpx.Client, url: str, i: int, users: int, max_tokens: int) -> dict[str, Any]:
    body = {"model": "labkit-tiny", "prompt": PROMPT + f"#{i}", "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "user": f"user-{i % users}"}
    t0 = time.monotonic()
    ttft = None
    try:
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line and ttft is None:
                    ttft = time.monotonic() - t0
            status = r.status_code
            arm, replica = r.headers.get("x-labkit-canary"), r.headers.get("x-labkit-replica")
    except httpx.HTTPError as exc:
        status, arm, replica = 599, None, f"{type(exc).__name__}"
    return {"i": i, "t": t0, "arm": arm, "replica": replica, "status": status,
            "ttft": ttft if status == 200 else None, "latency": time.monotonic() - t0}


def drive(router_url: str, canary: Canary, n_requests: int, concurrency: int = 4,
          users: int = 1000, max_tokens: int = 4, after_rollback: int = 20,
          on_request: Any = None) -> list[dict[str, Any]]:
    """Send up to ``n_requests`` from ``concurrency`` threads; stop early ``after_rollback``
    requests past a rollback. ``on_request(i)`` runs before request ``i`` (to inject faults)."""
    counter, lock = itertools.count(), threading.Lock()
    stop_at = [n_requests]
    out: list[dict[str, Any]] = []

    def worker() -> None:
        with httpx.Client(timeout=60) as c:
            while True:
                with lock:
                    i = next(counter)
                    if i >= stop_at[0]:
                        return
                    if on_request is not None:
                        on_request(i)
                    w0 = canary.split.weight
                r = _one(c, router_url, i, users, max_tokens)
                with lock:
                    r["weight_at_start"], r["weight"] = w0, canary.split.weight
                    out.append(r)
                    if canary.analysis.rolled_back and stop_at[0] == n_requests:
                        stop_at[0] = min(n_requests, i + after_rollback)

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    t0 = min((r["t"] for r in out), default=0.0)
    for r in out:
        r["t"] -= t0
    return sorted(out, key=lambda r: r["i"])


@contextlib.contextmanager
def canary_router(baseline_urls: Sequence[str], candidate_url: str, canary: Canary,
                  policy: str = "round-robin") -> Iterator[tuple[str, FaultInjector]]:
    """(router URL, the candidate's fault injector), both on loopback threads."""
    inj = FaultInjector(candidate_url)
    with serve_in_thread(inj.app) as inj_url, \
            serve_in_thread(create_app(baseline_urls, policy, canary_urls=[inj_url],
                                       canary=canary)) as router_url:
        yield router_url, inj


DEMO_RATIO = 2.0  # p99 ratio that fails a check: wide, a shared 2-core box adds ms-to-s noise


def default_canary(weight: float = 0.5, seed: int = 0, **analysis_kw: Any) -> Canary:
    """A canary sized for a short demo: verdicts after 20 requests per arm, a check every 10
    candidate requests, rollback on 2 failed checks in a row."""
    kw = {"window": 200, "min_samples": 20, "interval": 10, "threshold": 2,
          "max_ttft_p99_ratio": DEMO_RATIO, **analysis_kw}
    import random

    return Canary(CanarySplit(weight, rng=random.Random(seed)), CanaryAnalysis(**kw))


def run_canary(baseline_urls: Sequence[str], candidate_url: str, *, delay_s: float = 0.0,
               error_rate: float = 0.0, degrade_after: int = 0, n_requests: int = 300,
               concurrency: int = 4, canary: Canary | None = None, prometheus: bool = False,
               promql_window: str = "20s", **drive_kw: Any) -> dict[str, Any]:
    """One canary run. The candidate gets ``delay_s`` / ``error_rate`` from request
    ``degrade_after`` on (0: from the start; both 0: a healthy candidate). ``prometheus=True``
    starts a Prometheus scraping the router and every replica each second, and the canary
    reads its verdict from PromQL every second (``promql`` rows: the side-by-side check)."""
    canary = canary or default_canary()
    prom_port = None
    if prometheus:
        from labkit.router.prometheus import PromQLCanarySource
        from labkit.serve.launcher import free_port

        prom_port = free_port()
        canary.promql = PromQLCanarySource(f"http://127.0.0.1:{prom_port}", promql_window)
        canary.interval_s, canary.analysis.auto = 1.0, False
    with canary_router(baseline_urls, candidate_url, canary) as (url, inj), \
            _maybe_prometheus(prom_port, url, baseline_urls, candidate_url) as prom:
        def on_request(i: int) -> None:
            if i == degrade_after:
                inj.set(delay_s, error_rate)

        t0 = time.monotonic()
        reqs = drive(url, canary, n_requests, concurrency, on_request=on_request, **drive_kw)
        wall = time.monotonic() - t0
        deadline = time.monotonic() + 5  # the router records an outcome just after the last byte
        while sum(canary.analysis.seen.values()) < len(reqs) and time.monotonic() < deadline:
            time.sleep(0.02)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        promql = promql_side_by_side(prom.url, metrics) if prom is not None else None
    st = canary.status()
    return {"requests": reqs, "rolled_back": st["rolled_back"],
            "rolled_back_after": st["rolled_back_after"], "reason": st["reason"],
            "checks": [{"action": v.action, "reason": v.reason, "source": v.source,
                        "metrics": v.metrics, "candidate_seen": v.candidate_seen}
                       for v in canary.analysis.checks], "promql": promql,
            "degrade_after": degrade_after, "delay_s": delay_s, "error_rate": error_rate,
            "seen": st["seen"], "wall_s": wall, "router_metrics": metrics,
            "candidate_requests": sum(r["arm"] == CANDIDATE for r in reqs)}


def start_replicas(n: int, model: str = "labkit-tiny", args: Sequence[str] = ()) -> list[Any]:
    """``n`` ``labkit serve`` processes started in parallel (stop each with ``.stop()``)."""
    from labkit.serve.process import ServerProcess

    procs = [ServerProcess(model, args) for _ in range(n)]
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda p: p.start(), procs))
    return procs


def run_demo(baseline_urls: Sequence[str] | None = None, candidate_url: str | None = None,
             delay_s: float = 1.0, degrade_after: int = 60, n_requests: int = 300,
             concurrency: int = 4, prometheus: bool | None = None) -> dict[str, Any]:
    """The notebook's "a canary that degrades and gets rolled back": healthy for
    ``degrade_after`` requests, then ``delay_s`` slower. Starts two labkit-tiny replicas when
    no URLs are given (and stops them). ``prometheus``: read the verdict from a real Prometheus
    and return the side-by-side rows (None: when the binary is installed; ``promql_skipped``
    then says why not). Plot with ``labkit.viz.canary.plot_canary`` and ``promql_table``."""
    from labkit.router.prometheus import MISSING, find_prometheus

    use_prom = find_prometheus() is not None if prometheus is None else prometheus
    procs = [] if baseline_urls and candidate_url else start_replicas(2)
    try:
        base = list(baseline_urls or [procs[0].url])
        cand = candidate_url or procs[1].url
        out = run_canary(base, cand, delay_s=delay_s, degrade_after=degrade_after,
                         n_requests=n_requests, concurrency=concurrency, prometheus=use_prom)
        out["promql_skipped"] = None if use_prom else MISSING
        out["ratio"] = DEMO_RATIO
        return out
    finally:
        for p in procs:
            p.stop()


@contextlib.contextmanager
def _maybe_prometheus(port: int | None, router_url: str, baseline_urls: Sequence[str],
                      candidate_url: str) -> Iterator[Any]:
    if port is None:
        yield None
        return
    from labkit.router.prometheus import PrometheusServer

    with PrometheusServer({"router": [router_url], "replicas": list(baseline_urls),
                           "candidate": [candidate_url]}, port=port) as prom:
        yield prom


def _router_number(text: str, arm: str, status: str | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "labkit_router_canary_requests_total" and s.labels["arm"] == arm
               and (status is None or s.labels["status"] == status))


def promql_side_by_side(prom_url: str, router_metrics: str,
                        timeout: float = 15.0) -> list[dict[str, Any]]:
    """Each quantity as a PromQL query over everything scraped (no ``rate``: cumulative since
    the router started) beside the same number computed from the router's ``/metrics`` text
    (the fallback's arithmetic: :func:`~labkit.router.prometheus.histogram_quantile`). Waits up
    to ``timeout`` for a scrape that saw the final counts first."""
    from labkit.router.prometheus import histogram_quantile, scraped_buckets, value

    total = 'sum(labkit_router_canary_requests_total{arm="%s"})'
    want = _router_number(router_metrics, CANDIDATE) + _router_number(router_metrics, "baseline")
    deadline = time.monotonic() + timeout
    q_all = "sum(labkit_router_canary_requests_total)"
    while (value(prom_url, q_all) or 0) != want and time.monotonic() < deadline:
        time.sleep(0.5)
    rows = []
    for arm in ("baseline", CANDIDATE):
        errors = f'(sum(labkit_router_canary_requests_total{{arm="{arm}",status="error"}}) ' \
                 f"or vector(0))"
        n = _router_number(router_metrics, arm)
        p99 = ("histogram_quantile(0.99, sum by (le) "
               f'(labkit_router_canary_ttft_seconds_bucket{{arm="{arm}"}}))')
        rows += [
            {"arm": arm, "quantity": "requests", "promql": total % arm,
             "prometheus": value(prom_url, total % arm), "router": n},
            {"arm": arm, "quantity": "error ratio", "promql": f"{errors} / {total % arm}",
             "prometheus": value(prom_url, f"{errors} / {total % arm}"),
             "router": _router_number(router_metrics, arm, "error") / n if n else None},
            {"arm": arm, "quantity": "TTFT p99 (s)", "promql": p99,
             "prometheus": value(prom_url, p99),
             "router": histogram_quantile(0.99, scraped_buckets(
                 router_metrics, "labkit_router_canary_ttft_seconds", {"arm": arm}))},
        ]
    return rows
