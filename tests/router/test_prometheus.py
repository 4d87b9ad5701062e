"""Prometheus as deployments run it: the generated config and alert rules (checked by promtool,
evaluated by a real ``prometheus`` on 127.0.0.1), the rules' metric names against what the
server and router really export, and the canary's verdict read from PromQL, each number equal
to the same one computed from the router's own /metrics.

The halves that need Debian's ``prometheus`` package skip with that reason when it is missing."""

import re
import shutil
import socket
import time

import httpx
import pytest
from fake_openai import fake_replica
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from labkit.router.canary_demo import default_canary, run_canary
from labkit.router.faults import serve_in_thread
from labkit.router.health import Backoff
from labkit.router.prometheus import (
    MISSING,
    PrometheusError,
    PrometheusServer,
    alert_rules,
    check_rules,
    find_prometheus,
    histogram_quantile,
    scrape_config,
    write_config,
)
from labkit.router.proxy import create_app
from labkit.serve.metrics import ServerMetrics

needs_prometheus = pytest.mark.skipif(find_prometheus() is None, reason=MISSING)
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool is not on PATH (apt-get install prometheus)")
INF = float("inf")


def test_histogram_quantile_matches_hand_computed_cases():
    b = [(0.1, 10), (0.2, 30), (INF, 40)]
    assert histogram_quantile(0.5, b) == pytest.approx(0.15)  # rank 20: halfway through (0.1, 0.2]
    assert histogram_quantile(0.05, b) == pytest.approx(0.02)  # rank 2 of 10 in (0, 0.1]
    assert histogram_quantile(0.9, b) == 0.2  # rank 36 lies in +Inf: the highest finite bound
    assert histogram_quantile(0.75, b) == pytest.approx(0.2)  # rank 30: the bucket's top
    assert histogram_quantile(0.5, [(0.1, 0), (INF, 0)]) is None  # no observations: NaN
    assert histogram_quantile(0.5, [(0.1, 5)]) is None  # no +Inf bucket


def test_scrape_config_targets_and_bad_url():
    cfg = scrape_config({"router": ["http://127.0.0.1:8000"], "replicas": ["127.0.0.1:8001",
                                                                          "http://127.0.0.1:8002/"],
                         "canary": []}, "2s", ["r.yml"])
    assert [j["job_name"] for j in cfg["scrape_configs"]] == ["router", "replicas"]
    assert cfg["scrape_configs"][1]["static_configs"][0]["targets"] == ["127.0.0.1:8001",
                                                                       "127.0.0.1:8002"]
    assert cfg["global"]["scrape_interval"] == "2s" and cfg["rule_files"] == ["r.yml"]
    with pytest.raises(ValueError, match="host and port"):
        scrape_config({"x": ["http://localhost"]})


@needs_promtool
def test_promtool_accepts_the_rules(tmp_path):
    write_config(tmp_path, {"router": ["http://127.0.0.1:8000"]})
    assert "SUCCESS: 6 rules found" in check_rules(tmp_path / "rules.yml")
    bad = tmp_path / "bad.yml"
    bad.write_text("groups: [{name: x, rules: [{alert: A, expr: 'sum(('}]}]\n")
    with pytest.raises(PrometheusError, match="promtool check rules failed"):
        check_rules(bad)


class _FakeLLM:
    stats = {"num_running": 1, "num_waiting": 2, "num_used_blocks": 3, "num_blocks": 10}
    num_in_flight = 3


def test_every_metric_in_the_rules_is_exported():
    """A rule over a misspelt metric is silently never true: check the names against the real
    exporters (labkit serve's ServerMetrics, the router's /metrics with a canary)."""
    sm = ServerMetrics(_FakeLLM(), "m")
    sm.ttft.labels("m").observe(0.1)
    sm.itl.labels("m").observe(0.01)
    exported = sm.render().decode()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    with serve_in_thread(fake_replica("a", 0.0)) as a:
        app = create_app([dead, a], "round-robin", canary_urls=[a], canary=default_canary(0.5),
                         backoff=Backoff(0.001, 0.002, max_retries=2))
        with serve_in_thread(app) as url, httpx.Client(timeout=10) as c:
            for i in range(6):
                assert c.post(url + "/v1/completions", json={"prompt": f"p{i}", "stream": True},
                              headers={"x-labkit-canary": str(i % 2)}).status_code == 200
            exported += c.get(url + "/metrics").text
    rules = [r["expr"] for r in alert_rules()["groups"][0]["rules"]]
    names = {n for e in rules for n in re.findall(r"\b(labkit[:_][a-z0-9_:]*[a-z0-9])\b", e)}
    assert len(names) == 7, names
    for n in names:
        assert re.search(rf"^{re.escape(n)}[{{ ]", exported, re.M), f"{n} is not exported"


def _target(hot: bool) -> FastAPI:
    """A /metrics target: hot = KV nearly full, a long queue, every TTFT ~4 s (its counts grow
    at each scrape, so rate() sees traffic)."""
    app, n = FastAPI(), [0]

    @app.get("/metrics")
    def metrics():
        n[0] += 10
        le = "5.0" if hot else "0.1"
        lines = [f'labkit:kv_cache_usage_perc{{model_name="m"}} {0.97 if hot else 0.1}',
                 f'labkit:num_requests_waiting{{model_name="m"}} {40 if hot else 0}']
        for b in ("0.1", "2.5", "5.0", "+Inf"):
            c = n[0] if float(b) >= float(le) else 0
            lines.append(f'labkit:time_to_first_token_seconds_bucket{{le="{b}",model_name="m"}} '
                         f"{c}")
        return PlainTextResponse("\n".join(lines) + "\n")

    return app


@needs_prometheus
@pytest.mark.slow
def test_alerts_fire_on_the_hot_replica_only():
    with serve_in_thread(_target(True)) as hot, serve_in_thread(_target(False)) as calm, \
            PrometheusServer({"replicas": [hot, calm]}, for_="0s", window="10s") as prom:
        hot_inst = hot.removeprefix("http://")
        want = {("LabkitKVCacheNearlyFull", hot_inst), ("LabkitQueueLong", hot_inst),
                ("LabkitTTFTP99High", hot_inst)}
        deadline, firing = time.monotonic() + 40, set()
        while time.monotonic() < deadline and firing != want:
            time.sleep(1)
            got = prom.alerts()
            firing = {(a["labels"]["alertname"], a["labels"].get("instance")) for a in got
                      if a["state"] == "firing"}
        assert firing == want, got
        assert prom.value('sum(up{job="replicas"})') == 2
        assert prom.value("max(labkit:kv_cache_usage_perc)") == 0.97


@needs_prometheus
@pytest.mark.slow
def test_canary_verdict_from_promql_and_numbers_match_the_router():
    with serve_in_thread(fake_replica("a", 0.02)) as a, serve_in_thread(fake_replica("b", 0.02)) \
            as b:
        r = run_canary([a], b, delay_s=1.0, n_requests=400, concurrency=8,
                       canary=default_canary(0.5), prometheus=True, after_rollback=16)
    assert r["rolled_back"], r["checks"]
    assert r["reason"].endswith("(source: prometheus)") and "TTFT p99" in r["reason"]
    assert {c["source"] for c in r["checks"]} == {"prometheus"}
    rows = {(x["arm"], x["quantity"]): x for x in r["promql"]}
    assert rows[("candidate", "requests")]["router"] == r["seen"]["candidate"]
    for row in r["promql"]:
        assert row["prometheus"] == pytest.approx(row["router"], rel=1e-9, abs=1e-12), row
    assert rows[("candidate", "TTFT p99 (s)")]["prometheus"] > 1.0
