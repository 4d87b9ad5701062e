"""The real-replica half of ``labkit bench cluster``: ``labkit serve`` processes behind
``labkit router`` on loopback (``labkit.router.cluster.Cluster``).

1. **Prefix-affinity vs round-robin**: a shared-system-prompt workload (``prompts`` system
   prompts of ~110 tokens, more than one replica's cache holds (``REPLICA_ARGS``), with
   ``per_prompt`` short questions under each, shuffled with a seed, sent by ``concurrency``
   clients) under each policy, on fresh system prompts per policy so one run
   cannot warm the other's cache. Prefix-affinity runs twice: with ``min_load`` (the headline:
   the bound applies once a replica holds that many) and with the strict bound alone. Hit rate
   = the replicas' own prefix-cache counters (``labkit:prefix_cache_hits`` / ``queries``,
   prompt tokens) over the run; TTFT = the client's time to the first streamed chunk through
   the router. Round-robin sends a prompt's requests to every replica in turn, so each replica
   prefills it once (and, with more prompts than one replica's cache holds, again after LRU
   evicted it); affinity sends them to one.
2. **Failover**: ``streams`` greedy streams at once, first uninterrupted (the reference), then
   again with the replica holding the most of them SIGKILLed once every stream has output.
   Counted: streams resumed elsewhere, streams lost (no ``[DONE]`` or an error event), and
   whether every text equals its uninterrupted run byte for byte.

Used by ``labkit bench cluster`` (``run_real``), the tests and notebook 08.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from labkit.router.cluster import Cluster

SYSTEM = ("You are the assistant of the {team} team at a company that builds data tools. "
          "Answer in Python 3 with type hints. Keep every function short and name it plainly. "
          "Add a docstring that says why the code exists, not what it does. Never log secrets, "
          "tokens or passwords. Prefer the standard library over third-party packages. ")
QUESTIONS = ("def parse_{k}(line):", "class Cache{k}:", "def load_{k}(path):",
             "def merge_{k}(a, b):", "def retry_{k}(fn, times):", "import json\n\ndef dump_{k}(x):")
FAILOVER_PROMPTS = ("def read_config(path):", "class Stack:", "import os\n\ndef walk(root):",
                    "def parse(line):", "for i in range(10):", "def fib(n):",
                    "class Queue:", "def main():")


def shared_prompt_workload(prompts: int, per_prompt: int, salt: str = "a",
                           seed: int = 0, max_tokens: int = 8) -> list[dict[str, Any]]:
    """``prompts`` system prompts x ``per_prompt`` questions each, shuffled (seeded)."""
    rng = random.Random(seed)
    bodies = [{"prompt": SYSTEM.format(team=f"{salt}-{i}") + rng.choice(QUESTIONS).format(k=j),
               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "group": i}
              for i in range(prompts) for j in range(per_prompt)]
    rng.shuffle(bodies)
    return bodies


def stream_one(url: str, path: str, body: dict[str, Any],
               on_event: Callable[[float], None] | None = None) -> dict[str, Any]:
    """One streamed request; the client's view: text, first-chunk time, events, outcome."""
    body = {k: v for k, v in body.items() if k != "group"}
    rec: dict[str, Any] = {"text": "", "ids": [], "reasons": [], "usage": None, "events": [],
                           "done": False, "errors": [], "id": None, "start": time.time(),
                           "choices": {}}  # choice index -> its text (n > 1, several prompts)
    try:
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
            rec["status"], rec["replica"] = r.status_code, r.headers.get("x-labkit-replica")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    rec["done"] = True
                    break
                d = json.loads(line[6:])
                if "error" in d:
                    rec["errors"].append(d["error"].get("message"))
                    continue
                rec["id"] = rec["id"] or d.get("id")
                rec["usage"] = d.get("usage") or rec["usage"]
                for ch in d.get("choices", []):
                    text = ch.get("text", (ch.get("delta") or {}).get("content") or "")
                    rec["text"] += text
                    i = ch.get("index", 0)
                    rec["choices"][i] = rec["choices"].get(i, "") + text
                    rec["ids"] += ch.get("token_ids", [])
                    rec["reasons"].append(ch.get("finish_reason"))
                t = time.time()
                rec["events"].append(t)
                if on_event is not None:
                    on_event(t)
    except httpx.HTTPError as e:
        rec["errors"].append(f"{type(e).__name__}: {e}")
    rec["ttft"] = rec["events"][0] - rec["start"] if rec["events"] else None
    return rec


