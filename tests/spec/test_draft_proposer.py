"""DraftModelProposer over a shared paged cache equals the draft model run on its own.

The reference is the draft model's plain forward over the whole context (no cache at all). The
proposer is driven like the engine drives it: several sequences at once, contexts growing by
accepted drafts plus a correction, tail blocks freed after rejections and handed to other
sequences, and a sequence moved to fresh blocks (preemption) mid-way.
"""

from __future__ import annotations

import random

import torch

from labkit.model.llama import causal_attention
from labkit.model.sampling import apply_sampling_filters
from labkit.spec.proposers import DraftModelProposer, ProposalRequest


class RefPagedBackend:
    """Gather-then-attend paged attention in plain torch (the test's independent backend)."""

    name = "test-ref"

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping, k_scale=None,
                          v_scale=None, meta=None):
        bs = k_cache.shape[1]
        for i, s in enumerate(slot_mapping.tolist()):
            if s >= 0:
                k_cache[s // bs, s % bs] = key[i]
                v_cache[s // bs, s % bs] = value[i]

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None,
               v_scale=None, meta=None, sliding_window=None):
        qsl = torch.arange(len(context_lens) + 1, dtype=torch.int32)
        return self.prefill(q, k_cache, v_cache, block_tables, qsl, context_lens, scale)

    def prefill(self, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                k_scale=None, v_scale=None, meta=None, sliding_window=None):
        bs = k_cache.shape[1]
        out = torch.empty_like(q)
        for b in range(len(context_lens)):
            lo, hi, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(context_lens[b])
            slots = [int(block_tables[b, p // bs]) * bs + p % bs for p in range(n)]
            k = k_cache.flatten(0, 1)[slots][None]
            v = v_cache.flatten(0, 1)[slots][None]
            out[lo:hi] = causal_attention(q[None, lo:hi], k, v)[0]
        return out


def _reference_drafts(draft, ctx, gamma):
    toks, logits = [], []
    for _ in range(gamma):
        lg = draft(torch.tensor([ctx + toks]))[0, -1].float()
        logits.append(lg)
        toks.append(int(lg.argmax()))
    return toks, logits


class _Pool:
    def __init__(self, n):
        self.free = list(range(n))

    def grow(self, table, num_slots, bs):
        while len(table) * bs < num_slots:
            table.append(self.free.pop())

    def shrink(self, table, num_slots, bs):
        while len(table) * bs > num_slots + bs - 1 and len(table) > 1:
            self.free.append(table.pop())


@torch.inference_mode()
def test_greedy_proposals_follow_rollback_and_preemption(drafts):
    draft = drafts["small"]
    bs, gamma, rng = 4, 3, random.Random(0)
    prop = DraftModelProposer(draft, gamma, num_blocks=64, block_size=bs,
                              attention_backend=RefPagedBackend())
    pool = _Pool(64)
    ctxs = {"a": [3, 1, 4, 1, 5], "b": list(range(20, 31)), "c": [9, 9]}
    tables: dict[str, list[int]] = {k: [] for k in ctxs}
    for step in range(8):
        reqs = []
        for sid, ctx in ctxs.items():
            pool.grow(tables[sid], len(ctx) + gamma - 1, bs)
            reqs.append(ProposalRequest(sid, list(ctx), gamma, block_table=list(tables[sid])))
        props = prop.propose(reqs)
        for r, p in zip(reqs, props):
            want, _ = _reference_drafts(draft, list(r.token_ids), gamma)
            assert p.token_ids == want, (step, r.seq_id)
            assert p.probs is None  # greedy drafts carry no distribution
            k = rng.randint(0, gamma)
            ctxs[r.seq_id] = list(r.token_ids) + want[:k] + [rng.randrange(128)]
            pool.shrink(tables[r.seq_id], len(ctxs[r.seq_id]) - 1, bs)  # rollback frees tails
        if step == 4:  # preempt "b": all its blocks go back, it restarts on other blocks
            pool.free[:0] = tables["b"]
            tables["b"] = []
        if step == 6:
            prop.free("c")  # forgetting a sequence only means recomputing it


@torch.inference_mode()
def test_sampled_proposals_carry_their_distribution(drafts):
    draft = drafts["noisy"]
    bs, gamma = 8, 4
    prop = DraftModelProposer(draft, gamma, num_blocks=16, block_size=bs,
                              attention_backend=RefPagedBackend())
    ctx = [5, 6, 7, 8, 9, 10]
    gen = torch.Generator().manual_seed(0)
    req = ProposalRequest("s", ctx, gamma, temperature=0.8, top_k=20, top_p=0.9,
                          generator=gen, block_table=[3, 7])
    p = prop.propose([req])[0]
    assert len(p.token_ids) == gamma and p.probs.shape == (gamma, 128)
    for j in range(gamma):
        lg = draft(torch.tensor([ctx + p.token_ids[:j]]))[0, -1]
        q = apply_sampling_filters(lg, 0.8, 20, 0.9)
        torch.testing.assert_close(p.probs[j], q, atol=1e-5, rtol=1e-4)
        assert q[p.token_ids[j]] > 0  # drawn from q's support
    # a sequence that asks for fewer drafts, and one that asks for none, in the same batch
    reqs = [ProposalRequest("s", ctx + p.token_ids[:2] + [1], 2, block_table=[3, 7]),
            ProposalRequest("t", [1, 2, 3], 0, block_table=[]),
            ProposalRequest("u", [4, 5, 6, 7, 8, 9, 10, 11, 12], 4, block_table=[0, 1])]
    out = prop.propose(reqs)
    assert out[0].token_ids == _reference_drafts(draft, reqs[0].token_ids, 2)[0]
    assert out[1].token_ids == []
    assert out[2].token_ids == _reference_drafts(draft, reqs[2].token_ids, 4)[0]
