"""Incremental detokenization (vLLM's detokenizer): :func:`update_text`, called by
``LLMEngine._step_output`` every step.

Text is re-decoded from all output ids every step, not token by token, because a byte-level BPE
token can be half a UTF-8 character: only the full decode is right. The delta a stream sees is
what the text grew by, minus a tail that could still turn into a stop string. The scheduler's
stop checker finds stop strings; the text is cut at them here, and the token that completed one
stays in ``token_ids`` (as vLLM).
"""

from __future__ import annotations

from typing import Any

from labkit.sched.stop import stop_string_hit

__all__ = ["stop_string_hit", "update_text"]


def update_text(tokenizer: Any, seq: Any, finished: bool = False) -> tuple[str, bool]:
    """Decode ``seq``'s output and cut it at the first stop string; stores it in
    ``seq.output_text``. Returns (the text a stream may show now, whether a stop string was hit).

    While a sequence runs, the last ``len(longest stop string) - 1`` characters are held back
    (vLLM does the same): they could be the start of a stop string that the next token
    completes, and a stream must never show text that is cut later. Everything held back comes
    out when the sequence finishes (``finished``, or a stop string hit), so the deltas of a
    stream always add up to ``output_text``."""
    text = tokenizer.decode(seq.output_token_ids)
    hit = False
    for s in seq.request.params.stop:
        cut = text.find(s)
        if cut >= 0:
            text, hit = text[:cut], True
    seq.output_text = text
    hold = 0 if finished or hit else max((len(s) for s in seq.request.params.stop), default=1) - 1
    visible = text[:max(0, len(text) - hold)]
    shown, seq.streamed_text = seq.streamed_text, visible
    if not visible.startswith(shown):  # a re-decode changed shown characters: resend it all
        return visible, hit
    return visible[len(shown):], hit
