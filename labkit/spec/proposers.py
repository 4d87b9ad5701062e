"""Draft proposers: where the γ guessed tokens come from.

* :class:`NgramProposer` (prompt lookup decoding): if the last n tokens already occurred earlier
  in the prompt or output, guess that what followed then follows again. Free to compute and very
  good on code and on summarisation/editing, where the output copies the input.
* :class:`DraftModelProposer`: a small model with the target's tokenizer runs γ cheap decode
  steps through its own :class:`~labkit.engine.model_runner.ModelRunner` and ``PagedKVCache``
  -- the engine's own packed-forward code path, not a copy. Its KV tensors are its own, but it
  addresses them with the TARGET's block tables (same physical block ids, same slots), so the
  scheduler's block accounting (allocation, lookahead slots, rollback, freeing, preemption)
  covers the draft for free, with no second allocator to keep in sync. The cost is that the
  draft's pool is as many blocks as the target's (small: the draft is several times smaller).

:func:`draft_loop` is the one autoregressive draft loop: the engine's proposer and the
engine-free reference (:mod:`labkit.spec.theory`) differ only in how one step runs the model.

The draft remembers how many positions of each sequence it has written and into which blocks; if
the target's block table changed under it (preemption, copy-on-write, a prefix-cache hit on blocks
the draft never filled) it recomputes from the first changed block. Stale draft KV could only lower
acceptance, never change the output, because every token is verified by the target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from labkit.engine.model_runner import ModelRunner
from labkit.kv.attention import AttentionBackend, get_attention_backend
from labkit.model.sampling import apply_sampling_filters
from labkit.spec.lean_draft import lean_draft

Feed = tuple[int, list[int]]  # (first position, tokens the draft has not seen yet)


@dataclass
class ProposalRequest:
    """One sequence asking for drafts. ``token_ids`` is the verified context (prompt + output)."""

    seq_id: str
    token_ids: Sequence[int]
    num_tokens: int  # γ for this sequence (the engine lowers it near max_tokens / context end)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    # physical blocks covering positions 0 .. len(token_ids) + num_tokens - 2 (draft proposer)
    block_table: Sequence[int] = field(default_factory=list)


@dataclass
class Proposal:
    """Drafted token ids and the filtered draft distribution q they were drawn from.

    ``probs`` is ``[len(token_ids), V]``, or ``None`` for deterministic (point-mass) drafts.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None


class NgramProposer:
    """Prompt lookup: match the last n tokens (n = max .. min) earlier in the context.

    Among the earlier occurrences of the longest matching suffix, take the most recent one that
    still has γ tokens after it (recent context predicts best); if none has, the earliest one
    (which has the longest continuation). No match: no drafts, a plain decode step.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int = 4,
                 prompt_lookup_min: int = 1) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min

    def lookup(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """The continuation of the best earlier match of the context's suffix (may be short)."""
        ctx = np.asarray(token_ids, dtype=np.int64)
        L = len(ctx)
        if num_tokens < 1:
            return []
        for n in range(min(self.prompt_lookup_max, L - 1), self.prompt_lookup_min - 1, -1):
            # windows start at i = 0 .. L-n-1, so a match always ends before the suffix itself
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
            hits = np.flatnonzero((windows == ctx[L - n:]).all(axis=1))
            if len(hits) == 0:
                continue
            full = hits[hits + n + num_tokens <= L]
            start = int(full[-1] if len(full) else hits[0]) + n
            return ctx[start:start + num_tokens].tolist()
        return []

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        return [Proposal(self.lookup(r.token_ids, r.num_tokens), None) for r in requests]

    def free(self, seq_id: str) -> None:
        """Stateless: nothing to release."""

    def tracked(self) -> list[str]:
        return []


def _pick(logits: torch.Tensor, r: ProposalRequest) -> tuple[int, torch.Tensor | None]:
    """Greedy: the argmax, no distribution. Sampled: a draw from the filtered q, and q itself
    (rejection sampling needs the exact distribution the draft drew from)."""
    if r.temperature == 0.0:
        return int(logits.argmax()), None
    q = apply_sampling_filters(logits, r.temperature, r.top_k, r.top_p)
    return int(torch.multinomial(q, 1, generator=r.generator)), q


