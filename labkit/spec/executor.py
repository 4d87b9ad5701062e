"""SpecDecodeExecutor: one engine step with speculation, wrapping the engine's ModelExecutor.

Per step (vLLM's "draft, then verify in one target forward"):

1. Every *decoding* sequence (not one still prefilling) asks the proposer for up to γ drafts.
   γ is lowered per sequence so it never drafts past ``max_tokens`` or the context end.
2. ONE target forward runs every scheduled chunk: prefill chunks as usual, and for a
   speculating sequence the chunk ``[last token, d1 .. dγ]`` at positions ``L-1 .. L+γ-1``
   through the paged prefill attention path (the scheduler reserved γ lookahead slots), with
   logits kept for all γ+1 positions.
3. :mod:`labkit.spec.rejection` accepts a prefix of the drafts and adds one target token.
   The executor returns ``{seq_id: [tokens]}``; the engine appends them (stopping at EOS / stop
   ids / max_tokens), sets ``num_computed_tokens = num_tokens - 1`` -- the KV of rejected drafts
   sits past that point and is simply overwritten later -- and truncates the block table,
   which frees blocks that only held rejected drafts.

Sequences that speculate and sequences that prefill share the step; a step's n-gram lookups and
draft forwards run before the target forward. ``pop_spec_records`` hands the engine the trace's
per-step ``spec`` list.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from labkit.model.sampling import sample_token
from labkit.sched.scheduler import SchedulerOutput
from labkit.spec.config import SpeculativeConfig
from labkit.spec.proposers import DraftModelProposer, NgramProposer, ProposalRequest
from labkit.spec.rejection import verify


class SpecDecodeExecutor:
    kind = "model"

    def __init__(self, base: Any, config: SpeculativeConfig, max_model_len: int,
                 running: Callable[[], list[Any]] = list) -> None:
        self.base = base  # labkit.engine.model_runner.ModelExecutor: owns the target + its KV
        self.model = base.model
        self.config = config
        self.gamma = config.num_speculative_tokens
        self.max_model_len = max_model_len
        if config.method == "ngram":
            self.proposer: Any = NgramProposer(self.gamma, config.prompt_lookup_max,
                                               config.prompt_lookup_min)
        else:
            kv = base.kv_cache
            self.proposer = DraftModelProposer(config.draft_model, self.gamma,
                                               kv.k_caches[0].shape[0], base.block_size,
                                               kv.backend)
        self._running = running  # the scheduler's running sequences (to forget finished ones)
        self._records: list[dict[str, Any]] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # CPU seconds spent drafting / in the target forward / verifying (for the benchmark's
        # cost breakdown; process time, so other processes on a shared machine do not count)
        self.cpu_s = {"propose": 0.0, "target": 0.0, "verify": 0.0}

    # ---- engine hooks -------------------------------------------------------------------------
    def apply_block_ops(self, copies, swap_out, swap_in) -> None:
        # the draft's KV is not copied: a changed block id makes it recompute (proposers.py)
        self.base.apply_block_ops(copies, swap_out, swap_in)

    def pop_spec_records(self) -> list[dict[str, Any]]:
        out, self._records = self._records, []
        return out

    def _num_drafts(self, seq: Any) -> int:
        p = seq.request.params
        left = p.max_tokens - seq.num_output_tokens - 1  # the verify step adds one token anyway
        room = self.max_model_len - seq.num_tokens  # last verify position L-1+γ < max_model_len
        return max(0, min(self.gamma, left, room))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for seq, _ in out.preempted:
            self.proposer.free(seq.seq_id)  # its blocks are gone; the draft KV with them
        spec, reqs = [], []
        for sc in out.scheduled:
            if sc.is_prefill:
                self.proposer.free(sc.seq.seq_id)  # new or recomputed: draft state restarts
            elif sc.samples and not sc.children:
                s, p = sc.seq, sc.seq.request.params
                spec.append(sc)
                reqs.append(ProposalRequest(s.seq_id, s.token_ids, self._num_drafts(s),
                                            p.temperature, p.top_k, p.top_p, s.generator,
                                            s.block_table))
        t0 = time.process_time()
        proposals = dict(zip((sc.seq.seq_id for sc in spec), self.proposer.propose(reqs)))
        t1 = time.process_time()

        chunks, rows = [], []
        for sc in out.scheduled:
            s, a = sc.seq, sc.start_pos
            prop = proposals.get(s.seq_id)
            if prop is not None:
                chunks.append((s, a, s.token_ids[a:a + 1] + prop.token_ids))
                rows.append(list(range(len(prop.token_ids) + 1)))
            else:
                chunks.append((s, a, s.token_ids[a:a + sc.num_new_tokens]))
                rows.append([sc.num_new_tokens - 1] if sc.samples else [])
        if not chunks:
            return {}
        logits = self.base.forward_chunks(chunks, rows)
        if logits.numel() == 0:
            return {}
        logits = logits.float()
        if logits.device.type != "cpu":
            logits = logits.cpu()
        t2 = time.process_time()
        results: dict[str, list[int]] = {}
        start = 0
        for sc, r in zip(out.scheduled, rows):
            if not r:
                continue
            block = logits[start:start + len(r)]
            start += len(r)
            s = sc.seq
            prop = proposals.get(s.seq_id)
            if prop is None:  # an ordinary sampling row (prefill end; n > 1 forks share it)
                for t in (s, *sc.children):
                    p = t.request.params
                    results[t.seq_id] = [sample_token(block[0], p.temperature, p.top_k, p.top_p,
                                                      t.generator)]
                continue
            p = s.request.params
            emitted, k = verify(prop.token_ids, prop.probs, block, p.temperature, p.top_k,
                                p.top_p, s.generator)
            results[s.seq_id] = emitted
            self.num_draft_tokens += len(prop.token_ids)
            self.num_accepted_tokens += k
            self._records.append({"request_id": s.request_id, "seq_id": s.seq_id,
                                  "proposed": list(prop.token_ids), "accepted": k})
        self._forget_finished()
        c = self.cpu_s
        c["propose"] += t1 - t0
        c["target"] += t2 - t1
        c["verify"] += time.process_time() - t2
        return results

    def _forget_finished(self) -> None:
        """Drop draft state of sequences that left (finished / aborted) now and then."""
        state = getattr(self.proposer, "_computed", None)
        if state is None or len(state) < 64:
            return
        live = {s.seq_id for s in self._running()}
        for sid in [sid for sid in state if sid not in live]:
            self.proposer.free(sid)


def make_spec_executor(engine: Any, speculative_config: dict[str, Any] | SpeculativeConfig
                       ) -> SpecDecodeExecutor:
    """Called by ``LLMEngine(speculative_config=...)``: validate, load the draft, reserve γ
    lookahead KV slots per decoding sequence, and wrap the engine's model executor."""
    base = engine.executor
    if getattr(base, "kind", "model") != "model" or not hasattr(base, "forward_chunks"):
        raise ValueError("speculative decoding needs the model executor (real tensors)")
    cfg = SpeculativeConfig.from_dict(speculative_config)
    model = base.model
    cfg.resolve(model.config, engine.max_model_len, dtype=model.dtype, device=model.device)
    engine.config.num_lookahead_slots = cfg.num_speculative_tokens  # the scheduler's config
    return SpecDecodeExecutor(base, cfg, engine.max_model_len,
                              running=lambda: engine.scheduler.running)
