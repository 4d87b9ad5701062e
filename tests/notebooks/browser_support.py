"""What the browser tests share: Debian's chromium and its flags, a free loopback port, and a
notebook server (Voilà, JupyterLab) started, awaited and always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"   # from tests/notebooks/install_browser.sh
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(args: list[str], port: int, log_path: Path, *, cwd: Path, env: dict[str, str],
            startup_s: float = 60.0) -> Iterator[str]:
    """Run the server ``args`` (listening on 127.0.0.1:``port``) until the block ends; yield its
    URL once it accepts connections. Its whole process group is stopped at the end."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + startup_s
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{args[2]} did not start:\n"
                                           + log_path.read_text()) from None
                    time.sleep(0.3)
            yield f"http://127.0.0.1:{port}/"
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
