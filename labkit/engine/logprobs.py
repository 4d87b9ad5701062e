"""Log-probabilities from the logits the runner already has (vLLM's ``logprobs`` and
``prompt_logprobs``).

Why in the runner: the sampled token's logprob must come from the very row it was sampled
from, after the same temperature / top-k / top-p (:func:`labkit.model.sampling.processed_logprobs`),
and prompt logprobs need logits for every prompt position, which only the forward has. So the
runner computes them, only for the sequences that asked, and hands them up in
``ModelRunnerOutput``; the engine just carries them to the outputs. A request without logprobs
costs one attribute check per scheduled sequence: no extra logits rows, no softmax, no top-k.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.engine.outputs import Logprob
from labkit.sched.scheduler import SchedulerOutput


def token_entry(lp: torch.Tensor, token_id: int, k: int) -> dict[int, Logprob]:
    """``{token_id: Logprob}`` for one position: the chosen token first, then the top ``k``
    (so k or k + 1 entries). Ranks count the tokens at least as likely (vLLM's rule)."""
    chosen = lp[token_id]
    entry = {token_id: Logprob(float(chosen), int((lp >= chosen).sum()))}
    if k:
        vals, idx = torch.topk(lp, k)
        for r, (v, i) in enumerate(zip(vals.tolist(), idx.tolist()), 1):
            entry.setdefault(i, Logprob(v, r))
    return entry


def prompt_rows(out: SchedulerOutput) -> list[list[int]]:
    """Per scheduled chunk, the offsets whose logits score a prompt token not yet scored.

    The row at position p predicts token p + 1, so a request with ``prompt_logprobs`` needs
    positions ``len(scored) - 1 .. prompt_len - 2`` (``scored`` starts as ``[None]``: the first
    prompt token has no prefix). A recompute after preemption finds them scored: no rows."""
    rows: list[list[int]] = []
    for sc in out.scheduled:
        req = sc.seq.request
        scored = getattr(req, "prompt_logprobs", None)
        if scored is None:
            rows.append([])
            continue
        a = sc.start_pos
        first, end = max(a, len(scored) - 1), min(a + sc.num_new_tokens, req.prompt_len - 1)
        rows.append([p - a for p in range(first, end)])
    return rows


def split_prompt_rows(logits: torch.Tensor, extra: list[list[int]], rows: list[list[int]],
                      out: SchedulerOutput) -> tuple[torch.Tensor, dict[str, list]]:
    """Split a forward's logits (each chunk's ``extra`` rows, then its sampling ``rows``) into
    the sampling rows and each request's prompt-logprob entries (raw ``log_softmax``: the
    model's likelihood of the prompt, whatever the request's temperature, as vLLM)."""
    sample_idx: list[int] = []
    prompt: dict[str, list] = {}
    i = 0
    for sc, e, r in zip(out.scheduled, extra, rows):
        if e:
            req = sc.seq.request
            first = sc.start_pos + e[0] + 1  # the first prompt token these rows score
            lp = torch.log_softmax(logits[i:i + len(e)].float(), dim=-1)
            toks = req.prompt_token_ids[first:first + len(e)]
            k = req.params.prompt_logprobs
            prompt[req.request_id] = [token_entry(lp[j], t, k) for j, t in enumerate(toks)]
        i += len(e)
        sample_idx.extend(range(i, i + len(r)))
        i += len(r)
    return logits[sample_idx], prompt


def decode_tokens(entries: list[Any], tokenizer: Any) -> None:
    """Fill ``decoded_token`` in place (each token decoded alone, as vLLM shows them)."""
    if tokenizer is None:
        return
    for entry in entries:
        for tid, lp in (entry or {}).items():
            if lp.decoded_token is None:
                lp.decoded_token = tokenizer.decode([tid])
