"""Reference solutions of exercise 09 (serving): the per-key token bucket and the disconnect-safe
SSE stream. The checker (``labkit.exercises.serving``) compares learners' code with these and
drives both through a real server."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any


class TokenBucket:
    """Holds up to ``burst`` tokens, refills ``rate`` per second; ``try_take(cost)`` returns
    0.0 when it took ``cost``, else the seconds until it could (taking nothing); ``inf`` when
    ``cost`` exceeds ``burst``."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.rate, self.burst, self.clock = float(rate), float(burst), clock
        self.tokens = self.burst
        self.last = clock()

    def try_take(self, cost: float = 1.0) -> float:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if cost > self.burst:
            return math.inf
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate

    def give_back(self, cost: float) -> None:
        self.tokens = min(self.burst, self.tokens + cost)


async def sse_stream(stream: Any) -> AsyncIterator[str]:
    """SSE events for one engine request: ``data: {"text": delta}`` per non-empty text delta,
    then ``data: [DONE]``; the request is aborted if the client goes away at any point."""
    try:
        async for item in stream:
            for out in item.outputs:
                if out.text_delta:
                    yield f"data: {json.dumps({'text': out.text_delta})}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # the client left (the task was cancelled) or the stream ended: aclose aborts
        await stream.aclose()  # any request still running; a finished one is left alone
