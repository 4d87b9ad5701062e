"""Moving KV blocks between two engines over TCP: the wire format of prefill/decode disaggregation.

A prefill instance pushes a request's computed blocks to a decode instance in one *frame*:

    8 bytes    header length H (big-endian)
    H bytes    JSON header: {"version", "model", "layout": {name: [shape, dtype]},
                             "keys": [hex block hashes], "nbytes", "sha256"}
    nbytes     the payloads, block after block, each block's tensors in layout order

and the receiver answers one JSON line, ``{"ok": true, "blocks": n}`` or ``{"ok": false,
"error": "..."}``, after the blocks are stored. The sender returns only then: the push is
*acknowledged*, so when the prefill's HTTP response reaches the router the decode instance
already holds the KV.

Why a header that repeats the layout and the model: the keys are token hashes (salt and adapter
included, :mod:`labkit.kv.prefix`), not model identities. A decode instance running another
model, block size, KV dtype or layer count would accept KV that fits no cache of its own, or
worse, one that fits and is wrong. The receiver refuses any mismatch, a frame larger than its
``max_frame_bytes`` (before reading it), a short read, a bad checksum, or a timeout, and stores
nothing from a refused frame. vLLM's NIXL connector moves device memory directly (RDMA) and
checks compatibility in a handshake; this is the same check on a plain socket, with the bytes
staged through host memory.
"""

from __future__ import annotations

import hashlib
import json
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch

from labkit.errors import KVConnectorError
from labkit.kv.connector.tiers import Layout, Payload
from labkit.kv.prefix import BlockHash

VERSION = 1
_LEN = struct.Struct(">Q")
MAX_HEADER_BYTES = 1 << 20


def layout_spec(layout: Layout) -> dict[str, list]:
    """The layout as JSON: name -> [shape, dtype name]."""
    return {n: [list(shape), str(dtype).removeprefix("torch.")] for n, (shape, dtype) in
            layout.items()}


def encode_frame(model: str, layout: Layout, blocks: list[tuple[BlockHash, Payload]]) -> bytes:
    """One frame carrying ``blocks`` (key, payload) of an engine with ``layout``."""
    body = b"".join(p[n].contiguous().view(torch.uint8).numpy().tobytes()
                    for _, p in blocks for n in layout)
    header = json.dumps({"version": VERSION, "model": model, "layout": layout_spec(layout),
                         "keys": [bytes(k).hex() for k, _ in blocks], "nbytes": len(body),
                         "sha256": hashlib.sha256(body).hexdigest()}).encode()
    return _LEN.pack(len(header)) + header + body


def send_blocks(host: str, port: int, frame: bytes, timeout_s: float = 5.0) -> int:
    """Push one frame and wait for the receiver's answer; returns the blocks it stored.
    Raises KVConnectorError on refusal, ConnectionError / OSError / TimeoutError otherwise."""
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(frame)
        s.shutdown(socket.SHUT_WR)
        reply = s.makefile("rb").readline(1 << 16)
    if not reply:
        raise ConnectionError(f"{host}:{port} closed the connection without an answer")
    ans = json.loads(reply)
    if not ans.get("ok"):
        raise KVConnectorError(f"{host}:{port} refused the KV blocks: {ans.get('error')}")
    return int(ans["blocks"])


def decode_frame(read: Callable[[int], bytes], model: str, layout: Layout,
                 max_frame_bytes: int) -> list[tuple[BlockHash, Payload]]:
    """Read and check one frame from ``read(n)`` (exactly n bytes or fewer at EOF)."""
    raw = read(_LEN.size)
    if len(raw) != _LEN.size:
        raise KVConnectorError("truncated frame: no header length")
    (hlen,) = _LEN.unpack(raw)
    if hlen > MAX_HEADER_BYTES:
        raise KVConnectorError(f"header of {hlen} bytes is over {MAX_HEADER_BYTES}")
    try:
        h = json.loads(read(hlen))
        keys, nbytes = [bytes.fromhex(k) for k in h["keys"]], int(h["nbytes"])
    except (ValueError, KeyError, TypeError) as e:
        raise KVConnectorError(f"malformed header: {e}") from None
    if h.get("version") != VERSION or h.get("model") != model or \
            h.get("layout") != layout_spec(layout):
        raise KVConnectorError(f"incompatible KV: this engine is model {model!r} with layout "
                               f"{layout_spec(layout)}, the frame says {h.get('model')!r} "
                               f"{h.get('layout')} (version {h.get('version')})")
    per_block = {n: torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                 for n, (s, d) in layout.items()}
    if nbytes != len(keys) * sum(per_block.values()):
        raise KVConnectorError(f"{nbytes} payload bytes for {len(keys)} blocks of "
                               f"{sum(per_block.values())}")
    if _LEN.size + hlen + nbytes > max_frame_bytes:
        raise KVConnectorError(f"frame of {_LEN.size + hlen + nbytes} bytes is over the "
                               f"receiver's limit of {max_frame_bytes}")
    body = read(nbytes)
    if len(body) != nbytes:
        raise KVConnectorError(f"truncated frame: {len(body)} of {nbytes} payload bytes")
    if hashlib.sha256(body).hexdigest() != h.get("sha256"):
        raise KVConnectorError("payload checksum mismatch")
    return _split(body, keys, layout, per_block)


def _split(body: bytes, keys: list[BlockHash], layout: Layout,
           per_block: dict[str, int]) -> list[tuple[BlockHash, Payload]]:
    flat = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    out, at = [], 0
    for k in keys:
        p = {}
        for n, (shape, dtype) in layout.items():
            p[n] = flat[at:at + per_block[n]].view(dtype).reshape(shape).clone()
            at += per_block[n]
        out.append((k, p))
    return out


class KVReceiver:
    """A TCP server (one thread per connection) that checks each frame and hands its blocks to
    ``on_blocks``; listens on ``host:port`` (port 0: a free one, see ``.port``)."""

    def __init__(self, host: str, port: int, model: str, layout: Layout,
                 on_blocks: Callable[[list[tuple[BlockHash, Payload]]], None],
                 max_frame_bytes: int = 256 << 20, timeout_s: float = 10.0) -> None:
        self.counters = {"frames": 0, "blocks": 0, "bytes": 0, "refused": 0}
        self.last_error: str | None = None
        receiver = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                self.connection.settimeout(timeout_s)
                receiver._serve(self.rfile, self.wfile, model, layout, on_blocks,
                                max_frame_bytes)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads, allow_reuse_address = True, True

        self.server = Server((host, port), Handler)
        self.host, self.port = self.server.server_address[:2]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                       name=f"kv-receiver:{self.port}")
        self.thread.start()

    def _serve(self, rfile: Any, wfile: Any, model: str, layout: Layout,
               on_blocks: Callable, max_frame_bytes: int) -> None:
        try:
            blocks = decode_frame(rfile.read, model, layout, max_frame_bytes)
            on_blocks(blocks)
            self.counters["frames"] += 1
            self.counters["blocks"] += len(blocks)
            self.counters["bytes"] += sum(t.nbytes for _, p in blocks for t in p.values())
            answer: dict[str, Any] = {"ok": True, "blocks": len(blocks)}
        except (KVConnectorError, OSError) as e:  # OSError: the socket timed out or broke
            self.counters["refused"] += 1
            self.last_error = str(e)
            answer = {"ok": False, "error": str(e)}
        try:
            wfile.write(json.dumps(answer).encode() + b"\n")
        except OSError:
            pass  # the sender is gone; nothing was stored from a refused frame

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
