"""Per-group block tables for models that mix sliding-window and full layers (labkit.kv.
hybrid_manager, vLLM's hybrid KV cache manager): the layout by hand, the engine's greedy output
against the reference with windows shorter than the prompts, the freeing rule checked at every
step, prefix hits across groups, preemption in a tight pool, admission, and the KV memory one
request holds against a cache that keeps every block."""

from __future__ import annotations

import pytest
import torch

from labkit.engine.invariants import assert_no_leaks, check_kv_invariants
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import InvalidPromptError
from labkit.kv.hybrid import (
    NULL_BLOCK,
    group_kv_bytes,
    hit_blocks,
    hybrid_layout,
    max_blocks_held,
    num_skipped_blocks,
)
from labkit.kv.hybrid_manager import KVCacheCoordinator, group_block_tables
from labkit.model.generate import generate
from labkit.model.testing import tiny_config, tiny_model

S, F = "sliding_attention", "full_attention"
GPT_OSS = dict(num_hidden_layers=4, sliding_window=6, layer_types=[S, F, S, F])  # 1:1
GEMMA = dict(num_hidden_layers=6, sliding_window=6, layer_types=[S] * 5 + [F])  # 5:1


def test_layout_by_hand():
    oss = hybrid_layout(tiny_config(**GPT_OSS))
    assert [(g.kind, g.sliding_window, g.layers) for g in oss.groups] == [
        ("sliding", 6, (0, 2)), ("full", None, (1, 3))]
    assert oss.layer_group == (0, 1, 0, 1) and oss.layer_tensor == (0, 0, 1, 1)
    assert oss.num_tensors == 2  # a block id holds 2 layers' K/V, not 4
    gemma = hybrid_layout(tiny_config(**GEMMA))
    assert [g.layers for g in gemma.groups] == [(i,) for i in range(5)] + [(5,)]
    assert [g.sliding_window for g in gemma.groups] == [6] * 5 + [None]
    assert gemma.layer_tensor == (0,) * 6 and gemma.num_tensors == 1
    assert hybrid_layout(tiny_config(sliding_window=6)) is None  # every layer slides: one table
    assert hybrid_layout(tiny_config()) is None


def test_hit_blocks_and_bounds_by_hand():
    """bs 2, window 4: a 4-block hit computes 8 tokens; the next query (position 8) sees keys
    5..8, so blocks 0 and 1 (keys 0..3) are dead: only blocks 2..3 must be cached."""
    assert hit_blocks([None, None, 12, 13], 4, 4, 2) == [NULL_BLOCK, NULL_BLOCK, 12, 13]
    assert hit_blocks([None, None, 12, 13], 4, None, 2) is None  # a full group needs them all
    assert hit_blocks([10, 11, None, 13], 4, 4, 2) is None
    assert hit_blocks([10, 11, 12, 13], 4, None, 2) == [10, 11, 12, 13]
    assert max_blocks_held(40, 2) == 20
    # decoding (1 token a step) with window 4: at most (1 + 3) // 2 + 2 = 4 blocks
    assert max_blocks_held(40, 2, 4, 1) == 4
    for n in range(40):  # the bound holds at every step: blocks of n+1 tokens minus the dead
        assert -(-(n + 1) // 2) - num_skipped_blocks(n, 4, 2) <= 4


def run_checked(model, prompts, sp, **kw):
    """Run to completion; at every step check the pool against the tables, and that each
    sliding table holds NULL exactly where the window rule says (for the sequences the step
    ran, from their computed count when it was scheduled) and each full table none."""
    eng = LLMEngine.from_model(model, None, **kw)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp)
    windows = [g.sliding_window for g in eng.block_manager.layout.groups]
    bs = eng.config.cache.block_size
    decode_steps = {True: 0, False: 0}
    while eng.has_unfinished_requests():
        before = {s.seq_id: s.num_computed_tokens for r in eng.requests.values() for s in r.seqs}
        eng.step()
        check_kv_invariants(eng)
        for r in eng.requests.values():
            for s in r.seqs:
                if s.is_finished:
                    continue  # its tables are empty (check_kv_invariants saw to it)
                n0, n = before.get(s.seq_id, -1), s.num_computed_tokens
                for w, table in zip(windows, group_block_tables(s)):
                    nulls = table.count(NULL_BLOCK)
                    assert table[:nulls] == [NULL_BLOCK] * nulls  # dead blocks lead
                    if w is None:
                        assert nulls == 0
                    elif n0 > 0 and n == n0 + 1:  # a decode step: freed exactly the dead
                        assert nulls == num_skipped_blocks(n0, w, bs)
                    else:  # a prefill (maybe a prefix hit): the next query's window is whole
                        assert nulls <= num_skipped_blocks(n, w, bs)
                    decode_steps[w is not None and n0 > 0 and n == n0 + 1] += 1
    assert decode_steps[True] > 10  # the exact rule was checked, not only the bound
    return eng


CASES = [
    (GPT_OSS, dict(block_size=2, num_blocks=80)),
    (GPT_OSS, dict(block_size=4, num_blocks=60, enable_chunked_prefill=True,
                   max_num_batched_tokens=7)),
    (GPT_OSS, dict(block_size=3, num_blocks=30, max_num_seqs=4)),  # tight: preempts
    (GEMMA, dict(block_size=2, num_blocks=150)),
]


