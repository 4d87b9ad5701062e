"""Tokens per SSE event (``labkit serve --stream-interval N``, SGLang's flag of that name).

With ``N = 1`` (the default) every step's new tokens of a choice go out as their own event, as
soon as the step made them. Each event is a JSON chunk of ~150-300 bytes framed as
``data: ...\\n\\n`` for a token that is a few bytes of text, plus one ``send`` (a syscall, and a
wake-up of the event loop that shares the GIL with an in-thread engine) per token per stream.
Buffering ``N`` tokens per event divides those bytes and syscalls by about ``N``; the price is
that the client sees text in bursts of ``N`` tokens, so its inter-event gap grows to ``N`` steps
and its inter-token latency becomes lumpy (``N - 1`` tokens arrive late by up to ``N - 1``
steps), while the time to the last token is unchanged.

Two events are never held back: a choice's first one (time to first token stays the engine's)
and its last one (``finish_reason`` set: the final event always flushes). The text of a choice is
the concatenation of its events whatever ``N`` is; only the cut points move.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Delta = tuple[int, str, list[int], "str | None", "list | None"]  # (choice, text, ids, reason, lps)


@dataclass
class _Pending:
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    lps: list | None = None


class TokenBatcher:
    """Holds each choice's deltas until ``interval`` tokens are pending, its first event, or its
    finish; ``add`` returns the merged delta to send now, or None."""

    def __init__(self, interval: int = 1) -> None:
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"stream interval must be an integer >= 1, got {interval!r}")
        self.interval = interval
        self.pending: dict[int, _Pending] = {}

    def add(self, c: int, text: str, ids: list[int], reason: str | None, lps: list | None,
            first: bool) -> Delta | None:
        """Fold one delta of choice ``c`` (``first``: the choice has sent nothing yet)."""
        if self.interval == 1:
            return c, text, ids, reason, lps
        p = self.pending.setdefault(c, _Pending())
        p.text.append(text)
        p.ids.extend(ids)
        if lps is not None:
            p.lps = (p.lps or []) + list(lps)
        if not (first or reason is not None or len(p.ids) >= self.interval):
            return None
        del self.pending[c]
        return c, "".join(p.text), p.ids, reason, p.lps
