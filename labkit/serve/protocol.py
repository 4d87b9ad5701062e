"""The OpenAI wire format: parse and check request bodies (answers: :mod:`labkit.serve.replies`).

Parsing is done by hand rather than by pydantic models so that every client mistake becomes an
``APIError`` with OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``), a 4xx
status and a message naming the field, and never a 500 or a framework-shaped 422.

Which fields pass:

- fields labkit reads (``KNOWN``) are checked and honoured;
- fields that would change the answer and that labkit does not implement are refused with 400
  (``unsupported``) instead of silently ignored, because a client that asked for them would
  otherwise get a different answer than it thinks: OpenAI's penalties, ``suffix``,
  tools... and vLLM's sampling extras (``repetition_penalty``, ``min_p``, ``min_tokens``,
  beam search...). A neutral value (``repetition_penalty: 1``, ``min_p: 0``,
  ``logprobs: false``) asks for nothing and passes;
- any other field is ignored with one warning line in the server log naming it, as vLLM does
  (its ``extra="allow"`` request models log "fields were present in the request but ignored"):
  clients send their own bookkeeping (``metadata``, ``store``, tags), and refusing it would
  break them for nothing. The same holds inside ``stream_options``.

Every string in the body must be valid Unicode: JSON may spell a lone UTF-16 surrogate
(``"\\ud800"``, what a client that cut a string inside an emoji sends), which decodes to a
Python ``str`` that cannot be encoded, tokenized or logged; it is a 400 ``invalid_unicode``
naming its field (``prompt[1]``, ``messages[0].content``, ``stop[2]``).

Structured outputs (``response_format``, ``structured_outputs``, ``guided_*``) are parsed in
:mod:`labkit.serve.structured`.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from labkit.engine.sampling_params import SamplingParams
from labkit.errors import SamplingParamsError
from labkit.serve.logprobs import FieldError, LogprobsAsk, parse_logprobs

# the answers' shapes, re-exported: protocol.sse, protocol.chunk... (labkit.serve.replies)
from labkit.serve.replies import chunk, new_id, now_s, response, sse, usage, usage_chunk  # noqa: F401
from labkit.serve.structured import FIELDS as STRUCTURED_FIELDS
from labkit.serve.structured import parse_structured


class APIError(Exception):
    """An error answered with OpenAI's body; ``status`` < 500 for every client mistake."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


log = logging.getLogger("uvicorn.error")  # the server's log: uvicorn's handler and --log-level

# fields that change the answer and that labkit does not implement: refuse, never ignore
UNSUPPORTED = ("suffix", "logit_bias", "tools",
               "tool_choice", "functions", "function_call", "best_of",
               # vLLM's extensions
               "bad_words",
               "allowed_token_ids", "logits_processors", "use_beam_search")
ZERO_ONLY = ("presence_penalty", "frequency_penalty")
# vLLM's sampling extras: refused unless they hold their neutral value (which asks for nothing)
NEUTRAL_ONLY = {"repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0,
                "length_penalty": 1.0}
# fields parse_request reads (beside the above): anything else is ignored with a warning
KNOWN = frozenset({"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n",
                   "top_k", "seed", "stream", "stream_options", "user", "priority",
                   "stop_token_ids", "stop", "temperature", "top_p", "ignore_eos",
                   "return_token_ids", "logprobs", "top_logprobs", "echo", "prompt_logprobs",
                   "guided_decoding_backend", "kv_transfer_params", *STRUCTURED_FIELDS})
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


@dataclass
class ParsedRequest:
    """One OpenAI request, checked: its prompts and the engine's SamplingParams."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    user: str | None = None
    max_tokens_given: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    logprobs: LogprobsAsk = field(default_factory=LogprobsAsk)
    echo_only: bool = False  # echo with max_tokens 0: the prompt scored, nothing generated
    ignored: list[str] = field(default_factory=list)  # unknown fields, ignored with a warning
    structured_field: str | None = None  # the field a structured-output constraint came from


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        d = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    if not isinstance(d, dict):
        raise bad(f"the request body must be a JSON object, got {type(d).__name__}")
    where = lone_surrogate(d)
    if where is not None:
        path, pos = where
        raise bad(f"{path} is not valid Unicode: it holds a lone UTF-16 surrogate at character "
                  f"{pos} (a \\ud800-\\udfff escape without its pair; a client that cut a "
                  "string inside a character sends one): send whole characters", path,
                  "invalid_unicode")
    return d


def _utf8_error(s: str) -> int | None:
    """The index of the first character that UTF-8 cannot encode (a lone surrogate)."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def lone_surrogate(d: Any) -> tuple[str, int] | None:
    """(field path, character index) of the first string, or key, in a decoded JSON value that
    holds a lone surrogate, else None. Paths read like ``messages[1].content``; iterative, so a
    deep body cannot overflow the stack."""
    stack: list[tuple[str, Any]] = [("", d)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            pos = _utf8_error(x)
            if pos is not None:
                return path or "body", pos
        elif isinstance(x, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(x))))
        elif isinstance(x, dict):
            items = []
            for k, v in x.items():
                pos = _utf8_error(k)
                if pos is not None:
                    return f"{path + '.' if path else ''}{ascii(k)} (a key)", pos
                items.append((f"{path}.{k}" if path else k, v))
            stack.extend(reversed(items))
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num(d: dict, name: str, default: float, lo: float, hi: float,
         lo_open: bool = False) -> float:
    x = d.get(name)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or \
            x < lo or x > hi or (lo_open and x == lo):
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad(f"{name} must be a number in {rng}, got {x!r}", name)
    return float(x)


