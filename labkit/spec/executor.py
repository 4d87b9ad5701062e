"""SpecDecodeExecutor: one engine step with speculation, around the engine's ModelRunner.

Per step (vLLM's "draft, then verify in one target forward"):

1. Every *decoding* sequence (not one still prefilling) asks the proposer for up to γ drafts.
   γ is lowered per sequence so it never drafts past ``max_tokens`` or the context end.
2. ONE target forward runs every scheduled chunk: prefill chunks as usual, and for a
   speculating sequence the chunk ``[last token, d1 .. dγ]`` at positions ``L-1 .. L+γ-1``
   through the paged prefill attention path (the scheduler reserved γ lookahead slots), with
   logits kept for all γ+1 positions.
3. :mod:`labkit.spec.rejection` accepts a prefix of the drafts and adds one target token.
   The executor returns ``{seq_id: [tokens]}``; the scheduler appends them (stopping at EOS /
   stop ids / max_tokens), sets ``num_computed_tokens = num_tokens - 1`` -- the KV of rejected
   drafts sits past that point and is simply overwritten later -- and truncates the block
   table, which frees blocks that only held rejected drafts.

Sequences that speculate and sequences that prefill share the step; a step's n-gram lookups and
draft forwards run before the target forward. The step's ``spec`` records (proposed, accepted)
go back in ``ModelRunnerOutput.spec_records`` for the trace. The engine builds this executor
through the factory :func:`make_spec_executor`, which ``labkit/__init__.py`` registers (the
engine never imports this package).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from labkit.config import CacheConfig, EngineConfig, SpeculativeConfig
from labkit.engine.executor import Executor, ModelRunnerOutput
from labkit.engine.logprobs import prompt_rows, split_prompt_rows, token_entry
from labkit.engine.model_runner import ModelExecutor, step_chunks
from labkit.kv.block_manager import BlockOps
from labkit.model.sampling import processed_logprobs
from labkit.sched.scheduler import ScheduledSeq, SchedulerOutput
from labkit.spec.eagle import load_eagle
from labkit.spec.eagle_proposer import EagleProposer
from labkit.spec.proposers import DraftModelProposer, NgramProposer, Proposal, ProposalRequest
from labkit.spec.rejection import verify

_MAX_DRAFT_STATES = 64  # forget draft KV of sequences not in the step beyond this many


class SpecDecodeExecutor(Executor):
    # logprobs: each emitted token's entry comes from the verify row it was taken from (the
    # same filtered distribution it was accepted or resampled under); structured outputs: the
    # verify rows are masked by the grammar (GrammarLogitsProcessor.mask_draft_rows)
    supports_logprobs = True
    supports_structured_outputs = True

    def __init__(self, base: ModelExecutor, config: SpeculativeConfig,
                 max_model_len: int, cache: CacheConfig,
                 attention_backend: str | None = None) -> None:
        self.base = base  # owns the target model, its KV cache and its runner
        self.runner = base.runner
        self.model = base.model
        self.config = config
        self.gamma = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer: NgramProposer | DraftModelProposer
        self._features: torch.Tensor | None = None  # the target's last features (EAGLE)
        if config.method == "ngram":
            self.proposer = NgramProposer(self.gamma, config.prompt_lookup_max,
                                          config.prompt_lookup_min)
        elif config.method == "eagle":
            self.proposer = EagleProposer(config.draft_model, self.gamma, cache.num_blocks,
                                          cache.block_size, attention_backend or "torch")
        else:
            # the draft's own pool mirrors the target's block ids (same size, same tables),
            # read from the config: the target's cache may live in other processes (TP)
            self.proposer = DraftModelProposer(config.draft_model, self.gamma,
                                               cache.num_blocks, cache.block_size,
                                               attention_backend or "torch")
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # CPU seconds spent drafting / in the target forward / verifying (for the benchmark's
        # cost breakdown; process time, so other processes on a shared machine do not count)
        self.cpu_s = {"propose": 0.0, "target": 0.0, "verify": 0.0}

    def _catch_features(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._features = args[0]

    def _observe(self, out: SchedulerOutput, chunks: list) -> None:
        """Hand the EAGLE proposer the target's features of every chunk this step ran."""
        if not isinstance(self.proposer, EagleProposer) or self._features is None:
            return
        feats, at = self._features[0], 0
        for sc, (_, start, toks) in zip(out.scheduled, chunks):
            self.proposer.observe(sc.seq.seq_id, start, feats[at:at + len(toks)])
            at += len(toks)
        self._features = None

    def add_lora(self, lora_request: Any) -> None:
        """Adapters live on the target's executor (``labkit.lora``'s, a ModelExecutor); the
        draft stays the base model, so an adapter's tokens are accepted less often."""
        self.base.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.base.remove_lora(lora_int_id)

    def stats(self) -> dict[str, Any]:
        return self.base.stats()

    def admission_policy(self) -> Any:
        return self.base.admission_policy()

    def apply_block_ops(self, ops: BlockOps) -> None:
        # the draft's KV is not copied: a changed block id makes it recompute (proposers.py)
        self.base.apply_block_ops(ops)

    def _num_drafts(self, seq: Any) -> int:
        p = seq.request.params
        left = p.max_tokens - seq.num_output_tokens - 1  # the verify step adds one token anyway
        room = self.max_model_len - seq.num_tokens  # last verify position L-1+γ < max_model_len
        return max(0, min(self.gamma, left, room))

    def _propose(self, out: SchedulerOutput) -> dict[str, Proposal]:
        """Drafts for every decoding sequence that samples alone (not a prefill, not a fork)."""
        for seq, _ in out.preempted:
            self.proposer.free(seq.seq_id)  # its blocks are gone; the draft KV with them
        reqs = []
        for sc in out.scheduled:
            s = sc.seq
            if sc.is_prefill:
                self.proposer.free(s.seq_id)  # new or recomputed: draft state restarts
            elif sc.samples and not sc.children:
                p = s.request.params
                reqs.append(ProposalRequest(s.seq_id, s.token_ids, self._num_drafts(s),
                                            p.temperature, p.top_k, p.top_p, s.generator,
                                            s.block_table))
        self._forget_others(out)
        return {r.seq_id: prop for r, prop in zip(reqs, self.proposer.propose(reqs))}

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = scheduler_output
        t0 = time.process_time()
        proposals = self._propose(out)
        t1 = time.process_time()
        chunks, rows, _ = step_chunks(out, {k: p.token_ids for k, p in proposals.items()})
        result = ModelRunnerOutput()
        if not chunks:
            return result
        extra = prompt_rows(out)  # prompt_logprobs requests' extra rows (prefill chunks only)
        hook = None
        if isinstance(self.proposer, EagleProposer):
            # the head drafts from the input of the target's final norm: catch it this forward
            # (hooked per step: engines may share one target model object)
            hook = self.model.model.norm.register_forward_hook(self._catch_features)
        try:
            owners = [sc.seq for sc in out.scheduled]  # step_chunks' order (LoRA's hook)
            logits = self.runner.forward(chunks, [e + r for e, r in zip(extra, rows)],
                                         owners=owners)
            if any(extra):
                logits, result.prompt_logprobs = split_prompt_rows(logits, extra, rows, out)
            logits = logits.float().cpu()
        finally:
            if hook is not None:
                hook.remove()
        self._observe(out, chunks)
        t2 = time.process_time()
        start = 0
        for sc, r in zip(out.scheduled, rows):
            if r:
                self._verify(sc, proposals.get(sc.seq.seq_id), logits[start:start + len(r)],
                             result)
                start += len(r)
        c = self.cpu_s
        c["propose"] += t1 - t0
        c["target"] += t2 - t1
        c["verify"] += time.process_time() - t2
        return result

    def _verify(self, sc: ScheduledSeq, prop: Proposal | None, logits: torch.Tensor,
                result: ModelRunnerOutput) -> None:
        """Tokens for one scheduled chunk: plain sampling from its last row (a prefill's end,
        shared by its n > 1 forks), or drafts accepted / resampled against the target."""
        s = sc.seq
        if prop is None:
            result.sampled_token_ids.update(self.runner.sample(logits[:1], [[s, *sc.children]],
                                                              result.logprobs))
            return
        p = s.request.params
        drafts, probs = list(prop.token_ids), prop.probs
        proc = getattr(s, "logits_processor", None)
        if proc is not None:  # structured outputs: each row under its own grammar state
            logits, n = proc.mask_draft_rows(logits, drafts)
            drafts, probs = drafts[:n], None if probs is None else probs[:n]
        emitted, k = verify(drafts, probs, logits, p.temperature, p.top_k, p.top_p,
                            s.generator)
        result.sampled_token_ids[s.seq_id] = emitted
        if p.logprobs is not None:  # each emitted token scored by the row it came from
            result.logprobs[s.seq_id] = [
                token_entry(processed_logprobs(logits[j], p.temperature, p.top_k, p.top_p), t,
                            p.logprobs) for j, t in enumerate(emitted)]
        self.num_draft_tokens += len(prop.token_ids)
        self.num_accepted_tokens += k
        result.spec_records.append({"request_id": s.request_id, "seq_id": s.seq_id,
                                    "proposed": list(prop.token_ids), "accepted": k})

    def _forget_others(self, out: SchedulerOutput) -> None:
        """Drop the draft state of sequences that left (finished / aborted) now and then: once
        it holds many, keep only the sequences in this step (a running sequence that sat this
        step out only recomputes its draft KV later)."""
        tracked = self.proposer.tracked()
        if len(tracked) < _MAX_DRAFT_STATES:
            return
        live = {sc.seq.seq_id for sc in out.scheduled}
        for sid in tracked:
            if sid not in live:
                self.proposer.free(sid)


def make_spec_executor(base: ModelExecutor, config: EngineConfig) -> SpecDecodeExecutor:
    """The engine's factory for ``speculative_config`` (registered by ``labkit/__init__.py``):
    wrap the model executor. The config is already checked, its draft loaded, and the
    scheduler's lookahead slots set to γ (``EngineConfig``)."""
    if not isinstance(base, ModelExecutor):
        raise ValueError("speculative decoding needs the model executor (real tensors)")
    spec = config.speculative
    if spec.method == "eagle" and spec.draft_model is None:
        # a head is built on the target's own embedding, norm and LM head: load it here,
        # where the target exists (the engine itself never imports labkit.spec)
        head = spec.model if isinstance(spec.model, torch.nn.Module) else load_eagle(
            spec.model, base.model)
        spec.draft_model = head.eval()
    return SpecDecodeExecutor(base, config.speculative, config.max_model_len, config.cache,
                              config.model.attention_backend)
