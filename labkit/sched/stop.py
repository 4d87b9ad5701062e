"""The one stop checker: when a sequence's new token ends it (vLLM's ``check_stop``).

A sample ends at EOS (unless ``ignore_eos``), at one of its ``stop_token_ids``, at
``max_tokens`` or the context end (``"length"``), or when its text contains a stop string.
Stop strings need the text, so the checker holds the tokenizer; it decodes only for samples
that have stop strings. The detokenizer (``labkit.engine.detokenizer``) later cuts the text at
the stop string; the token that completed it stays in ``token_ids``, as in vLLM.

A speculative step appends several tokens at once. They are checked one by one and the rest
dropped at the first stop, so token ids come out exactly as a one-token-per-step run's would.
"""

from __future__ import annotations

from typing import Any


def stop_string_hit(tokenizer: Any, seq: Any) -> bool:
    """Does ``seq``'s output text so far contain one of its stop strings?"""
    text = tokenizer.decode(seq.output_token_ids)
    return any(s in text for s in seq.request.params.stop)


class StopChecker:
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
