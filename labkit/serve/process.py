"""``labkit serve`` (or any ``labkit`` server command) as a child process: started, waited for,
stopped.

A separate process is what a real deployment looks like, and it keeps the server's threads off
the client's GIL, so a load generator in this process measures the server and not itself.
Stopping sends SIGTERM (the server drains) and kills only if it does not exit in time.

The child's output goes to a temporary log file, not a pipe: a pipe nobody reads fills after
~64 KB of access-log lines and then blocks the server mid-request.
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


class ChildServer:
    """``python -m labkit.cli COMMAND...`` on a loopback port, healthy when ``GET health_path``
    answers 200. ``launch()`` and ``wait_ready()`` are separate so several children start in
    parallel; ``start()`` is both."""

    def __init__(self, argv: Sequence[str], port: int, startup_timeout: float = 120.0,
                 threads: int | None = 1, health_path: str = "/health",
                 name: str = "labkit") -> None:
        self.argv, self.port, self.name = list(argv), port, name
        self.cmd = [sys.executable, "-m", "labkit.cli", *self.argv]
        self.startup_timeout, self.health_path = startup_timeout, health_path
        self.env = dict(os.environ)
        if threads:
            self.env["OMP_NUM_THREADS"] = str(threads)
        self.proc: subprocess.Popen | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self) -> ChildServer:
        self._close_log()
        self._log = tempfile.NamedTemporaryFile("w+", prefix=f"{self.name}-", suffix=".log")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     text=True, env=self.env)
        return self

    def log(self) -> str:
        """What the child printed so far (for error messages)."""
        if self._log is None:
            return ""
        self._log.flush()
        with open(self._log.name) as f:
            return f.read()

    def wait_ready(self, timeout: float | None = None) -> ChildServer:
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"{self.name} ({' '.join(self.argv[:2])}) exited with {code}:"
                                   f"\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + self.health_path, timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} did not become healthy in {self.startup_timeout} s:\n"
                           f"{self.log()[-4000:]}")

    def start(self) -> ChildServer:
        self.launch()
        try:
            return self.wait_ready()
        except BaseException:  # KeyboardInterrupt while waiting: no orphan child
            self.stop()
            raise

    def kill(self) -> int | None:
        """SIGKILL: a crash, as far as clients and the router can tell."""
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
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ChildServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self._close_log()


class ServerProcess(ChildServer):
    """``with ServerProcess("labkit-tiny", ["--policy", "fair"]) as srv: srv.url``"""

    def __init__(self, model: str = "labkit-tiny", args: Sequence[str] = (),
                 port: int | None = None, startup_timeout: float = 120.0,
                 threads: int | None = 1, name: str = "labkit-serve") -> None:
        port = port or free_port()
        super().__init__(["serve", model, "--host", "127.0.0.1", "--port", str(port), *args],
                         port, startup_timeout, threads, name=name)
