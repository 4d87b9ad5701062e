"""One accepted OpenAI request from engine streams to HTTP: SSE events or one JSON body.

A request with k prompts and n samples is k engine requests; choice ``i * n + j`` is sample j of
prompt i (OpenAI's numbering). Their streams are merged as the engine produces them, so every
chunk is flushed in the step that made it. The same merge enforces the timeouts:

- queue timeout: a request that produced nothing within ``queue_timeout`` s of arrival is
  aborted (its KV blocks freed) and answered with an error (the front cannot see the engine's
  queue, so "queued" means "no output yet": queueing plus its prefill);
- request timeout: the whole request is bounded by ``request_timeout`` s.

Client disconnect: a watcher task waits for ASGI's ``http.disconnect`` and aborts every engine
request of the call; the engine applies aborts before its next step, so the blocks come back
within one step whether the request was queued, prefilling or decoding.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from labkit.serve import protocol
from labkit.serve.async_llm import RequestStream, StreamItem
from labkit.serve.logprobs import CompletionLogprobs, chat_logprobs, vllm_prompt_logprobs
from labkit.serve.protocol import APIError, ParsedRequest
from labkit.serve.stream_interval import TokenBatcher


class Timeout(Exception):
    def __init__(self, kind: str, seconds: float) -> None:
        super().__init__(f"{kind} timeout after {seconds:g} s")
        self.kind, self.seconds = kind, seconds


@dataclass
class Call:
    """What the server knows about one accepted HTTP request while it runs."""

    parsed: ParsedRequest
    streams: list[RequestStream]
    prompt_lens: list[int]
    arrival: float
    queue_timeout: float | None = None
    request_timeout: float | None = None
    id: str = ""
    created: int = 0
    outcome: str | None = None  # finished | aborted:<reason> | timeout:<kind>
    completion_tokens: int = 0
    texts: dict[int, list[str]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    last_token_time: dict[int, float] = field(default_factory=dict)  # per choice (ITL)
    first_step_start: float | None = None
    first_token_time: float | None = None
    tokenizer: Any = None  # echo's prompt text and a logprob token's text when not decoded
    logprobs: dict[int, list] = field(default_factory=dict)  # per choice, per token
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # per prompt (echo)
    shapers: dict[int, CompletionLogprobs] = field(default_factory=dict)  # text_offset so far
    started: set[int] = field(default_factory=set)  # choices that sent their first chunk

    def abort_all(self) -> None:
        for s in self.streams:
            if not s.finished:
                s.finished = True
                s.llm.abort(s.request_id)

    @property
    def n(self) -> int:
        return self.parsed.params.n

    @property
    def usage(self) -> dict[str, int]:
        return protocol.usage(sum(self.prompt_lens), self.completion_tokens)


async def _next(call: Call, s: RequestStream, first: bool) -> StreamItem:
    """The stream's next item, or Timeout when the call's deadline comes first."""
    wait, kind = _deadline(call, first)
    try:
        return await s.get(wait)
    except (TimeoutError, asyncio.TimeoutError):
        raise Timeout(kind, getattr(call, f"{kind}_timeout")) from None


async def _pump(call: Call, i: int, s: RequestStream, out: asyncio.Queue) -> None:
    first = True
    while True:
        try:
            item = await _next(call, s, first)
        except Timeout as t:
            await out.put((i, t))
            return
        first = False
        await out.put((i, item))
        if item.finished or item.error is not None:
            return


def _deadline(call: Call, first: bool) -> tuple[float | None, str]:
    now = time.monotonic()
    best: tuple[float | None, str] = (None, "request")
    if call.request_timeout is not None:
        best = (max(0.0, call.arrival + call.request_timeout - now), "request")
    if first and call.queue_timeout is not None:
        q = max(0.0, call.arrival + call.queue_timeout - now)
        if best[0] is None or q < best[0]:
            best = (q, "queue")
    return best


async def merged(call: Call) -> AsyncIterator[tuple[int, StreamItem]]:
    """(prompt index, item) from every stream of the call, in the order the engine made
    them; raises Timeout or the step error; aborts everything still running on exit.

    One stream (one prompt, the common case) is read directly: a pump task and a second queue
    per stream cost two more task wake-ups per token on the event loop, which shares the GIL
    with the engine thread (every wake-up there is time taken from the step)."""
    try:
        if len(call.streams) == 1:
            first = True
            while True:
                item = await _next(call, call.streams[0], first)
                first = False
                if item.error is not None:
                    raise item.error
                yield 0, item
                if item.finished:
                    return
        out: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(call, i, s, out))
                 for i, s in enumerate(call.streams)]
        live = len(tasks)
        try:
            while live:
                i, item = await out.get()
                if isinstance(item, Timeout):
                    raise item
                if item.error is not None:
                    raise item.error
                if item.finished:
                    live -= 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        call.abort_all()


def account(call: Call, i: int, item: StreamItem, itl: Callable[[float], None] | None = None
            ) -> list[tuple[int, str, list[int], str | None, list | None]]:
    """Fold one item into the call's state; returns (choice, text, ids, reason, logprobs)
    deltas. An echo-only request (max_tokens 0) keeps none of the token it had to generate."""
    now = time.monotonic()
    deltas = []
    for o in item.outputs:
        c = i * call.n + o.index
        if o.new_token_ids:
            if call.first_token_time is None:
                call.first_token_time, call.first_step_start = now, item.step_start
            if itl is not None and c in call.last_token_time:
                itl(now - call.last_token_time[c])
            call.last_token_time[c] = now
        if o.prompt_logprobs is not None:
            call.prompt_logprobs.setdefault(i, o.prompt_logprobs)
        if call.parsed.echo_only:
            reason = "length" if o.finished else None
            if reason:
                call.reasons[c] = reason
            deltas.append((c, "", [], reason, None))
            continue
        if o.logprobs is not None:
            call.logprobs.setdefault(c, []).extend(o.logprobs)
        call.completion_tokens += len(o.new_token_ids)
        call.texts.setdefault(c, []).append(o.text_delta)
        call.token_ids.setdefault(c, []).extend(o.new_token_ids)
        if o.finished:
            call.reasons[c] = o.finish_reason or "stop"
        deltas.append((c, o.text_delta, o.new_token_ids, o.finish_reason if o.finished
                       else None, o.logprobs))
    return deltas


def choice_logprobs(call: Call, c: int, toks: list[int], lps: list | None
                    ) -> tuple[str, dict[str, Any] | None]:
    """(echo text to put first, the ``logprobs`` object) for choice ``c``'s tokens ``toks``.
    A choice's first call (its whole answer, or its first chunk) carries the echoed prompt."""
    p, ask = call.parsed, call.parsed.logprobs
    first = c not in call.started
    call.started.add(c)
    if ask.chat:
        return "", None if ask.k is None else chat_logprobs(toks, lps or [], ask.k,
                                                             call.tokenizer)
    prefix, ids, entries = "", list(toks), list(lps or [])
    if ask.echo and first:
        i = c // call.n
        pids = p.extra["prompt_token_ids"][i]
        prompt = p.prompts[i]
        prefix = prompt if isinstance(prompt, str) else \
            call.tokenizer.decode(pids) if call.tokenizer is not None else ""
        plps = call.prompt_logprobs.get(i) or [None] * len(pids)
        ids, entries = pids + ids, list(plps) + entries
    if ask.k is None:
        return prefix, None
    shaper = call.shapers.setdefault(c, CompletionLogprobs())
    return prefix, shaper.shape(ids, entries, call.tokenizer)


