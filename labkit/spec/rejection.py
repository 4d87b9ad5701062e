"""Verification of draft tokens: greedy acceptance and exact speculative (rejection) sampling.

Why this is exact (Leviathan et al. 2023; Chen et al. 2023): the draft proposes ``x ~ q``. Accept
it with probability ``min(1, p(x) / q(x))``; otherwise draw from the residual
``normalize(max(0, p - q))``. The probability of emitting token ``y`` is then

    q(y) min(1, p(y)/q(y))  +  (1 - sum_x min(p(x), q(x))) * max(0, p(y) - q(y)) / Z
  = min(p(y), q(y))       +  max(0, p(y) - q(y))          = p(y)

because ``Z = sum_x max(0, p(x) - q(x)) = 1 - sum_x min(p(x), q(x))``. So every emitted token
follows the target's distribution whatever the draft does; a bad draft only costs speed. When all
γ drafts are accepted, one extra ("bonus") token is drawn from the target's distribution at the
position after the last draft, which the verify forward computed anyway.

``p`` and ``q`` must come from the SAME filters (temperature, top-k, top-p) via
``labkit.model.sampling.apply_sampling_filters``: the theorem is about the distribution the target
would sample from, and that is the filtered one. An n-gram draft is deterministic, so its ``q`` is a
point mass on the proposed token (``draft_probs=None`` here): accept with probability ``p(x)``,
and on rejection sample ``p`` with ``x`` removed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SpecVerifyError(ValueError):
    """Shapes or values handed to the verifier do not fit together."""


def _check(draft_token_ids: Sequence[int], target: torch.Tensor,
           draft_probs: torch.Tensor | None) -> int:
    gamma = len(draft_token_ids)
    if target.dim() != 2 or target.shape[0] != gamma + 1:
        raise SpecVerifyError(
            f"target scores must be [γ+1, V] = [{gamma + 1}, V] for {gamma} draft tokens, "
            f"got {tuple(target.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (gamma, target.shape[1]):
        raise SpecVerifyError(
            f"draft_probs must be [γ, V] = [{gamma}, {target.shape[1]}], "
            f"got {tuple(draft_probs.shape)}")
    return gamma


def verify_greedy(draft_token_ids: Sequence[int],
                  target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification: accept drafts while they equal the target's argmax.

    ``target_logits`` is ``[γ+1, V]``: row ``j`` scores the token after draft ``j`` (row 0 the
    token after the sequence's last real token). Returns ``(emitted, num_accepted)`` where
    ``emitted`` is the accepted drafts plus one target token (the correction at the first
    mismatch, or the bonus token when all γ match) — so it always has ``num_accepted + 1`` tokens,
    exactly what plain greedy decoding would have produced.
    """
    gamma = _check(draft_token_ids, target_logits, None)
    argmax = target_logits.argmax(dim=-1).tolist()
    k = 0
    while k < gamma and int(draft_token_ids[k]) == argmax[k]:
        k += 1
    return [int(t) for t in draft_token_ids[:k]] + [argmax[k]], k


def rejection_sample(draft_token_ids: Sequence[int], draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Exact speculative sampling of one sequence's γ drafts.

    ``target_probs`` ``[γ+1, V]`` and ``draft_probs`` ``[γ, V]`` (``None`` = point-mass n-gram
    drafts) are filtered probabilities. Random draws come from ``generator`` only (γ uniforms, then
    one multinomial), so a seeded generator makes the result deterministic.
    Returns ``(emitted, num_accepted)``; ``len(emitted) == num_accepted + 1``.
    """
    gamma = _check(draft_token_ids, target_probs, draft_probs)
    p = target_probs.float()
    drafts = torch.tensor([int(t) for t in draft_token_ids], dtype=torch.long)
    k = gamma
    if gamma:
        rows = torch.arange(gamma)
        p_x = p[rows, drafts]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.float()[rows, drafts]
        u = torch.rand(gamma, generator=generator)
        # accept iff u < p/q, written as u*q < p to avoid dividing (a token drawn from q has
        # q(x) > 0, so the two are the same test)
        accepted = (u * q_x < p_x).tolist()
        k = accepted.index(False) if False in accepted else gamma
    if k == gamma:  # all accepted: bonus token from p at the position after the last draft
        dist = p[gamma]
    else:
        if draft_probs is None:
            residual = p[k].clone()
            residual[drafts[k]] = 0.0
        else:
            residual = (p[k] - draft_probs[k].float()).clamp_min(0.0)
        # residual sums to 0 only when p == q, where rejection has probability 0; guard for
        # round-off so multinomial never sees an all-zero row
        dist = residual if float(residual.sum()) > 0.0 else p[k]
    last = int(torch.multinomial(dist, 1, generator=generator))
    return drafts[:k].tolist() + [last], k


def verify(draft_token_ids: Sequence[int], draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Verify one sequence's drafts against raw target logits ``[γ+1, V]``.

    Temperature 0 is greedy (``draft_probs`` ignored); otherwise the target's logits go through
    the same ``apply_sampling_filters`` the draft's did and then :func:`rejection_sample`.
    """
    if temperature == 0.0:
        return verify_greedy(draft_token_ids, target_logits)
    from labkit.model.sampling import apply_sampling_filters

    p = apply_sampling_filters(target_logits, temperature, top_k, top_p)
    return rejection_sample(draft_token_ids, draft_probs, p, generator)
