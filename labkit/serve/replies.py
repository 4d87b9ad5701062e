"""The OpenAI wire format of the server's answers: whole response bodies, stream chunks, the
usage object and SSE framing (request bodies are parsed in :mod:`labkit.serve.protocol`, which
re-exports these names: ``protocol.sse``, ``protocol.chunk``...)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(kind: str, rid: str, model: str, created: int, texts: list[str],
             reasons: list[str | None], use: dict[str, int]) -> dict[str, Any]:
    if kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": t},
                    "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": use}


def chunk(kind: str, rid: str, model: str, created: int, index: int, text: str | None,
          reason: str | None, *, role: bool = False, with_usage: bool = False,
          use: dict[str, int] | None = None) -> dict[str, Any]:
    """One SSE chunk for one choice; ``text=None`` with a reason is the closing chunk.
    ``with_usage``: the chunk carries ``usage`` (``use``, or null as OpenAI sends it on every
    chunk but the last)."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else \
            ({} if text is None else {"content": text})
        c: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                             "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        c = {"index": index, "text": text or "", "logprobs": None,
             "finish_reason": reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}
    if with_usage:
        out["usage"] = use  # None: OpenAI's usage: null on every chunk but the last
    return out


def usage_chunk(kind: str, rid: str, model: str, created: int,
                use: dict[str, int]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use}


def sse(payload: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event exactly as OpenAI frames it: ``data: <json>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def now_s() -> int:
    return int(time.time())
