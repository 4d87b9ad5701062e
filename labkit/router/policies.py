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

- ``adapter-affinity``: a request whose ``model`` names a LoRA adapter goes to a replica that
  already holds that adapter in a device slot, so it is not copied in again (and another
  adapter evicted): :class:`AdapterAffinity`, the same bounded loads; base-model requests go
  to the least outstanding.
- ``length-aware``: prompts of ``threshold_tokens`` or more to a long pool of replicas, the
  rest to the short pool (:class:`LengthAware`), so a short chat never queues behind a long
  prefill.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections import OrderedDict
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
    model: str | None = None  # the body's ``model``: the base model or a LoRA adapter's name


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


class AdapterAffinity:
    """Send a LoRA request where its adapter already sits in a slot, with bounded loads.

    Why: a replica holds ``max_loras`` adapters in its device slots (``labkit.lora.manager``,
    LRU). Round-robin hands every replica every adapter, so under more adapters than slots each
    replica keeps copying adapters in and evicting others (a slot load per request, and a
    request whose adapter has no free slot waits for one). Affinity gives each replica a few
    adapters to keep.

    What the router knows: where it sent each adapter. Per replica it keeps the adapters of its
    last requests, at most ``max_loras`` of them, least recently used out first: the same LRU
    the replica runs, so it is a model of the replica's slots (a guess, not a read: a replica
    restarted or with an adapter unloaded differs until requests refresh it). A request for
    adapter X goes to the least outstanding replica holding X whose load is under the cap of
    :class:`PrefixAffinity` (``ceil((1 + eps) * m / n)``, at least ``min_load``); when none is,
    X is loaded somewhere new: the least outstanding replica under the cap, preferring one with
    a free slot in the model, ties broken by rendezvous hashing of (X, replica) so that X's new
    home does not depend on the order of the replicas. A hot adapter therefore spreads over as
    many replicas as its load needs, and no more.

    Which ``model`` values are adapters: any name other than the base models'. The base names
    come from ``base_models`` and from the replicas' ``/v1/models`` (the router passes each
    replica's cards to :meth:`observe_models`; a card with no ``parent`` is a base model).
    Requests without ``model`` or naming a base model go to the least outstanding replica."""

    name = "adapter-affinity"

    def __init__(self, max_loras: int = 1, eps: float | None = 0.25, min_load: int = 0,
                 base_models: Sequence[str] = ()) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 (the replicas' --max-loras), got "
                             f"{max_loras}")
        if eps is not None and eps <= 0:
            raise ValueError(f"eps must be > 0 (or None for no bound), got {eps}")
        if min_load < 0:
            raise ValueError(f"min_load must be >= 0, got {min_load}")
        self.max_loras, self.eps, self.min_load = max_loras, eps, min_load
        self.base_models = set(base_models)
        self.slots: dict[str, OrderedDict[str, None]] = {}  # replica -> adapters, oldest first
        self._fallback = LeastOutstanding()
        self._bound = PrefixAffinity(eps=eps, min_load=min_load)

    def observe_models(self, cards: Sequence[dict[str, Any]]) -> None:
        """Learn the base model names from a replica's ``/v1/models`` ``data``."""
        self.base_models.update(c["id"] for c in cards
                                if isinstance(c, dict) and c.get("id") and not c.get("parent"))

    def adapter_of(self, key: Any) -> str | None:
        """The adapter a request names, or None for the base model."""
        model = getattr(key, "model", None)
        return model if isinstance(model, str) and model not in self.base_models else None

    def holders(self, adapter: str) -> list[str]:
        """Replicas the router believes hold ``adapter`` in a slot."""
        return [name for name, lru in self.slots.items() if adapter in lru]

    def choose(self, key: RouteKey, replicas: Sequence[Replica]) -> Replica:
        _check(replicas)
        adapter = self.adapter_of(key)
        if adapter is None:
            return self._fallback.choose(key, replicas)
        cap = self._bound.capacity(replicas)
        under = [r for r in replicas if r.outstanding < cap]  # never empty: n * cap > m - 1
        held = [r for r in under if adapter in self.slots.get(r.name, ())]
        if held:
            r = min(held, key=lambda r: r.outstanding)
        else:
            r = min(under, key=lambda r: (len(self.slots.get(r.name, ())) >= self.max_loras,
                                          r.outstanding, -_h64(f"{adapter}@{r.name}".encode())))
        lru = self.slots.setdefault(r.name, OrderedDict())
        lru[adapter] = None
        lru.move_to_end(adapter)
        while len(lru) > self.max_loras:
            lru.popitem(last=False)
        return r


