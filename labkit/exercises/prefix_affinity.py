"""Exercise 13: the router's prefix-affinity policy (consistent hashing with bounded loads).

The checker does not compare choices with a reference (any well-made ring is right); it
measures the properties that make the policy worth having, each on the key distribution that
breaks a plausible wrong answer, by calling the learner's ``choose`` directly:

1. affinity: requests sharing their leading full blocks meet on one replica, whatever follows
   (hashing the whole prompt fails), and a partial last block does not change the key (hashing a
   fixed token window that is not block-aligned fails);
2. spread: many distinct prefixes land evenly (one ring point per replica fails) and by replica
   *name*, whatever the order of the list (hashing list positions fails);
3. minimal remapping: removing a replica moves only its own prefixes, adding one moves about
   1/(n+1) of them, all to it (``hash % n`` fails: it moves almost everything);
4. bounded load: under one hot prefix no replica is sent a request while it holds
   ``ceil((1 + eps) * m / n)`` of the ``m`` in flight (no bound fails: the hot prefix piles up);
5. the fleet simulator (``labkit.sim.fleet``: each replica the real scheduler and prefix cache)
   measures the prefix hit rate against round-robin's on a multi-tenant trace.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.exercises.inject import inject as _inject
from labkit.router.policies import NoReplicaError, RoundRobin, RouteKey, _h64

NOTEBOOK = "13_prefix_affinity"
BLOCK, NUM_BLOCKS, EPS = 16, 4, 0.25  # the policy under test is built with these
WINDOW = BLOCK * NUM_BLOCKS


def inject(name: str, learner: Any) -> Any:
    """The reference under ``LABKIT_INJECT_SOLUTIONS=1`` (CI), else the learner's own."""
    return _inject(name, learner, "prefix_affinity_solutions")


def h64(data: bytes) -> int:
    """The router's stable 64-bit hash: the same in every process and run, unlike Python's
    ``hash()`` of a str (salted per process), so two routers agree on the ring."""
    return _h64(data)


@dataclass
class Rep:
    """A replica as the router sees it: a stable name and its requests in flight."""

    name: str
    outstanding: int = 0


def replicas(n: int, start: int = 0) -> list[Rep]:
    return [Rep(f"replica-{i}") for i in range(start, start + n)]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 32000) for _ in range(n)]


class _Probe:
    """Calls the learner's policy and checks that it answered with one of the replicas."""

    def __init__(self, policy_cls: Callable) -> None:
        self.policy_cls = policy_cls
        self.calls, self.seconds = 0, 0.0

    def new(self) -> Any:
        return call(self.policy_cls, block_size=BLOCK, num_blocks=NUM_BLOCKS, eps=EPS,
                    _label=f"PrefixAffinity(block_size={BLOCK}, num_blocks={NUM_BLOCKS}, "
                           f"eps={EPS})")

    def choose(self, policy: Any, ids: list[int], reps: list[Rep]) -> Rep:
        before = [r.outstanding for r in reps]
        t0 = time.perf_counter()
        got = call(policy.choose, RouteKey(token_ids=ids), reps,
                   _label=f"choose(prompt of {len(ids)} tokens, {len(reps)} replicas with "
                          f"outstanding {[r.outstanding for r in reps]})")
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        if [r.outstanding for r in reps] != before:
            raise CheckFailure("choose changed the replicas' outstanding counts",
                               expected=before, actual=[r.outstanding for r in reps],
                               hint="only read .outstanding: the router counts a request when "
                                    "it sends it and again when it finishes")
        if not any(got is r for r in reps):
            raise CheckFailure("choose must return one of the replica objects it was given",
                               expected="one of " + ", ".join(r.name for r in reps[:4]) + ", …",
                               actual=got)
        return got

    def homes(self, policy: Any, prompts: list[list[int]], reps: list[Rep]) -> list[str]:
        return [self.choose(policy, p, reps).name for p in prompts]


def _interface(p: _Probe) -> None:
    policy = p.new()
    try:
        got = policy.choose(RouteKey(token_ids=list(range(64))), [])
    except NoReplicaError:
        return
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - any other exception is the wrong contract
        got = f"{type(e).__name__}: {e}"
    raise CheckFailure("with no replica to route to, raise NoReplicaError", expected=
                       "NoReplicaError", actual=got, hint="from labkit.router.policies import "
                       "NoReplicaError; the router answers 503 with its message")


