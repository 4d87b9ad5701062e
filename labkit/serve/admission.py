"""Admission: the gates a request passes before the engine sees it, and its submission.

Gates 1-8 of :mod:`labkit.serve.api_server` (its docstring lists them and their answers),
cheapest first: key, draining, body (size, JSON, fields), context length, queue, the key's
token bucket, then the engine's own checks. A refused request raises the ``APIError`` its
client gets; an accepted one is a ``serving.Call`` counted in flight.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import HTTPConnection

from labkit.serve import protocol, serving
from labkit.serve.body import read_body
from labkit.serve.model_card import assign_seed
from labkit.serve.protocol import APIError, bad
from labkit.serve.structured import add_error

if TYPE_CHECKING:
    from labkit.serve.state import ServerState


def _reject(state: ServerState, reason: str) -> None:
    state.counts["rejected"] += 1
    state.metrics.rejected.labels(state.config.model_name, reason).inc()


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                    "authentication_error", None, "invalid_api_key")


def _tokenize(state: ServerState, parsed: protocol.ParsedRequest) -> list[list[int]]:
    tok = state.tokenizer
    out = []
    for p in parsed.prompts:
        if isinstance(p, list) and p and isinstance(p[0], dict):  # chat messages
            p = state.render_chat(p)
        if isinstance(p, str):
            if tok is None:
                raise bad("this model has no tokenizer: send prompts as token ids", "prompt")
            p = tok.encode(p)
        out.append(list(p))
    limit = state.max_model_len
    for ids in out:
        mt = parsed.params.max_tokens if parsed.max_tokens_given else 1
        if len(ids) + mt > limit:
            raise bad(f"this model's maximum context length is {limit} tokens; the request "
                      f"has {len(ids)} prompt tokens and asks for {mt} more", "prompt"
                      if len(ids) >= limit else "max_tokens", "context_length_exceeded")
    if not parsed.max_tokens_given:  # chat default: the rest of the context
        parsed.params.max_tokens = max(1, limit - max(len(i) for i in out))
    return out


async def admit(state: ServerState, request: HTTPConnection, kind: str,
                body: dict | None = None) -> serving.Call:
    """Run gates 1-8 and submit; returns the accepted call or raises APIError. ``body``: the
    request's JSON already read (the WebSocket route's first message), else read here."""
    cfg, m = state.config, state.metrics
    tenant = state.auth.tenant(request.headers.get("authorization"))  # V1KeyGuard checked it
    if tenant is None:
        raise unauthorized()
    if state.draining:
        _reject(state, "draining")
        raise APIError(503, "the server is shutting down", "server_unavailable", None,
                       "draining", _retry_after(5))
    parsed, ids, lora = await _parse(state, request, kind, body)
    _check_capacity(state, tenant, parsed, ids)
    call = serving.Call(parsed, [], [len(i) for i in ids], time.monotonic(),
                        cfg.queue_timeout, cfg.request_timeout, protocol.new_id(kind),
                        protocol.now_s(), tokenizer=state.tokenizer)
    try:  # all at once: counted in flight before the next request's admission check
        call.streams = await state.llm.add_requests([
            (state.new_request_id(), p_ids, parsed.params, parsed.priority, tenant, lora)
            for p_ids in ids])
    except ValueError as e:  # add_requests aborted the ones it had added
        raise bad(*add_error(e, parsed.structured_field)) from None
    state.counts["accepted"] += 1
    state.live.add(call, tenant)  # cancellable by its id (labkit.serve.cancel)
    parsed.extra["lora_request"] = lora
    state.loras.started(lora)
    m.accepted.labels(cfg.model_name).inc()
    m.prompt_tokens.labels(cfg.model_name).inc(sum(call.prompt_lens))
    return call


async def _parse(state: ServerState, request: HTTPConnection, kind: str, body: dict | None
                 ) -> tuple[protocol.ParsedRequest, list[list[int]], Any]:
    """Gates 3-5: the body read under its limits, its fields checked, its prompts tokenized
    within the context; returns the request, its prompts' ids and the adapter it names."""
    cfg = state.config
    d = body if body is not None else protocol.parse_json(await read_body(request,
                                                                          cfg.max_body_bytes))
    lora = state.loras.resolve(d.get("model"))  # a served adapter's name (lora_routes)
    parsed = protocol.parse_request(d, kind, served_model=lora.lora_name if lora else
                                    cfg.model_name,
                                    vocab_size=state.vocab_size, max_n=cfg.max_n)
    assign_seed(state.seeds, parsed.params)  # --seed: unseeded requests get one, in order
    parsed.extra["return_token_ids"] = protocol._bool(d, "return_token_ids")
    ids = _tokenize(state, parsed)
    parsed.extra["prompt_token_ids"] = ids  # echoed with return_token_ids (router failover)
    return parsed, ids, lora


def _check_capacity(state: ServerState, tenant: Any, parsed: protocol.ParsedRequest,
                    ids: list[list[int]]) -> None:
    """Gates 6-7: room in the queue (``--max-waiting``), then the key's token bucket, whose
    cost is the prompts plus every token the request may generate."""
    cfg = state.config
    seqs = parsed.params.n * len(ids)
    if cfg.max_waiting is not None and state.num_queued(seqs) > cfg.max_waiting:
        _reject(state, "queue_full")
        raise APIError(429, f"the queue is full ({cfg.max_waiting} sequences may wait beyond "
                       "the running batch); retry later", "rate_limit_exceeded", None,
                       "queue_full", _retry_after(1))
    cost = sum(len(i) for i in ids) + parsed.params.max_tokens * parsed.params.n * len(ids)
    wait = state.auth.limit(tenant, cost)
    if wait:
        _reject(state, "rate_limit")
        if math.isinf(wait):
            raise bad(f"this request costs {cost} tokens, more than the key's token bucket "
                      "ever holds: lower max_tokens or n", "max_tokens", "rate_limit_cost")
        raise APIError(429, f"rate limit for this key exceeded; retry in {wait:.2f} s",
                       "rate_limit_exceeded", None, "rate_limit", _retry_after(wait))
