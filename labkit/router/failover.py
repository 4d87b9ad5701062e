"""Failover mid-stream: when a replica dies during a stream, continue it on another replica.

A stream that breaks after the first byte cannot simply be retried: the client has already shown
part of the answer. What the router can do is what a replica does after a recompute preemption:
re-prefill. It asks the next replica for a *completion* whose prompt is the original prompt's
token ids followed by the tokens already sent, and relays the new tokens as if nothing had
happened (same ``id``, ``created``, choice ``index`` and chunk shape). The cost is one prefill of
prompt + sent tokens on the new replica (its prefix cache may hold part of it); the client sees
one longer inter-token gap.

To know those token ids the router asks every replica for them (``return_token_ids``, vLLM's
extension; ``labkit serve`` then also sends ``prompt_token_ids`` on a choice's first chunk) and
strips them again unless the client asked for them itself, so the client's bytes are the ones
the replica would have sent.

Why greedy output is byte-identical: decoding is a function of the token sequence, and greedy
picks the same next token from the same prefix on any replica of the same model; the resumed
replica's detokenizer starts at the cut, and for a byte-level BPE tokenizer ``decode(a + b) ==
decode(a) + decode(b)`` whenever the cut is not inside a multi-byte UTF-8 character.

**Several choices** (``n > 1``, several prompts): every unfinished choice continues, as one
completion with one token-id prompt per choice (``n = 1`` each) whose choice ``i`` the router
maps back to the client's index. One request has one ``max_tokens``: it asks for the largest
budget left and ends each choice itself (``finish_reason: length``) when its own budget is spent.

**Stop strings**: a replica holds back the last ``len(longest stop) - 1`` characters of a
sequence (``labkit.engine.detokenizer.update_text``: they could start a stop string), so when it
dies the router has the ids of tokens whose text the client never got, and no tokenizer to
decode them. It cuts back instead: after each event the replica's decoded length is exactly
``characters shown + hold`` (once something was shown), so the router knows token counts whose
text the client has seen *entirely*. The continuation starts at the last such count (the stop
list goes with it); the router drops the regenerated ids and characters the client already has
and relays the rest. Stop matching stays consistent because no stop string can begin before the
characters shown (the replica would have held that text back), so any match lies wholly in the
continuation's own output, where the new replica finds it. With several choices, the router
cannot end a choice at its budget itself here (the replica still holds that choice's last
characters back, and only it can decode them), so every choice is cut back to the *same* token
count: the last one that is exact for all of them (0, the original prompt, at worst). Every
choice then has the same budget left, the one ``max_tokens`` is exact for each, and the replica
ends each one itself, held characters included. Greedy streams come out identical; a sampled
one may regenerate the cut-back tokens differently, which the router detects (the dropped text
must equal what it sent) and reports as an error event rather than show inconsistent text.

Sampled requests otherwise continue with a valid sample conditioned on what was sent (a ``seed``
does not reproduce the uninterrupted run: the RNG restarts). ``not_resumable`` says which
requests are not resumed: only non-streamed ones, which the router retries whole. A replica
sends a prompt's ids with its first chunk; a choice of a several-prompt completion that had not
started when its replica died (queued behind ``max_num_seqs``) has none, and continues from
its prompt as the client sent it.
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


def _stops(body: dict[str, Any]) -> list[str]:
    s = body.get("stop") or []
    return [s] if isinstance(s, str) else [x for x in s if isinstance(x, str)]


def _num_prompts(body: dict[str, Any], chat: bool) -> int:
    p = body.get("prompt")
    if chat or not isinstance(p, list) or not p or all(isinstance(t, int) for t in p):
        return 1
    return len(p)


def not_resumable(body: dict[str, Any], chat: bool) -> str | None:
    """Why this request cannot be resumed mid-stream on another replica (None: it can)."""
    if not body.get("stream"):
        return "not a stream (the router buffers a non-streamed answer and retries it whole)"
    return None


class _Choice:
    """One choice of the client's stream: what it was sent, and the current upstream's offset."""

    def __init__(self, index: int, prompt: int) -> None:
        self.index, self.prompt = index, prompt
        self.ids: list[int] = []  # token ids the client's stream has covered
        self.text = ""  # text the client was sent
        self.reason: str | None = None
        self.marks: list[tuple[int, int]] = [(0, 0)]  # (ids, chars) decoded exactly (doc)
        self.base = (0, 0)  # (ids, chars) where the current upstream's output starts
        self.up_ids = self.up_chars = 0  # the current upstream's output so far
        self.skip_ids = 0  # regenerated ids the client already has
        self.verify = ""  # regenerated text the client already has: dropped, but checked


class StreamResume:
    """What the client has been sent for one streamed request, and the request that continues
    it elsewhere. ``on_event`` sees every upstream event, in order, across replicas."""

    def __init__(self, body: dict[str, Any], chat: bool) -> None:
        self.body, self.chat = body, chat
        self.want_ids = bool(body.get("return_token_ids"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        n = body.get("n")  # a bad n is the replica's to reject (400), not ours to crash on
        self.n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 64 else 1
        self.hold = max((len(s) for s in _stops(body)), default=1) - 1
        k = _num_prompts(body, chat)
        self.choices = {i: _Choice(i, i // self.n) for i in range(k * self.n)}
        self.prompts: dict[int, list[int]] = {}  # prompt index -> its token ids
        self.order: list[int] | None = None  # the continuation's choice i -> the client's
        self.done = False  # [DONE] relayed
        self.errored = False  # the replica reported an error event (relayed, not resumed)
        self.head: dict[str, Any] | None = None  # id, created, model of the client's stream
        self.forwarded = False  # the client has been sent something

    @property
    def kind(self) -> str:
        return "chat" if self.chat else "completion"

    @property
    def resumed(self) -> bool:
        return self.order is not None

    @property
    def prompt_ids(self) -> list[int] | None:
        return self.prompts.get(0)

    @property
    def sent_ids(self) -> list[int]:
        """The token ids sent on choice 0 (the only one unless ``n > 1`` or several prompts)."""
        return self.choices[0].ids

    def upstream_body(self) -> bytes:
        return json.dumps({**self.body, "return_token_ids": True}).encode()

    def path(self, original: str) -> str:
        """Where the next upstream request goes: a continuation is always a completion."""
        return "/v1/completions" if self.resumed else original

    def max_tokens(self, max_model_len: int | None, prompt: int = 0) -> int | None:
        """A choice's budget of new tokens (chat without one: the rest of the context)."""
        b = self.body
        mt = (b.get("max_completion_tokens") or b.get("max_tokens")) if self.chat else \
            b.get("max_tokens", 16)
        if mt is None and max_model_len is not None and prompt in self.prompts:
            mt = max_model_len - len(self.prompts[prompt])
        return mt

    def remaining(self, max_model_len: int | None = None, c: _Choice | None = None) -> int | None:
        c = c or self.choices[0]
        mt = self.max_tokens(max_model_len, c.prompt)
        return None if mt is None else mt - len(c.ids)

    def _open(self, max_model_len: int | None) -> list[_Choice]:
        def owed(c: _Choice) -> bool:  # held-back text is owed even with no tokens left
            r = self.remaining(max_model_len, c)
            return bool(self.hold) or r is None or r > 0

        return [c for c in self.choices.values() if c.reason is None and owed(c)]

    def _cuts(self, todo: list[_Choice]) -> list[tuple[int, int]]:
        """(ids, chars) where each continuation starts (module doc: stop strings): without
        stops, all that was sent; with them, the last token count exact for every choice."""
        if not self.hold:
            return [(len(c.ids), len(c.text)) for c in todo]
        exact = [{m[0]: m for m in sorted(c.marks) if m[1] <= len(c.text) and m[0] <= len(c.ids)}
                 for c in todo]
        k = max(set.intersection(*(set(e) for e in exact)))  # (0, 0) is in every choice's
        return [e[k] for e in exact]

    def resume_body(self, max_model_len: int | None = None) -> bytes:
        """The continuation: one completion over prompt + kept tokens per unfinished choice
        (before any prompt's ids arrived, the original request again)."""
        todo = self._open(max_model_len)
        if not todo or any(self._prompt(c) is None for c in todo):
            self.order = None
            return self.upstream_body()
        drop = ("messages", "prompt", "max_tokens", "max_completion_tokens", "n")
        b = {k: v for k, v in self.body.items() if k not in drop}
        prompts, need = [], []
        for c, (cut_ids, cut_chars) in zip(todo, self._cuts(todo)):
            c.base, c.up_ids, c.up_chars = (cut_ids, cut_chars), 0, 0
            c.skip_ids, c.verify = len(c.ids) - cut_ids, c.text[cut_chars:]
            p = self._prompt(c)
            prompts.append(p + c.ids[:cut_ids] if isinstance(p, list) else p)
            mt = self.max_tokens(max_model_len, c.prompt)
            need.append(None if mt is None else mt - cut_ids)
        b.update(prompt=prompts[0] if len(prompts) == 1 else prompts, return_token_ids=True)
        if None not in need:
            b["max_tokens"] = max(need)
        self.order = [c.index for c in todo]
        return json.dumps(b).encode()

    def _prompt(self, c: _Choice) -> list[int] | str | None:
        """What choice ``c`` continues from: its prompt's ids, or, for a choice that has not
        started (queued on the dead replica) of a several-prompt completion, its own prompt
        as the client sent it (a replica takes a list mixing strings and id lists)."""
        if c.prompt in self.prompts:
            return self.prompts[c.prompt]
        several = self.body.get("prompt")
        if not c.ids and self.prompts and _num_prompts(self.body, self.chat) > 1:
            return several[c.prompt]
        return None

    def cannot_resume(self) -> str | None:
        """Why the stream cannot continue elsewhere now (None: it can). Output was sent but the
        replica never said the prompt's ids (not a labkit server?): a retry would repeat it."""
        if self.forwarded and any(self._prompt(c) is None for c in self._open(None)):
            return "the replica sent output but no prompt_token_ids"
        return None

    def needs_max_model_len(self) -> bool:
        return self.chat and self.max_tokens(None) is None

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
            return self._usage_event() if self.resumed else self._plain(raw, d)
        if not self.resumed:
            for ch in d["choices"]:
                self._account(ch)
            return self._plain(raw, d)
        out = b"".join(self._continued(ch, "usage" in d) or b"" for ch in d["choices"])
        return out or None

    def _account(self, ch: dict[str, Any]) -> None:
        """An original replica's choice chunk: record ids, text, finish, exact-length marks."""
        c = self.choices.get(ch.get("index", 0))
        if c is None:
            return
        pids = ch.get("prompt_token_ids")
        if pids is not None:
            self.prompts[c.prompt] = list(pids)
        self._add(c, list(ch.get("token_ids") or []), _text(ch), ch.get("finish_reason"))

    def _add(self, c: _Choice, toks: list[int], text: str, reason: str | None) -> None:
        c.ids += toks
        c.text += text
        c.up_ids += len(toks)
        c.up_chars += len(text)
        c.reason = reason or c.reason
        if self.hold and c.up_chars and c.reason is None:  # decoded = shown + hold (doc)
            c.marks.append((c.base[0] + c.up_ids, c.base[1] + c.up_chars + self.hold))

    def _continued(self, ch: dict[str, Any], with_usage: bool) -> bytes | None:
        """A continuation's choice chunk: drop what the client has, end a spent budget, and
        send the rest in the shape and identity of the client's stream."""
        i = ch.get("index", 0)
        if self.order is None or not 0 <= i < len(self.order):
            return None
        c = self.choices[self.order[i]]
        if c.reason is not None:
            return None  # ended by the router (its budget) while the replica went on
        if c.prompt not in self.prompts and ch.get("prompt_token_ids") is not None:
            self.prompts[c.prompt] = list(ch["prompt_token_ids"])  # it started here
        toks, text, reason = list(ch.get("token_ids") or []), _text(ch), ch.get("finish_reason")
        k = min(len(toks), c.skip_ids)
        c.skip_ids -= k
        c.up_ids += k
        toks = toks[k:]
        m = min(len(text), len(c.verify))
        if text[:m] != c.verify[:m]:
            return self.error_tail(f"choice {c.index} regenerated differently after the "
                                   "cut-back (a sampled stream with stop strings)")
        c.verify, c.up_chars, text = c.verify[m:], c.up_chars + m, text[m:]
        room = self.remaining(None, c)
        if room is not None and len(toks) >= room and reason is None:
            if len(toks) > room and text:
                return self.error_tail(f"choice {c.index}: a chunk crossed its token budget")
            toks, reason = toks[:room], "length"
        self._add(c, toks, text, reason)
        if not text and reason is None and not (self.want_ids and toks):
            return None
        return self._chunk(c, text, toks, reason, with_usage)

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

    def _chunk(self, c: _Choice, text: str, toks: list[int], reason: str | None,
               with_usage: bool) -> bytes:
        h = self.head or {}
        ch = protocol.chunk(self.kind, h.get("id"), h.get("model"), h.get("created"), c.index,
                            text, reason, with_usage=with_usage)
        if self.want_ids:
            ch["choices"][0]["token_ids"] = toks
        return protocol.sse(ch)

    def _usage_event(self) -> bytes:
        h = self.head or {}
        use = protocol.usage(sum(len(p) for p in self.prompts.values()),
                             sum(len(c.ids) for c in self.choices.values()))
        return protocol.sse(protocol.usage_chunk(self.kind, h.get("id"), h.get("model"),
                                                 h.get("created"), use))

    def tail_if_finished(self, max_model_len: int | None = None) -> bytes | None:
        """The replica died after the last token: finish the stream here (finish chunks not
        sent yet, usage if asked, [DONE]) instead of resuming. None: not finished."""
        if self._open(max_model_len) or self.head is None:
            return None
        out = b""
        for c in self.choices.values():
            if c.reason is None:
                c.reason = "length"
                out += self._chunk(c, "", [], "length", self.include_usage)
        if self.include_usage:
            out += self._usage_event()
        self.done = True
        return out + DONE

    def error_tail(self, message: str) -> bytes:
        """End the client's stream with an OpenAI error event (nothing more can be done)."""
        self.done = True
        err = protocol.APIError(502, message, "server_error", None, "upstream_failed")
        return protocol.sse(err.body()) + DONE


def _text(ch: dict[str, Any]) -> str:
    return (ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")) or ""
