"""``labkit serve`` as a child process (benchmarks, notebooks): started, waited for, stopped.

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


class ServerProcess:
    """``with ServerProcess("labkit-tiny", ["--policy", "fair"]) as srv: srv.url``

    ``cmd`` runs another server instead (it must listen on ``self.port``; pass ``port``), whose
    readiness URL path is ``health``: the benchmarks start llama.cpp's server this way."""

    def __init__(self, model: str = "labkit-tiny", args: Sequence[str] = (),
                 port: int | None = None, startup_timeout: float = 120.0,
                 threads: int | None = 1, cmd: Sequence[str] | None = None,
                 health: str = "/health") -> None:
        self.port = port or free_port()
        self.cmd = [sys.executable, "-m", "labkit.cli", "serve", model, "--host", "127.0.0.1",
                    "--port", str(self.port), *args] if cmd is None else list(cmd)
        self.health = health  # another server (``cmd``) may answer readiness elsewhere
        self.startup_timeout = startup_timeout
        self.env = dict(os.environ)
        if threads:
            self.env["OMP_NUM_THREADS"] = str(threads)
        self.proc: subprocess.Popen | None = None
        self.log: Any = None

    def output(self) -> str:
        """What the server printed so far (its log)."""
        if self.log is None:
            return ""
        self.log.seek(0)
        return self.log.read()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     text=True, env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[:4]} exited with {self.proc.returncode}:\n"
                                   f"{self.output()[-4000:]}")
            try:
                if httpx.get(self.url + self.health, timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.cmd[:4]} did not become healthy in {self.startup_timeout} s")

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

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
