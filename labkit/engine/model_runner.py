"""ModelRunner runs the model on packed chunks; ModelExecutor turns a scheduled step into them.

All scheduled sequences go through ONE forward: their new tokens are packed into a single row
(B=1, T=sum of chunk lengths), positions and slot mapping tell each token where it belongs, and
``logits_indices`` picks only the rows that need a next token (the last token of each chunk that
reaches its sequence's end) so the vocabulary projection runs on a handful of rows.

A chunk is ``(block_table, start_pos, token_ids)``: the runner does not care whose it is (with
per-group block tables, :mod:`labkit.kv.hybrid_manager`, ``block_table`` is one per group). That
is what lets the speculative executor's verify pass (a chunk of ``[last token, d1 .. dγ]`` with
logits kept for every position) and the draft model (its own runner over its own
``PagedKVCache``) use this same code path.

The one place where owners matter is a per-step hook (``ModelRunner.step_hooks``): a feature
whose layers act per token by request (LoRA: which adapter each token runs through, vLLM's
``set_active_loras``) is entered as a context manager ``hook(owners, query_lens)`` around each
forward, after packing: it sets its per-token state before the model runs and clears it after,
so no later forward sees a stale one. ``owners`` is one object per chunk, given by the caller
(``ModelExecutor.execute`` and the speculative verify pass give the scheduled ``Sequence`` of
each chunk) or None.

Per-step Python overhead decides CPU throughput with a small model, so inputs are built with a
few list operations and one tensor per input (no per-layer work here); a step that samples every
row (a decode step) skips the logits gather, and a step with no hooks enters no context stack.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch

from labkit.config import CacheConfig
from labkit.engine.executor import Executor, ModelRunnerOutput
from labkit.engine.logprobs import prompt_rows, split_prompt_rows, token_entry
from labkit.kv.attention import AttentionBackend
from labkit.kv.block_manager import BlockOps
from labkit.kv.cache import PagedKVCache
from labkit.kv.hybrid_manager import group_block_tables
from labkit.model.sampling import processed_logprobs, sample_token
from labkit.sched.request import Sequence
from labkit.sched.scheduler import SchedulerOutput

Chunk = tuple[Seq[int], int, list[int]]  # (block table, start position, token ids)
# (chunk owners or None, query lens) -> a context entered around the forward
StepHook = Callable[[Seq[Any] | None, list[int]], AbstractContextManager]


class ModelRunner:
    """A model and its paged KV cache: packed forwards and sampling (vLLM's ModelRunner)."""

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.block_size = kv_cache.block_size
        self.step_hooks: list[StepHook] = []  # called once per forward (see the module doc)

    @classmethod
    def for_model(cls, model: torch.nn.Module, block_size: int, num_blocks: int,
                  num_cpu_blocks: int = 0, backend: AttentionBackend | None = None,
                  kv_cache_dtype: str = "auto") -> ModelRunner:
        """A runner with a fresh pool of ``num_blocks`` blocks for ``model``."""
        cache = CacheConfig(block_size, num_blocks, num_cpu_blocks, kv_cache_dtype=kv_cache_dtype)
        kv = PagedKVCache.for_model(model.config, cache, model.dtype, model.device, backend)
        return cls(model, kv)

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], logits_rows: list[list[int]],
                owners: Seq[Any] | None = None, **model_inputs: torch.Tensor) -> torch.Tensor:
        """Run chunks in one packed forward; each block table must already cover
        ``[start, start + len)``. ``logits_rows[i]`` lists the offsets within chunk i whose
        logits are wanted; returns them stacked ``[R, V]``. ``owners`` (one per chunk) only
        reaches the step hooks. ``model_inputs`` go to the model as keyword arguments (an
        EAGLE head's packed features)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        out_idx: list[int] = []
        hybrid = self.kv_cache.layout is not None  # a chunk's "table" is one per group
        for (table, start, toks), rows in zip(chunks, logits_rows):
            out_idx.extend(len(ids) + r for r in rows)
            ids.extend(toks)
            span = range(start, start + len(toks))
            pos.extend(span)
            if not hybrid:
                slots.extend([table[p // bs] * bs + p % bs for p in span])
            qlens.append(len(toks))
        ctx = [start + n for (_, start, _), n in zip(chunks, qlens)]
        if hybrid:
            self._begin_groups(chunks, qlens, ctx)
        else:
            self.kv_cache.begin_step(slots, [c[0] for c in chunks], qlens, ctx)
        dev = self.device
        every_row = not model_inputs and out_idx == list(range(len(ids)))
        try:
            with ExitStack() if self.step_hooks else nullcontext() as hooks:
                for hook in self.step_hooks:
                    hooks.enter_context(hook(owners, qlens))
                ids_t, pos_t = torch.tensor([ids], device=dev), torch.tensor([pos], device=dev)
                if every_row:  # a decode step samples every row: no gather of the logits
                    return self.model(ids_t, pos_t, self.kv_cache)[0]
                return self.model(ids_t, pos_t, self.kv_cache,
                                  torch.tensor(out_idx, dtype=torch.long, device=dev),
                                  **model_inputs)
        finally:
            self.kv_cache.end_step()

    def _begin_groups(self, chunks: list[Chunk], qlens: list[int], ctx: list[int]) -> None:
        """Per-group slot mappings and block tables (hybrid KV: each chunk carries one table
        per group, :func:`labkit.kv.hybrid_manager.group_block_tables`)."""
        bs, n = self.block_size, len(self.kv_cache.layout.groups)
        slots: list[list[int]] = [[] for _ in range(n)]
        for tables, start, toks in chunks:
            for g, t in enumerate(tables):
                slots[g].extend(t[p // bs] * bs + p % bs for p in range(start, start + len(toks)))
        self.kv_cache.begin_step_groups(slots, [[c[0][g] for c in chunks] for g in range(n)],
                                        qlens, ctx)

    @staticmethod
    def sample(logits: torch.Tensor, groups: list[list[Sequence]],
               logprobs: dict[str, list] | None = None) -> dict[str, list[int]]:
        """Row i of ``logits`` gives the next token of every sequence in ``groups[i]`` (a
        prompt's n samples share its last row). Greedy rows share one argmax over the batch.
        Given a ``logprobs`` dict, sequences whose request asked for logprobs get their
        token's entry there, from the same row (computed once per row). A sequence with a
        ``logits_processor`` (structured outputs) samples from its own processed copy of the
        row, so forks sharing a row and unconstrained neighbours are untouched."""
        results: dict[str, list[int]] = {}
        greedy = None
        for i, seqs in enumerate(groups):
            row_lp = None
            for s in seqs:
                p = s.request.params
                proc = getattr(s, "logits_processor", None)
                row = logits[i] if proc is None else proc(logits[i])  # its own masked copy
                if p.temperature == 0:
                    if proc is not None:
                        results[s.seq_id] = [int(row.argmax(-1))]
                    else:
                        if greedy is None:
                            # max's indices are argmax's (the first maximum of each row),
                            # and on a CPU it runs 3x faster over a [32, 4096] batch
                            greedy = logits.max(-1).indices.tolist()
                        results[s.seq_id] = [greedy[i]]
                else:
                    results[s.seq_id] = [sample_token(row, p.temperature, p.top_k, p.top_p,
                                                      s.generator)]
                k = getattr(p, "logprobs", None)
                if logprobs is not None and k is not None:
                    if proc is not None:
                        lp = processed_logprobs(row, p.temperature, p.top_k, p.top_p)
                    elif row_lp is None:
                        lp = row_lp = processed_logprobs(row, p.temperature, p.top_k, p.top_p)
                    else:
                        lp = row_lp
                    logprobs[s.seq_id] = [token_entry(lp, results[s.seq_id][0], k)]
        return results


def step_chunks(out: SchedulerOutput, drafts: dict[str, list[int]] | None = None
                ) -> tuple[list[Chunk], list[list[int]], list[list[Sequence]]]:
    """The chunks of a scheduled step, the logits rows each needs, and who samples from them.

    A chunk that reaches its sequence's end keeps its last row for the sequence and its forks.
    A sequence with ``drafts`` (speculative decoding) runs ``[last token, *drafts]`` instead and
    keeps every row; its group is just itself (the verifier decides its tokens)."""
    drafts = drafts or {}
    chunks: list[Chunk] = []
    rows: list[list[int]] = []
    groups: list[list[Sequence]] = []
    for sc in out.scheduled:
        s, a = sc.seq, sc.start_pos
        table = s.block_table if not hasattr(s, "kv_group_views") else group_block_tables(s)
        d = drafts.get(s.seq_id)
        if d is not None:
            chunks.append((table, a, s.token_ids[a:a + 1] + d))
            rows.append(list(range(len(d) + 1)))
            groups.append([s])
            continue
        chunks.append((table, a, s.token_ids[a:a + sc.num_new_tokens]))
        rows.append([sc.num_new_tokens - 1] if sc.samples else [])
        if sc.samples:
            groups.append([s, *sc.children])
    return chunks, rows, groups


class ModelExecutor(Executor):
    """The real model, one packed forward per step.

    With a KV connector (``kv_connector``, :mod:`labkit.kv.connector`) it plays the worker
    side: the connector sees the cache once (``register_kv_caches``, and per-layer hooks on
    this cache's ``attend``), and each step runs between ``bind_connector_metadata`` +
    ``start_load_kv`` and ``wait_for_save`` + ``clear_connector_metadata``."""

    supports_logprobs = True
    supports_structured_outputs = True

    def __init__(self, runner: ModelRunner, kv_connector: Any = None) -> None:
        self.runner = runner
        self.kv_connector = kv_connector
        if kv_connector is not None:
            from labkit.kv.connector.base import attach_layer_hooks

            kv_connector.register_kv_caches(runner.kv_cache)
            attach_layer_hooks(runner.kv_cache, kv_connector)

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def kv_cache(self) -> PagedKVCache:
        return self.runner.kv_cache

    def update_weights(self, state: dict[str, Any]) -> None:
        from labkit.engine.weight_update import copy_weights

        copy_weights(self.runner.model, state)

    def apply_block_ops(self, ops: BlockOps) -> None:
        kv = self.runner.kv_cache
        kv.swap_out(ops.swap_out)
        kv.swap_in(ops.swap_in)
        kv.copy_blocks(ops.copies)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        conn = self.kv_connector
        if conn is None:
            return self._execute(scheduler_output)
        conn.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        try:
            conn.start_load_kv()  # loads land layer by layer (wait_for_layer_load)
            result = self._execute(scheduler_output)
            conn.wait_for_save()
        finally:
            conn.clear_connector_metadata()
        return result

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        chunks, rows, groups = step_chunks(scheduler_output)
        result = ModelRunnerOutput()
        if not chunks:
            return result
        owners = [sc.seq for sc in scheduler_output.scheduled]  # step_chunks keeps this order
        extra = prompt_rows(scheduler_output)  # prompt_logprobs requests' extra rows, if any
        if any(extra):
            logits = self.runner.forward(chunks, [e + r for e, r in zip(extra, rows)],
                                         owners=owners)
            logits, result.prompt_logprobs = split_prompt_rows(logits, extra, rows,
                                                               scheduler_output)
        else:
            logits = self.runner.forward(chunks, rows, owners=owners)
        result.sampled_token_ids = self.runner.sample(logits, groups, result.logprobs)
        return result
