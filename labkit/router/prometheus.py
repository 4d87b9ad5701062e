"""Monitoring as deployments do it: a real Prometheus scrapes the router and every replica.

``labkit serve`` and ``labkit router`` already export Prometheus text at ``/metrics``; this module
is the other half: it writes a scrape config and alert rules over the metric names they actually
export, starts Debian's ``prometheus`` binary on 127.0.0.1 with a throw-away storage dir, asks its
HTTP API (instant PromQL queries, firing alerts) and stops it. Nothing is simulated: the alert
expressions are evaluated by Prometheus itself, ``promtool check rules`` validates them.

The canary analysis can read its verdict here too (:class:`PromQLCanarySource`), the way Flagger
and Argo Rollouts do: error ratio and TTFT p99 per arm, each one PromQL query over the router's
per-arm series (``labkit.router.canary``). :func:`histogram_quantile` is Prometheus's own
interpolation re-done in Python, so the router's raw bucket counts give the *same* number a
PromQL ``histogram_quantile`` gives: what a notebook shows side by side, and the fallback's
arithmetic when no Prometheus is installed.

Why these rules and thresholds: TTFT and inter-token latency p99 are what users feel (vLLM's
dashboards page on them), KV usage near 1 precedes preemptions, a growing waiting queue precedes
timeouts, and the error ratio at the router is the SLO clients see. Thresholds are arguments:
the defaults are for labkit-tiny on a CPU.
"""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from labkit.router.canary import BASELINE, CANDIDATE

MISSING = ("the `prometheus` binary is not on PATH (Debian/Ubuntu: `apt-get install "
           "prometheus`); the canary falls back to the router's own counters")


class PrometheusError(RuntimeError):
    """Prometheus did not start, or answered a query with an error."""


def find_prometheus() -> str | None:
    """Path of the ``prometheus`` binary, or None (then :data:`MISSING` says what to do)."""
    return shutil.which("prometheus")


def alert_rules(ttft_p99_s: float = 2.0, itl_p99_s: float = 0.5, kv_usage: float = 0.9,
                queue: int = 16, error_ratio: float = 0.05, window: str = "1m",
                for_: str = "30s") -> dict[str, Any]:
    """The rule file (as a dict): five alerts on the names ``labkit.serve.metrics`` and the
    router export. ``for_`` is how long an expression must hold before the alert fires."""
    def q99(metric: str) -> str:
        return (f"histogram_quantile(0.99, sum by (le, instance) "
                f"(rate({metric}_bucket[{window}])))")

    rules = [
        ("LabkitTTFTP99High", f"{q99('labkit:time_to_first_token_seconds')} > {ttft_p99_s}",
         f"TTFT p99 above {ttft_p99_s}s on {{{{ $labels.instance }}}}"),
        ("LabkitInterTokenLatencyP99High",
         f"{q99('labkit:inter_token_latency_seconds')} > {itl_p99_s}",
         f"inter-token latency p99 above {itl_p99_s}s on {{{{ $labels.instance }}}}"),
        ("LabkitKVCacheNearlyFull",
         f"max by (instance) (labkit:kv_cache_usage_perc) > {kv_usage}",
         f"KV-cache usage above {kv_usage:.0%} on {{{{ $labels.instance }}}}: preemptions next"),
        ("LabkitQueueLong", f"sum by (instance) (labkit:num_requests_waiting) > {queue}",
         f"more than {queue} requests waiting on {{{{ $labels.instance }}}}"),
        ("LabkitRouterErrorRatioHigh",
         f"sum by (replica) (rate(labkit_router_failures_total[{window}])) / "
         f"sum by (replica) (rate(labkit_router_requests_total[{window}])) > {error_ratio}",
         f"more than {error_ratio:.0%} of the router's attempts on {{{{ $labels.replica }}}} "
         f"fail"),
        ("LabkitCanaryErrorRatioHigh",
         f"sum by (arm) (rate(labkit_router_canary_requests_total{{status=\"error\"}}[{window}]))"
         f" / sum by (arm) (rate(labkit_router_canary_requests_total[{window}])) > {error_ratio}",
         f"more than {error_ratio:.0%} of {{{{ $labels.arm }}}} requests fail"),
    ]
    return {"groups": [{"name": "labkit", "rules": [
        {"alert": name, "expr": expr, "for": for_, "labels": {"severity": "page"},
         "annotations": {"summary": summary}} for name, expr, summary in rules]}]}