def draft_loop(step: Callable[[list[int], list[Feed]], torch.Tensor],
               requests: Sequence[ProposalRequest], feeds: list[Feed]) -> list[Proposal]:
    """γ autoregressive draft steps for a batch. ``feeds[i]`` is what request i's draft has not
    seen (the first step: the new context; later: the previous draft token). ``step(rows,
    feeds)`` runs the draft on those rows and returns their next-token logits ``[len(rows), V]``.
    The batch shrinks only when a request asks for fewer drafts."""
    out = [Proposal([], None) for _ in requests]
    probs: list[list[torch.Tensor]] = [[] for _ in requests]
    feeds = list(feeds)
    for k in range(max((r.num_tokens for r in requests), default=0)):
        rows = [i for i, r in enumerate(requests) if r.num_tokens > k]
        logits = step(rows, [feeds[i] for i in rows]).float().cpu()
        for row, i in enumerate(rows):
            tok, q = _pick(logits[row], requests[i])
            out[i].token_ids.append(tok)
            if q is not None:
                probs[i].append(q)
            start, toks = feeds[i]
            feeds[i] = (start + len(toks), [tok])
    for o, p in zip(out, probs):
        if p:
            o.probs = torch.stack(p)
    return out


class DraftModelProposer:
    """γ autoregressive steps of a small draft model, batched over all speculating sequences."""

    def __init__(self, model: torch.nn.Module, num_speculative_tokens: int, num_blocks: int,
                 block_size: int, attention_backend: str | AttentionBackend = "torch") -> None:
        if isinstance(attention_backend, str):
            attention_backend = get_attention_backend(attention_backend)
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        # the fused forward where it covers the model (lean_draft.py: same logits, fewer ops)
        self.runner = ModelRunner.for_model(lean_draft(model) or model, block_size, num_blocks,
                                            0, attention_backend)
        self._computed: dict[str, int] = {}  # positions 0..n-1 hold valid draft KV
        self._blocks: dict[str, list[int]] = {}  # the block table those positions were written to

    def free(self, seq_id: str) -> None:
        """Forget a finished/aborted sequence (its blocks go back to the target's pool)."""
        self._computed.pop(seq_id, None)
        self._blocks.pop(seq_id, None)

    def tracked(self) -> list[str]:
        """Sequences whose draft KV state is kept."""
        return list(self._computed)

    def _valid_prefix(self, r: ProposalRequest) -> int:
        old = self._blocks.get(r.seq_id, [])
        same = 0
        while same < min(len(old), len(r.block_table)) and old[same] == r.block_table[same]:
            same += 1
        return min(self._computed.get(r.seq_id, 0), same * self.block_size, len(r.token_ids) - 1)

    def _check_tables(self, active: Sequence[ProposalRequest]) -> None:
        for r in active:
            need = len(r.token_ids) + r.num_tokens - 1
            if len(r.block_table) * self.block_size < need:
                raise ValueError(f"sequence {r.seq_id}: block table covers "
                                 f"{len(r.block_table) * self.block_size} positions, drafting "
                                 f"needs {need}")

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        active = [r for r in requests if r.num_tokens > 0]
        self._check_tables(active)
        # first step: every token the draft has not seen yet (the whole prompt the first time,
        # one or two tokens afterwards); later steps: the previous draft token
        feeds = [(s, list(r.token_ids[s:])) for r in active for s in [self._valid_prefix(r)]]

        def step(rows: list[int], fed: list[Feed]) -> torch.Tensor:
            chunks = [(active[i].block_table, start, toks) for i, (start, toks) in zip(rows, fed)]
            return self.runner.forward(chunks, [[len(toks) - 1] for _, toks in fed])

        props = iter(draft_loop(step, active, feeds))
        for r in active:
            # positions up to len + γ - 2 now hold draft KV (the last draft token is never fed)
            self._computed[r.seq_id] = len(r.token_ids) + r.num_tokens - 1
            self._blocks[r.seq_id] = list(r.block_table)
        return [next(props) if r.num_tokens > 0 else Proposal([], None) for r in requests]
