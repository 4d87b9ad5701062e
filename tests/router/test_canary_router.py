"""The canary wired into the router, on loopback: fake OpenAI replicas (fixed 20 ms "prefill"),
the candidate behind the FaultInjector. A candidate made 1 s slower is rolled back within a
stated number of its requests and what is sent after it all goes to the baseline; arms are
sticky per user and a header forces one. (The erroring and the healthy candidate run through
the benchmark's own function: tests/bench/test_cluster_canary.py.)

Timing margins are wide on purpose: the box running this may be shared (2 cores), so TTFT p99
carries scheduling noise of a few hundred ms on both arms; the checks use a 2x p99 ratio and
a 1 s injected delay."""

import httpx
import pytest
from fake_openai import fake_replica
from scipy import stats

from labkit.router.canary import CANDIDATE
from labkit.router.canary_demo import default_canary, run_canary
from labkit.router.faults import FaultInjector, serve_in_thread
from labkit.router.proxy import create_app

# The first verdict needs 20 finished requests in *each* arm (min_samples); the sticky hashes
# of user-0..user-59 put 39 of them on the candidate, so that is ~40 candidate requests (more
# when baseline requests are still in flight); then threshold (2) failed checks, interval (10)
# apart: rolled back by the 80th candidate request. The check sequence is asserted exactly.
ROLLBACK_WITHIN = 80


@pytest.fixture(scope="module")
def replicas():
    a, b = fake_replica("a", 0.02), fake_replica("b", 0.02)
    with serve_in_thread(a) as ua, serve_in_thread(b) as ub:
        yield ua, ub


@pytest.mark.slow
@pytest.mark.parametrize("fault", [{"delay_s": 1.0}])  # erroring, healthy: tests/bench
def test_bad_candidate_is_rolled_back_through_the_router(replicas, fault):
    base, cand = replicas
    r = run_canary([base], cand, n_requests=400, concurrency=8, canary=default_canary(0.5),
                   after_rollback=24, **fault)
    assert r["rolled_back"], r["checks"]
    assert r["rolled_back_after"] <= ROLLBACK_WITHIN
    actions = [c["action"] for c in r["checks"]]
    assert actions[-2:] == ["fail", "rollback"] and actions[0] == "wait"
    assert ("TTFT p99" if "delay_s" in fault else "error rate") in r["reason"]
    assert r["reason"].endswith("(source: router)")
    # requests sent after the rollback went to the baseline, every one
    later = [x for x in r["requests"] if x["weight_at_start"] == 0.0]
    assert later and all(x["arm"] == "baseline" and x["status"] == 200 for x in later)
    assert "labkit_router_canary_rolled_back 1.0" in r["router_metrics"]


def test_arms_sticky_per_user_header_forces_and_bad_header_is_400(replicas):
    base, cand = replicas
    canary = default_canary(0.5)
    app = create_app([base], "round-robin", canary_urls=[cand], canary=canary)
    with serve_in_thread(app) as url, httpx.Client(timeout=10) as c:
        def arm(user=None, headers=None):
            body = {"prompt": "hi", "stream": True, **({"user": user} if user else {})}
            r = c.post(url + "/v1/completions", json=body, headers=headers or {})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            assert (r.headers["x-labkit-replica"] == "canary-0") == \
                (r.headers["x-labkit-canary"] == CANDIDATE)
            return r.headers["x-labkit-canary"]

        first = {f"u{i}": arm(f"u{i}") for i in range(40)}
        assert all(arm(u) == a for u, a in list(first.items())[:20])  # sticky
        assert 0 < list(first.values()).count(CANDIDATE) < 40
        assert arm("u1", {"x-labkit-canary": "1"}) == CANDIDATE
        assert arm("u1", {"x-labkit-canary": "0"}) == "baseline"
        r = c.post(url + "/v1/completions", json={"prompt": "hi"},
                   headers={"x-labkit-canary": "maybe"})
        assert r.status_code == 400 and "x-labkit-canary" in r.json()["error"]["message"]
        st = c.get(url + "/canary").json()
        assert st["seen"]["baseline"] + st["seen"]["candidate"] == 62
        assert not st["rolled_back"]
    with pytest.raises(ValueError, match="candidate replica"):
        create_app([base], canary=default_canary())


def test_no_canary_endpoint_says_how(replicas):
    with serve_in_thread(create_app([replicas[0]])) as url:
        r = httpx.get(url + "/canary", timeout=10)
        assert r.status_code == 404 and "--canary" in r.json()["error"]["message"]


def test_fault_injector_errors_at_its_rate_and_delays(replicas):
    inj = FaultInjector(replicas[0], error_rate=0.3, seed=1)
    with serve_in_thread(inj.app) as url, httpx.Client(timeout=10) as c:
        codes = [c.post(url + "/v1/completions", json={"prompt": "x"}).status_code
                 for _ in range(60)]
        assert set(codes) == {200, 503}
        assert stats.binomtest(codes.count(503), 60, 0.3).pvalue > 1e-3
        r = c.post(url + "/faults", json={"error_rate": 0, "delay_s": 0.3}).json()
        assert r["delay_s"] == 0.3 and r["injected"]["errors"] == codes.count(503)
        resp = c.post(url + "/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 200 and resp.elapsed.total_seconds() >= 0.3
        assert c.post(url + "/faults", json={"error_rate": 2}).status_code == 400


@pytest.mark.slow
def test_cli_router_with_canary_flags(replicas):
    """``labkit router ... --canary URL --canary-weight 1`` as a process: every request without
    a header goes to the candidate; ``/canary`` reports the flags' thresholds at work."""
    import subprocess
    import sys
    import time

    from labkit.serve.launcher import free_port

    base, cand = replicas
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "labkit.cli", "router", "--replica", base,
                             "--canary", cand, "--canary-weight", "1", "--canary-min-samples",
                             "5", "--port", str(port), "--policy", "round-robin"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        with httpx.Client(timeout=10) as c:
            rs = [c.post(url + "/v1/completions", json={"prompt": f"p{i}"}) for i in range(6)]
            assert all(r.status_code == 200 for r in rs), [(r.status_code, r.text) for r in rs]
            got = {r.headers["x-labkit-replica"] for r in rs}
            assert got == {"canary-0"}
            st = c.get(url + "/canary").json()
            assert st["weight"] == 1 and st["seen"]["candidate"] == 6
    finally:
        proc.terminate()
        proc.wait(10)
    bad = subprocess.run([sys.executable, "-m", "labkit.cli", "router", "--replica", base,
                          "--canary-prometheus", "http://127.0.0.1:9090"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "needs --canary" in bad.stderr
