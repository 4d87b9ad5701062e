"""Failover mid-stream: when a replica dies during a stream, continue it on another replica.

A stream that breaks after the first byte cannot simply be retried: the client has already shown
part of the answer. What the router can do is what a replica does after a recompute preemption:
re-prefill. It asks the next replica for a *completion* whose prompt is the original prompt's
token ids followed by every token already sent, with ``max_tokens`` reduced by as many, and
relays the new tokens as if nothing had happened (same ``id``, ``created`` and chunk shape).
The cost is one prefill of prompt + sent tokens on the new replica (its prefix cache may hold
part of it); the client sees one longer inter-token gap.

To know those token ids the router asks every replica for them (``return_token_ids``, vLLM's
extension; ``labkit serve`` then also sends ``prompt_token_ids`` on a choice's first chunk) and
strips them again unless the client asked for them itself, so the client's bytes are the ones
the replica would have sent.

Why greedy output is byte-identical: decoding is a function of the token sequence, and greedy
picks the same next token from the same prefix on any replica of the same model; the resumed
replica's detokenizer starts at the cut, and for a byte-level BPE tokenizer ``decode(a + b) ==
decode(a) + decode(b)`` whenever the cut is not inside a multi-byte UTF-8 character.

What is supported (``not_resumable`` says why a request is not):

- ``/v1/completions`` with one prompt (text or token ids) and ``n = 1``;
- ``/v1/chat/completions`` with ``n = 1``: the replica sends the *rendered* chat prompt's ids, so
  the continuation is a completion over them, translated back into chat chunks (``delta``);
- greedy requests continue exactly; sampled ones continue with a valid sample conditioned on
  what was sent (a ``seed`` does not reproduce the uninterrupted run: the RNG restarts);
- not resumable: ``n > 1`` or several prompts, and ``stop`` strings (the dead replica may have
  held back text that could start a stop string; the router cannot recover it without the
  tokenizer). Those streams end with an error event when their replica dies.
"""

from __future__ import annotations

import json
from typing import Any

from labkit.serve import protocol

DONE = b"data: [DONE]\n\n"


class SSEBuffer:
    """Raw bytes in, whole ``data: ...`` events out (a TCP read may end mid-event)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        *events, self._buf = self._buf.split(b"\n\n")
        return [e for e in events if e]


def not_resumable(body: dict[str, Any], chat: bool) -> str | None:
    """Why this request's stream cannot be resumed on another replica (None: it can)."""
    if not body.get("stream"):
        return "not a stream (a failed non-streamed request is retried only before headers)"
    if body.get("n") not in (None, 1):
        return "n > 1"
    if body.get("stop"):
        return "stop strings (held-back text is lost with the replica)"
    if not chat:
        p = body.get("prompt")
        if isinstance(p, list) and p and not all(isinstance(t, int) for t in p) and len(p) > 1:
            return "several prompts in one request"
    return None