def _target(url: str) -> str:
    u = urlparse(url if "://" in url else f"http://{url}")
    if not u.hostname or not u.port:
        raise ValueError(f"a scrape target needs host and port, e.g. http://127.0.0.1:8001; "
                         f"got {url!r}")
    return f"{u.hostname}:{u.port}"


def scrape_config(targets: Mapping[str, Sequence[str]], interval: str = "1s",
                  rule_files: Sequence[str] = ()) -> dict[str, Any]:
    """``prometheus.yml`` (as a dict): one job per key of ``targets`` (e.g. ``router``,
    ``replicas``, ``canary``), each URL scraped at ``/metrics`` every ``interval``."""
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": list(rule_files),
            "scrape_configs": [{"job_name": job, "metrics_path": "/metrics",
                                "static_configs": [{"targets": [_target(u) for u in urls]}]}
                               for job, urls in targets.items() if urls]}


def write_config(folder: str | Path, targets: Mapping[str, Sequence[str]],
                 interval: str = "1s", **rule_kw: Any) -> Path:
    """Write ``prometheus.yml`` and ``rules.yml`` into ``folder``; returns the config path."""
    import yaml

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rules = folder / "rules.yml"
    rules.write_text(yaml.safe_dump(alert_rules(**rule_kw), sort_keys=False))
    cfg = folder / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(scrape_config(targets, interval, [str(rules)]),
                                  sort_keys=False))
    return cfg


def check_rules(path: str | Path) -> str:
    """``promtool check rules PATH``; raises PrometheusError with its output when it fails."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise PrometheusError("promtool is not on PATH (it ships with Debian's prometheus)")
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                       timeout=60)
    if r.returncode:
        raise PrometheusError(f"promtool check rules failed:\n{r.stdout}{r.stderr}")
    return r.stdout


class PrometheusServer:
    """``with PrometheusServer({"router": [url], "replicas": urls}) as prom: prom.query(...)``:
    Prometheus on 127.0.0.1, config and TSDB in a temp dir removed on exit."""

    def __init__(self, targets: Mapping[str, Sequence[str]], interval: str = "1s",
                 port: int | None = None, startup_timeout: float = 60.0,
                 **rule_kw: Any) -> None:
        self.binary = find_prometheus()
        if self.binary is None:
            raise PrometheusError(MISSING)
        from labkit.serve.launcher import free_port

        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="labkit-prometheus-"))
        self.config = write_config(self.dir, targets, interval, **rule_kw)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusServer:
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}",
             f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read()
                self.stop()
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}:\n{err}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise PrometheusError(f"prometheus was not ready in {self.startup_timeout} s")

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def query(self, promql: str) -> list[dict[str, Any]]:
        return query(self.url, promql)

    def value(self, promql: str) -> float | None:
        return value(self.url, promql)

    def alerts(self) -> list[dict[str, Any]]:
        return alerts(self.url)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _result(payload: dict[str, Any], promql: str) -> list[dict[str, Any]]:
    if payload.get("status") != "success":
        raise PrometheusError(f"query {promql!r} failed: {payload.get('error', payload)}")
    data = payload["data"]
    if data["resultType"] == "scalar":
        return [{"metric": {}, "value": float(data["result"][1])}]
    return [{"metric": r["metric"], "value": float(r["value"][1])} for r in data["result"]]


def query(url: str, promql: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """An instant query: ``[{"metric": {labels}, "value": float}, ...]``."""
    r = httpx.get(url.rstrip("/") + "/api/v1/query", params={"query": promql}, timeout=timeout)
    return _result(r.json(), promql)


def _one(rows: list[dict[str, Any]], promql: str) -> float | None:
    if len(rows) > 1:
        raise PrometheusError(f"{promql!r} returned {len(rows)} series; aggregate it to one")
    v = rows[0]["value"] if rows else None
    return None if v is None or math.isnan(v) else v


def value(url: str, promql: str) -> float | None:
    """A query that returns one number (None: no series, or NaN)."""
    return _one(query(url, promql), promql)


def alerts(url: str) -> list[dict[str, Any]]:
    """Alerts Prometheus is evaluating now (``state``: pending or firing) with their labels."""
    r = httpx.get(url.rstrip("/") + "/api/v1/alerts", timeout=10.0).json()
    if r.get("status") != "success":
        raise PrometheusError(f"/api/v1/alerts failed: {r}")
    return r["data"]["alerts"]


def canary_queries(arm: str, window: str = "1m") -> dict[str, str]:
    """The PromQL Flagger-style analysis runs per arm over the router's per-arm series."""
    sel = f'arm="{arm}"'
    return {
        "n": f"sum(increase(labkit_router_canary_requests_total{{{sel}}}[{window}]))",
        "errors": f'sum(increase(labkit_router_canary_requests_total{{{sel},status="error"}}'
                  f"[{window}]))",
        "ttft_p99": f"histogram_quantile(0.99, sum by (le) "
                    f"(increase(labkit_router_canary_ttft_seconds_bucket{{{sel}}}[{window}])))",
    }


