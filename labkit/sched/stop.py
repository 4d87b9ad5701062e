"""The one stop checker every engine path shares: where a sequence's output ends.

Why one place: EOS, the request's stop ids, ``max_tokens``, the model's context end and stop
strings must end a plain decode step, a speculative step (several tokens appended at once, each
checked in turn, the rest dropped after a stop) and a resumed stream identically, or greedy
output would differ between paths. The scheduler calls :meth:`StopChecker.append` from
``update_from_output``; the detokenizer reuses :func:`stop_string_hit`.
"""

from __future__ import annotations

from typing import Any


def stop_string_hit(tokenizer: Any, seq: Any) -> bool:
    """Does ``seq``'s output text so far contain one of its stop strings?"""
    text = tokenizer.decode(seq.output_token_ids)
    return any(s in text for s in seq.request.params.stop)


class StopChecker:
    """Appends a step's tokens to a sequence up to its first stop (see the module doc)."""

    def __init__(self, eos_token_ids: tuple[int, ...] = (), max_model_len: int | None = None,
                 tokenizer: Any = None) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def append(self, seq: Any, new: list[int], now: float) -> tuple[list[int], str | None]:
        """Append ``new`` to ``seq`` up to its first stop; returns (appended, reason or None)."""
        p = seq.request.params
        eos = () if p.ignore_eos else self.eos_token_ids
        limit = seq.num_prompt_tokens + p.max_tokens
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len)
        strings = bool(p.stop) and self.tokenizer is not None
        for i, tok in enumerate(new):
            seq.token_ids.append(tok)
            seq.token_times.append(now)
            if tok in eos or tok in p.stop_token_ids:
                return new[: i + 1], "stop"
            if len(seq.token_ids) >= limit:
                return new[: i + 1], "length"
            if strings and stop_string_hit(self.tokenizer, seq):
                return new[: i + 1], "stop"
        return new, None
