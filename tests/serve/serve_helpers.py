"""Helpers the serving tests share (imported as a top-level module, like tests/kernels')."""

from __future__ import annotations

import time
from operator import methodcaller

from labkit.engine.invariants import assert_no_leaks

NAME = "labkit-tiny"


def idle(server, timeout=10.0):
    """Wait until the engine holds nothing, then check its KV accounting in its core (both
    functions are picklable, so this works for an engine process too)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = server.call(methodcaller("stats"))
        if s["num_running"] == s["num_waiting"] == s["num_used_blocks"] == 0:
            server.call(assert_no_leaks)
            return s
        time.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout} s: {s}")


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body into its data payloads, checking OpenAI's exact framing."""
    assert raw.endswith(b"data: [DONE]\n\n")
    parts = raw.decode().split("\n\n")
    assert parts[-1] == ""
    events = []
    for p in parts[:-1]:
        assert p.startswith("data: ") and "\n" not in p, p
        events.append(p[len("data: "):])
    return events


def wait_aborted(server, before: int, timeout: float = 5.0) -> None:
    """Wait until the server counted one more aborted request than ``before``."""
    deadline = time.monotonic() + timeout
    while server.state.counts["aborted"] == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.state.counts["aborted"] == before + 1
