"""Reference solution of exercise 13 (prefix-affinity routing), injected by CI.

Written out from the contract, independently of ``labkit.router.policies.PrefixAffinity`` (which
keys on the engine's chained block hashes); the checker measures properties, not equality, so
any correct ring passes.
"""

from __future__ import annotations

import bisect
import hashlib
import math

from labkit.router.policies import NoReplicaError


def h64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


class PrefixAffinity:
    name = "prefix-affinity (exercise)"

    def __init__(self, block_size: int = 16, num_blocks: int = 8, eps: float = 0.25,
                 vnodes: int = 100) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        self.eps, self.vnodes = eps, vnodes
        self._ring_of: tuple[str, ...] | None = None
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, names: tuple[str, ...]) -> None:
        if names != self._ring_of:  # rebuilt only when the replica set changes
            pts = sorted((h64(f"{n}#{i}".encode()), n) for n in names for i in range(self.vnodes))
            self._points, self._owners = [p for p, _ in pts], [n for _, n in pts]
            self._ring_of = names

    def prefix_hash(self, token_ids) -> int | None:
        """The first num_blocks FULL blocks; None when there is no full block."""
        ids = list(token_ids or [])[: self.block_size * self.num_blocks]
        full = len(ids) // self.block_size * self.block_size
        return h64(repr(ids[:full]).encode()) if full else None

    def choose(self, key, replicas):
        if not replicas:
            raise NoReplicaError("no replica to route to")
        h = self.prefix_hash(key.token_ids)
        if h is None:  # nothing a prefix cache could share
            return min(replicas, key=lambda r: r.outstanding)
        self._ring(tuple(sorted(r.name for r in replicas)))
        by_name = {r.name: r for r in replicas}
        cap = math.ceil((1 + self.eps) * (sum(r.outstanding for r in replicas) + 1)
                        / len(replicas))
        i = bisect.bisect_left(self._points, h)
        seen = set()
        for j in range(len(self._points)):  # clockwise from the key's point
            name = self._owners[(i + j) % len(self._points)]
            if name not in seen:
                seen.add(name)
                if by_name[name].outstanding < cap:
                    return by_name[name]
        raise AssertionError("unreachable: some replica is always below the cap")
