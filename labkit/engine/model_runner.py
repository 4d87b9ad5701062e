"""ModelExecutor: runs one scheduled step on the real model through the paged KV cache.

All scheduled sequences go through ONE forward: their new tokens are packed into a single row
(B=1, T=sum of chunk lengths), positions and slot mapping tell each token where it belongs, and
``logits_indices`` picks only the rows that need a next token (the last token of each chunk that
reaches its sequence's end) so the vocabulary projection runs on a handful of rows.

Per-step Python overhead decides CPU throughput with a small model, so inputs are built with a
few list operations and one tensor per input (no per-layer work here).

Hook for speculative decoding: ``forward_chunks`` runs arbitrary (sequence, start, tokens)
chunks through the same packed path and returns logits for every token of chosen chunks, which
is how a verify pass scores k draft tokens at once (the draft KV goes in through the prefill
attention path; the block manager's ``truncate`` rolls back rejected slots).
"""

from __future__ import annotations

import torch

from labkit.kv.attention import AttentionBackend
from labkit.kv.cache import PagedKVCache
from labkit.kv.metadata import build_attention_metadata
from labkit.model.sampling import sample_token
from labkit.sched.request import Sequence
from labkit.sched.scheduler import SchedulerOutput


class ModelExecutor:
    kind = "model"

    def __init__(self, model: torch.nn.Module, block_size: int, num_blocks: int,
                 num_cpu_blocks: int = 0, backend: AttentionBackend | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        c = model.config
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.kv_cache = PagedKVCache(c.num_hidden_layers, num_blocks, block_size,
                                     c.num_key_value_heads, c.head_dim, model.dtype, self.device,
                                     backend, num_cpu_blocks, c.sliding_window, kv_cache_dtype)

    def apply_block_ops(self, copies, swap_out, swap_in) -> None:
        kv = self.kv_cache
        kv.swap_out(swap_out)
        kv.swap_in(swap_in)
        kv.copy_blocks(copies)

    @torch.inference_mode()
    def forward_chunks(self, chunks: list[tuple[Sequence, int, list[int]]],
                       logits_rows: list[list[int]]) -> torch.Tensor:
        """Run chunks (seq, start_pos, token_ids) in one packed forward; the sequences' block
        tables must already cover [start_pos, start_pos + len). ``logits_rows[i]`` lists the
        offsets within chunk i whose logits are wanted; returns them stacked [R, V]."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        ctx: list[int] = []
        tables: list[list[int]] = []
        out_idx: list[int] = []
        for (seq, start, toks), rows in zip(chunks, logits_rows):
            n = len(toks)
            base = len(ids)
            ids.extend(toks)
            table = seq.block_table
            slots.extend([table[p // bs] * bs + p % bs for p in range(start, start + n)])
            pos.extend(range(start, start + n))
            qlens.append(n)
            ctx.append(start + n)
            tables.append(table)
            out_idx.extend(base + r for r in rows)
        dev = self.device
        self.kv_cache.meta = build_attention_metadata(slots, tables, qlens, ctx, dev)
        logits = self.model(torch.tensor([ids], device=dev), torch.tensor([pos], device=dev),
                            self.kv_cache, torch.tensor(out_idx, dtype=torch.long, device=dev))
        self.kv_cache.meta = None
        return logits

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Run a step; returns the sampled token(s) per sequence id."""
        chunks, rows, samplers = [], [], []
        for sc in out.scheduled:
            s = sc.seq
            a = sc.start_pos
            chunks.append((s, a, s.token_ids[a : a + sc.num_new_tokens]))
            if sc.samples:
                rows.append([sc.num_new_tokens - 1])
                samplers.append([s, *sc.children])
            else:
                rows.append([])
        if not chunks:
            return {}
        logits = self.forward_chunks(chunks, rows)
        if not samplers:
            return {}
        results: dict[str, list[int]] = {}
        greedy = None
        for i, seqs in enumerate(samplers):
            for s in seqs:
                p = s.request.params
                if p.temperature == 0:
                    if greedy is None:  # one argmax for the whole batch
                        greedy = logits.argmax(-1).tolist()
                    results[s.seq_id] = [greedy[i]]
                else:
                    results[s.seq_id] = [sample_token(logits[i], p.temperature, p.top_k, p.top_p,
                                                      s.generator)]
        return results
