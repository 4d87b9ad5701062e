"""The router over REAL ``labkit serve`` replicas (child processes on 127.0.0.1, one cluster of 2
for the module, every process stopped at the end): prefix-affinity against round-robin on the
replicas' own prefix-cache counters, a rolling update with drain under traffic, and a replica
killed mid-stream whose streams continue elsewhere and equal the reference generation."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from labkit.bench.cluster_live import failover_run, policy_run, shared_prompt_workload, stream_one
from labkit.model.generate import generate
from labkit.model.loader import load_pretrained
from labkit.router.cluster import Cluster
from labkit.serve.chat import chatml

pytestmark = pytest.mark.slow
NEVER = "~~~~~~"  # a stop string the reference generations do not contain
SYSTEM = ("You are the build assistant of team {t}. Answer in Python, keep functions short, "
          "name things plainly, add a docstring that says why, and never print secrets. ")


@pytest.fixture(scope="module")
def cluster():
    # 32 sequences: the failover test holds 20 at once (n = 2 and two-prompt requests) and
    # kills a replica once every stream has output, so none may wait for a slot (a choice
    # still queued at the kill: test_failover.py)
    c = Cluster(2, policy="round-robin", probe_interval=0.25,
                replica_args=("--num-blocks", "256", "--max-num-seqs", "32"))
    with c:
        yield c
    assert not any(r.alive() for r in c.replicas) and not c.router.alive()


@pytest.fixture(scope="module")
def ref():
    model, tok = load_pretrained("labkit-tiny", dtype=torch.float32)

    def run(prompt_ids: list[int], n: int) -> tuple[list[int], str]:
        ids = generate(model, prompt_ids, n, ignore_eos=True)
        return ids, tok.decode(ids)

    return run, tok


def hit_tokens(c: Cluster) -> tuple[float, float]:
    ms = [c.replica_metrics(i) for i in range(len(c.replicas))]
    return (sum(m["labkit:prefix_cache_hits_total"] for m in ms),
            sum(m["labkit:prefix_cache_queries_total"] for m in ms))


def late_stop(text: str, frac: float = 0.6, size: int = 4) -> tuple[str, int]:
    """A stop string whose first occurrence is past ``frac`` of ``text``, and where it starts
    (late enough that the replica is killed before it)."""
    for i in range(int(frac * len(text)), len(text) - size):
        s = text[i:i + size]
        if text.find(s) == i and s.strip():
            return s, i
    raise AssertionError(f"no late stop string in {text!r}")


def cut_at(text: str, stops: list[str]) -> str:
    """``text`` up to its first stop string, as the engine cuts it."""
    return text[:min([i for i in (text.find(s) for s in stops) if i >= 0], default=len(text))]


def test_prefix_affinity_meets_the_cache_that_round_robin_misses(cluster):
    """5 system prompts x 3 requests each, sent one at a time, round-robin over 2 replicas:
    prompt i's requests are number i, 5+i, 10+i, so round-robin sends them to replicas A, B, A
    (one hit in three), affinity to one replica (two hits in three): 2x the hit tokens."""
    rates, where = {}, {}
    for policy, team in (("round-robin", "rr"), ("prefix-affinity", "pa")):
        cluster.set_policy(policy)
        h0, q0 = hit_tokens(cluster)
        where[policy] = {}
        for k in range(15):
            i = k % 5
            body = {"prompt": SYSTEM.format(t=f"{team}{i}") + f"Task {k}: def f{k}(x):",
                    "max_tokens": 2, "temperature": 0}
            r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            where[policy].setdefault(i, []).append(r.headers["x-labkit-replica"])
        h1, q1 = hit_tokens(cluster)
        rates[policy] = (h1 - h0) / (q1 - q0)
    assert all(len(set(v)) == 1 for v in where["prefix-affinity"].values())
    assert all(v[0] == v[2] != v[1] for v in where["round-robin"].values())
    assert rates["prefix-affinity"] >= 1.8 * rates["round-robin"] > 0, rates
    # the benchmark's concurrent version of the same measurement, on the same counters
    row = policy_run(cluster, "prefix-affinity", shared_prompt_workload(3, 3, salt="t"), 2)
    assert row["requests"] == row["ok"] == 9 and row["replicas_per_prompt"] == 1.0
    assert 0 < row["hit_rate"] < 1 and row["hit_tokens"] <= row["prompt_tokens"]
    assert 0 < row["ttft_p50"] <= row["ttft_p90"]
    cluster.set_policy("round-robin")


def test_rolling_update_drains_without_losing_a_stream(cluster, ref):
    run, tok = ref
    prompt = "def read_config(path):"
    want_ids, want = run(tok.encode(prompt), 100)
    body = {"prompt": prompt, "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    events: list[float] = []
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(
        stream_one(cluster.url, "/v1/completions", body, events.append)))
    t.start()
    while not events and t.is_alive():
        time.sleep(0.01)
    target = next(i for i, s in enumerate(cluster.replica_states()) if s["outstanding"])
    update: list = []
    u = threading.Thread(target=lambda: update.extend(cluster.rolling_update([target])))
    u.start()
    while not cluster.replica_states()[target]["draining"]:
        time.sleep(0.01)
    during = []
    deadline = time.monotonic() + 120
    while u.is_alive() and time.monotonic() < deadline:  # traffic while it drains and restarts
        r = httpx.post(cluster.url + "/v1/completions", json={"prompt": "x = ", "max_tokens": 2},
                       timeout=60)
        # answered before the undrain call was made => routed while the replica was out
        during.append((time.time(), r.status_code, r.headers.get("x-labkit-replica")))
        time.sleep(0.3)
    u.join(1)
    t.join(60)
    assert not u.is_alive() and update[0]["new_pid"] != update[0]["old_pid"]
    assert result["done"] and not result["errors"] and result["text"] == want
    assert result["replica"] == cluster.names[target]  # it finished where it started
    assert during and all(code == 200 for _, code, _ in during)
    out = {rep for done, _, rep in during if done < update[0]["undrained_at"]}
    assert out and cluster.names[target] not in out  # out of rotation until put back
    states = cluster.replica_states()
    assert not states[target]["draining"] and states[target]["breaker"] == "closed"
    back = {httpx.post(cluster.url + "/v1/completions", json={"prompt": "y = ", "max_tokens": 1},
                       timeout=60).headers["x-labkit-replica"] for _ in range(4)}
    assert cluster.names[target] in back  # back in rotation


def test_replica_killed_mid_stream_every_stream_continues_identically(cluster, ref):
    """6 concurrent greedy streams (text and token-id prompts, chat, ids and usage asked or not)
    over 2 replicas; one replica is SIGKILLed once every stream has output: every stream ends
    with [DONE] and exactly the reference text, the cut ones resumed on the survivor."""
    run, tok = ref
    n_new = 60
    msgs = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def merge(a, b):"}]
    usage = {"include_usage": True}
    cases = [
        ("/v1/completions", {"prompt": "import os\n\ndef walk(root):"}, tok.encode(
            "import os\n\ndef walk(root):")),
        ("/v1/completions", {"prompt": tok.encode("class Stack:"), "return_token_ids": True,
                             "stream_options": usage}, tok.encode("class Stack:")),
        ("/v1/chat/completions", {"messages": msgs}, tok.encode(chatml(msgs))),
        ("/v1/chat/completions", {"messages": msgs[1:], "stream_options": usage},
         tok.encode(chatml(msgs[1:]))),
        ("/v1/completions", {"prompt": "def parse(line):"}, tok.encode("def parse(line):")),
        ("/v1/completions", {"prompt": "for i in range(10):"}, tok.encode("for i in range(10):")),
    ]
    wants = [run(p, n_new) for _, _, p in cases]
    common = {"max_tokens": n_new, "temperature": 0, "ignore_eos": True}
    # stop strings (cut-back resume), n = 2 and two prompts (per-choice resume), and two
    # non-streamed requests (retried whole): what each choice must read, from the reference
    fib, q = (run(tok.encode(x), n_new)[1] for x in ("def fib(n):", "class Queue:"))
    rc_msgs = [{"role": "user", "content": "def read_config(path):"}]
    rc = run(tok.encode(chatml(rc_msgs)), n_new)[1]  # "<> A: B-> A: B-> ... A-> A->"
    two = [run(tok.encode(x), n_new)[1] for x in ("def main():", "x = 1\n")]
    assert not any(NEVER in t for t in two)
    (s1, at1), (s2, at2), (s3, _) = late_stop(fib), late_stop(rc, 0.4), late_stop(q, 0.5)
    more = [("/v1/completions", {"prompt": "def fib(n):", "stop": [s1, "@@@@@@"]},
             {0: fib[:at1]}),
            ("/v1/chat/completions", {"messages": rc_msgs, "stop": s2}, {0: rc[:at2]}),
            ("/v1/completions", {"prompt": "class Queue:", "n": 2}, {0: q, 1: q}),
            ("/v1/completions", {"prompt": ["def main():", "x = 1\n"]}, {0: two[0], 1: two[1]}),
            # stop strings with several choices: one common cut-back (failover.py's doc)
            ("/v1/completions", {"prompt": "def fib(n):", "n": 2, "stop": s1},
             {0: fib[:at1], 1: fib[:at1]}),
            ("/v1/completions", {"prompt": ["def fib(n):", "class Queue:"], "stop": [s1, s3]},
             {0: cut_at(fib, [s1, s3]), 1: cut_at(q, [s1, s3])}),
            # a stop string never hit: both choices end at max_tokens with 5 characters held
            # back, so each one's cut-back must leave the replica its exact budget
            ("/v1/completions", {"prompt": ["def main():", "x = 1\n"], "stop": NEVER},
             {0: two[0], 1: two[1]})]
    whole = [("/v1/completions", {"prompt": "def fib(n):", **common}),
             ("/v1/chat/completions", {"messages": msgs[1:], **common})]
    # every request on replica 0 (replica 1 out of rotation until just before the kill), so
    # every kind of stream, and both non-streamed requests, must move
    cluster.drain(1)
    try:
        fo = failover_run(cluster, [(path, {**body, **common}) for path, body, _ in
                                    [*cases, *((m[0], m[1], None) for m in more)]],
                          restore=False, victim=0, whole=whole,
                          before_kill=lambda: cluster.undrain(1))
    finally:
        cluster.undrain(1)
    assert fo["held_at_kill"] == len(cases) + len(more) + len(whole)
    lost = [(k, r["done"], r["errors"], r["replica"]) for k, r in enumerate(fo["records"])
            if not r["done"] or r["errors"]] + \
        [(f"whole {k}", w["status"]) for k, w in enumerate(fo["whole_records"])
         if w["status"] != 200]
    assert fo["failover_lost"] == 0, f"lost (stream, done, errors, replica): {lost}; " \
        f"failovers: {fo['failovers']}"
    assert fo["failover_identical"] is True
    for (_path, body, want), res, first in zip(more, fo["records"][len(cases):],
                                              fo["reference"][len(cases):]):
        for r in (res, first):
            assert r["done"] and not r["errors"] and r["choices"] == want, (body, r)
        assert ("stop" in body and body["stop"] != NEVER) == (res["reasons"][-1] == "stop")
    assert [w["texts"] for w in fo["whole_records"]] == [[fib], [wants[3][1]]]
    assert {w["replica"] for w in fo["whole_records"]} == {cluster.names[1]}
    # labkit serve sends a non-streamed answer's headers with its body, so those two were
    # retried as failures before the first byte (a cut after the headers: test_proxy.py)
    assert len([f for f in fo["failovers"] if not f.get("whole")]) == len(cases) + len(more)
    for (path, body, prompt), (want_ids, want), res, first in zip(cases, wants, fo["records"],
                                                                  fo["reference"]):
        for r in (res, first):  # the killed run and the uninterrupted one
            assert r["done"] and not r["errors"], r
            assert r["text"] == want, (path, body)
            assert r["reasons"][-1] == "length"
            if body.get("return_token_ids"):
                assert r["ids"] == want_ids
            if body.get("stream_options"):
                assert r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n_new,
                                      "total_tokens": len(prompt) + n_new}
    victim = cluster.names.index(fo["victim"])
    moved = fo["failovers"]
    assert all(f["to"] != f["from"] and f["tokens_sent"] > 0 for f in moved)
    assert {f["id"] for f in moved} <= {r["id"] for r in fo["records"]}
    # the dead replica leaves rotation through the probes (breaker open), and new requests work
    deadline = time.monotonic() + 10
    while cluster.replica_states()[victim]["breaker"] == "closed" and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.replica_states()[victim]["breaker"] != "closed"
    r = httpx.post(cluster.url + "/v1/completions", json={"prompt": "z", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-labkit-replica"] != cluster.names[victim]
