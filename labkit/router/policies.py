"""Routing policies: which replica gets the next request. One class, one method, ``choose``.

The same classes route real HTTP requests (the router) and simulated ones (``labkit.sim.fleet``),
so a policy measured in the simulator at 64 replicas is the policy that runs on loopback.
A replica is anything with a ``name`` (str, stable across restarts) and ``outstanding`` (requests
sent and not yet finished, which the router counts itself); a request is a :class:`RouteKey`.

- ``round-robin``: replica i, i+1, ... Spreads requests evenly, ignores what each replica has
  cached, so every replica ends up prefilling every system prompt.
- ``least-outstanding``: the replica with the fewest requests in flight (ties rotate). Reacts to
  slow replicas and long requests, still cache-blind.
- ``prefix-affinity``: consistent hashing over the prompt's leading block-aligned tokens, so
  requests sharing a system prompt meet on the replica that has its KV blocks cached, with
  **bounded loads** (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads",
  SODA 2018): no replica takes a request while it holds ``ceil((1 + eps) * m / n)`` or more of
  the ``m`` outstanding requests (counting the new one) over ``n`` replicas; the request walks on
  along the ring to the next replica under the cap. One hot prefix therefore spills onto the next
  replicas of its ring walk instead of melting one replica, and the cap always leaves a replica
  free because ``n * cap > m - 1``.

Why ``min_load`` (default 0: off): with few requests in flight the bound is tighter than it
needs to be. At ``m = 2`` over ``n = 3`` replicas the cap is ``ceil(1.25 * 2 / 3) = 1``, so a
second request for a hot prefix must leave its replica although that replica batches 16
sequences and is nowhere near melting. ``min_load = k`` lets any replica holding fewer than
``k`` requests take one (cap = ``max(k, ceil(...))``), which is how production routers phrase it
(balance only past an absolute threshold, e.g. SGLang's cache-aware router); the bound still
rules once replicas are busy.

Why hash the first K *full* blocks and not the whole prompt: the engine's prefix cache shares KV
only in whole blocks (``labkit.kv.prefix``), and the part worth sharing is the leading one (the
system prompt); hashing past it would give every request its own key. The key here is the
engine's own chained block hash, so "same key" means "same cached blocks". Why virtual nodes:
with one point per replica the arcs differ by factors of several; with ``V`` points each the
shares are within about ``1/sqrt(V)`` of even. Why the ring (not ``hash % n``): removing a
replica moves only the keys it owned, everything else stays warm.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from labkit.kv.prefix import hash_prompt_blocks


class NoReplicaError(RuntimeError):
    """Every replica is out of rotation (unhealthy, draining or none configured)."""


class Replica(Protocol):
    name: str
    outstanding: int


@dataclass(frozen=True)
class RouteKey:
    """What a policy may look at: the prompt's token ids (None if the router has no tokenizer;
    then ``text`` is hashed), the OpenAI ``user`` field, and request headers."""

    token_ids: Sequence[int] | None = None
    text: str | None = None
    user: str | None = None


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def prefix_key(key: RouteKey, block_size: int = 16, num_blocks: int = 8) -> int | None:
    """64-bit hash of the prompt's first ``num_blocks`` full blocks (fewer if the prompt is
    shorter); None when the prompt has no full block, i.e. nothing a prefix cache could share.
    Token ids use the engine's chained block hash; text falls back to its leading
    ``block_size * num_blocks`` characters."""
    if block_size < 1 or num_blocks < 1:
        raise ValueError(f"block_size and num_blocks must be >= 1, got {block_size}, {num_blocks}")
    if key.token_ids is not None:
        hashes = hash_prompt_blocks(list(key.token_ids[: block_size * num_blocks]), block_size)
        return int.from_bytes(hashes[-1][:8], "little") if hashes else None
    if key.text is not None and len(key.text) >= block_size:
        n = len(key.text) // block_size * block_size
        return _h64(key.text[: min(n, block_size * num_blocks)].encode("utf-8"))
    return None


def _check(replicas: Sequence[Any]) -> None:
    if not replicas:
        raise NoReplicaError("no replica is available to route to (all unhealthy or draining?)")


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, key: RouteKey, replicas: Sequence[Replica]) -> Replica:
        _check(replicas)
        return replicas[next(self._counter) % len(replicas)]


class LeastOutstanding:
    name = "least-outstanding"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, key: RouteKey, replicas: Sequence[Replica]) -> Replica:
        _check(replicas)
        start = next(self._counter) % len(replicas)  # ties rotate instead of piling on replica 0
        order = list(replicas[start:]) + list(replicas[:start])
        return min(order, key=lambda r: r.outstanding)


class PrefixAffinity:
    """Consistent hashing with bounded loads over the prompt's leading blocks (module doc).

    ``eps`` = how far above the average a replica may go (0.25: 25%); ``eps=None`` turns the
    bound off (pure consistent hashing); ``min_load``: a replica holding fewer requests is never
    over the bound. Prompts with no full block go to the least loaded."""

    name = "prefix-affinity"

    def __init__(self, block_size: int = 16, num_blocks: int = 8, eps: float | None = 0.25,
                 vnodes: int = 160, min_load: int = 0) -> None:
        if eps is not None and eps <= 0:
            raise ValueError(f"eps must be > 0 (or None for no bound), got {eps}")
        if min_load < 0:
            raise ValueError(f"min_load must be >= 0, got {min_load}")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.eps, self.vnodes, self.min_load = eps, vnodes, min_load
        self._ring_for: tuple[str, ...] | None = None
        self._points: list[int] = []
        self._owners: list[str] = []
        self._fallback = LeastOutstanding()

    def _ring(self, names: tuple[str, ...]) -> None:
        if names == self._ring_for:
            return
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique, got {list(names)}")
        pts = sorted((_h64(f"{n}#{v}".encode()), n) for n in names for v in range(self.vnodes))
        self._points = [p for p, _ in pts]
        self._owners = [n for _, n in pts]
        self._ring_for = names

    def capacity(self, replicas: Sequence[Replica]) -> int:
        """Most requests a replica may hold after taking one more: ceil((1+eps) * m / n), and
        at least ``min_load``."""
        m = sum(r.outstanding for r in replicas) + 1
        if self.eps is None:
            return m
        return max(self.min_load, math.ceil((1 + self.eps) * m / len(replicas)))

    def walk(self, h: int, replicas: Sequence[Replica]) -> Iterator[Replica]:
        """Replicas in ring order starting at ``h``'s successor, each once."""
        self._ring(tuple(r.name for r in replicas))
        by_name = {r.name: r for r in replicas}
        i = bisect.bisect_left(self._points, h)
        seen: set[str] = set()
        for j in range(len(self._points)):
            name = self._owners[(i + j) % len(self._points)]
            if name not in seen:
                seen.add(name)
                yield by_name[name]
                if len(seen) == len(by_name):
                    return

    def choose(self, key: RouteKey, replicas: Sequence[Replica]) -> Replica:
        _check(replicas)
        h = prefix_key(key, self.block_size, self.num_blocks)
        if h is None:
            return self._fallback.choose(key, replicas)
        cap = self.capacity(replicas)
        for r in self.walk(h, replicas):
            if r.outstanding < cap:
                return r
        raise AssertionError("unreachable: n * capacity exceeds the outstanding total")


POLICIES = {c.name: c for c in (RoundRobin, LeastOutstanding, PrefixAffinity)}


def get_policy(name: str, **kw: Any) -> RoundRobin | LeastOutstanding | PrefixAffinity:
    """A policy by name (``round-robin``, ``least-outstanding``, ``prefix-affinity``)."""
    key = name.strip().lower().replace("_", "-")
    if key not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; valid names: {', '.join(POLICIES)}")
    return POLICIES[key](**kw)
