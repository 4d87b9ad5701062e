"""Blue/green weight rollouts through the router: update a standby set, flip traffic, roll back.

Hot weight updates (:mod:`labkit.engine.weight_update`) recompute a replica's in-flight requests
under the new weights, so an answer that spans the swap mixes two versions. When every answer
must come from one version, the swap happens on replicas that hold no traffic, and traffic
moves between sets of replicas instead, through the router's operator routes
(:mod:`labkit.router.admin`: drain = out of rotation, streams in flight finish):

1. :meth:`BlueGreen.start`: the standby set ("green") is drained, the live set ("blue") serves.
2. :meth:`BlueGreen.update_standby`: each standby replica gets the new weights
   (``POST /v1/admin/update_weights`` on the replica itself; a 4xx there stops the rollout with
   :class:`RolloutError` and the live set never noticed).
3. :meth:`BlueGreen.flip`: the standby set is undrained first (so there is never a moment with
   nothing in rotation), then the live set is drained and its in-flight requests are waited for
   (the router's ``outstanding`` count per replica); the roles swap. Every request either
   finished on the old set or started on the new one: none is lost or cut.
4. :meth:`BlueGreen.rollback`: the same flip back, while the old set still holds the old
   weights (it was only drained, never updated).

:func:`rolling_weight_update` is the one-set variant (drain one replica, update it, undrain,
the next): no spare capacity needed, a mixed fleet while it runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx


class RolloutError(RuntimeError):
    """A rollout step failed (a replica refused the weights, drain timed out); the message says
    which replica and what it answered. Traffic stays where it was when this is raised."""


class RouterAdmin:
    """The router's operator routes, by replica name."""

    def __init__(self, router_url: str, client: httpx.Client | None = None,
                 poll_s: float = 0.02) -> None:
        self.url, self.poll_s = router_url.rstrip("/"), poll_s
        self.http = client or httpx.Client(timeout=300)

    def replicas(self) -> dict[str, dict[str, Any]]:
        r = self.http.get(self.url + "/admin/replicas")
        r.raise_for_status()
        return {d["name"]: d for d in r.json()}

    def set_draining(self, name: str, draining: bool) -> None:
        r = self.http.post(f"{self.url}/admin/replicas/{name}/"
                           f"{'drain' if draining else 'undrain'}")
        if r.status_code != 200:
            raise RolloutError(f"router refused to {'drain' if draining else 'undrain'} "
                               f"{name}: {r.status_code} {r.text}")

    def wait_idle(self, names: Sequence[str], timeout: float) -> float:
        """Wait until the router holds no request on any of ``names``; seconds waited."""
        t0 = time.monotonic()
        while any(self.replicas()[n]["outstanding"] for n in names):
            if time.monotonic() - t0 > timeout:
                raise RolloutError(f"{list(names)} still hold requests after {timeout} s")
            time.sleep(self.poll_s)
        return time.monotonic() - t0

    def update_weights(self, name: str, path: str, version: str) -> dict[str, Any]:
        """``POST /v1/admin/update_weights`` on the replica itself (its URL from the router)."""
        url = self.replicas()[name]["url"]
        r = self.http.post(url + "/v1/admin/update_weights",
                           json={"path": str(path), "version": version})
        if r.status_code != 200:
            raise RolloutError(f"{name} refused the weights ({r.status_code}): {r.text}")
        return r.json()


class BlueGreen:
    """Two sets of replica names behind one router: ``live`` serves, ``standby`` waits."""

    def __init__(self, admin: RouterAdmin, blue: Sequence[str], green: Sequence[str]) -> None:
        if not blue or not green or set(blue) & set(green):
            raise ValueError(f"blue {list(blue)} and green {list(green)} must be non-empty and "
                             "disjoint sets of replica names")
        known = set(admin.replicas())
        if not (set(blue) | set(green)) <= known:
            raise ValueError(f"unknown replicas {sorted((set(blue) | set(green)) - known)}; "
                             f"the router has {sorted(known)}")
        self.admin, self.live, self.standby = admin, list(blue), list(green)
        self.history: list[dict[str, Any]] = []

    def start(self) -> None:
        """Live in rotation, standby drained."""
        for n in self.live:
            self.admin.set_draining(n, False)
        for n in self.standby:
            self.admin.set_draining(n, True)

    def update_standby(self, path: str, version: str) -> list[dict[str, Any]]:
        """New weights on every standby replica (idle: drained since :meth:`start`)."""
        self.admin.wait_idle(self.standby, 60.0)
        return [self.admin.update_weights(n, path, version) for n in self.standby]

    def flip(self, timeout: float = 60.0) -> dict[str, Any]:
        """Standby into rotation, then live out of it; wait for the old live set's in-flight
        requests; swap roles. Returns ``{"live", "standby", "drain_s"}``."""
        for n in self.standby:
            self.admin.set_draining(n, False)
        for n in self.live:
            self.admin.set_draining(n, True)
        drained = self.admin.wait_idle(self.live, timeout)
        self.live, self.standby = self.standby, self.live
        rec = {"live": list(self.live), "standby": list(self.standby), "drain_s": drained}
        self.history.append(rec)
        return rec

    def rollback(self, timeout: float = 60.0) -> dict[str, Any]:
        """Traffic back to the previous live set (a flip back; it still has its weights)."""
        if not self.history:
            raise RolloutError("nothing to roll back: no flip has happened")
        return self.flip(timeout)


def rolling_weight_update(admin: RouterAdmin, names: Sequence[str], path: str, version: str,
                          timeout: float = 60.0) -> list[dict[str, Any]]:
    """Drain, update, undrain each replica in turn; one record (the update's answer plus
    ``drain_s``) per replica. On a refusal the replica stays drained and RolloutError says so."""
    out = []
    for n in names:
        admin.set_draining(n, True)
        drained = admin.wait_idle([n], timeout)
        info = admin.update_weights(n, path, version)
        admin.set_draining(n, False)
        out.append({"replica": n, **info, "drain_s": drained})
    return out
