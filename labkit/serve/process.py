"""A server as a child process (benchmarks, notebooks, a local cluster): started, waited for,
stopped.

A separate process is what a real deployment looks like, and it keeps the server's threads off
the client's GIL, so a load generator in this process measures the server and not itself.
Stopping sends SIGTERM (the server drains) and kills only if it does not exit in time. The
child's output goes to a temporary file, not a pipe: nobody reads a pipe while the server runs,
and uvicorn's access log (a line per request) would fill it after a few hundred requests and
block the server on its next write.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import httpx

from labkit.serve.launcher import free_port


def labkit_cmd(*argv: str) -> list[str]:
    """``python -m labkit.cli ARGV...`` with this interpreter."""
    return [sys.executable, "-m", "labkit.cli", *argv]


# what a local cluster's replicas run with unless told otherwise (labkit cluster up)
DEFAULT_REPLICA_ARGS = ("--num-blocks", "256", "--max-num-seqs", "16")

class ChildServer:
    """``cmd`` listening on 127.0.0.1:``port``, ready when ``GET health`` answers 200.
    ``launch()`` and ``wait_ready()`` are separate so several children start in parallel;
    ``start()`` is both."""

    def __init__(self, cmd: Sequence[str], port: int, startup_timeout: float = 120.0,
                 threads: int | None = 1, health: str = "/health",
                 name: str = "server") -> None:
        self.cmd, self.port, self.name = list(cmd), port, name
        self.health = health  # another server may answer readiness elsewhere
        self.startup_timeout = startup_timeout
        self.env = dict(os.environ)
        if threads:
            self.env["OMP_NUM_THREADS"] = str(threads)
        self.proc: subprocess.Popen | None = None
        self.log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        """What the server printed so far (its log)."""
        if self.log is None:
            return ""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def launch(self) -> ChildServer:
        self._close_log()
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     text=True, env=self.env)
        return self

    def wait_ready(self, timeout: float | None = None) -> ChildServer:
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"{self.name} ({self.cmd[:4]}) exited with {code}:\n"
                                   f"{self.output()[-4000:]}")
            try:
                if httpx.get(self.url + self.health, timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} ({self.cmd[:4]}) did not become healthy in "
                           f"{self.startup_timeout} s:\n{self.output()[-4000:]}")

    def start(self) -> ChildServer:
        self.launch()
        try:
            return self.wait_ready()
        except BaseException:  # KeyboardInterrupt while waiting: no orphan child
            self.stop()
            raise

    def kill(self) -> int | None:
        """SIGKILL: a crash, as far as clients and a router can tell."""
        p = self.proc
        if p is None or p.poll() is not None:
            return None if p is None else p.returncode
        p.kill()
        return p.wait(10)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful drain), then kill if it is still there after ``timeout`` s."""
        p = self.proc
        if p is None or p.poll() is not None:
            return None if p is None else p.returncode
        p.send_signal(signal.SIGTERM)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait(10)

    def _close_log(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    def __enter__(self) -> ChildServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class ServerProcess(ChildServer):
    """``with ServerProcess("labkit-tiny", ["--policy", "fair"]) as srv: srv.url``

    ``cmd`` runs another server instead (it must listen on ``self.port``; pass ``port``), whose
    readiness URL path is ``health``: the benchmarks start llama.cpp's server this way."""

    def __init__(self, model: str = "labkit-tiny", args: Sequence[str] = (),
                 port: int | None = None, startup_timeout: float = 120.0,
                 threads: int | None = 1, cmd: Sequence[str] | None = None,
                 health: str = "/health", name: str = "labkit-serve") -> None:
        port = port or free_port()
        if cmd is None:
            cmd = labkit_cmd("serve", model, "--host", "127.0.0.1", "--port", str(port), *args)
        super().__init__(cmd, port, startup_timeout, threads, health, name)