class LengthAware:
    """Long prompts to a long pool, the rest to a short pool (least outstanding within each).

    Why: a prefill of thousands of tokens occupies its replica's steps for a long time, and a
    short chat queued behind it waits that long for its first token. Keeping long prompts on
    their own replicas bounds what a short request can wait behind (the "separate pools for
    short and long requests" of the deployment notes; vLLM's production stack and llm-d route on
    prompt length the same way). The price: the long pool's replicas sit idle when few long
    prompts come, and the short pool takes the rest of the load alone.

    The pools are fixed by replica name: the last ``long_replicas`` names in sorted order form
    the long pool (stable across restarts, as names are). A prompt is long from
    ``threshold_tokens`` tokens; without token ids (an HTTP router has no tokenizer) its length
    is estimated as characters / ``chars_per_token`` (4 is the usual rule for English text and
    code). A pool with no replica in rotation sends its requests to the other pool: availability
    first, isolation second."""

    name = "length-aware"

    def __init__(self, threshold_tokens: int = 1024, long_replicas: int = 1,
                 chars_per_token: float = 4.0) -> None:
        if not isinstance(threshold_tokens, int) or threshold_tokens < 1:
            raise ValueError(f"threshold_tokens must be an int >= 1, got {threshold_tokens!r}")
        if not isinstance(long_replicas, int) or long_replicas < 1:
            raise ValueError(f"long_replicas must be an int >= 1, got {long_replicas!r}")
        if not chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {chars_per_token!r}")
        self.threshold, self.long_replicas = threshold_tokens, long_replicas
        self.chars_per_token = float(chars_per_token)
        self._tie = LeastOutstanding()

    def prompt_tokens(self, key: RouteKey) -> float:
        """The prompt's length in tokens (estimated from its text when ids are missing)."""
        if key.token_ids is not None:
            return len(key.token_ids)
        return len(key.text or "") / self.chars_per_token

    def pools(self, replicas: Sequence[Replica]) -> tuple[list[Replica], list[Replica]]:
        """(short pool, long pool) among ``replicas``, by the sorted names."""
        names = sorted(r.name for r in replicas)
        long_names = set(names[-self.long_replicas:]) if len(names) > 1 else set()
        return ([r for r in replicas if r.name not in long_names],
                [r for r in replicas if r.name in long_names])

    def choose(self, key: RouteKey, replicas: Sequence[Replica]) -> Replica:
        _check(replicas)
        short, long_ = self.pools(replicas)
        pool = long_ if self.prompt_tokens(key) >= self.threshold else short
        return self._tie.choose(key, pool or short or long_)


def route_key(body: dict[str, Any]) -> RouteKey:
    """The text a policy hashes: the prompt, or the chat messages' contents in order (the
    system prompt first, which is what requests share); and the ``model`` the request names
    (a LoRA adapter's name picks that adapter on a replica)."""
    model = body.get("model") if isinstance(body.get("model"), str) else None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return RouteKey(token_ids=prompt, user=body.get("user"), model=model)
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
    if prompt is None and isinstance(body.get("messages"), list):
        prompt = "".join(str(m.get("content", "")) for m in body["messages"]
                         if isinstance(m, dict))
    return RouteKey(text=prompt if isinstance(prompt, str) else None, user=body.get("user"),
                    model=model)


POLICIES = {c.name: c for c in (RoundRobin, LeastOutstanding, PrefixAffinity, AdapterAffinity,
                                LengthAware)}


def get_policy(name: str, **kw: Any) -> Any:
    """A policy by name (``round-robin``, ``least-outstanding``, ``prefix-affinity``,
    ``adapter-affinity``, ``length-aware``)."""
    key = name.strip().lower().replace("_", "-")
    if key not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; valid names: {', '.join(POLICIES)}")
    return POLICIES[key](**kw)