def _affinity(p: _Probe, rng: random.Random) -> str:
    policy, reps = p.new(), replicas(8)
    for _ in range(12):
        system = _tokens(rng, WINDOW)
        prompts = [system + _tokens(rng, rng.randrange(0, 90)) for _ in range(10)]
        where = p.homes(policy, prompts, reps)
        if len(set(where)) > 1:
            raise CheckFailure(
                f"10 requests sharing a {WINDOW}-token system prompt (the first {NUM_BLOCKS} "
                f"full blocks of {BLOCK}) and differing after it went to {len(set(where))} "
                "replicas", inputs=f"prompt lengths {[len(x) for x in prompts]}",
                expected="one replica for all", actual=where,
                hint=f"key on the first num_blocks * block_size = {WINDOW} tokens only: the rest "
                     "is each user's own text, which no other request shares")
    for _ in range(12):
        system = _tokens(rng, 40)  # 2 full blocks and a partial third
        prompts = [system[:32], system, system + _tokens(rng, 5),
                   system[:32] + _tokens(rng, 9)]
        where = p.homes(policy, prompts, reps)
        if len(set(where)) > 1:
            raise CheckFailure(
                "prompts sharing their 2 full blocks (32 tokens) and differing only in a "
                "partial third block went to different replicas",
                inputs=f"lengths {[len(x) for x in prompts]}, block_size {BLOCK}",
                expected="one replica for all", actual=where,
                hint="the prefix cache shares whole blocks only: key on "
                     "token_ids[: n_full_blocks * block_size], never on a partial block")
    short = [Rep(f"replica-{i}", o) for i, o in enumerate((3, 1, 4, 1, 5, 9, 0, 6))]
    got = p.choose(p.new(), _tokens(rng, BLOCK - 1), short)
    if got.outstanding != 0:
        raise CheckFailure("a prompt shorter than one block has nothing a prefix cache could "
                           "share: it goes to the least-loaded replica",
                           inputs="15 tokens, outstanding [3, 1, 4, 1, 5, 9, 0, 6]",
                           expected="replica-6", actual=got.name)
    return "shared system prompts meet"


def _spread(p: _Probe, rng: random.Random) -> tuple[list[list[int]], list[str], str]:
    policy, reps = p.new(), replicas(8)
    prompts = [_tokens(rng, WINDOW) for _ in range(1000)]
    where = p.homes(policy, prompts, reps)
    counts = Counter(where)
    shares = [counts.get(r.name, 0) / (len(prompts) / len(reps)) for r in reps]
    if max(shares) > 1.5 or min(shares) < 0.5:
        raise CheckFailure(
            f"{len(prompts)} distinct prefixes over 8 idle replicas are far from even",
            expected="every replica within 0.5x..1.5x of the average",
            actual={r.name: round(s, 2) for r, s in zip(reps, shares)},
            hint="with one ring point per replica the arcs differ by factors of several; give "
                 "each replica vnodes points, at h64(f'{name}#{i}'.encode()) for i < vnodes")
    shuffled = [Rep(r.name) for r in rng.sample(reps, len(reps))]
    again = p.homes(p.new(), prompts[:200], shuffled)
    moved = sum(a != b for a, b in zip(where[:200], again))
    if moved:
        raise CheckFailure(
            "the same replicas listed in another order (new objects, same names) got "
            f"{moved} of 200 prefixes differently",
            expected=0, actual=moved,
            hint="place ring points by replica NAME, never by position in the list: the list's "
                 "order changes whenever a replica restarts or a health check flaps")
    return prompts, where, f"{len(prompts)} prefixes spread {min(shares):.2f}x..{max(shares):.2f}x"


def _remap(p: _Probe, prompts: list[list[int]], before: list[str]) -> str:
    """``before``: the prompts' replicas among replica-0..7 (from ``_spread``)."""
    prompts, before = prompts[:300], before[:300]
    reps = replicas(8)
    gone = "replica-3"
    after = p.homes(p.new(), prompts, [r for r in reps if r.name != gone])
    stayed = [(a, b) for a, b in zip(before, after) if a != gone]
    moved = sum(a != b for a, b in stayed)
    if moved:
        raise CheckFailure(
            f"removing {gone} moved {moved} of the {len(stayed)} prefixes that were NOT on it "
            f"({moved / len(stayed):.0%}); each one arrives cold at a replica without its KV",
            expected=0, actual=moved,
            hint="that is what hash % n does; on a ring a replica's removal only hands ITS "
                 "arcs to the next points clockwise, every other key keeps its replica")
    grown = p.homes(p.new(), prompts, reps + [Rep("replica-8")])
    wrong = [(a, b) for a, b in zip(before, grown) if a != b and b != "replica-8"]
    frac = sum(a != b for a, b in zip(before, grown)) / len(prompts)
    if wrong or frac > 2 / 9:
        raise CheckFailure(
            "adding replica-8 to 8 replicas should move about 1/9 of the prefixes, all to it",
            expected="<= 22% moved, all to replica-8",
            actual=f"{frac:.0%} moved, {len(wrong)} between old replicas",
            hint="a new replica's points take over only the arcs just before them")
    return (f"removing a replica moved none of the others' prefixes, adding one moved "
            f"{frac:.0%} (to it)")