class StreamResume:
    """What the client has been sent for one streamed request, and the request that continues
    it elsewhere. ``on_event`` sees every upstream event, in order, across replicas."""

    def __init__(self, body: dict[str, Any], chat: bool) -> None:
        self.body, self.chat = body, chat
        self.want_ids = bool(body.get("return_token_ids"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.prompt_ids: list[int] | None = None
        self.sent_ids: list[int] = []
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.done = False  # [DONE] relayed
        self.errored = False  # the replica reported an error event (relayed, not resumed)
        self.head: dict[str, Any] | None = None  # id, created, model of the client's stream
        self.resumed = False  # the current upstream is a continuation
        self.forwarded = False  # the client has been sent something

    @property
    def kind(self) -> str:
        return "chat" if self.chat else "completion"

    def upstream_body(self) -> bytes:
        return json.dumps({**self.body, "return_token_ids": True}).encode()

    def max_tokens(self, max_model_len: int | None) -> int | None:
        """The client's budget of new tokens (chat without one: the rest of the context)."""
        b = self.body
        mt = (b.get("max_completion_tokens") or b.get("max_tokens")) if self.chat else \
            b.get("max_tokens", 16)
        if mt is None and max_model_len is not None and self.prompt_ids is not None:
            mt = max_model_len - len(self.prompt_ids)
        return mt

    def resume_body(self, max_model_len: int | None = None) -> bytes:
        """The continuation: a completion over prompt + sent tokens (before any chunk arrived,
        the original request again)."""
        if self.prompt_ids is None:
            self.resumed = False
            return self.upstream_body()
        drop = ("messages", "prompt", "max_tokens", "max_completion_tokens")
        b = {k: v for k, v in self.body.items() if k not in drop}
        b.update(prompt=self.prompt_ids + self.sent_ids, return_token_ids=True)
        mt = self.max_tokens(max_model_len)
        if mt is not None:
            b["max_tokens"] = mt - len(self.sent_ids)
        self.resumed = True
        return json.dumps(b).encode()

    def cannot_resume(self) -> str | None:
        """Why the stream cannot continue elsewhere now (None: it can). Output was sent but the
        replica never said the prompt's ids (not a labkit server?): a retry would repeat it."""
        if self.prompt_ids is None and self.forwarded:
            return "the replica sent output but no prompt_token_ids"
        return None

    def needs_max_model_len(self) -> bool:
        return self.chat and self.max_tokens(None) is None

    def remaining(self, max_model_len: int | None = None) -> int | None:
        mt = self.max_tokens(max_model_len)
        return None if mt is None else mt - len(self.sent_ids)

    # ---- events ----------------------------------------------------------------------------
    def on_event(self, raw: bytes) -> bytes | None:
        """Account one upstream SSE event; returns the bytes to send the client (or None)."""
        out = self._on_event(raw)
        self.forwarded = self.forwarded or out is not None
        return out

    def _on_event(self, raw: bytes) -> bytes | None:
        if not raw.startswith(b"data: "):
            return raw + b"\n\n"
        data = raw[len(b"data: "):]
        if data == b"[DONE]":
            self.done = True
            return DONE
        try:
            d = json.loads(data)
        except ValueError:
            return raw + b"\n\n"
        if not isinstance(d, dict) or "error" in d or not isinstance(d.get("choices"), list):
            self.errored = self.errored or (isinstance(d, dict) and "error" in d)
            return raw + b"\n\n"
        if self.head is None:
            self.head = {"id": d.get("id"), "created": d.get("created"), "model": d.get("model")}
        if not d["choices"] and "usage" in d:
            return self._usage_event(d) if self.resumed else self._plain(raw, d)
        ch = d["choices"][0]
        pids = ch.get("prompt_token_ids")
        if pids is not None and not self.resumed:
            self.prompt_ids = list(pids)
        toks = list(ch.get("token_ids") or [])
        self.sent_ids += toks
        text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
        self.text.append(text or "")
        if ch.get("finish_reason"):
            self.finish_reason = ch["finish_reason"]
        if not self.resumed:
            return self._plain(raw, d)
        return self._translated(text or "", toks, ch.get("finish_reason"), "usage" in d)

    def _plain(self, raw: bytes, d: dict[str, Any]) -> bytes | None:
        """An event of the original replica: as it came, less the ids the router added."""
        if self.want_ids:
            return raw + b"\n\n"
        for ch in d["choices"]:
            ch.pop("token_ids", None)
            ch.pop("prompt_token_ids", None)
            delta = ch.get("delta")
            visible = ch.get("finish_reason") or (ch.get("text") if delta is None else
                                                  ("role" in delta or delta.get("content")))
            if not visible:
                return None  # only ids: the replica would not have sent it without them
        return protocol.sse(d)

    def _translated(self, text: str, toks: list[int], reason: str | None,
                    with_usage: bool) -> bytes | None:
        """A continuation's chunk, in the shape and identity of the client's stream."""
        if not text and reason is None and not (self.want_ids and toks):
            return None
        h = self.head
        ch = protocol.chunk(self.kind, h["id"], h["model"], h["created"], 0, text, reason,
                            with_usage=with_usage)
        if self.want_ids:
            ch["choices"][0]["token_ids"] = toks
        return protocol.sse(ch)

    def _usage(self) -> dict[str, int]:
        return protocol.usage(len(self.prompt_ids or []), len(self.sent_ids))

    def _usage_event(self, d: dict[str, Any]) -> bytes:
        h = self.head
        return protocol.sse(protocol.usage_chunk(self.kind, h["id"], h["model"], h["created"],
                                                 self._usage()))

    def tail_if_finished(self, max_model_len: int | None = None) -> bytes | None:
        """The replica died after the last token: finish the stream here (finish chunk if it
        was not sent, usage if asked, [DONE]) instead of resuming. None: not finished."""
        rem = self.remaining(max_model_len)
        if self.finish_reason is None and (rem is None or rem > 0):
            return None
        out = b""
        if self.finish_reason is None and self.head is not None:
            self.finish_reason = "length"
            out += self._translated("", [], "length", self.include_usage)
        if self.include_usage and self.head is not None:
            out += self._usage_event({})
        self.done = True
        return out + DONE

    def error_tail(self, message: str) -> bytes:
        """End the client's stream with an OpenAI error event (nothing more can be done)."""
        self.done = True
        err = protocol.APIError(502, message, "server_error", None, "upstream_failed")
        return protocol.sse(err.body()) + DONE
