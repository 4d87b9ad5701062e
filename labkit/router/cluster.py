"""A local cluster: N ``labkit serve`` replicas and a ``labkit router`` as child processes.

    with Cluster(3, policy="prefix-affinity") as c:
        openai.OpenAI(base_url=c.url + "/v1", api_key="-").completions.create(...)
        c.kill(1)              # a crash: streams on replica-1 continue elsewhere
        c.restart(1)           # back on the same port, breaker reset
        c.rolling_update()     # drain, restart, undrain each replica in turn

Every process is a real child on a loopback port (``labkit.serve.process``), exactly what
``labkit serve`` and ``labkit router`` run from a shell, so what the lab measures is what a
deployment would see (separate engines, separate prefix caches, real sockets). All of them are
stopped on exit from the ``with`` block, on an error or Ctrl-C while starting, and at
interpreter exit if the caller forgot.

Rolling update with drain, the way a Kubernetes rollout with a ``preStop`` hook does it: the
router takes the replica out of rotation (no new requests), the streams it holds run to the end,
then the process is stopped (SIGTERM) and started again, and once its ``/health`` answers the
router puts it back with a fresh breaker. Clients see no error at any point.
"""

from __future__ import annotations

import argparse
import atexit
import time
from collections.abc import Iterable, Sequence
from typing import Any

import httpx

from labkit.serve.launcher import free_port
from labkit.serve.metrics import parse_metrics
from labkit.serve.process import DEFAULT_REPLICA_ARGS, ChildServer, ServerProcess, labkit_cmd


class Cluster:
    """``n`` replicas of ``model`` behind a router with ``policy`` (see module doc)."""

    def __init__(self, n: int = 3, model: str = "labkit-tiny", policy: str = "prefix-affinity",
                 replica_args: Sequence[str] = DEFAULT_REPLICA_ARGS,
                 router_args: Sequence[str] = (), router_port: int | None = None,
                 probe_interval: float = 0.5, startup_timeout: float = 180.0,
                 threads: int | None = 1) -> None:
        if n < 1:
            raise ValueError(f"a cluster needs at least one replica, got n={n}")
        from labkit.router.policies import POLICIES

        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; valid: {', '.join(POLICIES)}")
        self.replicas = [ServerProcess(model, replica_args, startup_timeout=startup_timeout,
                                       threads=threads, name=f"replica-{i}") for i in range(n)]
        port = router_port or free_port()
        argv = ["router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--probe-interval", str(probe_interval), *router_args]
        for r in self.replicas:
            argv += ["--replica", r.url]
        self.router = ChildServer(labkit_cmd(*argv), port, startup_timeout, threads=1,
                                  name="labkit-router")
        self.names = [f"replica-{i}" for i in range(n)]
        self._http = httpx.Client(timeout=10)

    @property
    def url(self) -> str:
        """The router's base URL (what clients use)."""
        return self.router.url

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> Cluster:
        """Launch every replica at once (they load in parallel), wait for each to be healthy,
        then start the router. Anything started is stopped again if this fails or is
        interrupted."""
        atexit.register(self.stop)
        try:
            for r in self.replicas:
                r.launch()
            for r in self.replicas:
                r.wait_ready()
            self.router.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the router first (no new traffic), then every replica; each is tried even if
        another one fails to stop."""
        errors = []
        for p in (self.router, *self.replicas):
            try:
                p.stop(timeout)
            except Exception as e:  # noqa: BLE001 - keep stopping the others, report at the end
                errors.append(f"{p.name}: {e}")
            p._close_log()
        atexit.unregister(self.stop)
        if errors:
            raise RuntimeError("could not stop: " + "; ".join(errors))

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        finally:
            self._http.close()

    def alive(self) -> list[bool]:
        return [r.alive() for r in self.replicas]

    # ---- operations ------------------------------------------------------------------------
    def kill(self, i: int) -> None:
        """SIGKILL replica ``i``: a crash (no drain, connections cut mid-stream)."""
        self.replicas[i].kill()

    def restart(self, i: int, rejoin: bool = True) -> float:
        """Stop replica ``i`` (SIGTERM: it drains what it still holds) and start it on the same
        port; with ``rejoin`` the router puts it back in rotation. Returns the seconds taken."""
        t0 = time.monotonic()
        r = self.replicas[i]
        r.stop()
        r.start()
        if rejoin:
            self.undrain(i)
        return time.monotonic() - t0

    def drain(self, i: int, timeout: float = 60.0) -> float:
        """Take replica ``i`` out of rotation and wait until the router holds no request on it
        (its streams finished). Returns the seconds waited."""
        t0 = time.monotonic()
        self._post(f"/admin/replicas/{self.names[i]}/drain")
        while self.replica_states()[i]["outstanding"] > 0:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{self.names[i]} still holds requests after {timeout} s")
            time.sleep(0.05)
        return time.monotonic() - t0

    def undrain(self, i: int) -> None:
        self._post(f"/admin/replicas/{self.names[i]}/undrain")

    def rolling_update(self, indices: Iterable[int] | None = None,
                       timeout: float = 60.0) -> list[dict[str, Any]]:
        """Drain, restart and undrain each replica in turn (one at a time, so the others carry
        the traffic). One record per replica: drain and restart seconds, old and new pid, and
        when (``time.time()``) it was put back in rotation."""
        out = []
        for i in range(len(self.replicas)) if indices is None else indices:
            old = self.replicas[i].pid
            drained = self.drain(i, timeout)
            restarted = self.restart(i, rejoin=False)
            back = time.time()
            self.undrain(i)
            out.append({"replica": self.names[i], "drain_s": drained, "restart_s": restarted,
                        "old_pid": old, "new_pid": self.replicas[i].pid, "undrained_at": back})
        return out

    def set_policy(self, name: str, **kw: Any) -> None:
        """Switch the router's policy (``kw``: its keyword arguments, e.g. ``min_load=4``)."""
        self._post("/admin/policy", {"policy": name, **kw})

    # ---- observation -----------------------------------------------------------------------
    def replica_states(self) -> list[dict[str, Any]]:
        """The router's view: outstanding requests, draining, breaker state per replica."""
        return self._get("/admin/replicas")

    def failovers(self) -> list[dict[str, Any]]:
        """One record per stream the router resumed on another replica."""
        return self._get("/admin/failovers")

    def replica_metrics(self, i: int) -> dict[str, float]:
        """Replica ``i``'s own ``/metrics`` (summed over labels); {} if it is down."""
        try:
            return parse_metrics(self._http.get(self.replicas[i].url + "/metrics").text)
        except httpx.TransportError:
            return {}

    def router_metrics(self) -> str:
        return self._http.get(self.url + "/metrics").text

    def _get(self, path: str) -> Any:
        r = self._http.get(self.url + path)
        r.raise_for_status()
        return r.json()

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        r = self._http.post(self.url + path, json=body or {})
        if r.status_code != 200:
            raise RuntimeError(f"router {path}: {r.status_code} {r.text}")
        return r.json()


