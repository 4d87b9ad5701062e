"""Draft proposers: where the γ guessed tokens come from.

* :class:`NgramProposer` (prompt lookup decoding): if the last n tokens already occurred earlier
  in the prompt or output, guess that what followed then follows again. Free to compute and very
  good on code and on summarisation/editing, where the output copies the input.
* :class:`DraftModelProposer`: a small model with the target's tokenizer runs γ cheap decode
  steps. It keeps its own KV cache in its own per-layer tensors but indexes them with the
  TARGET's block tables: same physical block ids, same slots. So the scheduler's block
  accounting (allocation, lookahead slots, rollback, freeing, preemption) covers the draft for
  free, with no second allocator to keep in sync. The cost is that the draft's tensors are sized
  for the target's whole block pool (small: the draft is several times smaller).

The draft remembers how many positions of each sequence it has written and into which blocks; if
the target's block table changed under it (preemption, copy-on-write, a prefix-cache hit on blocks
the draft never filled) it recomputes from the first changed block. Stale draft KV could only lower
acceptance, never change the output, because every token is verified by the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from labkit.kv.metadata import build_attention_metadata
from labkit.model.sampling import apply_sampling_filters


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


class _DraftPagedKV:
    """The draft's KV tensors, addressed through the target's block tables (see module doc)."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 backend: object) -> None:
        c = model.config
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        kw = {"dtype": model.dtype, "device": model.device}
        self.k = [torch.zeros(shape, **kw) for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros(shape, **kw) for _ in range(c.num_hidden_layers)]
        self.scale = c.head_dim ** -0.5
        self.backend = backend
        self._pass_meta = bool(getattr(backend, "accepts_metadata", False))
        self.meta = None  # per-forward AttentionMetadata, set by DraftModelProposer

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        be, m = self.backend, self.meta
        kw = {"meta": m} if self._pass_meta else {}
        be.reshape_and_cache(k[0], v[0], kc, vc, m.slot_mapping, **kw)
        if m.decode_only:  # one token per sequence: the cheaper decode kernel
            out = be.decode(q[0], kc, vc, m.block_tables, m.context_lens, self.scale, **kw)
        else:
            out = be.prefill(q[0], kc, vc, m.block_tables, m.query_start_loc, m.context_lens,
                             self.scale, **kw)
        return out[None]


class DraftModelProposer:
    """γ autoregressive steps of a small draft model, batched over all speculating sequences."""

    def __init__(self, model: torch.nn.Module, num_speculative_tokens: int, num_blocks: int,
                 block_size: int, attention_backend: str | object = "torch") -> None:
        if isinstance(attention_backend, str):
            from labkit.kv.attention import get_attention_backend

            attention_backend = get_attention_backend(attention_backend)
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.kv = _DraftPagedKV(model, num_blocks, block_size, attention_backend)
        self._computed: dict[str, int] = {}  # positions 0..n-1 hold valid draft KV
        self._blocks: dict[str, list[int]] = {}  # the block table those positions were written to

    def free(self, seq_id: str) -> None:
        """Forget a finished/aborted sequence (its blocks go back to the target's pool)."""
        self._computed.pop(seq_id, None)
        self._blocks.pop(seq_id, None)

    def _valid_prefix(self, r: ProposalRequest) -> int:
        old = self._blocks.get(r.seq_id, [])
        same = 0
        while same < min(len(old), len(r.block_table)) and old[same] == r.block_table[same]:
            same += 1
        return min(self._computed.get(r.seq_id, 0), same * self.block_size, len(r.token_ids) - 1)

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        out = [Proposal([], None) for _ in requests]
        active = [i for i, r in enumerate(requests) if r.num_tokens > 0]
        if not active:
            return out
        bs, dev = self.block_size, self.model.device
        for i in active:
            r = requests[i]
            need = len(r.token_ids) + r.num_tokens - 1
            if len(r.block_table) * bs < need:
                raise ValueError(f"sequence {r.seq_id}: block table covers "
                                 f"{len(r.block_table) * bs} positions, drafting needs {need}")
        width = max(len(requests[i].block_table) for i in active)
        tables = {i: list(requests[i].block_table) + [0] * (width - len(requests[i].block_table))
                  for i in active}
        # first step: every token the draft has not seen yet (the whole prompt the first time,
        # one or two tokens afterwards); later steps: the previous draft token
        feeds = {}
        for i in active:
            start = self._valid_prefix(requests[i])
            feeds[i] = (start, list(requests[i].token_ids[start:]))
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        for step in range(max(requests[i].num_tokens for i in active)):
            # the batch shrinks only when a sequence drafts fewer tokens
            rows = [i for i in active if requests[i].num_tokens > step]
            ids, pos, slots, qlens, ctx = [], [], [], [], []
            for i in rows:
                start, toks = feeds[i]
                table = tables[i]
                ids += toks
                pos += range(start, start + len(toks))
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + len(toks))]
                qlens.append(len(toks))
                ctx.append(start + len(toks))
            kv = self.kv
            kv.meta = build_attention_metadata(slots, [tables[i] for i in rows], qlens, ctx, dev)
            last = torch.tensor(qlens, device=dev).cumsum(0) - 1
            logits = self.model(torch.tensor([ids], device=dev), torch.tensor([pos], device=dev),
                                kv, logits_indices=last).float().cpu()
            greedy = logits.argmax(-1).tolist()
            for row, i in enumerate(rows):
                r = requests[i]
                if r.temperature == 0.0:
                    tok = greedy[row]
                else:
                    q = apply_sampling_filters(logits[row], r.temperature, r.top_k, r.top_p)
                    tok = int(torch.multinomial(q, 1, generator=r.generator))
                    probs[i].append(q)
                out[i].token_ids.append(tok)
                feeds[i] = (ctx[row], [tok])
        for i in active:
            r = requests[i]
            # positions up to len + γ - 2 now hold draft KV (the last draft token is never fed)
            self._computed[r.seq_id] = len(r.token_ids) + r.num_tokens - 1
            self._blocks[r.seq_id] = list(r.block_table)
            if probs[i]:
                out[i].probs = torch.stack(probs[i])
        return out