def _int(d: dict, name: str, default: int | None, lo: int | None = None,
         hi: int | None = None) -> int | None:
    x = d.get(name)
    if x is None:
        return default
    if not _is_int(x) or (lo is not None and x < lo) or (hi is not None and x > hi):
        lim = f" >= {lo}" if hi is None and lo is not None else \
            f" in [{lo}, {hi}]" if lo is not None else ""
        raise bad(f"{name} must be an integer{lim}, got {x!r}", name)
    return x


def _bool(d: dict, name: str, default: bool = False) -> bool:
    x = d.get(name, default)
    if x is None:
        return default
    if not isinstance(x, bool):
        raise bad(f"{name} must be true or false, got {x!r}", name)
    return x


def _prompts(x: Any, vocab_size: int | None) -> list[str | list[int]]:
    """OpenAI's four prompt shapes: a string, a list of strings, a list of token ids, or a
    list of lists of token ids."""
    if isinstance(x, str):
        items: list[Any] = [x]
    elif isinstance(x, list) and x and all(_is_int(t) for t in x):
        items = [x]
    elif isinstance(x, list) and x:
        items = x
    else:
        raise bad("prompt must be a non-empty string, list of strings, list of token ids or "
                  f"list of lists of token ids, got {json.dumps(x)[:80]}", "prompt")
    for p in items:
        if isinstance(p, str):
            if not p:
                raise bad("prompt must not be empty", "prompt")
        elif isinstance(p, list) and p and all(_is_int(t) for t in p):
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in p):
                raise bad(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        else:
            raise bad("each prompt must be a non-empty string or list of token ids, got "
                      f"{json.dumps(p)[:80]}", "prompt")
    return items


def _stop(x: Any) -> list[str]:
    if x is None:
        return []
    items = [x] if isinstance(x, str) else x
    if not isinstance(items, list) or any(not isinstance(s, str) or not s for s in items):
        raise bad(f"stop must be a non-empty string or a list of them, got {x!r}", "stop")
    return items


def messages_of(x: Any) -> list[dict[str, str]]:
    """Chat messages as ``[{"role", "content": str}]``; content parts of type text are joined."""
    if not isinstance(x, list) or not x:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(x):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user",
                                                             "assistant"):
            raise bad(f"messages[{i}] needs a role of system, developer, user or assistant",
                      "messages")
        c = m.get("content")
        if isinstance(c, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" or
                   not isinstance(p.get("text"), str) for p in c):
                raise bad(f"messages[{i}].content parts must be {{type: text, text: str}} "
                          "(labkit's models read text only)", "messages")
            c = "".join(p["text"] for p in c)
        if not isinstance(c, str):
            raise bad(f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": c})
    return out


def parse_request(d: dict[str, Any], kind: str, *, served_model: str,
                  vocab_size: int | None = None, max_n: int = 16) -> ParsedRequest:
    """Check an OpenAI completion / chat body and build the engine's SamplingParams.
    For chat, ``prompts`` holds the messages list; the server renders the template."""
    model = d.get("model", served_model)
    if not isinstance(model, str):
        raise bad(f"model must be a string, got {model!r}", "model")
    if model != served_model:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{served_model!r}", "invalid_request_error", "model", "model_not_found")
    ignored = _refuse_unsupported(d)
    prompts, mt_name = _prompts_of(d, kind, vocab_size)
    default_mt = None if kind == "chat" else 16
    try:
        ask = parse_logprobs(d, kind)
        constraint, constraint_field = parse_structured(d)
    except FieldError as e:
        raise bad(*e.args) from None
    max_tokens = _int(d, mt_name, default_mt, 0 if ask.echo else 1)
    n = _int(d, "n", 1, 1, max_n)
    top_k = _int(d, "top_k", 0, -1)
    seed = _int(d, "seed", None, -(2**63), 2**63 - 1)
    stream = _bool(d, "stream")
    include_usage, continuous, so_ignored = _stream_options(d, stream)
    ignored += so_ignored
    user = d.get("user")
    if user is not None and not isinstance(user, str):
        raise bad(f"user must be a string, got {user!r}", "user")
    priority = _int(d, "priority", 0, -(2**31), 2**31 - 1)
    stop_ids = d.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or any(not _is_int(t) or t < 0 for t in stop_ids):
        raise bad("stop_token_ids must be a list of token ids", "stop_token_ids")
    kw = {"kv_transfer_params": d.get("kv_transfer_params")}
    try:  # what the fields above did not check yet (kv_transfer_params) is a 400 too
        params = SamplingParams(
            n=n, temperature=_num(d, "temperature", 1.0, 0.0, 2.0),
            top_p=_num(d, "top_p", 1.0, 0.0, 1.0, lo_open=True), top_k=top_k,
            max_tokens=max_tokens or 1, stop=_stop(d.get("stop")), stop_token_ids=stop_ids,
            seed=seed, ignore_eos=_bool(d, "ignore_eos"), logprobs=ask.k,
            prompt_logprobs=ask.engine_prompt_k, structured_outputs=constraint, **kw)
    except SamplingParamsError as e:
        raise bad(str(e), "kv_transfer_params" if "kv_transfer" in str(e) else None) from None
    if ignored:  # vLLM's behaviour: the request is served, the log says what was dropped
        log.warning("ignored fields labkit does not know: %s", ", ".join(ignored))
    # vLLM: usage on every chunk only when include_usage asks for usage at all
    return ParsedRequest(kind, model, prompts, params, stream, include_usage, priority, user,
                         max_tokens is not None, continuous_usage=include_usage and
                         bool(continuous), ignored=ignored, logprobs=ask,
                         echo_only=max_tokens == 0, structured_field=constraint_field)


def _refuse_unsupported(d: dict[str, Any]) -> list[str]:
    """Refuse the fields that would change the answer and that labkit does not implement (a
    client asking for them must not get a different answer silently); returns the unknown
    fields, which are only ignored."""
    for name in UNSUPPORTED:
        if d.get(name) not in (None, False) and not (name == "best_of" and d[name] == 1):
            raise bad(f"{name} is not supported by labkit's server", name, "unsupported")
    for name in ZERO_ONLY:
        if _num(d, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad(f"{name} is not supported by labkit's server (only 0)", name,
                      "unsupported")
    for name, neutral in NEUTRAL_ONLY.items():
        x = d.get(name)
        if x is not None and (isinstance(x, bool) or x != neutral):
            raise bad(f"{name} is not supported by labkit's server (only {neutral:g}, which "
                      f"changes nothing), got {x!r}", name, "unsupported")
    return [k for k in d if k not in KNOWN and k not in UNSUPPORTED and
            k not in ZERO_ONLY and k not in NEUTRAL_ONLY]


def _prompts_of(d: dict[str, Any], kind: str, vocab_size: int | None
                ) -> tuple[list[Any], str]:
    """The prompts (chat: its one messages list) and the field that bounds the answer's
    length: chat's ``max_completion_tokens`` wins over its older ``max_tokens``."""
    if kind == "chat":
        prompts: list[Any] = [messages_of(d.get("messages"))]
        mt_name = "max_completion_tokens" if d.get("max_completion_tokens") is not None \
            else "max_tokens"
    else:
        if "prompt" not in d:
            raise bad("prompt is required", "prompt")
        prompts = _prompts(d["prompt"], vocab_size)
        mt_name = "max_tokens"
    return prompts, mt_name


def _stream_options(d: dict[str, Any], stream: bool) -> tuple[bool, Any, list[str]]:
    """``stream_options`` (only with ``stream=true``): ``include_usage``,
    ``continuous_usage_stats``, and the unknown options, ignored as unknown fields are."""
    so = d.get("stream_options")
    if so is not None and (not isinstance(so, dict) or not stream):
        raise bad("stream_options is an object and only allowed with stream=true",
                  "stream_options")
    so = so or {}
    include_usage = _bool(so, "include_usage")
    continuous = so.get("continuous_usage_stats")
    if continuous is not None and not isinstance(continuous, bool):
        raise bad(f"stream_options.continuous_usage_stats must be true or false, got "
                  f"{continuous!r}", "stream_options.continuous_usage_stats")
    return include_usage, continuous, [f"stream_options.{k}" for k in so
                                       if k not in STREAM_OPTIONS]
