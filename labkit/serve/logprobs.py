"""OpenAI's log-probability fields: parse them, and shape the engine's ``Logprob`` dicts.

Two wire shapes, as OpenAI (and vLLM) send them:

- completions (legacy): ``logprobs: k`` gives per choice ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``, one entry per token; ``top_logprobs[i]`` maps token text to
  logprob for the chosen token and the k most likely (vLLM's shape: k or k + 1 entries). With
  ``echo: true`` the prompt comes first, in the text and in those lists (its first token has
  no prefix: ``null``); ``max_tokens: 0`` with echo scores the prompt only (lm-eval's
  loglikelihood requests: ``echo=True, max_tokens=0, logprobs=1``).
- chat: ``logprobs: true`` + ``top_logprobs: k`` give ``{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [k of {"token", "logprob", "bytes"}]}]}``.
- vLLM's ``prompt_logprobs: k`` (completions and chat): the prompt scored token by token, in
  vLLM's shape: a list, ``null`` for the first token, then ``{token_id: {"logprob", "rank",
  "decoded_token"}}`` holding the prompt's token and the k most likely; per choice on
  completions, at the top of a chat response (on a stream: with a choice's first chunk).

-inf (a token top-k / top-p filtered out) is not JSON: it is sent as -9999.0, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.engine.sampling_params import MAX_LOGPROBS

FLOOR = -9999.0


@dataclass
class LogprobsAsk:
    """What a request asked for: ``k`` top tokens per position (None: no logprobs)."""

    k: int | None = None
    echo: bool = False
    chat: bool = False
    prompt_k: int | None = None  # vLLM's prompt_logprobs

    @property
    def engine_prompt_k(self) -> int | None:
        """What the engine must compute for the prompt: echo's k and prompt_logprobs' k."""
        ks = [x for x in (self.k if self.echo else None, self.prompt_k) if x is not None]
        return max(ks) if ks else None


class FieldError(ValueError):
    """A bad logprobs field: (message, param, code), which protocol turns into its 400."""


def bad(message: str, param: str, code: str | None = None) -> FieldError:
    return FieldError(message, param, code)


def _bool(d: dict, name: str) -> bool:
    x = d.get(name)
    if x is not None and not isinstance(x, bool):
        raise bad(f"{name} must be true or false, got {x!r}", name)
    return bool(x)


def _k(d: dict, name: str) -> int | None:
    x = d.get(name)
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_LOGPROBS:
        raise bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {x!r}", name)
    return x


def parse_logprobs(d: dict[str, Any], kind: str) -> LogprobsAsk:
    """Check ``logprobs`` / ``top_logprobs`` / ``echo`` / ``prompt_logprobs``; FieldError
    naming the field."""
    ask = _parse_logprobs(d, kind)
    ask.prompt_k = _k(d, "prompt_logprobs")
    return ask


def _parse_logprobs(d: dict[str, Any], kind: str) -> LogprobsAsk:
    if kind == "chat":
        if d.get("echo") not in (None, False):
            raise bad("echo is a completions field; chat does not support it", "echo",
                      "unsupported")
        on = _bool(d, "logprobs")
        k = _k(d, "top_logprobs")
        if k is not None and not on:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return LogprobsAsk(k or 0 if on else None, False, True)
    if d.get("top_logprobs") is not None:
        raise bad("top_logprobs is a chat field; completions take logprobs: k",
                  "top_logprobs")
    return LogprobsAsk(None if d.get("logprobs") is False else _k(d, "logprobs"),
                       _bool(d, "echo"))


def _lp(x: float) -> float:
    return max(x, FLOOR)


def _text(lp: Any, tokenizer: Any, tid: int) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid]) if tokenizer is not None else str(tid)


@dataclass
class CompletionLogprobs:
    """The legacy shape, grown token by token (a stream sends each delta's part)."""

    offset: int = 0  # text_offset of the next token

    def shape(self, token_ids: list[int], entries: list[Any], tokenizer: Any = None
              ) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for tid, e in zip(token_ids, entries):
            lp = None if e is None else e.get(tid)
            s = _text(lp, tokenizer, tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if lp is None else _lp(lp.logprob))
            out["top_logprobs"].append(None if e is None else
                                       {_text(v, tokenizer, t): _lp(v.logprob)
                                        for t, v in e.items()})
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out


def chat_logprobs(token_ids: list[int], entries: list[Any], k: int,
                  tokenizer: Any = None) -> dict[str, list]:
    """OpenAI chat's ``logprobs`` object for these tokens (``top_logprobs``: the k most
    likely, best first)."""
    def item(t: int, v: Any) -> dict[str, Any]:
        s = _text(v, tokenizer, t)
        return {"token": s, "logprob": _lp(v.logprob), "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, e in zip(token_ids, entries):
        top = sorted(e.items(), key=lambda kv: -kv[1].logprob)[:k]
        content.append({**item(tid, e[tid]), "top_logprobs": [item(t, v) for t, v in top]})
    return {"content": content}


def vllm_prompt_logprobs(entries: list[Any] | None, k: int, tokenizer: Any = None
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` list: per prompt token ``None`` (the first) or the token
    and the ``k`` most likely, ``{"id": {"logprob", "rank", "decoded_token"}}``. The engine may
    have computed more (an echo with a larger ``logprobs``): entries ranked past k are dropped,
    except the prompt's own token, which is always first."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries or []:
        if e is None:
            out.append(None)
            continue
        first = next(iter(e))  # token_entry puts the scored (prompt) token first
        out.append({str(t): {"logprob": _lp(v.logprob), "rank": v.rank,
                             "decoded_token": _text(v, tokenizer, t)}
                    for t, v in e.items() if t == first or (v.rank or 0) <= k})
    return out