def post_one(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One non-streamed request: status, serving replica, each choice's text."""
    try:
        r = httpx.post(url + path, json={**body, "stream": False}, timeout=120)
    except httpx.HTTPError as e:
        return {"status": None, "error": f"{type(e).__name__}: {e}", "texts": None}
    d = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    texts = [ch.get("text", (ch.get("message") or {}).get("content")) for ch in
             d.get("choices", [])] if r.status_code == 200 else None
    return {"status": r.status_code, "replica": r.headers.get("x-labkit-replica"),
            "texts": texts, "error": None if r.status_code == 200 else r.text}


def _threads(fns: Sequence[Callable[[], Any]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=f) for f in fns]
    for t in threads:
        t.start()
    return threads


def run_load(url: str, bodies: Sequence[dict[str, Any]], concurrency: int = 4,
             path: str = "/v1/completions") -> list[dict[str, Any]]:
    """Send ``bodies`` with ``concurrency`` client threads; one record per request, in order."""
    out: list[dict[str, Any] | None] = [None] * len(bodies)
    it = iter(range(len(bodies)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                k = next(it, None)
            if k is None:
                return
            out[k] = {**stream_one(url, path, bodies[k]), "group": bodies[k].get("group")}

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


def _hits(c: Cluster) -> tuple[float, float]:
    ms = [c.replica_metrics(i) for i in range(len(c.replicas))]
    return (sum(m.get("labkit:prefix_cache_hits_total", 0.0) for m in ms),
            sum(m.get("labkit:prefix_cache_queries_total", 0.0) for m in ms))


def policy_run(c: Cluster, policy: str, bodies: Sequence[dict[str, Any]],
               concurrency: int = 4, **policy_kw: Any) -> dict[str, Any]:
    """One policy over the workload: hit rate from the replicas' counters, client TTFT."""
    c.set_policy(policy, **policy_kw)
    h0, q0 = _hits(c)
    t0 = time.perf_counter()
    recs = run_load(c.url, bodies, concurrency)
    wall = time.perf_counter() - t0
    h1, q1 = _hits(c)
    ttft = [r["ttft"] for r in recs if r["ttft"] is not None]
    spread = {}
    for r in recs:
        spread.setdefault(r["group"], set()).add(r["replica"])
    ok = sum(r["done"] and not r["errors"] for r in recs)
    return {"policy": policy, "policy_kw": policy_kw, "requests": len(recs), "ok": ok,
            "hit_rate": (h1 - h0) / max(q1 - q0, 1.0), "hit_tokens": h1 - h0,
            "prompt_tokens": q1 - q0, "ttft_p50": float(np.percentile(ttft, 50)),
            "ttft_p90": float(np.percentile(ttft, 90)), "wall_s": wall,
            "replicas_per_prompt": float(np.mean([len(v) for v in spread.values()]))}


def failover_run(c: Cluster, cases: Sequence[tuple[str, dict[str, Any]]], min_events: int = 3,
                 restore: bool = True, victim: int | None = None,
                 whole: Sequence[tuple[str, dict[str, Any]]] = (),
                 before_kill: Callable[[], Any] | None = None) -> dict[str, Any]:
    """``cases`` = (path, body) of greedy streams, ``whole`` of non-streamed requests (sent
    once every stream has output). Runs them uninterrupted, then again with a replica killed
    mid-stream (``victim``, default the one holding the most; ``before_kill`` runs just
    before); compares every choice's text. ``restore`` restarts the victim afterwards."""
    ref, ref_whole = _uninterrupted(c.url, cases, whole)
    counts = [0] * len(cases)
    recs: list[Any] = [None] * len(cases)
    got_whole: list[Any] = [None] * len(whole)

    def go(k: int) -> None:
        recs[k] = stream_one(c.url, *cases[k], on_event=lambda t: counts.__setitem__(
            k, counts[k] + 1))

    threads = _threads([lambda k=k: go(k) for k in range(len(cases))])
    deadline = time.monotonic() + 120

    def wait_for(n: int) -> None:
        while min(counts) < n and time.monotonic() < deadline and \
                any(t.is_alive() for t in threads):
            time.sleep(0.005)

    wait_for(1)
    if whole:  # sent now, and routed before the kill
        threads += _send_routed(c, whole, got_whole, sum(t.is_alive() for t in threads),
                                deadline)
    wait_for(min_events)
    if before_kill is not None:
        before_kill()
    victim, held, kill_time = _kill(c, victim)
    for t in threads:
        t.join()
    moved = [f for f in c.failovers() if f["time"] >= kill_time - 1
             and f["from"] == c.names[victim]]
    lost = sum(not r["done"] or bool(r["errors"]) for r in recs) + \
        sum(w["status"] != 200 for w in got_whole)
    out = {"streams": len(cases), "whole": len(whole), "victim": c.names[victim],
           "held_at_kill": held, "kill_time": kill_time, "failover_requests": len(moved),
           "failover_lost": lost,
           "failover_identical": all(r["choices"] == w["choices"] and w["done"] for r, w in
                                     zip(recs, ref)) and
           all(g["texts"] == w["texts"] is not None for g, w in zip(got_whole, ref_whole)),
           "failovers": moved, "records": recs, "reference": ref,
           "whole_records": got_whole, "whole_reference": ref_whole}
    if restore:
        out["restart_s"] = c.restart(victim)
    return out


def _uninterrupted(url: str, cases: Sequence[tuple[str, dict[str, Any]]],
                   whole: Sequence[tuple[str, dict[str, Any]]]) -> tuple[list[Any], list[Any]]:
    """The reference: every stream and whole request answered with no replica killed."""
    ref: list[Any] = [None] * len(cases)
    ref_whole: list[Any] = [None] * len(whole)
    for t in _threads([lambda k=k: ref.__setitem__(k, stream_one(url, *cases[k]))
                       for k in range(len(cases))] +
                      [lambda k=k: ref_whole.__setitem__(k, post_one(url, *whole[k]))
                       for k in range(len(whole))]):
        t.join()
    return ref, ref_whole


def _send_routed(c: Cluster, whole: Sequence[tuple[str, dict[str, Any]]], got: list[Any],
                 streaming: int, deadline: float) -> list[threading.Thread]:
    """Send the whole requests and wait until the router holds them all (beside the
    ``streaming`` streams), so the kill hits requests already routed."""
    threads = _threads([lambda k=k: got.__setitem__(k, post_one(c.url, *whole[k]))
                        for k in range(len(whole))])
    while sum(s["outstanding"] for s in c.replica_states()) < streaming + len(whole) and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    return threads


def _kill(c: Cluster, victim: int | None) -> tuple[int, int, float]:
    """Kill ``victim`` (default: the replica holding the most requests); returns it, how many
    it held and when."""
    states = c.replica_states()
    if victim is None:
        victim = max(range(len(states)), key=lambda i: states[i]["outstanding"])
    held, kill_time = states[victim]["outstanding"], time.time()
    c.kill(victim)
    return victim, held, kill_time


def failover_cases(streams: int, max_tokens: int = 64) -> list[tuple[str, dict[str, Any]]]:
    """Greedy streams for the failover run: text prompts, and every third one a chat."""
    cases = []
    for k in range(streams):
        p = FAILOVER_PROMPTS[k % len(FAILOVER_PROMPTS)]
        common = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if k % 3 == 2:
            cases.append(("/v1/chat/completions",
                          {"messages": [{"role": "user", "content": p}], **common}))
        else:
            cases.append(("/v1/completions", {"prompt": p, **common}))
    return cases


# The fleet-level point of affinity is that the replicas' caches add up instead of holding
# copies, so the workload has more system prompts than one replica's cache holds but fewer than
# the fleet's: 16 prompts x 7 blocks = 112 blocks against 64-block pools (less the blocks of
# requests in flight). Round-robin makes every replica cache all 16 (LRU thrash); affinity gives
# each ~5 (~37 blocks). With 12 prompts (84 blocks) the pools hold most of them even under
# round-robin, and the ratio is mostly the first-touch misses: a prompt's 4 requests land on
# ~2.3-2.7 replicas, so round-robin hits 1.3-1.7 of 4 where affinity hits 3 (1.8-2.4x,
# depending on the shuffle).
REPLICA_ARGS = ("--num-blocks", "64", "--max-num-seqs", "16")
QUICK = {"replicas": 3, "prompts": 16, "per_prompt": 4, "concurrency": 4, "streams": 6,
         "max_tokens": 64, "min_load": 4}
FULL = {"replicas": 3, "prompts": 24, "per_prompt": 8, "concurrency": 6, "streams": 12,
        "max_tokens": 128, "min_load": 4}
POLICY_RUNS = (("round-robin", {}), ("prefix-affinity", {"min_load": "min_load"}),
               ("prefix-affinity", {}))


def run_real(quick: bool = True, seed: int = 0, sizes: dict[str, Any] | None = None,
             cluster: Cluster | None = None) -> dict[str, Any]:
    """Both experiments on a fresh cluster (or the one given); the bench's real fields."""
    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    own = cluster is None
    c = cluster or Cluster(cfg["replicas"], policy="round-robin", replica_args=REPLICA_ARGS)
    t0 = time.perf_counter()
    if own:
        c.start()
    try:
        startup = time.perf_counter() - t0
        rows = []
        for k, (pol, kw) in enumerate(tqdm(POLICY_RUNS, desc="real replicas", leave=False)):
            bodies = shared_prompt_workload(cfg["prompts"], cfg["per_prompt"],
                                            salt=f"{k}-{seed}", seed=seed)
            rows.append(policy_run(c, pol, bodies, cfg["concurrency"],
                                   **{a: cfg[b] for a, b in kw.items()}))
        fo = failover_run(c, failover_cases(cfg["streams"], cfg["max_tokens"]), restore=not own)
    finally:
        if own:
            c.stop()
    rr, pa, strict = rows
    return {"real_config": cfg, "real_replicas": len(c.replicas), "real_startup_s": startup,
            "affinity_hit_rate": pa["hit_rate"], "round_robin_hit_rate": rr["hit_rate"],
            "affinity_ttft_p50": pa["ttft_p50"], "round_robin_ttft_p50": rr["ttft_p50"],
            "affinity_strict_hit_rate": strict["hit_rate"],
            "affinity_strict_ttft_p50": strict["ttft_p50"],
            "failover_requests": fo["failover_requests"], "failover_lost": fo["failover_lost"],
            "failover_identical": fo["failover_identical"], "failover_streams": fo["streams"],
            "real_policies": rows,
            "failover": {k: v for k, v in fo.items() if k not in ("records", "reference")}}
