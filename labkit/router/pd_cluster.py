"""A local disaggregated cluster: prefill instances, decode instances and the P/D proxy.

    labkit cluster up --prefill 1 --decode 1 --port 8000 --model labkit-tiny

    with PDCluster(1, 1) as c:
        openai.OpenAI(base_url=c.url + "/v1", api_key="-").completions.create(...)
        c.kill_decode(0)   # a fault: the proxy answers 503 (or uses another decode instance)

Each instance is a real ``labkit serve`` child on a loopback port (``--kv-role prefill`` or
``--kv-role decode --kv-transfer-port P``) and the proxy is ``labkit router --prefill ...
--decode ...`` (:mod:`labkit.router.disagg`), exactly what a shell would run. Everything is
stopped on leaving the ``with`` block, on an error or Ctrl-C while starting, and at exit.
"""

from __future__ import annotations

import atexit
from typing import Any

import httpx

from labkit.serve.launcher import free_port
from labkit.serve.process import DEFAULT_REPLICA_ARGS, ChildServer, ServerProcess, labkit_cmd


class PDCluster:
    """``num_prefill`` prefill and ``num_decode`` decode instances of ``model`` behind the
    P/D proxy (see the module doc)."""

    def __init__(self, num_prefill: int = 1, num_decode: int = 1, model: str = "labkit-tiny",
                 replica_args: tuple[str, ...] = DEFAULT_REPLICA_ARGS,
                 router_port: int | None = None, startup_timeout: float = 180.0) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(f"a P/D cluster needs at least one prefill and one decode "
                             f"instance, got {num_prefill} and {num_decode}")
        self.prefill = [ServerProcess(model, [*replica_args, "--kv-role", "prefill"],
                                      startup_timeout=startup_timeout, name=f"prefill-{i}")
                        for i in range(num_prefill)]
        self.decode = [ServerProcess(model, [*replica_args, "--kv-role", "decode",
                                             "--kv-transfer-port", str(free_port())],
                                     startup_timeout=startup_timeout, name=f"decode-{i}")
                       for i in range(num_decode)]
        port = router_port or free_port()
        argv = ["router", "--host", "127.0.0.1", "--port", str(port)]
        for s in self.prefill:
            argv += ["--prefill", s.url]
        for s in self.decode:
            argv += ["--decode", s.url]
        self.router = ChildServer(labkit_cmd(*argv), port, startup_timeout, threads=1,
                                  name="labkit-pd-router")

    @property
    def url(self) -> str:
        return self.router.url

    def start(self) -> PDCluster:
        """All instances load in parallel; the proxy starts once they are healthy."""
        atexit.register(self.stop)
        try:
            for s in (*self.prefill, *self.decode):
                s.launch()
            for s in (*self.prefill, *self.decode):
                s.wait_ready()
            self.router.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> None:
        errors = []
        for p in (self.router, *self.prefill, *self.decode):
            try:
                p.stop(timeout)
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                errors.append(f"{p.name}: {e}")
            p._close_log()
        atexit.unregister(self.stop)
        if errors:
            raise RuntimeError("could not stop: " + "; ".join(errors))

    def __enter__(self) -> PDCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def kill_decode(self, i: int) -> None:
        self.decode[i].kill()

    def kill_prefill(self, i: int) -> None:
        self.prefill[i].kill()

    def state(self) -> dict[str, Any]:
        """The proxy's counters (``GET /admin/pd``)."""
        return httpx.get(self.url + "/admin/pd", timeout=10).json()

    def stats(self, server: ServerProcess) -> dict[str, Any]:
        return httpx.get(server.url + "/v1/models", timeout=10).json()