class PromQLCanarySource:
    """Both arms' ``{n, error_rate, ttft_p99}`` from Prometheus: what ``Canary.promql_loop``
    decides on. ``window`` is the PromQL range (``increase`` over it)."""

    def __init__(self, url: str, window: str = "1m") -> None:
        self.url, self.window = url.rstrip("/"), window

    async def summaries(self) -> tuple[dict[str, Any], dict[str, Any]]:
        async with httpx.AsyncClient(timeout=10.0) as c:
            out = []
            for arm in (BASELINE, CANDIDATE):
                got = {}
                for k, q in canary_queries(arm, self.window).items():
                    r = await c.get(self.url + "/api/v1/query", params={"query": q})
                    got[k] = _one(_result(r.json(), q), q)
                n = got["n"] or 0.0
                out.append({"n": n, "error_rate": (got["errors"] or 0.0) / n if n else 0.0,
                            "ttft_p99": got["ttft_p99"]})
        return out[0], out[1]


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile`` on cumulative ``(le, count)`` buckets (``+Inf``
    included): linear interpolation inside the bucket holding rank ``q * total``; a rank in the
    ``+Inf`` bucket gives the highest finite bound. None where Prometheus gives NaN."""
    b = sorted((float(le), float(c)) for le, c in buckets)
    if len(b) < 2 or not math.isinf(b[-1][0]) or b[-1][1] == 0 or not 0 <= q <= 1:
        return None
    for i in range(1, len(b)):  # counts must not decrease (Prometheus fixes them up the same way)
        b[i] = (b[i][0], max(b[i][1], b[i - 1][1]))
    rank = q * b[-1][1]
    i = next(j for j, (_, c) in enumerate(b) if c >= rank)
    if i == len(b) - 1:
        return b[-2][0]
    if i == 0 and b[0][0] <= 0:
        return b[0][0]
    start, below = (0.0, 0.0) if i == 0 else b[i - 1]
    end, count = b[i]
    return start + (end - start) * (rank - below) / (count - below)


def scraped_buckets(text: str, name: str, labels: Mapping[str, str]) -> list[tuple[float, float]]:
    """``(le, count)`` of histogram ``name`` from ``/metrics`` text, summed over series that
    carry ``labels`` (what ``sum by (le)`` does)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name + "_bucket" and all(s.labels.get(k) == v for k, v in labels.items()):
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return sorted(out.items())
