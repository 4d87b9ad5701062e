"""Your block allocator drives the real model: paged KV, forked samples, copy-on-write.

The engine's ``ModelRunner.forward`` runs (sequence, start position, tokens) chunks
through the paged KV cache using each sequence's ``block_table``; here those tables come from
*your* allocator. Each prompt is prefilled once, then forked into samples that are forced to
diverge on their first token and continue greedily. If your copy-on-write is wrong, two samples
write their KV into the same block and one of them drifts from the reference ``generate``, which
recomputes everything with a plain contiguous cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from labkit.engine.model_runner import ModelRunner
from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.kv.attention import get_attention_backend
from labkit.model.generate import generate
from labkit.model.testing import tiny_model


@dataclass
class _Seq:
    seq_id: str
    tokens: list[int]
    block_table: list[int]


@torch.inference_mode()
def generate_with_allocator(allocator_cls: Callable[[int, int], Any], model: torch.nn.Module,
                            prompts: list[list[int]], *, samples: int = 2,
                            max_new_tokens: int = 10, block_size: int = 4,
                            num_blocks: int = 64) -> dict[str, list[int]]:
    """Greedy generation whose KV blocks come from ``allocator_cls``. Sample j of a prompt
    starts from the j-th most likely first token, then continues greedily. Returns new tokens
    per sequence id ``"p{i}:{j}"``; every block must be free again at the end."""
    ex = ModelRunner.for_model(model, block_size, num_blocks, 0, get_attention_backend("torch"))
    alloc = allocator_cls(num_blocks, block_size)
    live: list[_Seq] = []
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):  # prefill each prompt once, then fork the samples
        parent = f"p{i}:0"
        call(alloc.allocate, parent, len(prompt), _label=f"allocate({parent!r}, {len(prompt)})")
        seq = _Seq(parent, list(prompt), _table(alloc, parent, len(prompt), block_size,
                                                num_blocks))
        logits = ex.forward([(seq.block_table, 0, prompt)], [[len(prompt) - 1]])[0]
        ranked = torch.argsort(logits.float(), descending=True).tolist()
        for j in range(samples):
            sid = f"p{i}:{j}"
            if j:
                call(alloc.fork, parent, sid, _label=f"fork({parent!r}, {sid!r})")
            live.append(_Seq(sid, list(prompt) + [ranked[j]], []))
            out[sid] = [ranked[j]]
    for _ in range(max_new_tokens - 1):  # decode: every sequence in one packed forward
        chunks = []
        for s in live:
            cow = call(alloc.append_token, s.seq_id, _label=f"append_token({s.seq_id!r})")
            if cow is not None:
                ex.kv_cache.copy_blocks([tuple(cow)])
            s.block_table = _table(alloc, s.seq_id, len(s.tokens), block_size, num_blocks)
            chunks.append((s.block_table, len(s.tokens) - 1, [s.tokens[-1]]))
        logits = ex.forward(chunks, [[0]] * len(chunks))
        for s, row in zip(live, logits):
            token = int(row.float().argmax())
            s.tokens.append(token)
            out[s.seq_id].append(token)
    for s in live:
        call(alloc.free, s.seq_id, _label=f"free({s.seq_id!r})")
    if alloc.num_free_blocks() != num_blocks:
        raise CheckFailure("blocks leaked after every sequence was freed",
                           expected=num_blocks, actual=alloc.num_free_blocks(),
                           hint="free must drop one reference from every block of the sequence.")
    return out


def _table(alloc: Any, sid: str, num_tokens: int, block_size: int, num_blocks: int
           ) -> list[int]:
    table = list(call(alloc.block_table, sid, _label=f"block_table({sid!r})"))
    need = -(-num_tokens // block_size)
    if len(table) < need or not all(isinstance(b, int) and 0 <= b < num_blocks for b in table):
        raise CheckFailure(f"block_table({sid!r}) cannot hold its {num_tokens} tokens",
                           expected=f"{need} block ids in [0, {num_blocks})", actual=table,
                           hint="ceil(num_tokens / block_size) blocks; the last may be partial.")
    return table


def check_on_model(allocator_cls: Callable[[int, int], Any], model: torch.nn.Module | None = None,
                   *, block_size: int = 4) -> object:
    """Run the model on your allocator and compare every sample with reference generation."""

    def body() -> str:
        m = model if model is not None else tiny_model()
        g = torch.Generator().manual_seed(1)
        vocab = m.config.vocab_size
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 9, 4)]
        got = generate_with_allocator(allocator_cls, m, prompts, block_size=block_size)
        for sid, tokens in got.items():
            i = int(sid[1:].split(":")[0])
            want = [tokens[0]] + generate(m, prompts[i] + [tokens[0]], len(tokens) - 1)
            if tokens != want:
                k = next(t for t in range(len(want)) if tokens[t] != want[t])
                raise CheckFailure(
                    f"sample {sid} drifted from the reference at new token {k}",
                    inputs=f"prompt {i} = {prompts[i]}, block_size={block_size}",
                    expected=want, actual=tokens,
                    hint="the model read KV another sample wrote: copy-on-write must give a "
                         "sample its own copy of a shared, partly filled block before it writes.")
        return (f"{len(got)} samples of {len(prompts)} prompts generated through your block "
                "tables equal reference generation token for token, and every block came back.")

    return run_check("block_allocator", body, record=False)