def prompt_logprobs_of(call: Call, i: int) -> list | None:
    """vLLM's ``prompt_logprobs`` of prompt ``i`` (the engine sends them with its first
    output), trimmed to the k the request asked for."""
    return vllm_prompt_logprobs(call.prompt_logprobs.get(i), call.parsed.logprobs.prompt_k,
                                call.tokenizer)


def error_for(exc: BaseException) -> APIError:
    if isinstance(exc, Timeout):
        if exc.kind == "queue":
            return APIError(503, f"the request waited {exc.seconds:g} s in the queue without "
                            "being served (--queue-timeout); retry later", "server_overloaded",
                            None, "queue_timeout", {"Retry-After": "1"})
        return APIError(504, f"the request did not finish within {exc.seconds:g} s "
                        "(--request-timeout); ask for fewer tokens", "timeout", None,
                        "request_timeout")
    return APIError(500, f"the engine failed while serving this request: {exc}",
                    "server_error", None, "engine_step_failed")


def _content_chunk(call: Call, delta: tuple, use: dict[str, int] | None) -> dict[str, Any]:
    """One choice's content chunk: its text (after the echoed prompt on its first chunk), its
    logprobs, the prompt's logprobs on its first chunk, its token ids if asked."""
    p, (c, text, toks, reason, lps) = call.parsed, delta
    first = c not in call.started
    prefix, lp_obj = choice_logprobs(call, c, toks, lps)
    ch = protocol.chunk(p.kind, call.id, p.model, call.created, c, prefix + text, reason,
                        with_usage=p.include_usage, use=use)
    ch["choices"][0]["logprobs"] = lp_obj
    if first and p.logprobs.prompt_k is not None:  # with a choice's first chunk
        where = ch if p.kind == "chat" else ch["choices"][0]
        where["prompt_logprobs"] = prompt_logprobs_of(call, c // call.n)
    if p.extra.get("return_token_ids", False):
        ch["choices"][0]["token_ids"] = toks
    return ch


def _usage_so_far(call: Call, c: int) -> dict[str, int] | None:
    """continuous_usage_stats: vLLM's usage on every chunk, for the chunk's choice (its
    prompt's tokens and the tokens that choice generated so far); else null."""
    if not call.parsed.continuous_usage:
        return None
    return protocol.usage(call.prompt_lens[c // call.n], len(call.token_ids.get(c, ())))


async def stream_events(call: Call, itl: Callable[[float], None] | None = None,
                        interval: int = 1, encode: Callable[[Any], Any] = protocol.sse
                        ) -> AsyncIterator[Any]:
    """The SSE body: chunks as the engine yields them (``interval`` tokens per event, the
    first and last of a choice never held: :mod:`labkit.serve.stream_interval`), usage if
    asked, then ``[DONE]``. A step failure or timeout becomes one error event (the server goes
    on serving the others). A call cancelled meanwhile (``outcome`` already ``aborted:...``)
    ends with its choices' ``finish_reason: "abort"`` chunks and ``[DONE]``, no usage.
    ``encode`` turns each payload (a chunk dict, or ``"[DONE]"``) into what is sent: SSE bytes,
    or the payload itself for the WebSocket route."""
    p, kind = call.parsed, call.parsed.kind
    batch = TokenBatcher(interval)
    ids = p.extra.get("return_token_ids", False)
    unsent = set(range(len(call.streams) * call.n)) if ids else set()  # prompt ids still owed

    def with_prompt_ids(ch: dict[str, Any], c: int) -> dict[str, Any]:
        if c in unsent:  # vLLM's convention: the prompt's ids ride on a choice's first chunk
            unsent.discard(c)
            ch["choices"][0]["prompt_token_ids"] = p.extra["prompt_token_ids"][c // call.n]
        return ch

    if kind == "chat":
        for c in range(len(call.streams) * call.n):
            yield encode(with_prompt_ids(protocol.chunk(
                kind, call.id, p.model, call.created, c, None, None, role=True,
                with_usage=p.include_usage, use=_usage_so_far(call, c)), c))
    try:
        async for i, item in merged(call):
            for delta in account(call, i, item, itl):
                merged_delta = batch.add(*delta, first=delta[0] not in call.started)
                if merged_delta is None:
                    continue  # held for the next event (--stream-interval)
                c, text, toks, reason, lps = merged_delta
                if not text and reason is None and not ((ids or lps) and toks) and \
                        not ((p.logprobs.echo or p.logprobs.prompt_k is not None)
                             and c not in call.started):
                    continue  # nothing a client can see yet (held-back tail, partial UTF-8)
                ch = _content_chunk(call, merged_delta, _usage_so_far(call, c))
                yield encode(with_prompt_ids(ch, c))
        call.outcome = call.outcome or "finished"  # a cancel (outcome set) stays an abort
    except (Timeout, Exception) as e:  # noqa: BLE001 - reported to the client as an event
        err = error_for(e)
        call.outcome = f"timeout:{e.kind}" if isinstance(e, Timeout) else "aborted:step_error"
        yield encode(err.body())
    if call.outcome == "finished" and p.include_usage:
        yield encode(protocol.usage_chunk(kind, call.id, p.model, call.created, call.usage))
    yield encode("[DONE]")


async def collect(call: Call, itl: Callable[[float], None] | None = None) -> dict[str, Any]:
    """The non-streaming answer; raises APIError on a timeout or a step failure."""
    try:
        async for i, item in merged(call):
            account(call, i, item, itl)
    except Timeout as e:
        call.outcome = f"timeout:{e.kind}"
        raise error_for(e) from None
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - the step error, as an OpenAI error body
        call.outcome = "aborted:step_error"
        raise error_for(e) from None
    call.outcome = call.outcome or "finished"
    k = len(call.streams) * call.n
    texts = ["".join(call.texts.get(c, [])) for c in range(k)]
    body = protocol.response(call.parsed.kind, call.id, call.parsed.model, call.created, texts,
                             [call.reasons.get(c) for c in range(k)], call.usage)
    for c, ch in enumerate(body["choices"]):
        prefix, ch["logprobs"] = choice_logprobs(call, c, call.token_ids.get(c, []),
                                                 call.logprobs.get(c))
        if prefix:
            ch["text"] = prefix + ch["text"]
    if call.parsed.logprobs.prompt_k is not None:
        if call.parsed.kind == "chat":  # one prompt: vLLM puts it beside the choices
            body["prompt_logprobs"] = prompt_logprobs_of(call, 0)
        for c, ch in enumerate(body["choices"]):
            if call.parsed.kind != "chat":
                ch["prompt_logprobs"] = prompt_logprobs_of(call, c // call.n)
    if call.parsed.extra.get("return_token_ids"):
        for c, ch in enumerate(body["choices"]):
            ch["token_ids"] = call.token_ids.get(c, [])
            ch["prompt_token_ids"] = call.parsed.extra["prompt_token_ids"][c // call.n]
    return body


async def watch_disconnect(receive: Callable, call: Call) -> None:
    """Abort the call's engine requests as soon as the client goes away."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if call.outcome is None:
                call.outcome = "aborted:disconnect"
                call.abort_all()
            return
