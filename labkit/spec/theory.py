"""The arithmetic of speculative decoding, and a standalone reference implementation.

With a per-token acceptance probability α (assumed independent across positions), a step that
drafts γ tokens emits 1 + (number of accepted drafts) tokens, whose expectation is

    E[tokens / step] = 1 + α + α² + ... + α^γ = (1 - α^(γ+1)) / (1 - α)

(Leviathan et al. 2023, eq. 1). If one draft step costs c target steps, a speculative step costs
γc + 1 target steps, so the speed-up over plain decoding is E[tokens / step] / (γc + 1). On a GPU
the verify forward of γ+1 tokens costs about one decode step (memory-bound); on a CPU, and in a
Python engine, fixed per-step overheads also count, which is where measured and predicted differ.

:func:`speculative_generate` runs one sequence with contiguous caches and no engine at all, so
tests and notebooks can compare the engine against something small enough to read in one sitting.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from labkit.model.generate import ContiguousKVCache
from labkit.model.sampling import validate_sampling
from labkit.spec.proposers import NgramProposer, ProposalRequest, draft_loop
from labkit.spec.rejection import verify


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """(1 - α^(γ+1)) / (1 - α): mean tokens emitted by one verify step (γ+1 when α = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, draft_cost: float) -> float:
    """Speed-up over plain decoding when a draft step costs ``draft_cost`` (c) target steps."""
    if draft_cost < 0:
        raise ValueError(f"draft cost c must be >= 0, got {draft_cost}")
    return expected_tokens_per_step(alpha, gamma) / (gamma * draft_cost + 1.0)


def cpu_speedup(alpha: float, gamma: int, draft_cost: float, verify_cost: float,
                overhead: float = 0.0) -> float:
    """The speed-up with the costs a CPU engine pays, in target decode forwards: each draft
    token ``draft_cost`` (c), the verify forward of γ+1 tokens ``verify_cost`` (1 on a GPU,
    more on a CPU), and a fixed per-step ``overhead`` O that plain decoding pays too:
    E(α, γ) · (1 + O) / (γc + verify + O)."""
    if min(draft_cost, verify_cost, overhead) < 0:
        raise ValueError("costs must be >= 0")
    return expected_tokens_per_step(alpha, gamma) * (1.0 + overhead) / (
        gamma * draft_cost + verify_cost + overhead)


def alpha_needed(speedup: float, gamma: int, draft_cost: float, verify_cost: float,
                 overhead: float = 0.0) -> float | None:
    """The per-token acceptance α at which :func:`cpu_speedup` reaches ``speedup`` (bisection;
    it rises with α), or None if even α = 1 falls short: how good a draft of this cost must be."""
    def f(a: float) -> float:
        return cpu_speedup(a, gamma, draft_cost, verify_cost, overhead)

    if f(1.0) < speedup:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < speedup else (lo, mid)
    return hi


