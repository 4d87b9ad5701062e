"""EagleProposer: the EAGLE head (:mod:`labkit.spec.eagle`) drafting inside the engine.

It is a :class:`~labkit.spec.proposers.DraftModelProposer` whose model needs one more input per
token: the target's feature at the previous position. The executor hands over the features of
every chunk the target runs (prefill chunks and verify chunks alike) through :meth:`observe`;
the proposer keeps them per sequence by position. Drafting then feeds, for each position p:

* p < len(context) (verified tokens the head has not seen): the target's feature f_{p-1};
* p >= len(context) (the head's own previous draft): the feature it predicted itself.

The head's KV is therefore valid only up to the verified context (``_computed`` = context
length), and the block-table bookkeeping, γ loop and sampling are the draft model's. A missing
feature (a prefix-cache hit the target never recomputed) is read as zeros: that can only lower
acceptance, never change the output, since the target verifies every token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from labkit.kv.attention import AttentionBackend
from labkit.spec.eagle import EagleDraft
from labkit.spec.proposers import DraftModelProposer, Feed, Proposal, ProposalRequest, draft_loop


class EagleProposer(DraftModelProposer):
    def __init__(self, draft: EagleDraft, num_speculative_tokens: int, num_blocks: int,
                 block_size: int, attention_backend: str | AttentionBackend = "torch") -> None:
        super().__init__(draft, num_speculative_tokens, num_blocks, block_size,
                         attention_backend)
        self._feats: dict[str, torch.Tensor] = {}  # seq -> [capacity, d], row p = f_p

    def observe(self, seq_id: str, start: int, features: torch.Tensor) -> None:
        """The target's features [n, d] for positions start .. start+n-1 of ``seq_id``."""
        end = start + features.shape[0]
        buf = self._feats.get(seq_id)
        if buf is None or buf.shape[0] < end:
            grown = features.new_zeros(max(end, 2 * (0 if buf is None else buf.shape[0]), 64),
                                       features.shape[1])
            if buf is not None:
                grown[:buf.shape[0]] = buf
            buf = self._feats[seq_id] = grown
        buf[start:end] = features

    def free(self, seq_id: str) -> None:
        super().free(seq_id)
        self._feats.pop(seq_id, None)

    def _true_features(self, seq_id: str, start: int, n: int, d: int) -> torch.Tensor:
        """f_{p-1} for p = start .. start+n-1 (zeros where the target gave none)."""
        out = torch.zeros(n, d, device=self.model.device)
        buf = self._feats.get(seq_id)
        lo, hi = max(start - 1, 0), start - 1 + n  # feature rows wanted
        if buf is not None:
            have = min(hi, buf.shape[0])
            if have > lo:
                out[lo - (start - 1):have - (start - 1)] = buf[lo:have]
        return out

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        active = [r for r in requests if r.num_tokens > 0]
        self._check_tables(active)
        feeds = [(s, list(r.token_ids[s:])) for r in active for s in [self._valid_prefix(r)]]
        d = self.model.config.hidden_size
        prev: dict[int, torch.Tensor] = {}  # request index -> its last predicted feature

        def step(rows: list[int], fed: list[Feed]) -> torch.Tensor:
            feats = [prev[i][None] if start >= len(active[i].token_ids)
                     else self._true_features(active[i].seq_id, start, len(toks), d)
                     for i, (start, toks) in zip(rows, fed)]
            chunks = [(active[i].block_table, start, toks) for i, (start, toks) in zip(rows, fed)]
            logits = self.runner.forward(chunks, [[len(toks) - 1] for _, toks in fed],
                                         features=torch.cat(feats)[None])
            for row, i in enumerate(rows):
                prev[i] = self.runner.model.last_hidden[row]  # the module or its LeanEagle
            return logits

        props = iter(draft_loop(step, active, feeds))
        for r in active:
            # only positions fed with the target's own features stay valid
            self._computed[r.seq_id] = len(r.token_ids)
            self._blocks[r.seq_id] = list(r.block_table)
        return [next(props) if r.num_tokens > 0 else Proposal([], None) for r in requests]
