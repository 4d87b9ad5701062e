"""Reference solutions of exercise 09 (serving): the per-key token bucket and the disconnect-safe
SSE stream. The checker (``labkit.exercises.serving``) compares learners' code with these and
drives both through a real server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from labkit.serve.limits import TokenBucket as _TokenBucket

# The reference bucket is the server's own: the checker compares the learner's with it.
TokenBucket = _TokenBucket


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