@dataclass
class AcceptanceStats:
    """Acceptance measured from (proposed, accepted) records, one per sequence per step."""

    num_steps: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    reached: list[int] = field(default_factory=list)  # steps that got to draft position i
    accepted_at: list[int] = field(default_factory=list)  # ... and accepted it

    @property
    def alpha(self) -> float:
        """Maximum-likelihood α of the geometric model: accepted / (accepted + rejections)."""
        tried = sum(self.reached)
        return self.num_accepted / tried if tried else 0.0

    @property
    def alpha_per_position(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    @property
    def mean_accepted(self) -> float:
        return self.num_accepted / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (vLLM's 'draft acceptance rate')."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0


def acceptance_stats(records: Iterable[tuple[int, int]]) -> AcceptanceStats:
    """Fold ``(num_proposed, num_accepted)`` records into :class:`AcceptanceStats`.

    Position i (0-based) is *reached* when drafts 0..i-1 were accepted; it is then accepted or
    rejected. Steps that proposed nothing are ignored (there was nothing to accept).
    """
    s = AcceptanceStats()
    for proposed, accepted in records:
        if proposed <= 0:
            continue
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted {accepted} of {proposed} proposed drafts")
        s.num_steps += 1
        s.num_proposed += proposed
        s.num_accepted += accepted
        while len(s.reached) < proposed:
            s.reached.append(0)
            s.accepted_at.append(0)
        for i in range(min(accepted + 1, proposed)):
            s.reached[i] += 1
            s.accepted_at[i] += i < accepted
    return s


def trace_acceptance(trace: dict) -> AcceptanceStats:
    """Acceptance statistics from an engine trace dict (its per-step ``spec`` records)."""
    return acceptance_stats((len(r["proposed"]), r["accepted"])
                            for step in trace["steps"] for r in step.get("spec", []))


class _ContiguousDraft:
    """The reference's draft: a model with its own contiguous cache, fed lazily (see proposers),
    through the same :func:`~labkit.spec.proposers.draft_loop` as the engine's proposer."""

    def __init__(self, model: torch.nn.Module, max_len: int) -> None:
        self.model, self.cache, self.computed = model, ContiguousKVCache(model, 1, max_len), 0

    def propose(self, ctx: list[int], gamma: int, temperature: float, top_k: int, top_p: float,
                gen: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        dev = self.model.device
        start = min(self.computed, len(ctx) - 1)

        def step(rows: list[int], fed: list[tuple[int, list[int]]]) -> torch.Tensor:
            pos, toks = fed[0]
            positions = torch.arange(pos, pos + len(toks), device=dev)[None]
            return self.model(torch.tensor([toks], device=dev), positions, self.cache)[:, -1]

        req = ProposalRequest("ref", ctx, gamma, temperature, top_k, top_p, gen)
        prop = draft_loop(step, [req], [(start, ctx[start:])])[0]
        self.computed = len(ctx) + gamma - 1  # the last draft token is proposed, not fed
        return prop.token_ids, prop.probs


@torch.inference_mode()
def speculative_generate(target: torch.nn.Module, draft: torch.nn.Module | NgramProposer,
                         prompt_ids: Sequence[int], max_new_tokens: int, gamma: int = 4,
                         temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                         seed: int | None = None, stop_token_ids: Sequence[int] = (),
                         ignore_eos: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """Speculative decoding of one prompt; returns ``(new_token_ids, [(proposed, accepted)])``.

    Greedy output equals ``labkit.model.generate.generate`` token for token; sampled output
    follows the same distribution (not the same tokens: the random stream is used differently).
    The target verifies all drafts in one forward of γ+1 tokens over its contiguous cache; its
    rejected positions are simply overwritten later (a contiguous cache's rollback is free).
    """
    if gamma < 1:
        raise ValueError(f"gamma (num_speculative_tokens) must be >= 1, got {gamma}")
    validate_sampling(temperature, top_k, top_p)
    prompt = list(prompt_ids)
    if not prompt or max_new_tokens < 1:
        raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
    total = min(len(prompt) + max_new_tokens, target.config.max_position_embeddings)
    stops = set(stop_token_ids) | (set() if ignore_eos else set(target.config.eos_token_ids))
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    cache = ContiguousKVCache(target, 1, total + gamma)
    drafter = draft if isinstance(draft, NgramProposer) else _ContiguousDraft(draft, total + gamma)
    dev = target.device

    # prefill: the first new token is plain sampling from the target
    logits = target(torch.tensor([prompt], device=dev), None, cache)[0, -1].float().cpu()
    first = int(verify([], None, logits[None], temperature, top_k, top_p, gen)[0][0])
    ctx, out, records = prompt + [first], [first], []
    done = first in stops or len(out) >= max_new_tokens or len(ctx) >= total
    while not done:
        g = min(gamma, total - len(ctx) - 1)  # never draft past the last position we may emit
        if g == 0:
            drafts, q = [], None
        elif isinstance(drafter, NgramProposer):
            drafts, q = drafter.lookup(ctx, g), None
        else:
            drafts, q = drafter.propose(ctx, g, temperature, top_k, top_p, gen)
        feed = [ctx[-1]] + drafts
        pos = torch.arange(len(ctx) - 1, len(ctx) - 1 + len(feed), device=dev)[None]
        logits = target(torch.tensor([feed], device=dev), pos, cache)[0].float().cpu()
        emitted, k = verify(drafts, q, logits, temperature, top_k, top_p, gen)
        records.append((len(drafts), k))
        for tok in emitted:
            ctx.append(tok)
            out.append(tok)
            done = tok in stops or len(out) >= max_new_tokens or len(ctx) >= total
            if done:
                break
    return out, records
