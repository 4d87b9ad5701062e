"""A real S3 API on loopback, behind a bandwidth throttle: the object store of the cold-start lab.

``S3Loopback`` starts moto's S3 server (a real HTTP S3 API: ListObjectsV2, ranged and
conditional GETs, ETags) in its own process on 127.0.0.1, and optionally a throttling TCP
proxy in front of it, also in its own process so neither competes with the loader for the
GIL. The throttle models what makes object-store loading slow: each connection is held to
``per_conn_mbps`` (a single S3 stream tops out well below the node's link) and all together to
``total_mbps`` (the node's NIC). With those two numbers, one GET per file is bound by the
first, parallel ranged GETs by the second, which is the trade the experiment measures.

What the loopback does not model: request latency across a network (loopback adds ~0.1 ms),
the store's per-prefix request-rate limits, or throttling by the provider; say so next to any
number it produces.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

CHUNK = 64 << 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the loopback server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout:.0f} s")


class Bucket:
    """A token bucket of ``rate`` bytes/s (None = unlimited), shared by the threads using it."""

    def __init__(self, rate: float | None) -> None:
        self.rate, self.lock = rate, threading.Lock()
        self.tokens, self.last = 0.0, time.monotonic()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.tokens + (now - self.last) * self.rate, self.rate * 0.05)
            self.last = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


def _pump(src: socket.socket, dst: socket.socket, buckets: list[Bucket]) -> None:
    try:
        while data := src.recv(CHUNK):
            for b in buckets:
                b.take(len(data))
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve_proxy(listen: int, upstream: int, per_conn_mbps: float | None,
                total_mbps: float | None) -> None:
    """Forward 127.0.0.1:listen to 127.0.0.1:upstream; the server->client direction of each
    connection is held to per_conn_mbps, all connections together to total_mbps."""
    total = Bucket(total_mbps * 1e6 / 8 if total_mbps else None)
    server = socket.create_server(("127.0.0.1", listen))
    while True:
        client, _ = server.accept()
        up = socket.create_connection(("127.0.0.1", upstream))
        per = Bucket(per_conn_mbps * 1e6 / 8 if per_conn_mbps else None)
        threading.Thread(target=_pump, args=(client, up, []), daemon=True).start()
        threading.Thread(target=_pump, args=(up, client, [per, total]), daemon=True).start()


class S3Loopback:
    """``with S3Loopback(per_conn_mbps=400, total_mbps=3200) as s3: s3.endpoint_url``; the
    moto server (and the throttle, if any rate is given) stop on exit."""

    def __init__(self, per_conn_mbps: float | None = None,
                 total_mbps: float | None = None) -> None:
        self.per_conn_mbps, self.total_mbps = per_conn_mbps, total_mbps
        self.procs: list[subprocess.Popen] = []

    def _start(self, args: list[str], port: int) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
        self.procs.append(proc)
        _wait_port(port, proc)

    def __enter__(self) -> S3Loopback:
        try:
            import moto  # noqa: F401
        except ImportError as e:
            raise RuntimeError("the loopback S3 server needs moto: pip install "
                               "'labkit[objstore]'") from e
        moto_port = _free_port()
        self._start(["-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)], moto_port)
        port = moto_port
        if self.per_conn_mbps or self.total_mbps:
            port = _free_port()
            self._start(["-m", "labkit.bench.s3_loopback", "--listen", str(port),
                         "--upstream", str(moto_port),
                         "--per-conn-mbps", str(self.per_conn_mbps or 0),
                         "--total-mbps", str(self.total_mbps or 0)], port)
        self.endpoint_url = f"http://127.0.0.1:{port}"
        self.direct_url = f"http://127.0.0.1:{moto_port}"
        for k, v in (("AWS_ACCESS_KEY_ID", "labkit"), ("AWS_SECRET_ACCESS_KEY", "labkit"),
                     ("AWS_DEFAULT_REGION", "us-east-1")):
            os.environ.setdefault(k, v)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def client(self, direct: bool = True) -> Any:
        """A boto3 client; ``direct`` skips the throttle (uploads in the set-up)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.direct_url if direct else
                            self.endpoint_url)

    def upload_folder(self, folder: Path, bucket: str, prefix: str) -> str:
        """Put every file of ``folder`` under s3://bucket/prefix/; returns that URI."""
        c = self.client()
        try:
            c.create_bucket(Bucket=bucket)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        for f in sorted(Path(folder).iterdir()):
            if f.is_file():
                c.upload_file(str(f), bucket, f"{prefix}/{f.name}")
        return f"s3://{bucket}/{prefix}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="throttling TCP proxy on loopback")
    p.add_argument("--listen", type=int, required=True)
    p.add_argument("--upstream", type=int, required=True)
    p.add_argument("--per-conn-mbps", type=float, default=0)
    p.add_argument("--total-mbps", type=float, default=0)
    a = p.parse_args(argv)
    serve_proxy(a.listen, a.upstream, a.per_conn_mbps or None, a.total_mbps or None)


if __name__ == "__main__":
    main()