def _bounded_traffic(p: _Probe, policy: Any, reps: list[Rep], rng: random.Random,
                     hot: list[int], cold: list[list[int]], home: dict[tuple[int, ...], str]
                     ) -> tuple[Any, int, float, set[str], int, int]:
    """160 steps of 3 arrivals: (first cap breach or None, peak in flight, worst multiple of the
    cap, replicas the hot prefix used, cold requests sent home, cold requests)."""
    ends: list[tuple[int, Rep]] = []
    home_hits = cold_total = 0
    hot_used: set[str] = set()
    peak, worst, first = 0, 0.0, None
    for step in range(160):
        for _, r in [e for e in ends if e[0] == step]:
            r.outstanding -= 1
        ends = [e for e in ends if e[0] > step]
        for _ in range(3):
            is_hot = rng.random() < 0.5
            prefix = hot if is_hot else rng.choice(cold)
            ids = prefix + _tokens(rng, rng.randrange(0, 40))
            m = sum(r.outstanding for r in reps) + 1
            cap = math.ceil((1 + EPS) * m / len(reps))
            state = [r.outstanding for r in reps]
            got = p.choose(policy, ids, reps)
            if got.outstanding >= cap and first is None:
                first = (f"{got.name} already held {got.outstanding} of the {m - 1} requests in "
                         f"flight and was sent another ({'the hot' if is_hot else 'a cold'} "
                         f"prefix, step {step})", f"outstanding {state}",
                         f"a replica below cap = ceil((1 + {EPS}) * {m} / {len(reps)}) = {cap}",
                         f"{got.name} with {got.outstanding}")
            if got.outstanding >= cap:
                worst = max(worst, (got.outstanding + 1) / cap)
            got.outstanding += 1
            peak = max(peak, got.outstanding)
            ends.append((step + rng.randrange(4, 25), got))
            if is_hot:
                hot_used.add(got.name)
            else:
                cold_total += 1
                home_hits += got.name == home[tuple(prefix)]
    return first, peak, worst, hot_used, home_hits, cold_total


def _bounded(p: _Probe, rng: random.Random) -> str:
    """One hot prefix (half the traffic) among 40 others; requests last 4..24 steps."""
    policy, reps = p.new(), replicas(8)
    hot = _tokens(rng, WINDOW)
    cold = [_tokens(rng, WINDOW) for _ in range(40)]
    idle = p.new()
    home = {tuple(c): p.choose(idle, c, replicas(8)).name for c in cold}  # where each is idle
    first, peak, worst, hot_used, home_hits, cold_total = _bounded_traffic(
        p, policy, reps, rng, hot, cold, home)
    if first is not None:
        what, inputs, expected, actual = first
        raise CheckFailure(
            f"{what}; over the run the busiest replica peaked at {peak} in flight, "
            f"{worst:.1f}x its cap, and the hot prefix used {len(hot_used)} replica(s)",
            inputs=inputs, expected=expected, actual=actual,
            hint="bounded load: walk clockwise from the key's point to the first replica with "
                 "outstanding < ceil((1 + eps) * m / n), m counting this request")
    share = home_hits / cold_total
    if share < 0.6:
        raise CheckFailure(
            "under load, the cold prefixes (none of them near the cap) left their replica too "
            "often", expected=">= 60% of them on the replica they get when all are idle",
            actual=f"{share:.0%}", hint="spill a request only when its replica is at the cap")
    return (f"a hot prefix (half the traffic) spread over {len(hot_used)} replicas, never over "
            f"the cap (peak {peak}), and {share:.0%} of the cold ones stayed home")


def _fleet(policy_cls: Callable, p: _Probe) -> str:
    from labkit.sim.fleet import Fleet, FleetConfig
    from labkit.sim.traces import poisson_trace

    trace = poisson_trace(30.0, 8.0, num_tenants=48, seed=0)
    rr = Fleet(RoundRobin(), 8, FleetConfig()).run(trace.specs, trace.duration).hit_rate
    mine = call(lambda: Fleet(p.new(), 8, FleetConfig()).run(trace.specs, trace.duration),
                _label="the fleet simulator, 8 replicas, 48 tenants").hit_rate
    if mine < 1.25 * rr:
        raise CheckFailure("in the fleet simulator your prefix hit rate is not clearly above "
                           "round-robin's", inputs=f"{len(trace.specs)} requests, 48 tenants, "
                           "8 replicas", expected=f">= 1.25 x {rr:.2f}", actual=round(mine, 3))
    return (f"in the fleet simulator (8 replicas, real scheduler and prefix cache) your prefix "
            f"hit rate is {mine:.2f} against round-robin's {rr:.2f} ({mine / rr:.1f}x)")


def check_prefix_affinity(policy_cls: Callable) -> Any:
    """Properties 1-5 of the module doc, in that order; the first broken one is reported."""
    def body() -> str:
        rng = random.Random(13)
        p = _Probe(policy_cls)
        _interface(p)
        parts = [_affinity(p, rng)]
        prompts, homes, spread = _spread(p, rng)
        parts += [spread, _remap(p, prompts, homes), _bounded(p, rng), _fleet(policy_cls, p)]
        ms = 1e3 * p.seconds / max(p.calls, 1)
        slow = (f" Note: choose took {ms:.1f} ms per call; a router calls it per request, so "
                "build the ring once per replica set, not on every call.") if ms > 1.0 else ""
        return "; ".join(parts) + "." + slow

    return run_check("prefix_affinity", body)