def main(argv: list[str] | None = None) -> int:
    """``labkit cluster up N [--policy P] [--model M] [--port P]``: start, print, wait for
    Ctrl-C (or SIGTERM), stop everything."""
    p = _parser()
    args = p.parse_args(argv)
    pd = args.prefill is not None or args.decode is not None
    if pd and (args.n is not None or args.prefill is None or args.decode is None):
        p.error("a disaggregated cluster takes --prefill P and --decode D (and no N)")
    if not pd and (args.n is None or args.n < 1):
        p.error(f"N must be >= 1, got {args.n}")
    extra = DEFAULT_REPLICA_ARGS if args.replica_arg is None else tuple(args.replica_arg)
    _stop_on_signals()
    if pd:
        from labkit.router.pd_cluster import PDCluster

        try:
            c: Any = PDCluster(args.prefill, args.decode, args.model, extra, args.port)
        except ValueError as e:
            p.error(str(e))
        servers = [*c.prefill, *c.decode]
        print(f"starting {args.prefill} prefill + {args.decode} decode x {args.model} and the "
              "P/D proxy ...", flush=True)
    else:
        c = Cluster(args.n, args.model, args.policy, extra, router_port=args.port)
        servers = c.replicas
        print(f"starting {args.n} x {args.model} and a router ({args.policy}) ...", flush=True)
    try:
        with c:
            for r in servers:
                print(f"  {r.name}: {r.url}  (pid {r.pid})")
            print(f"router: {c.url}  (OpenAI base URL {c.url}/v1; /metrics, /admin/replicas)\n"
                  "Ctrl-C stops everything.", flush=True)
            while True:
                time.sleep(1)
    except KeyboardInterrupt:
        print("stopped", flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    """The ``labkit cluster`` command line (``up``, colocated or disaggregated)."""
    from labkit.router.policies import POLICIES

    p = argparse.ArgumentParser(prog="labkit cluster", description="N labkit serve replicas "
                                "and a router on loopback, stopped together on Ctrl-C.")
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start N replicas and a router")
    up.add_argument("n", type=int, metavar="N", nargs="?", default=None,
                    help="replicas (colocated); or give --prefill and --decode instead")
    up.add_argument("--prefill", type=int, default=None, metavar="P",
                    help="prefill instances of a disaggregated cluster (with --decode)")
    up.add_argument("--decode", type=int, default=None, metavar="D",
                    help="decode instances of a disaggregated cluster (with --prefill)")
    up.add_argument("--policy", default="prefix-affinity", choices=list(POLICIES))
    up.add_argument("--model", default="labkit-tiny")
    up.add_argument("--port", type=int, default=8000, help="the router's port")
    up.add_argument("--replica-arg", action="append", default=None, metavar="ARG",
                    help="extra argument for every `labkit serve` (repeat), e.g. "
                    "--replica-arg=--max-num-seqs --replica-arg=8")
    return p


def _stop_on_signals() -> None:
    """SIGTERM and Ctrl-C stop the cluster the same way (KeyboardInterrupt), and only once."""
    import signal

    def on_term(sig: int, frame: Any) -> None:
        # once: a second signal must not interrupt the stopping of the children
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
