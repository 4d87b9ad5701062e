"""Incremental detokenization and stop strings (vLLM's detokenizer / stop checker).

Text is re-decoded from all output ids every step (not token by token), because a byte-level
BPE token can be half a UTF-8 character: only the full decode is right. The delta a stream sees
is what the text grew by. A stop string ends the sample and is cut from the text, like vLLM; the
token that completed it stays in ``token_ids``.

Speculative decoding appends several tokens in one step. The engine then checks stop strings
after each of them (``stop_string_hit``) and drops the rest, so token ids come out exactly as a
one-token-per-step run's would.
"""

from __future__ import annotations

from typing import Any


def stop_string_hit(tokenizer: Any, seq: Any) -> bool:
    """Does ``seq``'s output text so far contain one of its stop strings?"""
    text = tokenizer.decode(seq.output_token_ids)
    return any(s in text for s in seq.request.params.stop)


def update_text(tokenizer: Any, seq: Any) -> tuple[str, bool]:
    """Decode ``seq``'s output and cut it at the first stop string; stores it in
    ``seq.output_text``. Returns (what the text grew by, whether a stop string was hit)."""
    text = tokenizer.decode(seq.output_token_ids)
    hit = False
    for s in seq.request.params.stop:
        cut = text.find(s)
        if cut >= 0:
            text, hit = text[:cut], True
    old = seq.output_text
    seq.output_text = text
    return (text[len(old):] if text.startswith(old) else text), hit