@pytest.mark.parametrize("arch,kw", CASES)
def test_engine_greedy_matches_reference(arch, kw):
    """Prompts of 9..30 tokens, window 6: sliding groups free blocks, n=2 forks share the
    tables, prefix caching hits every group, and every token equals the reference."""
    model = tiny_model(3, **arch)
    shared = list(range(10, 28))
    prompts = [shared + [3, 4, 5], shared + list(range(40, 52)), list(range(60, 69)), shared]
    sp = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)
    eng = run_checked(model, prompts, sp, enable_prefix_caching=True, **kw)
    assert isinstance(eng.block_manager, KVCacheCoordinator)
    for i, p in enumerate(prompts):
        want = generate(model, p, 12, ignore_eos=True)
        assert [s.output_token_ids for s in eng.requests[f"r{i}"].seqs] == [want, want]
    st = eng.block_manager.stats()
    assert st["num_window_freed_blocks"] > 0 and st["prefix_hit_tokens"] > 0
    if kw["num_blocks"] == 30:
        assert eng.scheduler.num_preemptions > 0
    assert_no_leaks(eng)


def test_disabled_manager_gives_the_same_tokens_with_one_table():
    model = tiny_model(3, **GPT_OSS)
    prompts = [list(range(10, 35)), list(range(40, 49))]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = []
    for off in (False, True):
        eng = LLMEngine.from_model(model, None, block_size=2, num_blocks=80,
                                   disable_hybrid_kv_cache_manager=off)
        assert isinstance(eng.block_manager, KVCacheCoordinator) != off
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, sp)
        while eng.has_unfinished_requests():
            eng.step()
        outs.append([eng.requests[f"r{i}"].seqs[0].output_token_ids for i in range(2)])
        assert_no_leaks(eng)
    assert outs[0] == outs[1]


def kv_bytes_held(model, prompt, new, **kw):
    """(the most KV bytes one request holds at once, what it holds at its last running step):
    used blocks x bytes per block."""
    eng = LLMEngine.from_model(model, None, block_size=2, enable_prefix_caching=False, **kw)
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    peak = last = 0
    while eng.has_unfinished_requests():
        eng.step()
        if eng.has_unfinished_requests():
            last = eng.block_manager.pool.num_used
            peak = max(peak, last)
    per_block = eng.executor.runner.kv_cache.nbytes() // eng.config.cache.num_blocks
    return peak * per_block, last * per_block


def test_one_request_holds_less_kv_than_a_cache_that_keeps_everything():
    """30 + 11 tokens: the last step that still runs has written 39 (the last token's K/V is
    never written, and its step frees the request). bs 2, window 6, fp32, 2 KV heads x 16 dims.
    Keeping everything: 20 blocks of 4 layers x (K, V) x 2 tokens x 2 heads x 16 x 4 bytes =
    2,048 bytes. Per group (blocks of 2 layers, 1,024 bytes): the full group keeps 20, the
    sliding one 20 - 16 dead = 4 at the end. The peak is the prefill's: 30 tokens written in
    one step hold 15 blocks in each group; chunked prefill (4 tokens a step) lowers it."""
    c = tiny_config(**GPT_OSS)
    assert (c.num_key_value_heads, c.head_dim) == (2, 16)
    model = tiny_model(3, **GPT_OSS)
    prompt, new = list(range(10, 40)), 11
    kept, kept_end = kv_bytes_held(model, prompt, new, num_blocks=60,
                                   disable_hybrid_kv_cache_manager=True)
    assert kept == kept_end == 20 * 2048
    assert kept == sum(group_kv_bytes(c, 39, 2, torch.float32, False).values())
    peak, end = kv_bytes_held(model, prompt, new, num_blocks=60)
    assert end == (20 + 4) * 1024 == sum(group_kv_bytes(c, 39, 2, torch.float32, True).values())
    assert peak == (15 + 15) * 1024
    chunked, chunked_end = kv_bytes_held(model, prompt, new, num_blocks=60,
                                         enable_chunked_prefill=True, max_num_batched_tokens=4)
    assert chunked_end == end
    assert chunked <= (20 + max_blocks_held(39, 2, 6, 4)) * 1024 < peak < kept


def test_admission_counts_every_group():
    """bs 2, no chunked prefill, so a prefill writes the whole prompt in one step and each
    group holds all of it then. A pool of 16: 26 + 4 tokens need 15 blocks per group: refused
    by name at add_request, never a stall; 10 + 4 need 7 + 7: admitted. With chunks of 4 the
    sliding group holds at most (4 + 5) // 2 + 2 = 6: 15 + 6 = 21 fits a pool of 21."""
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    model = tiny_model(3, **GPT_OSS)
    eng = LLMEngine.from_model(model, None, block_size=2, num_blocks=16)
    with pytest.raises(InvalidPromptError, match="needs up to 30 KV blocks"):
        eng.add_request("big", list(range(10, 36)), sp)
    eng.add_request("ok", list(range(10, 20)), sp)
    chunked = LLMEngine.from_model(model, None, block_size=2, num_blocks=21,
                                   enable_chunked_prefill=True, max_num_batched_tokens=4)
    chunked.add_request("big", list(range(10, 36)), sp)
    for e in (eng, chunked):
        while e.has_unfinished_requests():
            e.step()
            check_kv_invariants(e)
        assert_no_leaks(e)
    want = generate(model, list(range(10, 36)), 4, ignore_eos=True)
    assert chunked.requests["big"].seqs[0].output_token_ids == want


def test_abort_frees_every_group():
    eng = LLMEngine.from_model(tiny_model(3, **GPT_OSS), None, block_size=2, num_blocks=80)
    eng.add_request("a", list(range(10, 40)), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(3):
        eng.step()
    seq = eng.requests["a"].seqs[0]
    assert all(group_block_tables(seq)) and NULL_BLOCK in group_block_tables(seq)[0]
    eng.abort("a")
    check_kv_invariants(eng)
    assert_no_leaks(eng)
